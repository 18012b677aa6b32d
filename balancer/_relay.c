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
 *   A session added with ``chunked`` is the body of a plain-HTTP response instead (SSE: an LLM's
 *   streamed answer): the thread forwards its whole chunks (``walk_chunks``, llhttp reading the
 *   framing), each counted as a frame and its data (not its framing) as bytes, and returns it at
 *   the last chunk or anything else; the rules are the same.
 * - Backpressure: a send that takes less than it was given keeps the rest (at most one read's
 *   worth), stops reading the worker and waits for the client socket to be writable. Nothing else
 *   is ever buffered. A chunked body is RETURNED there instead, its rest as the backlog: the event
 *   loop keeps the clock of a plain-HTTP client that stops reading (``timeouts.backpressure``).
 * - RETURNED: at the first frame that is anything else (a control frame, a fragment, an RSV bit, a
 *   mask bit, a larger frame), at the worker's EOF or a read error, or at a client write error, the
 *   thread stops touching the session's sockets and queues a RETURNED event; the bytes from that
 *   frame on stay in the carry. The event loop then calls ``remove``.
 * - ``remove`` (the event loop taking the session back, RETURNED or not): the thread lets go, and
 *   the caller receives the carry (unread by the scanner, from a frame boundary), the unsent
 *   backlog (to write to the client first), the recorded bytes, the counts and why it returned.
 * - With ``record`` set (a pool with crash failover), every forwarded byte is also appended to a
 *   record, taken by ``take_record``; a RECORD event says it passed ``REC_NOTIFY`` bytes. A byte
 *   is recorded before it is sent: the journal never misses a byte the client got.
 * - Out of memory (NOMEM) loses no byte: an allocation is only ever needed to keep bytes the
 *   thread already holds (the carry, the backlog, the record, its read buffer), and when it fails
 *   they stay the session's - the read buffer itself becomes the session's carry and backlog if
 *   nothing else can hold them, and the thread gets a new one before its next read - and the
 *   session is RETURNED with reason NOMEM, its bytes intact, for the event loop to go on with. A
 *   read whose bytes could not be recorded is not forwarded: they come back as carry. Queueing an
 *   event allocates nothing (each session is linked into the queue at most once, with the kinds
 *   it has pending), so no session is ever stranded in the thread for want of memory; an
 *   ``events()`` that cannot build its list raises MemoryError and queues the events again.
 *
 * Locking. One mutex ``mu`` guards the shared structures: the slots (handles), the event queue,
 * each session's published fields (``frames``, ``bytes``, the record, ``busy``, the queue links,
 * ``state`` once RELEASED) and the graveyard. The thread never holds it across a recv, a send or
 * an epoll_ctl, and the event loop never across building its Python results:
 *
 * 1. The thread waits in epoll_wait without it. It then takes ``mu`` once to *collect* the ready
 *    sessions (``busy`` COLLECTED), and takes the graveyard: the sessions released since its
 *    last collection, freed after ``mu``. No epoll event can name one of them any more: each
 *    left the epoll set, under ``mu``, before it entered the graveyard, and the events of the
 *    epoll_wait that may have seen it are the ones just collected.
 * 2. For each collected session in turn it takes ``mu`` briefly to publish the one before (3)
 *    and to mark this one SERVING (one released meanwhile is skipped), then does its I/O
 *    *without* ``mu``. A SERVING session's private fields (its carry and backlog, its watches,
 *    its ``state`` while ACTIVE or RETURNED, the counts not yet published) are the thread's
 *    alone: the event loop reads them only in ``remove``, which waits on the condition ``idle``
 *    while the session is SERVING - one session's recv and send at most, with the GIL held (the
 *    thread never takes the GIL, so the wait cannot close a cycle). A session only COLLECTED is
 *    released by ``remove`` at once. The only lock taken during the I/O is a brief one to
 *    append to the record (before the send), as ``take_record`` may take the record at any time.
 * 3. Publishing (with ``mu``): the counts, a RETURNED event, ``busy`` back to IDLE and ``idle``
 *    signalled when someone waits. The eventfd that wakes the event loop is written after ``mu``
 *    is released, and only when the queue went from empty to not.
 *
 * The event loop side: ``add`` and ``remove`` change the slots and the epoll set under ``mu``
 * (one epoll_ctl each); ``remove`` closes the thread's dup()s and builds its bytes after
 * releasing it. ``counts`` and ``take_record`` read published fields (counts lag by the read in
 * flight). ``events`` copies the queue into an array sized with the slots (one entry per session
 * at most) and builds the list after releasing ``mu``. A session ``remove`` released is unlinked
 * from the queue and marked RELEASED, so the thread never serves it again; it is freed at the
 * thread's next collection, or by ``close`` after the thread has stopped. ``close`` stops and
 * joins the thread before it lets go of the sessions, so no descriptor is closed under a recv.
 *
 * Sizes from the wire are bounded before arithmetic: a frame's 7- or 16-bit length and a chunk's
 * size (llhttp's reading, which refuses one past 2^64; at most 8 hex digits) are compared with
 * ``limit`` (at most 65535) before they are added to a position, so a carry is always less than
 * one read buffer; the record stops at REC_MAX (NOMEM: its bytes kept, as any allocation
 * failure). ``close`` waits JOIN_DEADLINE_S for the thread; past that it raises TimeoutError and
 * leaves the thread and every session it holds as they are, never freed, for the process's exit
 * to end.
 *
 * Python objects are touched only by the calling thread, with the GIL; the relay thread never
 * takes the GIL.
 *
 * Test-only: ``_fail_next(kind, n)`` makes the next n allocations of the thread ("alloc") or the
 * next n ``events()`` lists ("events") fail (tests/test_relay_faults.py); inert unless set.
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
#include <time.h>
#include <unistd.h>

#include "llhttp.h"

#define BUF_SIZE (256 * 1024)
#define REC_NOTIFY 8192
#define REC_MAX ((size_t)64 << 20) /* a record not taken past this: NOMEM, the bytes kept */
#define MAX_EVENTS 256
#define JOIN_DEADLINE_S 5 /* close() waits this long for the thread */

enum { S_ACTIVE = 0, S_RETURNED = 1, S_RELEASED = 2 };
enum { R_NONE = 0, R_FRAME = 1, R_EOF = 2, R_READ_ERROR = 3, R_WRITE_ERROR = 4, R_NOMEM = 5 };
enum { EV_RETURNED = 1, EV_RECORD = 2 };
enum { READY_READ = 1, READY_WRITE = 2 };
enum { BUSY_IDLE = 0, BUSY_COLLECTED = 1, BUSY_SERVING = 2 };

typedef struct sess sess_t;

typedef struct {
    sess_t *s;
    int which; /* 0: the worker socket (reads), 1: the client socket (writes) */
} watch_t;

struct sess {
    uint64_t handle;
    int wfd, cfd;
    long limit;
    int record;
    int chunked; /* the body of an HTTP/1.1 chunked response, not WebSocket frames */
    /* The thread's while it serves the session (busy SERVING); remove's otherwise. */
    int state, reason, err, told;
    int w_in_epoll, c_in_epoll, ready;
    watch_t ww, cw;
    /* What the session holds: keep[out_off:out_end] is the backlog (scanned, not yet sent to the
     * client), keep[out_end:keep_len] the carry (read, not yet scanned; from a frame boundary). */
    unsigned char *keep;
    size_t keep_cap, keep_len, out_off, out_end;
    unsigned long long d_frames, d_bytes; /* counted, not yet published */
    /* Under mu. */
    int busy, pending, rec_notified;
    unsigned long long frames, bytes;
    unsigned char *rec;
    size_t rec_len, rec_cap;
    sess_t *ev_prev, *ev_next, *next_dead;
};

typedef struct {
    uint64_t handle;
    int kinds;
} event_t;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t idle;
    pthread_t thread;
    int started, stopping, closed, stuck; /* stopping: atomic (close() takes no lock for it) */
    int epfd, wakefd, notifyfd;
    pid_t pid;
    unsigned char *buf; /* the thread's */
    /* Under mu. */
    sess_t **slots;
    uint32_t nslots;
    uint32_t *free_slots;
    uint32_t nfree;
    uint32_t generation;
    uint32_t live;
    sess_t *graveyard;
    sess_t *ev_head, *ev_tail; /* the sessions with events pending, in order */
    int notified, waiters;
    /* The event loop's (events()): room for every slot. */
    event_t *evout;
} Relay;

