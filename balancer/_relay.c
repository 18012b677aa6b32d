/* The relay's steady state out of the interpreter: a thread that forwards a session's
 * worker-to-client frames (balancer/aio/offload.py drives it; docs/architecture.md).
 *
 * Why. At stream load (one small frame per read) the relay's cost is per read, not per byte:
 * entering Python once per read costs 5-6 us, nginx's whole user time per frame is 2.4 us, and in
 * one event loop every event of a batch waits behind the others' Python work. A session that
 * streams tokens spends nearly all its reads on the worker leg, on whole small data frames that
 * only move counters. This module takes exactly those reads off the event loop.
 *
 * The rules of a relayed session (its state machine):
 *
 * - ACTIVE: the thread owns the *read side of the worker socket* and the *write side of the
 *   client socket*, through its own dup()s of both (so a descriptor closed by the event loop can
 *   never be reused under the thread). The event loop keeps the rest: it reads the client and
 *   writes the worker as before, and it must neither read the worker nor write the client until
 *   it has taken the session back. Reads are level-triggered, one recv per readiness (a short read
 *   is not followed by a second recv that would only say EAGAIN).
 * - What the thread forwards: whole data frames with FIN set, a text or binary opcode, RSV clear,
 *   no mask bit (server frames), a 7- or 16-bit length of at most ``limit`` - the frames that can
 *   only move the scanner's counters (the same walk as balancer/_scan.c). Bytes of a frame not yet
 *   whole are carried to the next read. Every forwarded frame counts one frame and one message.
 * - Backpressure: a send that takes less than it was given keeps the rest (at most one read's
 *   worth), stops reading the worker and waits for the client socket to be writable. Nothing else
 *   is ever buffered.
 * - RETURNED: at the first frame that is anything else (a control frame, a fragment, an RSV bit, a
 *   mask bit, a larger frame), at the worker's EOF or a read error, or at a client write error, the
 *   thread stops touching the session's sockets and queues a RETURNED event; the bytes from that
 *   frame on stay in the carry. The event loop then calls ``remove``.
 * - ``remove`` (the event loop taking the session back, RETURNED or not): the thread lets go, and
 *   the caller receives the carry (unread by the scanner, from a frame boundary), the unsent
 *   backlog (to write to the client first), the recorded bytes, the counts and why it returned.
 * - With ``record`` set (a pool with crash failover), every forwarded byte is also appended to a
 *   record, taken by ``take_record``; a RECORD event says it passed ``REC_NOTIFY`` bytes.
 *
 * Python objects are touched only by the calling thread, with the GIL; the relay thread takes
 * only the module's mutex and never the GIL, so neither can wait on the other in a cycle. Removed
 * sessions are freed by the relay thread after the batch of epoll events that may still name
 * them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#define BUF_SIZE (256 * 1024)
#define REC_NOTIFY 8192
#define MAX_EVENTS 256

enum { S_ACTIVE = 0, S_RETURNED = 1 };
enum { R_NONE = 0, R_FRAME = 1, R_EOF = 2, R_READ_ERROR = 3, R_WRITE_ERROR = 4, R_NOMEM = 5 };
enum { EV_RETURNED = 1, EV_RECORD = 2 };

typedef struct sess sess_t;

typedef struct {
    sess_t *s;
    int which; /* 0: the worker socket (reads), 1: the client socket (writes) */
} watch_t;

struct sess {
    uint64_t handle;
    int wfd, cfd;
    int state, reason, err;
    long limit;
    int record, rec_notified;
    int w_in_epoll, c_in_epoll;
    watch_t ww, cw;
    unsigned char *carry;
    size_t carry_len;
    unsigned char *out;
    size_t out_len, out_off;
    unsigned char *rec;
    size_t rec_len, rec_cap;
    unsigned long long frames, bytes;
    sess_t *next_dead;
};

typedef struct {
    uint64_t handle;
    int kind;
} event_t;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_t thread;
    int started, stopping, closed;
    int epfd, wakefd, notifyfd;
    pid_t pid;
    unsigned char *buf;
    sess_t **slots;
    uint32_t nslots;
    uint32_t *free_slots;
    uint32_t nfree;
    uint32_t generation;
    uint32_t live;
    sess_t *graveyard;
    event_t *events;
    size_t nevents, cap_events;
    int notified;
} Relay;