/* -- test-only failure injection (_fail_next; inert unless a test sets it) ----------------- */

static int fail_alloc, fail_events;

static int
take_fail(int *n)
{
    int v = __atomic_load_n(n, __ATOMIC_RELAXED);
    while (v > 0) {
        if (__atomic_compare_exchange_n(n, &v, v - 1, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            return 1;
        }
    }
    return 0;
}

/* Every allocation of the relay thread. */
static void *
t_malloc(size_t n)
{
    return take_fail(&fail_alloc) ? NULL : malloc(n);
}

static void *
t_realloc(void *p, size_t n)
{
    return take_fail(&fail_alloc) ? NULL : realloc(p, n);
}

/* -- the event queue (mu held; allocates nothing) ------------------------------------------ */

/* Queue an event of s; 1 when the caller must write notifyfd (after releasing mu). */
static int
push_event(Relay *r, sess_t *s, int kind)
{
    if (s->pending == 0) {
        s->ev_next = NULL;
        s->ev_prev = r->ev_tail;
        if (r->ev_tail != NULL) {
            r->ev_tail->ev_next = s;
        }
        else {
            r->ev_head = s;
        }
        r->ev_tail = s;
    }
    s->pending |= kind;
    if (!r->notified) {
        r->notified = 1;
        return 1;
    }
    return 0;
}

static void
unqueue(Relay *r, sess_t *s)
{
    if (s->pending == 0) {
        return;
    }
    if (s->ev_prev != NULL) {
        s->ev_prev->ev_next = s->ev_next;
    }
    else {
        r->ev_head = s->ev_next;
    }
    if (s->ev_next != NULL) {
        s->ev_next->ev_prev = s->ev_prev;
    }
    else {
        r->ev_tail = s->ev_prev;
    }
    s->ev_prev = s->ev_next = NULL;
    s->pending = 0;
}

static void
notify(Relay *r)
{
    uint64_t one = 1;
    ssize_t w = write(r->notifyfd, &one, sizeof one);
    (void)w;
}

/* -- a served session's I/O (the thread, without mu) --------------------------------------- */

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

/* Stop touching the session's sockets; its RETURNED event is queued when it is published. */
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
}