/* -- helpers (all called with mu held) ----------------------------------------------------- */

static int
push_event(Relay *r, sess_t *s, int kind)
{
    if (r->nevents == r->cap_events) {
        size_t cap = r->cap_events ? r->cap_events * 2 : 64;
        event_t *e = realloc(r->events, cap * sizeof(event_t));
        if (e == NULL) {
            return -1;
        }
        r->events = e;
        r->cap_events = cap;
    }
    r->events[r->nevents].handle = s->handle;
    r->events[r->nevents].kind = kind;
    r->nevents++;
    if (!r->notified) {
        uint64_t one = 1;
        ssize_t w = write(r->notifyfd, &one, sizeof one);
        (void)w;
        r->notified = 1;
    }
    return 0;
}

static void
watch(Relay *r, sess_t *s, int which, int on)
{
    int fd = which ? s->cfd : s->wfd;
    int *flag = which ? &s->c_in_epoll : &s->w_in_epoll;
    if (on && !*flag) {
        struct epoll_event ev;
        memset(&ev, 0, sizeof ev);
        ev.events = which ? EPOLLOUT : EPOLLIN;
        ev.data.ptr = which ? &s->cw : &s->ww;
        if (epoll_ctl(r->epfd, EPOLL_CTL_ADD, fd, &ev) == 0) {
            *flag = 1;
        }
    }
    else if (!on && *flag) {
        epoll_ctl(r->epfd, EPOLL_CTL_DEL, fd, NULL);
        *flag = 0;
    }
}

static void
give_back(Relay *r, sess_t *s, int reason, int err)
{
    if (s->state != S_ACTIVE) {
        return;
    }
    s->state = S_RETURNED;
    s->reason = reason;
    s->err = err;
    watch(r, s, 0, 0);
    watch(r, s, 1, 0);
    push_event(r, s, EV_RETURNED);
}

/* Keep n bytes at p as the carry (they start at a frame boundary). */
static int
keep_carry(sess_t *s, const unsigned char *p, size_t n)
{
    if (n == 0) {
        return 0;
    }
    s->carry = malloc(n);
    if (s->carry == NULL) {
        return -1;
    }
    memcpy(s->carry, p, n);
    s->carry_len = n;
    return 0;
}

static int
append_record(Relay *r, sess_t *s, const unsigned char *p, size_t n)
{
    if (s->rec_len + n > s->rec_cap) {
        size_t cap = s->rec_cap ? s->rec_cap : 4096;
        while (cap < s->rec_len + n) {
            cap *= 2;
        }
        unsigned char *q = realloc(s->rec, cap);
        if (q == NULL) {
            return -1;
        }
        s->rec = q;
        s->rec_cap = cap;
    }
    memcpy(s->rec + s->rec_len, p, n);
    s->rec_len += n;
    if (s->rec_len >= REC_NOTIFY && !s->rec_notified) {
        s->rec_notified = 1;
        push_event(r, s, EV_RECORD);
    }
    return 0;
}

/* How far the fast frames of p[0:n] reach; *stop is set when the walk ended at a frame that is
 * not fast (not merely cut short by the end of the data). */
static size_t
walk(const unsigned char *p, size_t n, long limit, unsigned long long *count, int *stop)
{
    size_t pos = 0;
    *stop = 0;
    while (pos + 2 <= n) {
        unsigned char b0 = p[pos];
        if (b0 != 0x81 && b0 != 0x82) {
            *stop = 1;
            break;
        }
        size_t length = p[pos + 1];
        size_t end;
        if (length < 126) {
            end = pos + 2 + length;
        }
        else if (length == 126) {
            if (pos + 4 > n) {
                break;
            }
            length = ((size_t)p[pos + 2] << 8) | p[pos + 3];
            if ((long)length > limit) {
                *stop = 1;
                break;
            }
            end = pos + 4 + length;
        }
        else {
            *stop = 1; /* a 64-bit length, or a mask bit (never on a server's frame) */
            break;
        }
        if (end > n) {
            break;
        }
        (*count)++;
        pos = end;
    }
    return pos;
}