static void
drop_keep(sess_t *s)
{
    free(s->keep);
    s->keep = NULL;
    s->keep_cap = s->keep_len = s->out_off = s->out_end = 0;
}

/* Keep b[from:to] of the read buffer b, b[from:mid] as the backlog and b[mid:to] as the carry.
 * 0, or -1 when no memory could hold them: then the read buffer itself is the session's (the
 * thread allocates another before its next read) and nothing is lost. */
static int
keep_bytes(Relay *r, sess_t *s, unsigned char *b, size_t from, size_t mid, size_t to)
{
    size_t n = to - from;
    int rc = 0;
    if (n == 0) {
        drop_keep(s);
        return 0;
    }
    if (n > s->keep_cap) {
        unsigned char *q = t_malloc(n);
        if (q == NULL) {
            free(s->keep);
            memmove(b, b + from, n);
            s->keep = b;
            s->keep_cap = BUF_SIZE;
            r->buf = NULL;
            rc = -1;
        }
        else {
            free(s->keep);
            s->keep = q;
            s->keep_cap = n;
        }
    }
    if (rc == 0) {
        memcpy(s->keep, b + from, n);
    }
    s->keep_len = n;
    s->out_off = 0;
    s->out_end = mid - from;
    return rc;
}

/* With mu held: append to the record; -1 when it cannot grow (the caller forwards nothing). */
static int
append_record(Relay *r, sess_t *s, const unsigned char *p, size_t n, int *wake)
{
    if (n > REC_MAX || s->rec_len > REC_MAX - n) {
        return -1; /* checked before the sum: it cannot wrap */
    }
    if (s->rec_len + n > s->rec_cap) {
        size_t cap = s->rec_cap ? s->rec_cap : 4096;
        while (cap < s->rec_len + n) {
            cap *= 2; /* below 2 * REC_MAX */
        }
        unsigned char *q = t_realloc(s->rec, cap);
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
        *wake |= push_event(r, s, EV_RECORD);
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
            if (length > (size_t)limit) { /* limit: 0..65535 */
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

/* walk()'s twin for a chunked HTTP response body (a plain-HTTP exchange, aio/httpproxy.py):
 * how far the whole chunks of p[0:n] reach, each a size line of 1-8 hex digits and CRLF (no
 * extension), at most ``limit`` bytes of data, then CRLF. *stop is set at anything else: the last
 * chunk (size 0, with its trailers), an extension, a malformed line - all of them Python's, whose
 * reader (httpmsg.ResponseReader) accepts every chunk forwarded here and refuses what it must.
 *
 * llhttp reads the framing (strict: no whitespace after a size, CRLF only, sizes past 2^64
 * refused): a copy of a parser that has read a chunked response's head (``chunked_body``) is
 * run over p[0:n], paused after each chunk's size line (its size and digits checked here) and
 * after each chunk's CRLF (a whole chunk: counted). An extension or any error of llhttp's stops
 * the walk at the chunk it is in; bytes it consumed without a pause are a chunk cut short (a size
 * line of 9 or more digits stops the walk once its CRLF is in). */
typedef struct {
    int at_header;   /* the pause was after a size line, not after a chunk */
    uint64_t size;   /* the current chunk's */
} chunk_walk_t;

static llhttp_t chunked_body; /* read "HTTP/1.1 200 OK", "Transfer-Encoding: chunked" (init) */
static llhttp_settings_t chunk_settings;

static int
on_chunk_header(llhttp_t *h)
{
    chunk_walk_t *w = h->data;
    w->at_header = 1;
    w->size = h->content_length;
    return HPE_PAUSED;
}

static int
on_chunk_complete(llhttp_t *h)
{
    ((chunk_walk_t *)h->data)->at_header = 0;
    return HPE_PAUSED;
}

static int
on_chunk_extension(llhttp_t *h, const char *at, size_t len)
{
    (void)h, (void)at, (void)len;
    return -1; /* not the thread's: the walk stops at this chunk */
}

static int
init_chunked_body(void)
{
    static const char head[] = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n";
    llhttp_settings_init(&chunk_settings);
    chunk_settings.on_chunk_header = on_chunk_header;
    chunk_settings.on_chunk_complete = on_chunk_complete;
    chunk_settings.on_chunk_extension_name = on_chunk_extension;
    llhttp_init(&chunked_body, HTTP_RESPONSE, &chunk_settings);
    return llhttp_execute(&chunked_body, head, sizeof head - 1) == HPE_OK ? 0 : -1;
}

static size_t
walk_chunks(const unsigned char *p, size_t n, long limit, unsigned long long *count,
            unsigned long long *payload, int *stop)
{
    llhttp_t h = chunked_body;
    chunk_walk_t w = {0, 0};
    const char *data = (const char *)p;
    size_t pos = 0, at = 0;
    h.data = &w;
    *stop = 0;
    while (at < n) {
        llhttp_errno_t e = llhttp_execute(&h, data + at, n - at);
        if (e == HPE_OK) {
            break; /* all of it read: the rest is a chunk cut short */
        }
        if (e != HPE_PAUSED) {
            *stop = 1;
            break;
        }
        at = (size_t)(llhttp_get_error_pos(&h) - data);
        if (w.at_header) {
            if (at - pos - 2 > 8 || w.size == 0 || w.size > (uint64_t)limit) { /* limit <= 65535 */
                *stop = 1;
                break;
            }
        }
        else {
            (*count)++;
            *payload += w.size;
            pos = at;
        }
        llhttp_resume(&h);
    }
    return pos;
}

static void
on_readable(Relay *r, sess_t *s, int *wake)
{
    if (s->out_off < s->out_end) {
        return; /* a backlog first (the worker's watch is off meanwhile) */
    }
    if (r->buf == NULL) {
        r->buf = t_malloc(BUF_SIZE);
        if (r->buf == NULL) {
            give_back(r, s, R_NOMEM, ENOMEM); /* its carry stays where it is */
            return;
        }
    }
    unsigned char *b = r->buf;
    size_t have = s->keep_len - s->out_end;
    if (have >= BUF_SIZE) { /* never: a carry is less than one frame or chunk of limit bytes */
        give_back(r, s, R_FRAME, 0);
        return;
    }
    if (have) {
        memcpy(b, s->keep + s->out_end, have); /* still kept until the read says otherwise */
    }
    ssize_t n = recv(s->wfd, b + have, BUF_SIZE - have, MSG_DONTWAIT);
    if (n <= 0) {
        int e = n < 0 ? errno : 0;
        if (n < 0 && (e == EAGAIN || e == EWOULDBLOCK || e == EINTR)) {
            return;
        }
        give_back(r, s, n == 0 ? R_EOF : R_READ_ERROR, e);
        return;
    }
    size_t total = have + (size_t)n;
    unsigned long long count = 0, payload = 0;
    int stop = 0;
    size_t pos = s->chunked ? walk_chunks(b, total, s->limit, &count, &payload, &stop)
                            : walk(b, total, s->limit, &count, &stop);
    if (pos > 0 && s->record) {
        pthread_mutex_lock(&r->mu);
        int rc = append_record(r, s, b, pos, wake);
        pthread_mutex_unlock(&r->mu);
        if (rc < 0) { /* the journal would miss them: nothing is forwarded, all is carried */
            keep_bytes(r, s, b, 0, 0, total);
            give_back(r, s, R_NOMEM, ENOMEM);
            return;
        }
    }
    if (pos == 0) {
        if (keep_bytes(r, s, b, 0, 0, total) < 0) {
            give_back(r, s, R_NOMEM, ENOMEM);
        }
        else if (stop) {
            give_back(r, s, R_FRAME, 0);
        }
        return;
    }
    s->d_frames += count;
    s->d_bytes += s->chunked ? payload : pos; /* a body's bytes are its chunks' data */
    ssize_t w = send(s->cfd, b, pos, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (w < 0) {
        int e = errno;
        if (e != EAGAIN && e != EWOULDBLOCK && e != EINTR) {
            keep_bytes(r, s, b, 0, pos, total);
            give_back(r, s, R_WRITE_ERROR, e);
            return;
        }
        w = 0;
    }
    if (keep_bytes(r, s, b, (size_t)w, pos, total) < 0) {
        give_back(r, s, R_NOMEM, ENOMEM);
        return;
    }
    if (stop) {
        give_back(r, s, R_FRAME, 0);
    }
    else if ((size_t)w < pos && s->chunked) {
        /* An HTTP client not taking the body: the event loop times its stall (httpproxy.py) */
        give_back(r, s, R_FRAME, 0);
    }
    else if ((size_t)w < pos) {
        watch(r, s, 0, 0); /* stop reading the worker until the client takes it */
        watch(r, s, 1, 1);
    }
}

static void
on_writable(Relay *r, sess_t *s)
{
    if (s->out_off == s->out_end) {
        watch(r, s, 1, 0);
        return;
    }
    size_t left = s->out_end - s->out_off;
    ssize_t w = send(s->cfd, s->keep + s->out_off, left, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (w < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
            return;
        }
        give_back(r, s, R_WRITE_ERROR, errno);
        return;
    }
    s->out_off += (size_t)w;
    if (s->out_off == s->out_end) {
        if (s->keep_len == s->out_end) {
            drop_keep(s);
        }
        watch(r, s, 1, 0);
        watch(r, s, 0, 1);
    }
}

static void
free_sess(sess_t *s)
{
    free(s->keep);
    free(s->rec);
    free(s);
}

/* With mu held: what a served session's I/O changed becomes visible; 1 to write notifyfd. */
static int
publish(Relay *r, sess_t *s)
{
    int wake = 0;
    s->frames += s->d_frames;
    s->bytes += s->d_bytes;
    s->d_frames = s->d_bytes = 0;
    if (s->state == S_RETURNED && !s->told) {
        s->told = 1;
        wake = push_event(r, s, EV_RETURNED);
    }
    s->busy = BUSY_IDLE;
    if (r->waiters) {
        pthread_cond_broadcast(&r->idle);
    }
    return wake;
}

static void *
run(void *arg)
{
    Relay *r = (Relay *)arg;
    struct epoll_event evs[MAX_EVENTS];
    sess_t *batch[MAX_EVENTS];
    for (;;) {
        int n = epoll_wait(r->epfd, evs, MAX_EVENTS, 1000);
        int woken = 0, nb = 0;
        /* 1. Collect. */
        pthread_mutex_lock(&r->mu);
        if (__atomic_load_n(&r->stopping, __ATOMIC_ACQUIRE)) {
            pthread_mutex_unlock(&r->mu);
            break;
        }
        for (int i = 0; i < n; i++) {
            watch_t *w = (watch_t *)evs[i].data.ptr;
            if (w == NULL) {
                woken = 1;
                continue;
            }
            sess_t *s = w->s;
            if (s->state != S_ACTIVE) {
                continue; /* returned, or released since epoll_wait */
            }
            s->ready |= w->which ? READY_WRITE : READY_READ;
            if (s->busy == BUSY_IDLE) {
                s->busy = BUSY_COLLECTED;
                batch[nb++] = s;
            }
        }
        sess_t *dead = r->graveyard;
        r->graveyard = NULL;
        pthread_mutex_unlock(&r->mu);
        if (woken) {
            uint64_t v;
            ssize_t got = read(r->wakefd, &v, sizeof v);
            (void)got;
        }
        while (dead != NULL) {
            sess_t *s = dead;
            dead = s->next_dead;
            free_sess(s);
        }
        /* 2. The I/O of each, then 3. publish it: one lock round per session, that publishes
         * the one before and starts this one (one removed meanwhile is skipped). */
        sess_t *prev = NULL;
        for (int i = 0; nb > 0 && i <= nb; i++) {
            sess_t *s = i < nb ? batch[i] : NULL;
            int wake = 0;
            pthread_mutex_lock(&r->mu);
            if (prev != NULL) {
                wake = publish(r, prev);
            }
            if (s != NULL) {
                if (s->state == S_RELEASED) {
                    s = NULL;
                }
                else {
                    s->busy = BUSY_SERVING;
                }
            }
            pthread_mutex_unlock(&r->mu);
            if (wake) {
                notify(r);
            }
            prev = s;
            if (s == NULL) {
                continue;
            }
            wake = 0;
            if (s->ready & READY_WRITE) {
                on_writable(r, s);
            }
            if ((s->ready & READY_READ) && s->state == S_ACTIVE && s->w_in_epoll) {
                on_readable(r, s, &wake);
            }
            s->ready = 0;
            if (wake) {
                notify(r);
            }
        }
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
    pthread_cond_init(&r->idle, NULL);
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

/* With mu held and s not being served: the thread lets go of s (it never serves it again; it is freed at
 * the thread's next collection). Its two descriptors are the caller's to close, after mu. */
static void
release_sess(Relay *r, sess_t *s)
{
    watch(r, s, 0, 0);
    watch(r, s, 1, 0);
    unqueue(r, s);
    uint32_t slot = (uint32_t)(s->handle & 0xffffffffu);
    r->slots[slot] = NULL;
    r->free_slots[r->nfree++] = slot;
    r->live--;
    s->state = S_RELEASED;
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
    /* No lock on the way: a thread stuck holding mu cannot hold up a shutdown. */
    __atomic_store_n(&r->stopping, 1, __ATOMIC_RELEASE);
    if (r->started) {
        uint64_t one = 1;
        ssize_t w = write(r->wakefd, &one, sizeof one);
        (void)w;
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += JOIN_DEADLINE_S;
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = pthread_timedjoin_np(r->thread, NULL, &until);
        Py_END_ALLOW_THREADS
        if (rc != 0) { /* everything it may touch stays, never freed; the exit ends it */
            r->closed = r->stuck = 1;
            PyErr_Format(PyExc_TimeoutError,
                         "the relay thread did not stop within %d s; its sessions are left to "
                         "the process's exit",
                         JOIN_DEADLINE_S);
            return NULL;
        }
        r->started = 0;
    }
    /* The thread is gone: nothing is busy. */
    pthread_mutex_lock(&r->mu);
    for (uint32_t i = 0; i < r->nslots; i++) {
        sess_t *s = r->slots[i];
        if (s != NULL) {
            release_sess(r, s);
            close(s->wfd);
            close(s->cfd);
        }
    }
    sess_t *dead = r->graveyard;
    r->graveyard = NULL;
    pthread_mutex_unlock(&r->mu);
    while (dead != NULL) {
        sess_t *s = dead;
        dead = s->next_dead;
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
        if (res == NULL) {
            PyErr_WriteUnraisable((PyObject *)r);
        }
        Py_XDECREF(res);
    }
    if (r->stuck) {
        return; /* a thread that did not stop may still use all of it: leaked on purpose */
    }
    free(r->buf);
    free(r->slots);
    free(r->free_slots);
    free(r->evout);
    pthread_cond_destroy(&r->idle);
    pthread_mutex_destroy(&r->mu);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *
Relay_fileno(Relay *r, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLong(r->notifyfd);
}

/* With mu held: room for ``grow`` more sessions (slots, free list, events() array). */
static int
grow_slots(Relay *r)
{
    if (r->nslots >= (1u << 30)) {
        return -1; /* the doubling would wrap */
    }
    uint32_t grow = r->nslots ? r->nslots : 256;
    uint32_t n = r->nslots + grow;
    sess_t **slots = realloc(r->slots, n * sizeof(sess_t *));
    if (slots == NULL) {
        return -1;
    }
    r->slots = slots;
    uint32_t *fr = realloc(r->free_slots, n * sizeof(uint32_t));
    if (fr == NULL) {
        return -1;
    }
    r->free_slots = fr;
    event_t *evout = realloc(r->evout, n * sizeof(event_t));
    if (evout == NULL) {
        return -1;
    }
    r->evout = evout;
    for (uint32_t i = 0; i < grow; i++) {
        r->slots[r->nslots + i] = NULL;
        r->free_slots[r->nfree++] = n - 1 - i;
    }
    r->nslots = n;
    return 0;
}

static PyObject *
Relay_add(Relay *r, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "add(worker_fd, client_fd, limit, record[, chunked])");
        return NULL;
    }
    if (ensure_open(r) < 0) {
        return NULL;
    }
    long wfd_l = PyLong_AsLong(args[0]);
    long cfd_l = PyLong_AsLong(args[1]);
    long limit = PyLong_AsLong(args[2]);
    int record = PyObject_IsTrue(args[3]);
    int chunked = nargs == 5 ? PyObject_IsTrue(args[4]) : 0;
    if (PyErr_Occurred() || record < 0 || chunked < 0) {
        return NULL;
    }
    if (wfd_l < 0 || cfd_l < 0 || wfd_l > INT_MAX || cfd_l > INT_MAX || limit < 0) {
        PyErr_SetString(PyExc_ValueError, "add: bad descriptor or limit");
        return NULL;
    }
    int wfd = (int)wfd_l, cfd = (int)cfd_l;
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
    s->chunked = chunked;
    s->ww.s = s;
    s->ww.which = 0;
    s->cw.s = s;
    s->cw.which = 1;
    pthread_mutex_lock(&r->mu);
    if (r->nfree == 0 && grow_slots(r) < 0) {
        pthread_mutex_unlock(&r->mu);
        close(s->wfd);
        close(s->cfd);
        free(s);
        return PyErr_NoMemory();
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
        close(s->wfd);
        close(s->cfd);
        errno = e;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (!r->started) {
        if (pthread_create(&r->thread, NULL, run, r) != 0) {
            PyErr_SetString(PyExc_RuntimeError, "the relay thread could not start");
            pthread_mutex_lock(&r->mu);
            release_sess(r, s);
            pthread_mutex_unlock(&r->mu);
            close(s->wfd);
            close(s->cfd);
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
    /* The thread is doing this session's I/O: at most one recv and one send, then it
     * publishes and signals (it never takes the GIL, which this thread holds meanwhile). One
     * only collected is released at once: the thread skips it. */
    while (s->busy == BUSY_SERVING) {
        r->waiters++;
        pthread_cond_wait(&r->idle, &r->mu);
        r->waiters--;
    }
    /* Not served: its fields are this thread's now. Take its buffers; build after mu. */
    int reason = s->state == S_ACTIVE ? R_NONE : s->reason;
    int err = s->err;
    unsigned long long frames = s->frames, nbytes = s->bytes;
    unsigned char *keep = s->keep, *rec = s->rec;
    size_t out_off = s->out_off, out_end = s->out_end, keep_len = s->keep_len;
    size_t rec_len = s->rec_len;
    s->keep = s->rec = NULL;
    int wfd = s->wfd, cfd = s->cfd;
    release_sess(r, s);
    pthread_mutex_unlock(&r->mu);
    close(wfd);
    close(cfd);
    PyObject *res = Py_BuildValue(
        "(NNNKKii)",
        bytes_of(keep ? keep + out_end : NULL, keep ? keep_len - out_end : 0),
        bytes_of(keep ? keep + out_off : NULL, keep ? out_end - out_off : 0),
        bytes_of(rec, rec_len),
        frames,
        nbytes,
        reason,
        err);
    free(keep);
    free(rec);
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
        /* One copy under mu (no Python code runs in it); the buffer stays the thread's, so a
         * MemoryError here leaves the record as it was. */
        res = bytes_of(s->rec, s->rec_len);
        if (res != NULL) {
            s->rec_len = 0;
            s->rec_notified = 0;
        }
    }
    pthread_mutex_unlock(&r->mu);
    if (s == NULL) {
        PyErr_SetString(PyExc_KeyError, "no such relayed session");
    }
    return res;
}

/* With mu held: queue again what events() took and could not hand over. */
static int
requeue(Relay *r, size_t n)
{
    int wake = 0;
    for (size_t i = 0; i < n; i++) {
        sess_t *s = lookup(r, r->evout[i].handle);
        if (s != NULL) {
            if (r->evout[i].kinds & EV_RECORD) {
                wake |= push_event(r, s, EV_RECORD);
            }
            if (r->evout[i].kinds & EV_RETURNED) {
                wake |= push_event(r, s, EV_RETURNED);
            }
        }
    }
    return wake;
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
    size_t n = 0, items = 0;
    pthread_mutex_lock(&r->mu);
    for (sess_t *s = r->ev_head; s != NULL; s = s->ev_next) {
        r->evout[n].handle = s->handle; /* at most one entry per slot: evout has room */
        r->evout[n].kinds = s->pending;
        items += (s->pending & EV_RECORD ? 1 : 0) + (s->pending & EV_RETURNED ? 1 : 0);
        n++;
    }
    while (r->ev_head != NULL) {
        unqueue(r, r->ev_head);
    }
    r->notified = 0;
    pthread_mutex_unlock(&r->mu);
    PyObject *list = take_fail(&fail_events) ? PyErr_NoMemory() : PyList_New((Py_ssize_t)items);
    Py_ssize_t k = 0;
    for (size_t i = 0; list != NULL && i < n; i++) {
        for (int kind = EV_RECORD; kind >= EV_RETURNED; kind--) {
            if (!(r->evout[i].kinds & kind)) {
                continue;
            }
            PyObject *t = Py_BuildValue("(Ki)", (unsigned long long)r->evout[i].handle, kind);
            if (t == NULL) {
                Py_CLEAR(list);
                break;
            }
            PyList_SET_ITEM(list, k++, t);
        }
    }
    if (list == NULL) {
        pthread_mutex_lock(&r->mu);
        int wake = requeue(r, n);
        pthread_mutex_unlock(&r->mu);
        if (wake) {
            notify(r);
        }
    }
    return list;
}

static PyObject *
Relay_live(Relay *r, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLong(r->live);
}

static PyMethodDef Relay_methods[] = {
    {"add", (PyCFunction)(void (*)(void))Relay_add, METH_FASTCALL,
     "add(worker_fd, client_fd, limit, record[, chunked]) -> handle: relay the worker's fast "
     "frames (chunked: the whole chunks of an HTTP response body)."},
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

static PyObject *
fail_next(PyObject *Py_UNUSED(module), PyObject *args)
{
    const char *kind;
    int n;
    if (!PyArg_ParseTuple(args, "si:_fail_next", &kind, &n)) {
        return NULL;
    }
    int *counter;
    if (strcmp(kind, "alloc") == 0) {
        counter = &fail_alloc;
    }
    else if (strcmp(kind, "events") == 0) {
        counter = &fail_events;
    }
    else {
        PyErr_SetString(PyExc_ValueError, "_fail_next: the kind is 'alloc' or 'events'");
        return NULL;
    }
    if (n < 0) { /* only tell */
        return PyLong_FromLong(__atomic_load_n(counter, __ATOMIC_RELAXED));
    }
    return PyLong_FromLong(__atomic_exchange_n(counter, n, __ATOMIC_RELAXED));
}

static PyMethodDef module_methods[] = {
    {"_fail_next", fail_next, METH_VARARGS,
     "_fail_next(kind, n) -> what was left of the last: test-only, the next n allocations of the "
     "relay thread ('alloc') or events() lists ('events') fail (n < 0: only tell what is left)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef relay_module = {
    PyModuleDef_HEAD_INIT, "_relay", "The relay thread (see balancer/_relay.c).", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__relay(void)
{
    if (init_chunked_body() < 0) {
        PyErr_SetString(PyExc_ImportError, "llhttp did not read a chunked response's head");
        return NULL;
    }
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
        PyModule_AddIntConstant(m, "TAKEN_BACK", R_NONE) < 0 ||
        PyModule_AddIntConstant(m, "FRAME", R_FRAME) < 0 ||
        PyModule_AddIntConstant(m, "EOF", R_EOF) < 0 ||
        PyModule_AddIntConstant(m, "READ_ERROR", R_READ_ERROR) < 0 ||
        PyModule_AddIntConstant(m, "WRITE_ERROR", R_WRITE_ERROR) < 0 ||
        PyModule_AddIntConstant(m, "NOMEM", R_NOMEM) < 0 ||
        PyModule_AddIntConstant(m, "BUF_SIZE", BUF_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "REC_NOTIFY", REC_NOTIFY) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