static void
on_readable(Relay *r, sess_t *s)
{
    unsigned char *b = r->buf;
    size_t have = 0;
    if (s->carry_len) {
        memcpy(b, s->carry, s->carry_len);
        have = s->carry_len;
        free(s->carry);
        s->carry = NULL;
        s->carry_len = 0;
    }
    ssize_t n = recv(s->wfd, b + have, BUF_SIZE - have, MSG_DONTWAIT);
    if (n <= 0) {
        int e = n < 0 ? errno : 0;
        if (n < 0 && (e == EAGAIN || e == EWOULDBLOCK || e == EINTR)) {
            keep_carry(s, b, have);
            return;
        }
        if (keep_carry(s, b, have) < 0) {
            give_back(r, s, R_NOMEM, ENOMEM);
            return;
        }
        give_back(r, s, n == 0 ? R_EOF : R_READ_ERROR, e);
        return;
    }
    size_t total = have + (size_t)n;
    unsigned long long count = 0;
    int stop = 0;
    size_t pos = walk(b, total, s->limit, &count, &stop);
    if (keep_carry(s, b + pos, total - pos) < 0) {
        /* Out of memory: the stream cannot go on intact; the event loop ends the session. */
        give_back(r, s, R_NOMEM, ENOMEM);
        return;
    }
    if (pos > 0) {
        s->frames += count;
        s->bytes += pos;
        if (s->record && append_record(r, s, b, pos) < 0) {
            give_back(r, s, R_NOMEM, ENOMEM); /* the journal would miss bytes */
            return;
        }
        ssize_t w = send(s->cfd, b, pos, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
                w = 0;
            }
            else {
                int e = errno;
                s->out = malloc(pos);
                if (s->out != NULL) {
                    memcpy(s->out, b, pos);
                    s->out_len = pos;
                    s->out_off = 0;
                }
                give_back(r, s, R_WRITE_ERROR, e);
                return;
            }
        }
        if ((size_t)w < pos) {
            size_t rest = pos - (size_t)w;
            s->out = malloc(rest);
            if (s->out == NULL) {
                give_back(r, s, R_WRITE_ERROR, ENOMEM);
                return;
            }
            memcpy(s->out, b + w, rest);
            s->out_len = rest;
            s->out_off = 0;
            if (!stop) {
                watch(r, s, 0, 0); /* stop reading the worker until the client takes it */
                watch(r, s, 1, 1);
            }
        }
    }
    if (stop) {
        give_back(r, s, R_FRAME, 0);
    }
}

static void
on_writable(Relay *r, sess_t *s)
{
    if (s->out == NULL) {
        watch(r, s, 1, 0);
        return;
    }
    size_t left = s->out_len - s->out_off;
    ssize_t w = send(s->cfd, s->out + s->out_off, left, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (w < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
            return;
        }
        give_back(r, s, R_WRITE_ERROR, errno);
        return;
    }
    s->out_off += (size_t)w;
    if (s->out_off == s->out_len) {
        free(s->out);
        s->out = NULL;
        s->out_len = s->out_off = 0;
        watch(r, s, 1, 0);
        watch(r, s, 0, 1);
    }
}

static void
free_sess(sess_t *s)
{
    free(s->carry);
    free(s->out);
    free(s->rec);
    free(s);
}

static void *
run(void *arg)
{
    Relay *r = (Relay *)arg;
    struct epoll_event evs[MAX_EVENTS];
    for (;;) {
        int n = epoll_wait(r->epfd, evs, MAX_EVENTS, 1000);
        pthread_mutex_lock(&r->mu);
        if (r->stopping) {
            pthread_mutex_unlock(&r->mu);
            break;
        }
        for (int i = 0; i < n; i++) {
            watch_t *w = (watch_t *)evs[i].data.ptr;
            if (w == NULL) {
                uint64_t v;
                ssize_t got = read(r->wakefd, &v, sizeof v);
                (void)got;
                continue;
            }
            sess_t *s = w->s;
            if (s->state != S_ACTIVE) {
                continue;
            }
            if (w->which == 0) {
                on_readable(r, s);
            }
            else {
                on_writable(r, s);
            }
        }
        while (r->graveyard != NULL) {
            sess_t *s = r->graveyard;
            r->graveyard = s->next_dead;
            free_sess(s);
        }
        pthread_mutex_unlock(&r->mu);
    }
    return NULL;
}

/* -- the Python type ----------------------------------------------------------------------- */

static sess_t *
lookup(Relay *r, uint64_t handle)
{
    uint32_t slot = (uint32_t)(handle & 0xffffffffu);
    if (slot >= r->nslots) {
        return NULL;
    }
    sess_t *s = r->slots[slot];
    return (s != NULL && s->handle == handle) ? s : NULL;
}

static int
ensure_open(Relay *r)
{
    if (r->closed) {
        PyErr_SetString(PyExc_RuntimeError, "the relay is closed");
        return -1;
    }
    if (r->pid != getpid()) {
        PyErr_SetString(PyExc_RuntimeError, "the relay belongs to another process");
        return -1;
    }
    return 0;
}

static PyObject *
Relay_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (!PyArg_ParseTuple(args, ":Relay")) {
        return NULL;
    }
    (void)kwds;
    Relay *r = (Relay *)type->tp_alloc(type, 0);
    if (r == NULL) {
        return NULL;
    }
    r->epfd = r->wakefd = r->notifyfd = -1;
    pthread_mutex_init(&r->mu, NULL);
    r->pid = getpid();
    r->buf = malloc(BUF_SIZE);
    r->epfd = epoll_create1(EPOLL_CLOEXEC);
    r->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    r->notifyfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (r->buf == NULL || r->epfd < 0 || r->wakefd < 0 || r->notifyfd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(r);
        return NULL;
    }
    struct epoll_event ev;
    memset(&ev, 0, sizeof ev);
    ev.events = EPOLLIN;
    ev.data.ptr = NULL;
    if (epoll_ctl(r->epfd, EPOLL_CTL_ADD, r->wakefd, &ev) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(r);
        return NULL;
    }
    return (PyObject *)r;
}

static void
release_sess(Relay *r, sess_t *s)
{
    /* With mu held: the thread lets go of s; it is freed after the current epoll batch. */
    watch(r, s, 0, 0);
    watch(r, s, 1, 0);
    close(s->wfd);
    close(s->cfd);
    uint32_t slot = (uint32_t)(s->handle & 0xffffffffu);
    r->slots[slot] = NULL;
    r->free_slots[r->nfree++] = slot;
    r->live--;
    s->state = S_RETURNED;
    s->next_dead = r->graveyard;
    r->graveyard = s;
}

static PyObject *
Relay_close(Relay *r, PyObject *Py_UNUSED(ignored))
{
    if (r->closed) {
        Py_RETURN_NONE;
    }
    if (r->pid != getpid()) {
        r->closed = 1; /* a forked copy: the thread and the sockets are the parent's */
        Py_RETURN_NONE;
    }
    pthread_mutex_lock(&r->mu);
    r->stopping = 1;
    for (uint32_t i = 0; i < r->nslots; i++) {
        if (r->slots[i] != NULL) {
            release_sess(r, r->slots[i]);
        }
    }
    pthread_mutex_unlock(&r->mu);
    if (r->started) {
        uint64_t one = 1;
        ssize_t w = write(r->wakefd, &one, sizeof one);
        (void)w;
        Py_BEGIN_ALLOW_THREADS
        pthread_join(r->thread, NULL);
        Py_END_ALLOW_THREADS
        r->started = 0;
    }
    while (r->graveyard != NULL) {
        sess_t *s = r->graveyard;
        r->graveyard = s->next_dead;
        free_sess(s);
    }
    close(r->epfd);
    close(r->wakefd);
    close(r->notifyfd);
    r->epfd = r->wakefd = r->notifyfd = -1;
    r->closed = 1;
    Py_RETURN_NONE;
}

static void
Relay_dealloc(Relay *r)
{
    if (!r->closed && r->pid == getpid()) {
        PyObject *res = Relay_close(r, NULL);
        Py_XDECREF(res);
    }
    free(r->buf);
    free(r->slots);
    free(r->free_slots);
    free(r->events);
    pthread_mutex_destroy(&r->mu);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *
Relay_fileno(Relay *r, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLong(r->notifyfd);
}

static PyObject *
Relay_add(Relay *r, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "add(worker_fd, client_fd, limit, record)");
        return NULL;
    }
    if (ensure_open(r) < 0) {
        return NULL;
    }
    int wfd = PyLong_AsLong(args[0]);
    int cfd = PyLong_AsLong(args[1]);
    long limit = PyLong_AsLong(args[2]);
    int record = PyObject_IsTrue(args[3]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (wfd < 0 || cfd < 0 || limit < 0) {
        PyErr_SetString(PyExc_ValueError, "add: bad descriptor or limit");
        return NULL;
    }
    sess_t *s = calloc(1, sizeof(sess_t));
    if (s == NULL) {
        return PyErr_NoMemory();
    }
    s->wfd = fcntl(wfd, F_DUPFD_CLOEXEC, 0);
    s->cfd = fcntl(cfd, F_DUPFD_CLOEXEC, 0);
    if (s->wfd < 0 || s->cfd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        if (s->wfd >= 0) {
            close(s->wfd);
        }
        if (s->cfd >= 0) {
            close(s->cfd);
        }
        free(s);
        return NULL;
    }
    s->limit = limit > 65535 ? 65535 : limit;
    s->record = record;
    s->ww.s = s;
    s->ww.which = 0;
    s->cw.s = s;
    s->cw.which = 1;
    pthread_mutex_lock(&r->mu);
    if (r->nfree == 0) {
        uint32_t grow = r->nslots ? r->nslots : 256;
        sess_t **slots = realloc(r->slots, (r->nslots + grow) * sizeof(sess_t *));
        uint32_t *fr = slots ? realloc(r->free_slots, (r->nslots + grow) * sizeof(uint32_t)) : NULL;
        if (slots) {
            r->slots = slots;
        }
        if (fr == NULL) {
            pthread_mutex_unlock(&r->mu);
            close(s->wfd);
            close(s->cfd);
            free(s);
            return PyErr_NoMemory();
        }
        r->free_slots = fr;
        for (uint32_t i = 0; i < grow; i++) {
            r->slots[r->nslots + i] = NULL;
            r->free_slots[r->nfree++] = r->nslots + grow - 1 - i;
        }
        r->nslots += grow;
    }
    uint32_t slot = r->free_slots[--r->nfree];
    r->generation++;
    s->handle = ((uint64_t)r->generation << 32) | slot;
    r->slots[slot] = s;
    r->live++;
    watch(r, s, 0, 1);
    int ok = s->w_in_epoll;
    int e = errno;
    if (!ok) {
        release_sess(r, s);
    }
    pthread_mutex_unlock(&r->mu);
    if (!ok) {
        errno = e;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (!r->started) {
        if (pthread_create(&r->thread, NULL, run, r) != 0) {
            PyErr_SetString(PyExc_RuntimeError, "the relay thread could not start");
            pthread_mutex_lock(&r->mu);
            release_sess(r, s);
            pthread_mutex_unlock(&r->mu);
            return NULL;
        }
        r->started = 1;
    }
    return PyLong_FromUnsignedLongLong(s->handle);
}

static PyObject *
bytes_of(const unsigned char *p, size_t n)
{
    return PyBytes_FromStringAndSize((const char *)(n ? p : (const unsigned char *)""), (Py_ssize_t)n);
}

static PyObject *
Relay_remove(Relay *r, PyObject *arg)
{
    uint64_t handle = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (ensure_open(r) < 0) {
        return NULL;
    }
    pthread_mutex_lock(&r->mu);
    sess_t *s = lookup(r, handle);
    if (s == NULL) {
        pthread_mutex_unlock(&r->mu);
        PyErr_SetString(PyExc_KeyError, "no such relayed session");
        return NULL;
    }
    int reason = s->state == S_ACTIVE ? R_NONE : s->reason;
    PyObject *res = Py_BuildValue(
        "(NNNKKii)",
        bytes_of(s->carry, s->carry_len),
        bytes_of(s->out ? s->out + s->out_off : NULL, s->out ? s->out_len - s->out_off : 0),
        bytes_of(s->rec, s->rec_len),
        s->frames,
        s->bytes,
        reason,
        s->err);
    release_sess(r, s);
    pthread_mutex_unlock(&r->mu);
    return res;
}

static PyObject *
Relay_counts(Relay *r, PyObject *arg)
{
    uint64_t handle = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) {
        return NULL;
    }
    pthread_mutex_lock(&r->mu);
    sess_t *s = lookup(r, handle);
    unsigned long long frames = s ? s->frames : 0, nbytes = s ? s->bytes : 0;
    pthread_mutex_unlock(&r->mu);
    if (s == NULL) {
        PyErr_SetString(PyExc_KeyError, "no such relayed session");
        return NULL;
    }
    return Py_BuildValue("(KK)", frames, nbytes);
}

static PyObject *
Relay_take_record(Relay *r, PyObject *arg)
{
    uint64_t handle = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) {
        return NULL;
    }
    pthread_mutex_lock(&r->mu);
    sess_t *s = lookup(r, handle);
    PyObject *res = NULL;
    if (s != NULL) {
        res = bytes_of(s->rec, s->rec_len);
        s->rec_len = 0;
        s->rec_notified = 0;
    }
    pthread_mutex_unlock(&r->mu);
    if (s == NULL) {
        PyErr_SetString(PyExc_KeyError, "no such relayed session");
    }
    return res;
}

static PyObject *
Relay_events(Relay *r, PyObject *Py_UNUSED(ignored))
{
    if (r->closed) {
        return PyList_New(0);
    }
    uint64_t v;
    ssize_t got = read(r->notifyfd, &v, sizeof v);
    (void)got;
    pthread_mutex_lock(&r->mu);
    size_t n = r->nevents;
    event_t *evs = r->events;
    r->events = NULL;
    r->nevents = r->cap_events = 0;
    r->notified = 0;
    pthread_mutex_unlock(&r->mu);
    PyObject *list = PyList_New((Py_ssize_t)n);
    if (list == NULL) {
        free(evs);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        PyObject *t = Py_BuildValue("(Ki)", (unsigned long long)evs[i].handle, evs[i].kind);
        if (t == NULL) {
            Py_DECREF(list);
            free(evs);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, t);
    }
    free(evs);
    return list;
}

static PyObject *
Relay_live(Relay *r, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLong(r->live);
}

static PyMethodDef Relay_methods[] = {
    {"add", (PyCFunction)(void (*)(void))Relay_add, METH_FASTCALL,
     "add(worker_fd, client_fd, limit, record) -> handle: relay the worker's fast frames."},
    {"remove", (PyCFunction)Relay_remove, METH_O,
     "remove(handle) -> (carry, backlog, record, frames, bytes, reason, errno): take it back."},
    {"counts", (PyCFunction)Relay_counts, METH_O, "counts(handle) -> (frames, bytes) so far."},
    {"take_record", (PyCFunction)Relay_take_record, METH_O,
     "take_record(handle) -> bytes forwarded since the last take (record set)."},
    {"events", (PyCFunction)Relay_events, METH_NOARGS,
     "events() -> [(handle, kind)]: what happened since the last call (clears fileno())."},
    {"fileno", (PyCFunction)Relay_fileno, METH_NOARGS,
     "fileno() -> the descriptor that is readable while events are queued."},
    {"close", (PyCFunction)Relay_close, METH_NOARGS,
     "close(): let go of every session and stop the thread."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Relay_getset[] = {
    {"live", (getter)Relay_live, NULL, "sessions relayed now", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RelayType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "balancer._relay.Relay",
    .tp_basicsize = sizeof(Relay),
    .tp_dealloc = (destructor)Relay_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The relay thread: steady-state worker-to-client frames out of the interpreter.",
    .tp_methods = Relay_methods,
    .tp_getset = Relay_getset,
    .tp_new = Relay_new,
};

static struct PyModuleDef relay_module = {
    PyModuleDef_HEAD_INIT, "_relay", "The relay thread (see balancer/_relay.c).", -1, NULL,
};

PyMODINIT_FUNC
PyInit__relay(void)
{
    if (PyType_Ready(&RelayType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&relay_module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&RelayType);
    if (PyModule_AddObject(m, "Relay", (PyObject *)&RelayType) < 0 ||
        PyModule_AddIntConstant(m, "RETURNED", EV_RETURNED) < 0 ||
        PyModule_AddIntConstant(m, "RECORD", EV_RECORD) < 0 ||
        PyModule_AddIntConstant(m, "FRAME", R_FRAME) < 0 ||
        PyModule_AddIntConstant(m, "EOF", R_EOF) < 0 ||
        PyModule_AddIntConstant(m, "READ_ERROR", R_READ_ERROR) < 0 ||
        PyModule_AddIntConstant(m, "WRITE_ERROR", R_WRITE_ERROR) < 0 ||
        PyModule_AddIntConstant(m, "NOMEM", R_NOMEM) < 0 ||
        PyModule_AddIntConstant(m, "BUF_SIZE", BUF_SIZE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
