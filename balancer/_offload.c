/* The offload thread: one thread per serving process that serves, out of the interpreter, the
 * steady state of two kinds of connection the event loop hands it (docs/architecture.md):
 *
 * - a relayed *session* (balancer/aio/offload.py): a WebSocket session's worker-to-client data
 *   frames, or the chunks of a plain-HTTP streamed answer (SSE);
 * - a *lane* (balancer/aio/lanes.py): a kept-alive plain-HTTP client connection and its worker
 *   connection, whose next requests are served whole while they route as the first one did.
 *
 * Why. At stream load the relay's cost is per read, not per byte: entering Python once per read
 * costs 5-6 us, nginx's whole user time per frame is 2.4 us, and in one event loop every event
 * of a batch waits behind the others' Python work. A small JSON request through the event loop
 * costs about 25x nginx's CPU, all of it Python per request, though most requests on a kept-alive
 * connection are the one before again. Both are taken off the event loop here, and handed back
 * for everything else.
 *
 * The core, shared by both kinds. One slot table (a handle: a generation and a slot, so a stale
 * handle never names a newer unit), one queue of events to the event loop (each unit linked into
 * it at most once with the kinds it has pending, so queueing allocates nothing), one epoll set
 * and loop, one stop. Every socket is watched edge-triggered, with its readiness kept in flags
 * until a read or a send says EAGAIN (or is short): a lane needs reads and writes on both of its
 * sockets in turns decided by its exchange, which level triggering would have to follow with an
 * epoll_ctl per turn; edge triggering registers each socket once, at add. A session whose read
 * filled the read buffer is served again at the loop's next turn (no epoll wait, at most
 * MAX_EVENTS of them a turn, in order: ``again_t``): one fast session cannot starve the rest.
 *
 * The thread's own dup()s of the descriptors are what it watches, reads and writes, so a
 * descriptor closed by the event loop can never be reused under the thread; they are closed when
 * the unit is freed.
 *
 * Locking. One mutex ``mu`` guards the slots, the event queue, the graveyard (units removed
 * since the thread's last collection, freed by it after its next), the lanes' control list, each
 * session's published fields and the lanes' log and counts. The thread never holds it across a
 * recv, a send or an epoll_ctl, and the event loop never across building its Python results:
 *
 * 1. The thread waits in epoll_wait without it, then takes ``mu`` once to *collect*: the ready
 *    sessions (``busy`` COLLECTED), the lanes' control list and the graveyard. The graveyard is
 *    freed at the end of the turn: no event of this turn's epoll_wait can name a unit released
 *    before the collection and still be followed (a session is checked under ``mu``, a lane left
 *    the epoll set in the thread before it was returned).
 * 2. A session is served under the protocol below (``busy``); a lane is the thread's alone while
 *    ACTIVE (the event loop asks for a release or an abort through the control list, under
 *    ``mu``, and reads a lane only in ``remove_lane``, after its RETURNED event).
 * 3. The eventfd that wakes the event loop is written after ``mu`` is released, and only when
 *    the queue went from empty to not.
 *
 * Shutdown. ``close`` stops the thread (it looks at ``stopping`` every 50 ms, and ``close`` takes
 * no lock on the way) and waits JOIN_DEADLINE_S for it; past that it raises TimeoutError and
 * leaves the thread and every unit it holds as they are, never freed, for the process's exit to
 * end. Then the sessions are let go and the lanes still ACTIVE are RETURNED with CLOSED.
 *
 * Sizes from the wire are bounded before arithmetic (see each kind's rules). Python objects are
 * touched only by the calling thread, with the GIL; the offload thread never takes the GIL.
 *
 * Test-only: ``_fail_next(kind, n)`` makes the next n allocations of a session's I/O ("alloc") or
 * the next n ``events()`` lists ("events") fail (tests/test_relay_faults.py); ``_spin(on)`` makes
 * the thread spin without a lock until it is cleared (tests/test_hostile_worker.py). Both are
 * inert unless a test sets them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "llhttp.h"

#define MAX_EVENTS 256
#define JOIN_DEADLINE_S 5 /* close() waits this long for the thread */
/* A session's. */
#define BUF_SIZE (256 * 1024)
#define REC_NOTIFY 8192
#define REC_MAX ((size_t)64 << 20) /* a record not taken past this: NOMEM, the bytes kept */
/* A lane's. */
#define READ_SIZE (64 * 1024)
#define RESP_HEAD_LIMIT (64 * 1024)
#define BUF_MAX ((size_t)64 << 20)        /* no buffer of a lane ever holds more */
#define LOG_MAX ((size_t)32768)           /* exchange records beyond this wait are dropped */
#define CHUNK_LINE_LIMIT 4096             /* a chunk-size line with its extension */
#define CHUNK_MAX ((unsigned long long)1 << 40) /* a larger chunk is refused */
#define MAX_FIELDS 256
/* The event loop is woken past this many exchange records: it formats them a batch at a time, and a
 * batch of 1,024 stalled the shared cores (keyed p99 4.3 ms against 1.3 ms at 32, bench/plain_http.py). */
#define LOG_NOTIFY 32
#define MAX_BUCKETS 32

enum { K_SESSION = 0, K_LANE = 1 };
enum { W_CLIENT = 0, W_WORKER = 1 };
/* The kinds of events(): a unit came back; a session's record passed REC_NOTIFY; the lanes'
 * exchange records passed LOG_NOTIFY. */
enum { EV_RETURNED = 1, EV_RECORD = 2, EV_FLUSH = 4 };
/* A session's. */
enum { S_ACTIVE = 0, S_RETURNED = 1, S_RELEASED = 2 };
enum { R_NONE = 0, R_FRAME = 1, R_EOF = 2, R_READ_ERROR = 3, R_WRITE_ERROR = 4, R_NOMEM = 5 };
enum { READY_READ = 1, READY_WRITE = 2 };
enum { BUSY_IDLE = 0, BUSY_COLLECTED = 1, BUSY_SERVING = 2 };
/* A lane's. */
enum { L_ACTIVE = 0, L_RETURNED = 1 };
enum { P_IDLE = 0, P_EXCHANGE = 1 };
enum {
    LR_HANDBACK = 1,
    LR_RETRY,
    LR_WORKER_DONE,
    LR_RELEASED,
    LR_IDLE,
    LR_CLIENT_EOF,
    LR_CLIENT_GONE,
    LR_FAILED,
    LR_CLOSED,
};
enum { RS_HEAD, RS_CL, RS_CHUNKED, RS_CLOSE, RS_DONE };
enum { CTL_RELEASE = 1, CTL_ABORT = 2 };

typedef struct unit unit_t;

/* What every slot holds first: a session or a lane. */
struct unit {
    uint64_t handle;
    int kind;
    int cfd, wfd; /* the thread's dup()s */
    /* Under mu. */
    int pending; /* the event kinds queued (0: not in the queue) */
    unit_t *ev_prev, *ev_next, *next_dead;
};

typedef struct {
    unit_t *u;
    int which; /* W_CLIENT or W_WORKER */
} watch_t;

typedef struct {
    unsigned char *p;
    size_t off, len, cap;
} buf_t;

typedef struct {
    unsigned char *p;
    size_t n;
} str_t;

typedef struct {
    size_t name, name_len, value, value_len;
} field_t;

typedef struct sess sess_t;

struct sess {
    unit_t u;
    long limit;
    int record;
    int chunked; /* the body of an HTTP/1.1 chunked response, not WebSocket frames */
    watch_t ww, cw;
    /* The thread's while it serves the session (busy SERVING); remove's otherwise. */
    int state, reason, err, told;
    int ready, hup; /* READY_*: kept until a recv or send says otherwise (edge-triggered) */
    /* What the session holds: keep[out_off:out_end] is the backlog (scanned, not yet sent to the
     * client), keep[out_end:keep_len] the carry (read, not yet scanned; from a frame boundary). */
    unsigned char *keep;
    size_t keep_cap, keep_len, out_off, out_end;
    unsigned long long d_frames, d_bytes; /* counted, not yet published */
    /* Under mu. */
    int busy, rec_notified;
    unsigned long long frames, bytes;
    unsigned char *rec;
    size_t rec_len, rec_cap;
    /* The thread's: linked into its list of sessions to read again next turn. */
    int in_again;
    sess_t *again_next;
};

typedef struct lane lane_t;

struct lane {
    unit_t u;
    int state, reason;
    watch_t cw, ww;
    /* The spec (the event loop's, copied at add). */
    str_t sig, target, pre, post, resp_add, pool; /* the spec's peer, key, backend: Python's */
    str_t *sig_names, *drop, *resp_drop;
    int n_sig, n_drop, n_resp_drop;
    long max_head, max_headers;
    long long max_body;
    double t_request, t_server, t_idle;
    double t_stall; /* timeouts.backpressure: a client that takes nothing for this long is cut */
    /* The thread's. */
    buf_t cin, wout, win, cout;
    unsigned long long c_sent, c_seen; /* bytes the client took; as check_clocks last saw it */
    double c_moved;                    /* when the client last took a byte or was owed none */
    int c_rd, c_wr, w_rd, w_wr, c_eof, w_eof, c_hup, w_hup;
    int phase, release_asked;
    size_t req_start;       /* cin offset of the current request's first byte */
    size_t req_seen, resp_seen; /* bytes of the head being read that llhttp saw (head_may_end) */
    long long req_left;     /* request body bytes still to come */
    int bodyless_idem, head_only;
    int rs, worker_keep, answered, resp_chunked, kind_sse;
    long long resp_left;
    /* A chunked answer's body, read by llhttp (RS_CHUNKED; reframe()). */
    llhttp_t body;
    unsigned long long chunk_size;
    size_t ext_len, trailer_len;
    int in_trailer;
    const char *body_err;
    int status;
    long long bytes_in, bytes_out;
    double t0, t_head, last, idle_since;
    unsigned char method[16];
    size_t method_len;
    unsigned char path[200];
    size_t path_len;
    unsigned char ua[256];
    size_t ua_len;
    int has_ua;
    unsigned long long exchanges;
    char why[96];
    /* Under mu. */
    char abort_why[96];
    int ctl, in_ctl;
    lane_t *ctl_next;
};

/* The exchanges of one (pool, kind, status) since the last take_stats: their number and their
 * durations' cumulative buckets (the event loop adds the statuses' buckets into one histogram). */
typedef struct {
    char pool[64];
    int kind, status;
    unsigned long long counts[MAX_BUCKETS], n;
    double sum;
} tally_t;

typedef struct {
    uint64_t handle;
    int kinds;
} event_t;

/* An exchange's record (take_log): what its access line needs beyond the lane's spec. */
typedef struct {
    uint64_t handle;
    double at, headers_s, duration; /* at: the wall clock at its end */
    int status, sse, has_ua;
    long long bytes_in, bytes_out;
    char end[96];
    unsigned char method[16], path[200], ua[256];
    size_t method_len, path_len, ua_len;
} exch_t;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t idle; /* a session's I/O ended (remove waits for it) */
    pthread_t thread;
    int started, stopping, closed, stuck; /* stopping: atomic (close() takes no lock for it) */
    int epfd, wakefd, notifyfd;
    pid_t pid;
    unsigned char *buf; /* the thread's read buffer for sessions */
    double buckets[MAX_BUCKETS];
    int nbuckets;
    /* Under mu. */
    unit_t **slots;
    uint32_t nslots, nfree, generation, live;
    uint32_t *free_slots;
    unit_t *graveyard;
    unit_t *ev_head, *ev_tail; /* the units with events pending, in order */
    lane_t *ctl_head;
    int notified, waiters;
    int log_on;
    exch_t *log;
    size_t nlog, log_cap;
    tally_t *tallies;
    size_t ntallies, tallies_cap;
    unsigned long long bytes_in, bytes_out, exchanges;
    /* The event loop's (events()): room for every slot. */
    event_t *evout;
} Core;

/* -- test-only failure injection (_fail_next, _spin; inert unless a test sets them) -------- */

static int fail_alloc, fail_events, test_spin;

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

/* Every allocation of a session's I/O. */
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

/* Queue an event of u; 1 when the caller must write notifyfd (after releasing mu). */
static int
push_event(Core *r, unit_t *u, int kind)
{
    if (u->pending == 0) {
        u->ev_next = NULL;
        u->ev_prev = r->ev_tail;
        if (r->ev_tail != NULL) {
            r->ev_tail->ev_next = u;
        }
        else {
            r->ev_head = u;
        }
        r->ev_tail = u;
    }
    u->pending |= kind;
    if (!r->notified) {
        r->notified = 1;
        return 1;
    }
    return 0;
}

static void
unqueue(Core *r, unit_t *u)
{
    if (u->pending == 0) {
        return;
    }
    if (u->ev_prev != NULL) {
        u->ev_prev->ev_next = u->ev_next;
    }
    else {
        r->ev_head = u->ev_next;
    }
    if (u->ev_next != NULL) {
        u->ev_next->ev_prev = u->ev_prev;
    }
    else {
        r->ev_tail = u->ev_prev;
    }
    u->ev_prev = u->ev_next = NULL;
    u->pending = 0;
}

static void
notify(Core *r)
{
    uint64_t one = 1;
    ssize_t w = write(r->notifyfd, &one, sizeof one);
    (void)w;
}

/* Queue an event and wake the event loop if the queue was empty (takes mu). */
static void
post_event(Core *r, unit_t *u, int kind)
{
    pthread_mutex_lock(&r->mu);
    int wake = push_event(r, u, kind);
    pthread_mutex_unlock(&r->mu);
    if (wake) {
        notify(r);
    }
}

/* Both of u's sockets out of the epoll set (the thread's, or the event loop's under mu). */
static void
unwatch(Core *r, unit_t *u)
{
    epoll_ctl(r->epfd, EPOLL_CTL_DEL, u->cfd, NULL);
    epoll_ctl(r->epfd, EPOLL_CTL_DEL, u->wfd, NULL);
}

/* Both of u's sockets into the epoll set, edge-triggered; -1 (errno set) when they could not. */
static int
watch(Core *r, unit_t *u, watch_t *cw, watch_t *ww, uint32_t cev, uint32_t wev)
{
    struct epoll_event ev;
    memset(&ev, 0, sizeof ev);
    ev.events = cev | EPOLLET;
    ev.data.ptr = cw;
    if (epoll_ctl(r->epfd, EPOLL_CTL_ADD, u->cfd, &ev) < 0) {
        return -1;
    }
    ev.events = wev | EPOLLET;
    ev.data.ptr = ww;
    if (epoll_ctl(r->epfd, EPOLL_CTL_ADD, u->wfd, &ev) < 0) {
        int e = errno;
        epoll_ctl(r->epfd, EPOLL_CTL_DEL, u->cfd, NULL);
        errno = e;
        return -1;
    }
    return 0;
}

/* == sessions: the relay ======================================================================
 *
 * A session that streams tokens spends nearly all its reads on the worker leg, on whole small
 * data frames that only move counters. Exactly those reads are taken off the event loop.
 *
 * The rules of a relayed session (its state machine):
 *
 * - ACTIVE: the thread owns the *read side of the worker socket* and the *write side of the
 *   client socket*, through its own dup()s of both (so a descriptor closed by the event loop can
 *   never be reused under the thread). The event loop keeps the rest: it reads the client and
 *   writes the worker as before, and it must neither read the worker nor write the client until
 *   it has taken the session back. One recv per turn of the loop (a short read is not followed
 *   by a second recv that would only say EAGAIN; a full one is followed at the next turn).
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
 * A session's share of the core's locking: for each collected session in turn the thread takes
 * ``mu`` briefly to publish the one before and to mark this one SERVING (one released meanwhile
 * is skipped), then does its I/O *without* ``mu``. A SERVING session's private fields (its carry
 * and backlog, its readiness, its ``state`` while ACTIVE or RETURNED, the counts not yet
 * published) are the thread's alone: the event loop reads them only in ``remove``, which waits on
 * the condition ``idle`` while the session is SERVING - one session's recv and send at most,
 * with the GIL held (the thread never takes the GIL, so the wait cannot close a cycle). A
 * session only COLLECTED is released by ``remove`` at once. The only lock taken during the I/O is
 * a brief one to append to the record (before the send), as ``take_record`` may take it at any
 * time. Publishing (with ``mu``): the counts, a RETURNED event, ``busy`` back to IDLE and
 * ``idle`` signalled when someone waits. ``counts`` and ``take_record`` read published fields
 * (counts lag by the read in flight).
 *
 * Sizes from the wire are bounded before arithmetic: a frame's 7- or 16-bit length and a chunk's
 * size (llhttp's reading, which refuses one past 2^64; at most 8 hex digits) are compared with
 * ``limit`` (at most 65535) before they are added to a position, so a carry is always less than
 * one read buffer; the record stops at REC_MAX (NOMEM: its bytes kept, as any allocation
 * failure).
 */

static void
s_give_back(Core *r, sess_t *s, int reason, int err)
{
    if (s->state != S_ACTIVE) {
        return;
    }
    s->state = S_RETURNED;
    s->reason = reason;
    s->err = err;
    unwatch(r, &s->u);
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
keep_bytes(Core *r, sess_t *s, unsigned char *b, size_t from, size_t mid, size_t to)
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
append_record(Core *r, sess_t *s, const unsigned char *p, size_t n, int *wake)
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
        *wake |= push_event(r, &s->u, EV_RECORD);
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

/* h: a parser that has read a chunked answer's head (no callbacks), ``settings`` for its body;
 * copied, it starts every chunked body either kind reads. 0, or -1 when llhttp did not read it. */
static int
chunked_parser(llhttp_t *h, llhttp_settings_t *settings, int lenient)
{
    static const char head[] = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n";
    static llhttp_settings_t none;
    llhttp_settings_init(&none);
    llhttp_init(h, HTTP_RESPONSE, &none);
    llhttp_set_lenient_spaces_after_chunk_size(h, lenient);
    if (llhttp_execute(h, head, sizeof head - 1) != HPE_OK) {
        return -1;
    }
    h->settings = settings;
    return 0;
}

static int
init_chunked_body(void)
{
    llhttp_settings_init(&chunk_settings);
    chunk_settings.on_chunk_header = on_chunk_header;
    chunk_settings.on_chunk_complete = on_chunk_complete;
    chunk_settings.on_chunk_extension_name = on_chunk_extension;
    return chunked_parser(&chunked_body, &chunk_settings, 0);
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
on_readable(Core *r, sess_t *s, int *wake)
{
    if (s->out_off < s->out_end) {
        return; /* a backlog first: the worker is not read meanwhile */
    }
    if (r->buf == NULL) {
        r->buf = t_malloc(BUF_SIZE);
        if (r->buf == NULL) {
            s_give_back(r, s, R_NOMEM, ENOMEM); /* its carry stays where it is */
            return;
        }
    }
    unsigned char *b = r->buf;
    size_t have = s->keep_len - s->out_end;
    if (have >= BUF_SIZE) { /* never: a carry is less than one frame or chunk of limit bytes */
        s_give_back(r, s, R_FRAME, 0);
        return;
    }
    if (have) {
        memcpy(b, s->keep + s->out_end, have); /* still kept until the read says otherwise */
    }
    ssize_t n = recv(s->u.wfd, b + have, BUF_SIZE - have, MSG_DONTWAIT);
    if (n <= 0) {
        int e = n < 0 ? errno : 0;
        if (n < 0 && (e == EAGAIN || e == EWOULDBLOCK || e == EINTR)) {
            s->ready &= e == EINTR ? ~0 : ~READY_READ;
            return;
        }
        s_give_back(r, s, n == 0 ? R_EOF : R_READ_ERROR, e);
        return;
    }
    if ((size_t)n < BUF_SIZE - have && !s->hup) {
        s->ready &= ~READY_READ; /* all there was: new bytes bring a new edge (an EOF that came
                                  * with these does not, hence hup: the next recv says it) */
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
            s_give_back(r, s, R_NOMEM, ENOMEM);
            return;
        }
    }
    if (pos == 0) {
        if (keep_bytes(r, s, b, 0, 0, total) < 0) {
            s_give_back(r, s, R_NOMEM, ENOMEM);
        }
        else if (stop) {
            s_give_back(r, s, R_FRAME, 0);
        }
        return;
    }
    s->d_frames += count;
    s->d_bytes += s->chunked ? payload : pos; /* a body's bytes are its chunks' data */
    ssize_t w = send(s->u.cfd, b, pos, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (w < 0) {
        int e = errno;
        if (e != EAGAIN && e != EWOULDBLOCK && e != EINTR) {
            keep_bytes(r, s, b, 0, pos, total);
            s_give_back(r, s, R_WRITE_ERROR, e);
            return;
        }
        w = 0;
    }
    if (keep_bytes(r, s, b, (size_t)w, pos, total) < 0) {
        s_give_back(r, s, R_NOMEM, ENOMEM);
        return;
    }
    if (stop) {
        s_give_back(r, s, R_FRAME, 0);
    }
    else if ((size_t)w < pos && s->chunked) {
        /* An HTTP client not taking the body: the event loop times its stall (httpproxy.py) */
        s_give_back(r, s, R_FRAME, 0);
    }
    else if ((size_t)w < pos) {
        s->ready &= ~READY_WRITE; /* the worker is not read until the client takes the rest */
    }
}

static void
on_writable(Core *r, sess_t *s)
{
    if (s->out_off == s->out_end) {
        return;
    }
    size_t left = s->out_end - s->out_off;
    ssize_t w = send(s->u.cfd, s->keep + s->out_off, left, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (w < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            s->ready &= ~READY_WRITE;
        }
        else if (errno != EINTR) {
            s_give_back(r, s, R_WRITE_ERROR, errno);
        }
        return;
    }
    s->out_off += (size_t)w;
    if (s->out_off < s->out_end) {
        s->ready &= ~READY_WRITE; /* the socket is full: its next edge says when it is not */
    }
    else if (s->keep_len == s->out_end) {
        drop_keep(s);
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
publish(Core *r, sess_t *s)
{
    int wake = 0;
    s->frames += s->d_frames;
    s->bytes += s->d_bytes;
    s->d_frames = s->d_bytes = 0;
    if (s->state == S_RETURNED && !s->told) {
        s->told = 1;
        wake = push_event(r, &s->u, EV_RETURNED);
    }
    s->busy = BUSY_IDLE;
    if (r->waiters) {
        pthread_cond_broadcast(&r->idle);
    }
    return wake;
}

/* == lanes: plain HTTP =======================================================================
 *
 * A small JSON request through the event loop costs about 25x nginx's CPU: two protocol
 * callbacks, two writes, the routing, the header rules and the access line, all in Python, per
 * request. Most requests on a kept-alive connection are the one before again: the same target
 * and the same routing headers (the key, the credential, the host), so the same pool, key and
 * worker. A *lane* is such a connection, handed over with everything routing decided: the thread
 * parses each next request, and when its routing inputs are byte for byte the first one's, it
 * rewrites the head as the event loop would, forwards it and its body, parses the answer, rewrites
 * its head, forwards its body and counts it - no Python per request (the access lines are
 * written by the event loop from the exchanges' records, in batches). Anything else goes
 * back to the event loop before a byte of it is used.
 *
 * The rules of a lane (its state machine):
 *
 * - ACTIVE: the thread owns both sockets through its own dup()s; the event loop has paused both
 *   transports and touches neither until the lane is RETURNED. A lane is IDLE (between requests)
 *   or in an EXCHANGE (one request and its answer; HTTP/1.1 serves one at a time).
 * - Taking a request (IDLE -> EXCHANGE), only when its head is whole and all of these hold; else
 *   the lane is RETURNED with reason HANDBACK, the request's bytes (from its first byte) as the
 *   carry, for the event loop to parse, route and answer as it always has (its errors included): a
 *   head llhttp reads (``read_head``: a method it knows) whose request line is h11's: a method, one
 *   space, a target (visible ASCII), one space and ``HTTP/1.1``; header lines of a token name, a
 *   colon and a value of visible, obs-text, space or tab bytes (no obs-fold, no bare LF, no space
 *   before the colon); at most ``max_headers`` of them, and at most ``max_head`` bytes by the event
 *   loop's measure (the target, then each field's name and value and 4); one Host; no
 *   Transfer-Encoding, Upgrade or Expect; no Sec-WebSocket-Key or -Version (the event loop takes
 *   such a request for a WebSocket handshake, perhaps a broken one: its 400 or 426); Connection
 *   absent or ``keep-alive``; at most one Content-Length, all digits, at most ``max_body``; and the
 *   *signature* (the target, then the values of each routing header in order) equal to the lane's.
 * - The request the worker gets: the method, the lane's target, the lane's ``pre`` lines, the
 *   client's headers but those in ``drop`` (lowercased names, values without their outer
 *   whitespace: what h11 gives the event loop), the lane's ``post`` lines and the Content-Length.
 *   The body follows as it arrives, never more than one read ahead of the worker.
 * - The answer: its 1xx heads are skipped (101 is a failure); the head the client gets has the
 *   worker's status and reason, its headers but hop-by-hop ones and those its Connection names,
 *   the lane's ``resp_add`` lines, and the framing: by length as the worker sent it, chunked as
 *   it sent it (read by llhttp; sizes of at most CHUNK_MAX rewritten without extensions,
 *   trailers dropped: ``reframe``), or chunked by wslb for a
 *   body delimited by the worker's close. HEAD, 204 and 304 answers have no body. No answer byte
 *   is buffered beyond one read: a client that does not read stops the reads of the worker; one
 *   that takes nothing for ``t_stall`` (``timeouts.backpressure``) is cut (FAILED: the worker's
 *   connection is closed, not reused).
 * - The end of an exchange: both messages done. Its record (with ``set_log``) and counts are
 *   queued (``take_log``, ``take_stats``). The lane goes back to IDLE, or is RETURNED: WORKER_DONE when the worker's
 *   connection cannot carry another request (``Connection: close``, HTTP/1.0, close-delimited,
 *   bytes past the answer), RELEASED when the event loop asked for it (``release``).
 * - Failures, the event loop's rules 3 and 4 (aio/httpproxy.py): a worker that closes or breaks
 *   before any byte of an answer to a bodiless request of an idempotent method gives the request
 *   back (RETRY: its bytes are the carry, the event loop sends it again on a new connection); any
 *   other failure before the answer's head is wslb's 502 (``timeout_server``: 504; the request's
 *   body late by ``timeout_request``: 408; ``abort``: 503), after it a cut (the client connection
 *   closes short of the body's end). Then the lane is RETURNED with FAILED: the client connection
 *   is not to be used again. A client gone mid-exchange: CLIENT_GONE (its status 499 if nothing
 *   was answered yet).
 * - Between requests: the client's EOF returns the lane (CLIENT_EOF: the worker's connection is
 *   good); so does the worker's (WORKER_DONE) or a byte from it, and ``idle_s`` without a request
 *   (IDLE: the event loop's keep-alive wait goes on, ``idle_for`` seconds of it spent).
 *
 * Sizes from the wire. Either peer may be hostile, so every size read from the wire is bounded
 * before any arithmetic: a Content-Length has at most 18 digits; a chunk size is llhttp's
 * unsigned 64-bit value (past 2^64 refused, never wrapped) and at most CHUNK_MAX; a chunk's
 * extensions at most CHUNK_LINE_LIMIT bytes, a response head and a trailer field
 * RESP_HEAD_LIMIT. Every buffer's growth is checked before the sum and capped at BUF_MAX; the
 * records waiting for the event loop at LOG_MAX (more are dropped, the counts go on). What the thread cannot take is a failure
 * like any other (502 before the answer's head, a cut after), never a spin: a worker's
 * ``ffffffffffffffff`` once made it copy SIZE_MAX bytes, ``8000000000000000`` spin forever.
 *
 * A lane's share of the core's locking: everything of an ACTIVE lane is the thread's alone; a
 * RETURNED lane's is the event loop's (``remove_lane``, which only ever follows its RETURNED
 * event: the lane left the epoll set in the thread before the event was queued). The event loop
 * asks for a release or an abort by linking the lane into the control list (under ``mu``) and
 * waking the thread, which serves the list after its collection.
 */

/* -- small helpers ------------------------------------------------------------------------- */

static double
mono(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Room for ``more`` bytes after what b holds; -1 (b untouched) past BUF_MAX or out of memory.
 * ``more`` is compared before it is added to anything: a size from the wire cannot wrap. */
static int
buf_reserve(buf_t *b, size_t more)
{
    if (b->off > 0 && b->off == b->len) {
        b->off = b->len = 0;
    }
    if (more > BUF_MAX || b->len - b->off > BUF_MAX - more) {
        return -1;
    }
    if (more <= b->cap - b->len) {
        return 0;
    }
    if (b->off > 0) { /* slide what is left to the front first */
        memmove(b->p, b->p + b->off, b->len - b->off);
        b->len -= b->off;
        b->off = 0;
        if (more <= b->cap - b->len) {
            return 0;
        }
    }
    size_t need = b->len + more; /* at most BUF_MAX */
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < need) {
        cap *= 2; /* cap < need <= BUF_MAX before: no wrap */
    }
    if (cap > BUF_MAX) {
        cap = BUF_MAX;
    }
    unsigned char *q = realloc(b->p, cap);
    if (q == NULL) {
        return -1;
    }
    b->p = q;
    b->cap = cap;
    return 0;
}

/* An array with room for its element ``n`` (doubling from ``first``): the array, moved or not,
 * and ``*cap`` updated; NULL, the old array untouched, when out of memory. */
static void *
grow(void *p, size_t *cap, size_t n, size_t size, size_t first)
{
    if (n < *cap) {
        return p;
    }
    size_t c = *cap ? *cap * 2 : first;
    if (c <= n || c > SIZE_MAX / 2 / size) {
        return NULL;
    }
    void *q = realloc(p, c * size);
    if (q != NULL) {
        *cap = c;
    }
    return q;
}

static int
buf_add(buf_t *b, const void *p, size_t n)
{
    if (n == 0) {
        return 0;
    }
    if (buf_reserve(b, n) < 0) {
        return -1;
    }
    memcpy(b->p + b->len, p, n);
    b->len += n;
    return 0;
}

static int
buf_addstr(buf_t *b, const char *s)
{
    return buf_add(b, s, strlen(s));
}

/* One header line as h11 hands it to the event loop and httpmsg writes it: the name lowercased,
 * ": ", the value without its outer whitespace (the parser already trimmed it), CRLF. */
static int
buf_add_field(buf_t *b, const unsigned char *name, size_t nl, const unsigned char *value, size_t vl)
{
    if (buf_reserve(b, nl + vl + 4) < 0) {
        return -1;
    }
    unsigned char *o = b->p + b->len;
    for (size_t c = 0; c < nl; c++) {
        unsigned char ch = name[c];
        o[c] = (ch >= 'A' && ch <= 'Z') ? (unsigned char)(ch + 32) : ch;
    }
    o[nl] = ':';
    o[nl + 1] = ' ';
    memcpy(o + nl + 2, value, vl);
    o[nl + 2 + vl] = '\r';
    o[nl + 3 + vl] = '\n';
    b->len += nl + 4 + vl;
    return 0;
}

static size_t
buf_avail(const buf_t *b)
{
    return b->len - b->off;
}

static void
buf_free(buf_t *b)
{
    free(b->p);
    b->p = NULL;
    b->off = b->len = b->cap = 0;
}

static int
is_value_char(unsigned char c)
{
    return c == '\t' || (c >= 0x20 && c != 0x7f);
}

static int
ieq(const unsigned char *a, size_t an, const char *b)
{
    size_t bn = strlen(b);
    if (an != bn) {
        return 0;
    }
    for (size_t i = 0; i < an; i++) {
        unsigned char c = a[i];
        if (c >= 'A' && c <= 'Z') {
            c = (unsigned char)(c + 32);
        }
        if (c != (unsigned char)b[i]) {
            return 0;
        }
    }
    return 1;
}

/* Name (any case) equal to the lowercase s. */
static int
name_is(const unsigned char *a, size_t an, const str_t *s)
{
    if (an != s->n) {
        return 0;
    }
    for (size_t i = 0; i < an; i++) {
        unsigned char c = a[i];
        if (c >= 'A' && c <= 'Z') {
            c = (unsigned char)(c + 32);
        }
        if (c != s->p[i]) {
            return 0;
        }
    }
    return 1;
}

static int
in_set(const unsigned char *a, size_t an, const str_t *set, int n)
{
    for (int i = 0; i < n; i++) {
        if (name_is(a, an, &set[i])) {
            return 1;
        }
    }
    return 0;
}

static int
parse_decimal(const unsigned char *p, size_t n, long long *out)
{
    if (n == 0 || n > 18) {
        return -1;
    }
    long long v = 0;
    for (size_t i = 0; i < n; i++) {
        if (p[i] < '0' || p[i] > '9') {
            return -1;
        }
        v = v * 10 + (p[i] - '0');
    }
    *out = v;
    return 0;
}

/* Connection's tokens name c (lowercase)? */
static int
conn_names(const unsigned char *v, size_t n, const unsigned char *name, size_t name_len)
{
    size_t i = 0;
    while (i < n) {
        while (i < n && (v[i] == ' ' || v[i] == '\t' || v[i] == ',')) {
            i++;
        }
        size_t s = i;
        while (i < n && v[i] != ',') {
            i++;
        }
        size_t e = i;
        while (e > s && (v[e - 1] == ' ' || v[e - 1] == '\t')) {
            e--;
        }
        if (e > s && e - s == name_len) {
            size_t k = 0;
            for (; k < name_len; k++) {
                unsigned char c = v[s + k];
                unsigned char d = name[k];
                if (c >= 'A' && c <= 'Z') {
                    c = (unsigned char)(c + 32);
                }
                if (d >= 'A' && d <= 'Z') {
                    d = (unsigned char)(d + 32);
                }
                if (c != d) {
                    break;
                }
            }
            if (k == name_len) {
                return 1;
            }
        }
    }
    return 0;
}

/* -- heads read by llhttp ------------------------------------------------------------------ */

/* A request's or an answer's head, read by llhttp from one buffer (so each part is one span,
 * kept as offsets into it): the method's length, the target (a request's) or reason (an
 * answer's), the fields (values without their trailing whitespace: llhttp leaves out the
 * leading). llhttp is strict here: CRLF only, no obs-fold, no space before a colon, no control
 * byte in a name, target or value (obs-text allowed in values), a known method, one
 * Content-Length, digits only. An answer's equal Content-Lengths are merged by the caller, as
 * h11 and the event loop do: llhttp, which refuses a second one, reads each as if alone. */
typedef struct {
    const char *base;
    field_t *f;
    int nf, max, too_many, done, answer;
    size_t method_len, first, first_len;
    int major, minor, status;
} head_t;

static int
hd_span(const head_t *hd, size_t *off, size_t *len, const char *at, size_t n)
{
    if (*len == 0) {
        *off = (size_t)(at - hd->base);
    }
    else if (at != hd->base + *off + *len) {
        return -1; /* never: the head is in one buffer */
    }
    *len += n;
    return 0;
}

static int
hd_method(llhttp_t *h, const char *at, size_t n)
{
    head_t *hd = h->data;
    size_t off = 0;
    return hd_span(hd, &off, &hd->method_len, at, n);
}

static int
hd_first(llhttp_t *h, const char *at, size_t n)
{
    head_t *hd = h->data;
    return hd_span(hd, &hd->first, &hd->first_len, at, n);
}

static int
hd_name(llhttp_t *h, const char *at, size_t n)
{
    head_t *hd = h->data;
    if (hd->nf >= hd->max) {
        hd->too_many = 1;
        return -1;
    }
    return hd_span(hd, &hd->f[hd->nf].name, &hd->f[hd->nf].name_len, at, n);
}

static int
hd_name_done(llhttp_t *h)
{
    head_t *hd = h->data;
    field_t *f = &hd->f[hd->nf];
    f->value = f->name + f->name_len;
    f->value_len = 0;
    const unsigned char *name = (const unsigned char *)hd->base + f->name;
    if (hd->answer && ieq(name, f->name_len, "content-length")) {
        h->flags &= ~F_CONTENT_LENGTH; /* see head_t */
        h->content_length = 0;
    }
    return 0;
}

static int
hd_value(llhttp_t *h, const char *at, size_t n)
{
    head_t *hd = h->data;
    return hd_span(hd, &hd->f[hd->nf].value, &hd->f[hd->nf].value_len, at, n);
}

static int
hd_value_done(llhttp_t *h)
{
    head_t *hd = h->data;
    field_t *f = &hd->f[hd->nf];
    while (f->value_len > 0 &&
           (hd->base[f->value + f->value_len - 1] == ' ' ||
            hd->base[f->value + f->value_len - 1] == '\t')) {
        f->value_len--;
    }
    hd->nf++;
    if (hd->nf < hd->max) {
        hd->f[hd->nf].name_len = 0;
    }
    return 0;
}

static int
hd_done(llhttp_t *h)
{
    head_t *hd = h->data;
    hd->done = 1;
    hd->major = h->http_major;
    hd->minor = h->http_minor;
    hd->status = h->status_code;
    return HPE_PAUSED; /* the head's end: the body is the caller's */
}

static llhttp_settings_t head_settings;

static void
init_heads(void)
{
    llhttp_settings_init(&head_settings);
    head_settings.on_method = hd_method;
    head_settings.on_url = hd_first;
    head_settings.on_status = hd_first;
    head_settings.on_header_field = hd_name;
    head_settings.on_header_field_complete = hd_name_done;
    head_settings.on_header_value = hd_value;
    head_settings.on_header_value_complete = hd_value_done;
    head_settings.on_headers_complete = hd_done;
}

/* Whether the head at p[0:n], whose first *seen bytes were read before, may be whole now: only
 * bytes with a LF can end it (so a head that comes a byte at a time is not read again for each). */
static int
head_may_end(const unsigned char *p, size_t n, size_t *seen)
{
    int lf = n > *seen && memchr(p + *seen, '\n', n - *seen) != NULL;
    *seen = n;
    return lf;
}

/* The head at p[0:n] read afresh: 1 whole (*len: its bytes), 0 not yet, -1 malformed, -2 more
 * than ``max`` fields. */
static int
read_head(head_t *hd, int answer, const unsigned char *p, size_t n, field_t *f, int max,
          size_t *len)
{
    llhttp_t h;
    llhttp_init(&h, answer ? HTTP_RESPONSE : HTTP_REQUEST, &head_settings);
    memset(hd, 0, sizeof *hd);
    hd->base = (const char *)p;
    hd->f = f;
    hd->max = max;
    hd->answer = answer;
    f[0].name_len = 0;
    h.data = hd;
    llhttp_errno_t e = llhttp_execute(&h, (const char *)p, n);
    if (e == HPE_PAUSED && hd->done) {
        *len = (size_t)(llhttp_get_error_pos(&h) - hd->base);
        return 1;
    }
    if (e == HPE_OK) {
        return 0;
    }
    return hd->too_many ? -2 : -1;
}

/* -- the exchanges' records and counts ----------------------------------------------------- */

/* The record of an exchange that has ended, for the event loop's access line (``take_log``;
 * logs.py formats it). mu held. Past LOG_MAX records waiting the rest are dropped (the counts go
 * on): an event loop that does not take them cannot grow the thread without bound. */
static void
log_exchange(Core *r, lane_t *l, double duration)
{
    if (!r->log_on || r->nlog >= LOG_MAX) {
        return;
    }
    exch_t *x = grow(r->log, &r->log_cap, r->nlog, sizeof *r->log, 64);
    if (x == NULL) {
        return; /* as a full buffer: the line is lost, the counts go on */
    }
    r->log = x;
    x = &r->log[r->nlog++];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    x->handle = l->u.handle;
    x->at = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
    x->headers_s = l->t_head > 0 ? l->t_head - l->t0 : 0.0;
    x->duration = duration;
    x->status = l->status;
    x->sse = l->kind_sse;
    x->bytes_in = l->bytes_in;
    x->bytes_out = l->bytes_out;
    snprintf(x->end, sizeof x->end, "%s", l->why[0] ? l->why : "done");
    memcpy(x->method, l->method, l->method_len);
    x->method_len = l->method_len;
    memcpy(x->path, l->path, l->path_len);
    x->path_len = l->path_len;
    x->has_ua = l->has_ua;
    memcpy(x->ua, l->ua, l->has_ua ? l->ua_len : 0);
    x->ua_len = l->has_ua ? l->ua_len : 0;
}

static void
pool_name(lane_t *l, char *out)
{
    size_t n = l->pool.n < 63 ? l->pool.n : 63;
    memcpy(out, l->pool.p, n);
    out[n] = 0;
}

/* mu held. */
static void
count_exchange(Core *r, lane_t *l, double duration)
{
    char pool[64];
    pool_name(l, pool);
    r->exchanges++;
    r->bytes_in += (unsigned long long)l->bytes_in;
    r->bytes_out += (unsigned long long)l->bytes_out;
    tally_t *c = NULL;
    for (size_t i = 0; i < r->ntallies; i++) {
        if (r->tallies[i].kind == l->kind_sse && r->tallies[i].status == l->status &&
            strcmp(r->tallies[i].pool, pool) == 0) {
            c = &r->tallies[i];
            break;
        }
    }
    if (c == NULL) {
        void *grown = grow(r->tallies, &r->tallies_cap, r->ntallies, sizeof *r->tallies, 16);
        if (grown == NULL) {
            return;
        }
        r->tallies = grown;
        c = &r->tallies[r->ntallies++];
        memset(c, 0, sizeof *c);
        memcpy(c->pool, pool, sizeof pool);
        c->kind = l->kind_sse;
        c->status = l->status;
    }
    c->n++;
    c->sum += duration;
    for (int i = 0; i < r->nbuckets; i++) {
        if (duration <= r->buckets[i]) {
            c->counts[i]++;
        }
    }
}

/* -- a lane's I/O (the thread) ------------------------------------------------------------- */

static void
give_back(Core *r, lane_t *l, int reason)
{
    if (l->state != L_ACTIVE) {
        return;
    }
    unwatch(r, &l->u);
    l->state = L_RETURNED;
    l->reason = reason;
    post_event(r, &l->u, EV_RETURNED);
}

static void
end_exchange(Core *r, lane_t *l)
{
    double now = mono();
    double duration = now - l->t0;
    l->exchanges++;
    pthread_mutex_lock(&r->mu);
    log_exchange(r, l, duration);
    count_exchange(r, l, duration);
    int wake = r->nlog >= LOG_NOTIFY && push_event(r, &l->u, EV_FLUSH) == 1;
    pthread_mutex_unlock(&r->mu);
    if (wake) {
        notify(r);
    }
    l->phase = P_IDLE;
    l->idle_since = now;
    l->why[0] = 0;
}

/* wslb's own answer before the worker's head (its body the JSON reason), then FAILED. */
static void
fail(Core *r, lane_t *l, int status, const char *message, const char *why)
{
    if (l->state != L_ACTIVE) {
        return;
    }
    snprintf(l->why, sizeof l->why, "%s", why);
    if (!l->answered && status > 0) {
        const char *phrase = status == 502   ? "Bad Gateway"
                             : status == 503 ? "Service Unavailable"
                             : status == 504 ? "Gateway Timeout"
                             : status == 408 ? "Request Timeout"
                                             : "Error";
        char body[256], head[512];
        int bn = snprintf(body, sizeof body, "{\"error\": \"%s\"}", message);
        int hn = snprintf(head, sizeof head,
                          "HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                          "content-length: %d\r\nconnection: close\r\n\r\n",
                          status, phrase, bn);
        l->status = status;
        l->cout.off = l->cout.len = 0;
        if (buf_add(&l->cout, head, (size_t)hn) == 0 && buf_add(&l->cout, body, (size_t)bn) == 0) {
            ssize_t w = send(l->u.cfd, l->cout.p, l->cout.len, MSG_DONTWAIT | MSG_NOSIGNAL);
            (void)w; /* best effort: the connection closes next */
        }
    }
    else if (buf_avail(&l->cout) > 0) { /* a cut: what the client can take of it still goes */
        ssize_t w = send(l->u.cfd, l->cout.p + l->cout.off, buf_avail(&l->cout),
                         MSG_DONTWAIT | MSG_NOSIGNAL);
        (void)w;
    }
    if (l->phase == P_EXCHANGE) {
        end_exchange(r, l);
    }
    shutdown(l->u.cfd, SHUT_WR);
    give_back(r, l, LR_FAILED);
}

static void
client_gone(Core *r, lane_t *l, const char *why)
{
    if (l->phase == P_EXCHANGE) {
        if (!l->answered) {
            l->status = 499;
        }
        snprintf(l->why, sizeof l->why, "%s", why);
        end_exchange(r, l);
    }
    give_back(r, l, LR_CLIENT_GONE);
}

/* The worker failed (closed, broke, or sent what wslb refuses). */
static void
worker_failed(Core *r, lane_t *l, const char *why)
{
    if (l->phase != P_EXCHANGE) {
        give_back(r, l, LR_WORKER_DONE);
        return;
    }
    if (!l->answered && l->rs == RS_HEAD && buf_avail(&l->win) == 0 && l->bodyless_idem) {
        /* Rule 3: a kept-alive connection that died before any answer; the request again. */
        l->cin.off = l->req_start;
        l->phase = P_IDLE;
        give_back(r, l, LR_RETRY);
        return;
    }
    fail(r, l, 502, "the worker failed to answer", why);
}

/* The head of the next request, if whole: take it (EXCHANGE) or hand it back. */
static void
start_request(Core *r, lane_t *l)
{
    const unsigned char *base = l->cin.p + l->cin.off;
    size_t avail = buf_avail(&l->cin);
    if (avail == 0) {
        return;
    }
    field_t f[MAX_FIELDS];
    int max = l->max_headers < MAX_FIELDS ? (int)l->max_headers : MAX_FIELDS;
    head_t hd;
    size_t head_len = 0;
    int got = head_may_end(base, avail, &l->req_seen)
                  ? read_head(&hd, 0, base, avail, f, max, &head_len)
                  : 0;
    if (got == 0) {
        if ((long)avail > l->max_head) {
            give_back(r, l, LR_HANDBACK);
        }
        return;
    }
    l->req_start = l->cin.off;
    l->req_seen = 0;
    if (got < 0 || (long)head_len > l->max_head + 2048) {
        give_back(r, l, LR_HANDBACK);
        return;
    }
    /* The request line as h11 reads it (llhttp takes more spaces): the method, one space, the
     * target, one space, HTTP/1.1, CRLF, the fields from there. */
    int nf = hd.nf;
    size_t method_len = hd.method_len, ts = hd.first, target_len = hd.first_len;
    size_t line_end = nf > 0 ? f[0].name : head_len - 2;
    if (method_len > sizeof l->method || ts != method_len + 1 || hd.major != 1 || hd.minor != 1 ||
        line_end != ts + target_len + 11) {
        give_back(r, l, LR_HANDBACK);
        return;
    }
    /* The framing, and what only the event loop serves. */
    long long length = -1;
    int hosts = 0;
    int ua = -1;
    for (int k = 0; k < nf; k++) {
        const unsigned char *nm = base + f[k].name;
        size_t nl = f[k].name_len;
        const unsigned char *v = base + f[k].value;
        size_t vl = f[k].value_len;
        if (ieq(nm, nl, "content-length")) {
            if (length >= 0 || parse_decimal(v, vl, &length) < 0) {
                give_back(r, l, LR_HANDBACK);
                return;
            }
        }
        else if (ieq(nm, nl, "transfer-encoding") || ieq(nm, nl, "upgrade") ||
                 ieq(nm, nl, "expect") || ieq(nm, nl, "sec-websocket-key") ||
                 ieq(nm, nl, "sec-websocket-version")) {
            /* The last two make it a (broken) WebSocket handshake: httpmsg.is_handshake. */
            give_back(r, l, LR_HANDBACK);
            return;
        }
        else if (ieq(nm, nl, "connection")) {
            if (!ieq(v, vl, "keep-alive")) {
                give_back(r, l, LR_HANDBACK);
                return;
            }
        }
        else if (ieq(nm, nl, "host")) {
            hosts++;
        }
        else if (ieq(nm, nl, "user-agent") && ua < 0) {
            ua = k;
        }
    }
    /* The event loop's measure of a head (handshake.next_request): 431 past max_head. */
    size_t measure = target_len;
    for (int k = 0; k < nf; k++) {
        measure += f[k].name_len + f[k].value_len + 4;
    }
    if (hosts != 1 || length > l->max_body || (long)measure > l->max_head) {
        give_back(r, l, LR_HANDBACK);
        return;
    }
    /* The signature: the target, then each routing header's values ("\0name\0v1\1v2"). */
    size_t sp = 0;
    const unsigned char *sig = l->sig.p;
    size_t sn = l->sig.n;
    if (target_len > sn || memcmp(sig, base + ts, target_len) != 0) {
        give_back(r, l, LR_HANDBACK);
        return;
    }
    sp = target_len;
    for (int s = 0; s < l->n_sig; s++) {
        const str_t *name = &l->sig_names[s];
        if (sp + 2 + name->n > sn || sig[sp] != 0 || memcmp(sig + sp + 1, name->p, name->n) != 0 ||
            sig[sp + 1 + name->n] != 0) {
            give_back(r, l, LR_HANDBACK);
            return;
        }
        sp += 2 + name->n;
        int first = 1;
        for (int k = 0; k < nf; k++) {
            if (!name_is(base + f[k].name, f[k].name_len, name)) {
                continue;
            }
            if (!first) {
                if (sp >= sn || sig[sp] != 1) {
                    give_back(r, l, LR_HANDBACK);
                    return;
                }
                sp++;
            }
            first = 0;
            size_t vl = f[k].value_len;
            if (sp + vl > sn || memcmp(sig + sp, base + f[k].value, vl) != 0) {
                give_back(r, l, LR_HANDBACK);
                return;
            }
            sp += vl;
        }
        if (sp < sn && sig[sp] != 0) { /* the lane's has more values of this header */
            give_back(r, l, LR_HANDBACK);
            return;
        }
    }
    if (sp != sn) {
        give_back(r, l, LR_HANDBACK);
        return;
    }
    /* Taken: the head for the worker. */
    buf_t *w = &l->wout;
    int bad = buf_add(w, base, method_len) || buf_add(w, " ", 1) ||
              buf_add(w, l->target.p, l->target.n) || buf_add(w, " HTTP/1.1\r\n", 11) ||
              buf_add(w, l->pre.p, l->pre.n);
    for (int k = 0; k < nf && !bad; k++) {
        const unsigned char *nm = base + f[k].name;
        size_t nl = f[k].name_len;
        /* X-WSLB-* is wslb's own (credential, resume): a client's never reaches a worker. */
        if (in_set(nm, nl, l->drop, l->n_drop) || (nl >= 7 && ieq(nm, 7, "x-wslb-"))) {
            continue;
        }
        bad = buf_add_field(w, nm, nl, base + f[k].value, f[k].value_len);
    }
    if (!bad) {
        bad = buf_add(w, l->post.p, l->post.n);
    }
    if (!bad && length >= 0) {
        char cl[48];
        int n = snprintf(cl, sizeof cl, "content-length: %lld\r\n", length);
        bad = buf_add(w, cl, (size_t)n);
    }
    if (!bad) {
        bad = buf_add(w, "\r\n", 2);
    }
    if (bad) {
        w->off = w->len = 0;
        give_back(r, l, LR_HANDBACK);
        return;
    }
    /* The exchange's record. */
    double now = mono();
    l->phase = P_EXCHANGE;
    l->t0 = l->last = now;
    l->t_head = 0;
    memcpy(l->method, base, method_len);
    l->method_len = method_len;
    size_t pl = 0;
    while (pl < target_len && base[ts + pl] != '?') {
        pl++;
    }
    l->path_len = pl < sizeof l->path ? pl : sizeof l->path;
    memcpy(l->path, base + ts, l->path_len);
    l->has_ua = ua >= 0;
    if (ua >= 0) {
        l->ua_len = f[ua].value_len < sizeof l->ua ? f[ua].value_len : sizeof l->ua;
        memcpy(l->ua, base + f[ua].value, l->ua_len);
    }
    l->req_left = length > 0 ? length : 0;
    int idem = ieq(base, method_len, "get") || ieq(base, method_len, "head") ||
               ieq(base, method_len, "options") || ieq(base, method_len, "trace") ||
               ieq(base, method_len, "put") || ieq(base, method_len, "delete");
    /* Methods are case-sensitive: only the upper-case ones are the idempotent ones. */
    idem = idem && base[0] >= 'A' && base[0] <= 'Z';
    l->bodyless_idem = l->req_left == 0 && idem;
    l->head_only = method_len == 4 && memcmp(base, "HEAD", 4) == 0;
    l->rs = RS_HEAD;
    l->resp_seen = 0;
    l->worker_keep = 1;
    l->answered = 0;
    l->kind_sse = 0;
    l->status = 0;
    l->bytes_in = l->bytes_out = 0;
    l->why[0] = 0;
    l->cin.off += head_len;
}

/* Request body bytes from cin to the worker's output. */
static int
move_body(lane_t *l)
{
    size_t avail = buf_avail(&l->cin);
    if (l->req_left <= 0 || avail == 0) {
        return 0;
    }
    size_t n = (long long)avail < l->req_left ? avail : (size_t)l->req_left;
    if (buf_add(&l->wout, l->cin.p + l->cin.off, n) < 0) {
        return -1;
    }
    l->cin.off += n;
    l->req_left -= (long long)n;
    l->bytes_in += (long long)n;
    return 1;
}

/* The worker's response head at win: 1 parsed (or a 1xx skipped), 0 more needed, -1 failed. */
/* -- a chunked answer re-framed (llhttp reads it) ------------------------------------------ */

/* The client gets each chunk of 1 to CHUNK_MAX bytes as "%llx\r\n", its data and CRLF (no
 * extension), then "0\r\n\r\n" for the last chunk (its trailers dropped). llhttp reads the
 * worker's framing: hex sizes (past 2^64 refused, whitespace before the line's end allowed as
 * httpmsg's _CHUNK_SIZE allows it), extensions, CRLF after each chunk's data, trailer fields;
 * a copy of a parser that has read a chunked answer's head (``chunked_answer``) starts each
 * body. Bounded here: a chunk past CHUNK_MAX, extensions past CHUNK_LINE_LIMIT bytes, trailers
 * fields past RESP_HEAD_LIMIT. Anything llhttp refuses is a cut, as anything these bounds
 * refuse: a malformed trailer field too (the event loop's reader refuses it as well). */
static llhttp_t chunked_answer;
static llhttp_settings_t reframe_settings;

static int
rf_fail(lane_t *l, const char *why)
{
    l->body_err = why;
    return -1;
}

static int
rf_chunk_header(llhttp_t *h)
{
    lane_t *l = h->data;
    unsigned long long size = h->content_length;
    l->chunk_size = size;
    l->ext_len = 0;
    if (size > CHUNK_MAX) {
        return rf_fail(l, "malformed response: chunk too large");
    }
    if (size == 0) {
        l->in_trailer = 1;
        return 0;
    }
    char line[24];
    int n = snprintf(line, sizeof line, "%llx\r\n", size);
    return buf_add(&l->cout, line, (size_t)n) < 0 ? rf_fail(l, "no memory") : 0;
}

static int
rf_extension(llhttp_t *h, const char *at, size_t n)
{
    lane_t *l = h->data;
    (void)at;
    l->ext_len += n; /* the name and value bytes: less than CHUNK_LINE_LIMIT each time */
    return l->ext_len > CHUNK_LINE_LIMIT ? rf_fail(l, "malformed response: bad chunk size") : 0;
}

/* A trailer field's bytes (dropped): at most RESP_HEAD_LIMIT each, as httpmsg bounds a line. */
static int
rf_trailer(llhttp_t *h, const char *at, size_t n)
{
    lane_t *l = h->data;
    (void)at;
    l->trailer_len += n;
    return l->trailer_len > RESP_HEAD_LIMIT
               ? rf_fail(l, "malformed response: trailers too large")
               : 0;
}

static int
rf_trailer_done(llhttp_t *h)
{
    ((lane_t *)h->data)->trailer_len = 0;
    return 0;
}

static int
rf_body(llhttp_t *h, const char *at, size_t n)
{
    lane_t *l = h->data;
    if (buf_add(&l->cout, at, n) < 0) {
        return rf_fail(l, "no memory");
    }
    l->bytes_out += (long long)n;
    return 0;
}

static int
rf_chunk_complete(llhttp_t *h)
{
    lane_t *l = h->data;
    if (l->in_trailer) {
        return 0;
    }
    return buf_add(&l->cout, "\r\n", 2) < 0 ? rf_fail(l, "no memory") : 0;
}

static int
rf_message_complete(llhttp_t *h)
{
    lane_t *l = h->data;
    if (buf_add(&l->cout, "0\r\n\r\n", 5) < 0) {
        return rf_fail(l, "no memory");
    }
    return HPE_PAUSED; /* the bytes after it are not the answer's */
}

static int
init_reframe(void)
{
    llhttp_settings_init(&reframe_settings);
    reframe_settings.on_chunk_header = rf_chunk_header;
    reframe_settings.on_chunk_extension_name = rf_extension;
    reframe_settings.on_chunk_extension_value = rf_extension;
    reframe_settings.on_header_field = rf_trailer;
    reframe_settings.on_header_value = rf_trailer;
    reframe_settings.on_header_value_complete = rf_trailer_done;
    reframe_settings.on_body = rf_body;
    reframe_settings.on_chunk_complete = rf_chunk_complete;
    reframe_settings.on_message_complete = rf_message_complete;
    return chunked_parser(&chunked_answer, &reframe_settings, 1);
}

static void
start_reframe(lane_t *l)
{
    l->body = chunked_answer;
    l->body.data = l;
    l->chunk_size = 0;
    l->ext_len = l->trailer_len = 0;
    l->in_trailer = 0;
    l->body_err = NULL;
}

/* The worker's bytes p[0:n] of a chunked body through llhttp: 0, or -1 when the lane failed. */
static int
reframe(Core *r, lane_t *l, const unsigned char *p, size_t n)
{
    const char *data = (const char *)p;
    llhttp_errno_t e = llhttp_execute(&l->body, data, n);
    if (e == HPE_OK) {
        l->win.off += n;
        return 0;
    }
    if (e == HPE_PAUSED && l->body_err == NULL) { /* the last chunk and its trailers read */
        l->win.off += (size_t)(llhttp_get_error_pos(&l->body) - data);
        l->rs = RS_DONE;
        return 0;
    }
    fail(r, l, 0, "", l->body_err != NULL ? l->body_err : "malformed response: bad chunk framing");
    return -1;
}

static int
response_head(Core *r, lane_t *l)
{
    const unsigned char *base = l->win.p + l->win.off;
    size_t avail = buf_avail(&l->win);
    field_t f[MAX_FIELDS];
    head_t hd;
    size_t head_len = 0;
    int got = head_may_end(base, avail, &l->resp_seen)
                  ? read_head(&hd, 1, base, avail, f, MAX_FIELDS, &head_len)
                  : 0;
    if (got == 0) {
        if (avail > RESP_HEAD_LIMIT) {
            worker_failed(r, l, "malformed response: head too large");
            return -1;
        }
        return 0;
    }
    l->resp_seen = 0;
    if (got < 0) {
        worker_failed(r, l, got == -2 ? "malformed response: too many headers"
                                      : "malformed response: bad head");
        return -1;
    }
    /* What llhttp takes and the lane does not: a version other than 1.0 and 1.1, a status
     * outside 100-599, a control byte in the reason. */
    int status = hd.status, nf = hd.nf, v11 = hd.minor == 1;
    size_t rs = hd.first, reason_len = hd.first_len;
    int odd = hd.major != 1 || hd.minor > 1 || status < 100 || status > 599;
    for (size_t k = 0; k < reason_len && !odd; k++) {
        odd = !is_value_char(base[rs + k]);
    }
    if (odd) {
        worker_failed(r, l, "malformed response: bad status line");
        return -1;
    }
    if (status < 200) {
        l->win.off += head_len;
        if (status == 101) {
            worker_failed(r, l, "the worker switched protocols on a plain request");
            return -1;
        }
        return 1; /* 100, 103: wslb answered the client's 100-continue itself */
    }
    long long length = -1;
    int chunked = 0, te = 0, close = !v11, keep_alive = 0;
    int conn_idx[MAX_FIELDS], nconn = 0; /* every Connection line: each names hop headers */
    for (int k = 0; k < nf; k++) {
        const unsigned char *nm = base + f[k].name;
        size_t nl = f[k].name_len;
        const unsigned char *v = base + f[k].value;
        size_t vl = f[k].value_len;
        if (ieq(nm, nl, "content-length")) {
            long long x;
            if (parse_decimal(v, vl, &x) < 0 || (length >= 0 && x != length)) {
                worker_failed(r, l, "malformed response: bad Content-Length");
                return -1;
            }
            length = x;
        }
        else if (ieq(nm, nl, "transfer-encoding")) {
            te = 1;
            if (!ieq(v, vl, "chunked") || chunked) {
                worker_failed(r, l, "malformed response: a coding other than chunked");
                return -1;
            }
            chunked = 1;
        }
        else if (ieq(nm, nl, "connection")) {
            if (conn_names(v, vl, (const unsigned char *)"close", 5)) {
                close = 1;
            }
            if (conn_names(v, vl, (const unsigned char *)"keep-alive", 10)) {
                keep_alive = 1;
            }
            conn_idx[nconn++] = k; /* nf <= MAX_FIELDS */
        }
        else if (ieq(nm, nl, "content-type")) {
            l->kind_sse = vl >= 17 && ieq(v, 17, "text/event-stream");
        }
    }
    if (te && length >= 0) {
        worker_failed(r, l, "malformed response: both Content-Length and Transfer-Encoding");
        return -1;
    }
    if (!v11 && keep_alive) {
        close = 0;
    }
    int bodyless = l->head_only || status == 204 || status == 304;
    /* The head for the client. */
    buf_t *o = &l->cout;
    char line[32];
    int n = snprintf(line, sizeof line, "HTTP/1.1 %d ", status);
    int bad = buf_add(o, line, (size_t)n) || buf_add(o, base + rs, reason_len) ||
              buf_add(o, "\r\n", 2);
    int lengths = 0; /* equal Content-Lengths (checked above) reach the client as one, as h11's */
    for (int k = 0; k < nf && !bad; k++) {
        const unsigned char *nm = base + f[k].name;
        size_t nl = f[k].name_len;
        if (in_set(nm, nl, l->resp_drop, l->n_resp_drop) ||
            (ieq(nm, nl, "content-length") && lengths++ > 0)) {
            continue;
        }
        int named = 0;
        for (int c = 0; c < nconn && !named; c++) {
            named = conn_names(base + f[conn_idx[c]].value, f[conn_idx[c]].value_len, nm, nl);
        }
        if (named) {
            continue;
        }
        bad = buf_add_field(o, nm, nl, base + f[k].value, f[k].value_len);
    }
    if (!bad) {
        bad = buf_add(o, l->resp_add.p, l->resp_add.n);
    }
    int close_delimited = !bodyless && !chunked && length < 0;
    if (!bad && (chunked || close_delimited) && !bodyless) {
        bad = buf_addstr(o, "Transfer-Encoding: chunked\r\n"); /* as h11 writes it */
    }
    if (!bad) {
        bad = buf_add(o, "\r\n", 2);
    }
    if (bad) {
        fail(r, l, 502, "the worker failed to answer", "no memory");
        return -1;
    }
    l->win.off += head_len;
    l->status = status;
    l->answered = 1;
    l->t_head = mono();
    l->resp_chunked = chunked;
    if (close) {
        l->worker_keep = 0;
    }
    if (bodyless) {
        l->rs = RS_DONE;
    }
    else if (chunked) {
        start_reframe(l);
        l->rs = RS_CHUNKED;
    }
    else if (length >= 0) {
        l->resp_left = length;
        l->rs = length > 0 ? RS_CL : RS_DONE;
    }
    else {
        l->worker_keep = 0;
        l->rs = RS_CLOSE;
    }
    return 1;
}

/* The worker's bytes at win, as far as they go: 0, or -1 when the lane failed. */
static int
response_bytes(Core *r, lane_t *l)
{
    for (;;) {
        size_t avail = buf_avail(&l->win);
        const unsigned char *p = l->win.p + l->win.off;
        switch (l->rs) {
        case RS_HEAD: {
            if (avail == 0) {
                return 0;
            }
            int h = response_head(r, l);
            if (h <= 0) {
                return h;
            }
            break;
        }
        case RS_CL: {
            if (avail == 0) {
                return 0;
            }
            size_t n = (long long)avail < l->resp_left ? avail : (size_t)l->resp_left;
            if (buf_add(&l->cout, p, n) < 0) {
                fail(r, l, 0, "", "no memory");
                return -1;
            }
            l->win.off += n;
            l->resp_left -= (long long)n;
            l->bytes_out += (long long)n;
            if (l->resp_left == 0) {
                l->rs = RS_DONE;
            }
            break;
        }
        case RS_CHUNKED:
            if (avail == 0) {
                return 0;
            }
            if (reframe(r, l, p, avail) < 0) {
                return -1;
            }
            break;
        case RS_CLOSE: {
            if (avail == 0) {
                return 0;
            }
            char line[24];
            int n = snprintf(line, sizeof line, "%zx\r\n", avail);
            if (buf_add(&l->cout, line, (size_t)n) < 0 || buf_add(&l->cout, p, avail) < 0 ||
                buf_add(&l->cout, "\r\n", 2) < 0) {
                fail(r, l, 0, "", "no memory");
                return -1;
            }
            l->win.off += avail;
            l->bytes_out += (long long)avail;
            break;
        }
        case RS_DONE:
            if (avail > 0) {
                l->worker_keep = 0; /* bytes past the answer */
                l->win.off = l->win.len = 0;
            }
            return 0;
        }
    }
}

/* 1: the socket took everything; 0: the rest waits; -1: error. */
static int
flush(int fd, buf_t *b, int *writable)
{
    while (buf_avail(b) > 0 && *writable) {
        ssize_t w = send(fd, b->p + b->off, buf_avail(b), MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                *writable = 0;
                return 0;
            }
            if (errno == EINTR) {
                continue;
            }
            return -1;
        }
        b->off += (size_t)w;
    }
    if (buf_avail(b) == 0) {
        b->off = b->len = 0;
        return 1;
    }
    return 0;
}

/* One recv into b: >0 bytes, 0 EOF, -1 EAGAIN (flag cleared), -2 error, -3 no memory. */
static ssize_t
fill(int fd, buf_t *b, int *readable, int hup)
{
    if (buf_reserve(b, READ_SIZE) < 0) {
        return -3;
    }
    for (;;) {
        size_t room = b->cap - b->len;
        ssize_t n = recv(fd, b->p + b->len, room, MSG_DONTWAIT);
        if (n > 0) {
            b->len += (size_t)n;
            if ((size_t)n < room && !hup) {
                /* A short read took all there was; new bytes bring a new edge (the EOF that
                 * came with these does not, hence hup: then the next recv says so). */
                *readable = 0;
            }
            return n;
        }
        if (n == 0) {
            return 0;
        }
        if (errno == EINTR) {
            continue;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            *readable = 0;
            return -1;
        }
        return -2;
    }
}

static void
pump(Core *r, lane_t *l)
{
    while (l->state == L_ACTIVE) {
        int progress = 0;
        /* Writes first: what waits for a socket goes before anything else is read. */
        if (buf_avail(&l->cout) > 0 && l->c_wr) {
            size_t before = buf_avail(&l->cout);
            if (flush(l->u.cfd, &l->cout, &l->c_wr) < 0) {
                client_gone(r, l, "client went away");
                return;
            }
            progress |= buf_avail(&l->cout) != before;
            l->c_sent += before - buf_avail(&l->cout);
            l->last = mono();
        }
        if (buf_avail(&l->wout) > 0 && l->w_wr) {
            size_t before = buf_avail(&l->wout);
            if (flush(l->u.wfd, &l->wout, &l->w_wr) < 0) {
                worker_failed(r, l, "the worker closed the connection");
                return;
            }
            progress |= buf_avail(&l->wout) != before;
        }
        if (l->phase == P_IDLE) {
            if (l->release_asked) {
                give_back(r, l, LR_RELEASED);
                return;
            }
            if (l->w_rd) { /* a worker has nothing to say between requests: a byte or its EOF */
                unsigned char probe;
                ssize_t n = recv(l->u.wfd, &probe, 1, MSG_DONTWAIT | MSG_PEEK);
                if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
                    l->w_rd = 0;
                }
                else {
                    l->worker_keep = 0;
                    give_back(r, l, LR_WORKER_DONE);
                    return;
                }
            }
            start_request(r, l);
            if (l->state != L_ACTIVE) {
                return;
            }
            if (l->phase == P_EXCHANGE) {
                progress = 1;
                continue;
            }
            if (l->c_rd && !l->c_eof) {
                ssize_t n = fill(l->u.cfd, &l->cin, &l->c_rd, l->c_hup);
                if (n == 0 || n == -2) {
                    l->c_eof = 1;
                    give_back(r, l, buf_avail(&l->cin) ? LR_HANDBACK : LR_CLIENT_EOF);
                    return;
                }
                if (n == -3) {
                    give_back(r, l, LR_HANDBACK);
                    return;
                }
                progress |= n > 0;
            }
        }
        else {
            /* The request body, one read ahead of the worker at most. */
            if (l->req_left > 0) {
                int m = move_body(l);
                if (m < 0) {
                    fail(r, l, 502, "the worker failed to answer", "no memory");
                    return;
                }
                progress |= m;
                if (l->req_left > 0 && buf_avail(&l->wout) == 0 && l->c_rd && !l->c_eof) {
                    ssize_t n = fill(l->u.cfd, &l->cin, &l->c_rd, l->c_hup);
                    if (n == 0 || n == -2) {
                        l->c_eof = 1;
                        client_gone(r, l, "client closed before its request ended");
                        return;
                    }
                    if (n == -3) {
                        fail(r, l, 502, "the worker failed to answer", "no memory");
                        return;
                    }
                    if (n > 0) {
                        progress = 1;
                        l->last = mono();
                    }
                }
            }
            /* The answer, one read ahead of the client at most. */
            if (l->rs != RS_DONE && buf_avail(&l->cout) == 0 && l->w_rd) {
                ssize_t n = fill(l->u.wfd, &l->win, &l->w_rd, l->w_hup);
                if (n == -3) {
                    fail(r, l, 502, "the worker failed to answer", "no memory");
                    return;
                }
                if (n == 0 || n == -2) {
                    l->w_eof = 1;
                    if (l->rs == RS_CLOSE) {
                        if (buf_add(&l->cout, "0\r\n\r\n", 5) < 0) {
                            fail(r, l, 0, "", "no memory");
                            return;
                        }
                        l->rs = RS_DONE;
                        l->worker_keep = 0;
                    }
                    else {
                        if (response_bytes(r, l) < 0) {
                            return;
                        }
                        if (l->rs != RS_DONE) {
                            if (l->answered) {
                                fail(r, l, 0, "", "the worker closed the connection");
                            }
                            else {
                                worker_failed(r, l, "the worker closed the connection");
                            }
                            return;
                        }
                    }
                    progress = 1;
                }
                else if (n > 0) {
                    l->last = mono();
                    if (response_bytes(r, l) < 0) {
                        return;
                    }
                    progress = 1;
                }
            }
            if (l->rs == RS_DONE && l->req_left == 0 && buf_avail(&l->cout) == 0 &&
                buf_avail(&l->wout) == 0) {
                int keep = l->worker_keep;
                end_exchange(r, l);
                if (!keep) {
                    give_back(r, l, LR_WORKER_DONE);
                    return;
                }
                progress = 1;
            }
            else if (l->rs == RS_DONE && l->req_left > 0 && buf_avail(&l->cout) == 0) {
                snprintf(l->why, sizeof l->why, "answered before the request body ended");
                end_exchange(r, l);
                shutdown(l->u.cfd, SHUT_WR);
                give_back(r, l, LR_FAILED);
                return;
            }
        }
        if (!progress) {
            return;
        }
    }
}

/* Timeouts, every ~50 ms: the keep-alive wait, timeout_server, timeout_request. */
static void
check_clocks(Core *r, double now)
{
    pthread_mutex_lock(&r->mu);
    uint32_t n = r->nslots;
    lane_t **copy = n ? malloc(n * sizeof *copy) : NULL;
    uint32_t m = 0;
    if (copy != NULL) {
        for (uint32_t i = 0; i < n; i++) {
            lane_t *l = (lane_t *)r->slots[i];
            if (l != NULL && l->u.kind == K_LANE && l->state == L_ACTIVE) {
                copy[m++] = l;
            }
        }
    }
    pthread_mutex_unlock(&r->mu);
    for (uint32_t i = 0; i < m; i++) {
        lane_t *l = copy[i];
        if (l->state != L_ACTIVE) {
            continue;
        }
        if (l->phase == P_IDLE || buf_avail(&l->cout) == 0 || l->c_sent != l->c_seen) {
            l->c_seen = l->c_sent;
            l->c_moved = now; /* the client took something, or is owed nothing */
        }
        if (l->phase == P_IDLE) {
            if (now - l->idle_since >= l->t_idle) {
                give_back(r, l, LR_IDLE);
            }
            continue;
        }
        int paused = buf_avail(&l->cout) > 0; /* the client does not read: not the worker's fault */
        if (l->req_left > 0 && buf_avail(&l->wout) == 0 && now - l->t0 >= l->t_request) {
            fail(r, l, 408, "the request body did not arrive in time", "timeout_request");
        }
        else if (!paused && l->rs != RS_DONE && now - l->last >= l->t_server) {
            fail(r, l, 504, "the worker did not answer in time", "timeout_server");
        }
        else if (paused && l->t_stall > 0 && now - l->c_moved >= l->t_stall) {
            fail(r, l, 0, "", "client not reading"); /* FAILED: the worker's connection closes */
        }
    }
    free(copy);
}

static void
free_lane(lane_t *l)
{
    buf_free(&l->cin);
    buf_free(&l->wout);
    buf_free(&l->win);
    buf_free(&l->cout);
    str_t *all[] = {&l->sig, &l->target, &l->pre, &l->post, &l->resp_add,
                    &l->pool};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        free(all[i]->p);
    }
    for (int i = 0; i < l->n_sig; i++) {
        free(l->sig_names[i].p);
    }
    for (int i = 0; i < l->n_drop; i++) {
        free(l->drop[i].p);
    }
    for (int i = 0; i < l->n_resp_drop; i++) {
        free(l->resp_drop[i].p);
    }
    free(l->sig_names);
    free(l->drop);
    free(l->resp_drop);
    if (l->u.cfd >= 0) {
        close(l->u.cfd);
    }
    if (l->u.wfd >= 0) {
        close(l->u.wfd);
    }
    free(l);
}


/* == the loop ================================================================================ */

static void
free_unit(unit_t *u)
{
    if (u->kind == K_LANE) {
        free_lane((lane_t *)u);
    }
    else {
        free_sess((sess_t *)u);
    }
}

/* The sessions to read again at the next turn (their read filled the buffer, nothing holds them
 * back): the thread's own list, in order, of any length. */
typedef struct {
    sess_t *head, *tail;
} again_t;

static void
again_add(again_t *a, sess_t *s)
{
    if (s->in_again) {
        return;
    }
    s->in_again = 1;
    s->again_next = NULL;
    if (a->tail != NULL) {
        a->tail->again_next = s;
    }
    else {
        a->head = s;
    }
    a->tail = s;
}

/* With mu held: up to ``room`` of them into batch; those returned or released leave the list
 * (a released one is freed after this turn). How many were added. */
static int
again_collect(again_t *a, sess_t **batch, int room)
{
    int nb = 0;
    sess_t *keep = NULL, *last = NULL;
    for (sess_t *s = a->head, *next; s != NULL; s = next) {
        next = s->again_next;
        s->again_next = NULL;
        if (s->state == S_ACTIVE && nb >= room) { /* no room: the next turn */
            if (last != NULL) {
                last->again_next = s;
            }
            else {
                keep = s;
            }
            last = s;
            continue;
        }
        s->in_again = 0;
        if (s->state == S_ACTIVE && s->busy == BUSY_IDLE) {
            s->busy = BUSY_COLLECTED;
            batch[nb++] = s;
        }
    }
    a->head = keep;
    a->tail = last;
    return nb;
}

/* One turn's collected sessions served, each published before the next starts (see the
 * sessions' locking). */
static void
serve_sessions(Core *r, sess_t **batch, int nb, again_t *again)
{
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
        if ((s->ready & READY_READ) && s->state == S_ACTIVE) {
            on_readable(r, s, &wake);
        }
        if (s->state == S_ACTIVE && (s->ready & READY_READ) && s->out_off == s->out_end) {
            again_add(again, s); /* more to read, and nothing holds it back */
        }
        if (wake) {
            notify(r);
        }
    }
}

/* The event loop's requests of lanes (a lane may have returned since: then nothing). */
static void
serve_control(Core *r, lane_t *x)
{
    while (x != NULL) {
        lane_t *next = x->ctl_next;
        x->ctl_next = NULL;
        pthread_mutex_lock(&r->mu);
        int what = x->ctl;
        x->ctl = 0;
        char why[96];
        memcpy(why, x->abort_why, sizeof why);
        pthread_mutex_unlock(&r->mu);
        if (x->state == L_ACTIVE) {
            if (what & CTL_ABORT) {
                if (x->phase == P_EXCHANGE) {
                    fail(r, x, 503, why[0] ? why : "aborted", why[0] ? why : "aborted");
                }
                else {
                    give_back(r, x, LR_RELEASED);
                }
            }
            else if (what & CTL_RELEASE) {
                x->release_asked = 1;
                if (x->phase == P_IDLE) {
                    give_back(r, x, LR_RELEASED);
                }
            }
        }
        x = next;
    }
}

static void
lane_ready(lane_t *l, int which, uint32_t e)
{
    if (e & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
        int hup = (e & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) != 0;
        if (which == W_WORKER) {
            l->w_rd = 1;
            l->w_hup |= hup;
        }
        else {
            l->c_rd = 1;
            l->c_hup |= hup;
        }
    }
    if (e & (EPOLLOUT | EPOLLHUP | EPOLLERR)) {
        if (which == W_WORKER) {
            l->w_wr = 1;
        }
        else {
            l->c_wr = 1;
        }
    }
}

static void *
run(void *arg)
{
    Core *r = (Core *)arg;
    struct epoll_event evs[MAX_EVENTS];
    sess_t *batch[2 * MAX_EVENTS];
    again_t again = {NULL, NULL};
    double last_check = mono();
    for (;;) {
        int n = epoll_wait(r->epfd, evs, MAX_EVENTS, again.head != NULL ? 0 : 50);
        while (__atomic_load_n(&test_spin, __ATOMIC_RELAXED)) {
        }
        if (__atomic_load_n(&r->stopping, __ATOMIC_ACQUIRE)) {
            break;
        }
        /* 1. Collect. */
        int woken = 0;
        pthread_mutex_lock(&r->mu);
        int nb = again_collect(&again, batch, MAX_EVENTS); /* first: they waited a turn */
        for (int i = 0; i < n; i++) {
            watch_t *w = (watch_t *)evs[i].data.ptr;
            if (w == NULL) {
                woken = 1;
                continue;
            }
            if (w->u->kind != K_SESSION) {
                continue;
            }
            sess_t *s = (sess_t *)w->u;
            if (s->state != S_ACTIVE) {
                continue; /* returned, or released since epoll_wait */
            }
            uint32_t e = evs[i].events;
            if (w->which == W_WORKER) {
                s->ready |= READY_READ;
                s->hup |= (e & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) != 0;
            }
            else {
                s->ready |= READY_WRITE;
            }
            if (s->busy == BUSY_IDLE) {
                s->busy = BUSY_COLLECTED;
                batch[nb++] = s;
            }
        }
        lane_t *ctl = r->ctl_head;
        r->ctl_head = NULL;
        for (lane_t *x = ctl; x != NULL; x = x->ctl_next) {
            x->in_ctl = 0;
        }
        unit_t *dead = r->graveyard;
        r->graveyard = NULL;
        pthread_mutex_unlock(&r->mu);
        if (woken) {
            uint64_t v;
            ssize_t got = read(r->wakefd, &v, sizeof v);
            (void)got;
        }
        /* 2. Serve: the sessions, then the lanes (their readiness first, then the event loop's
         * requests, then their I/O). */
        serve_sessions(r, batch, nb, &again);
        for (int i = 0; i < n; i++) {
            watch_t *w = (watch_t *)evs[i].data.ptr;
            if (w != NULL && w->u->kind == K_LANE && ((lane_t *)w->u)->state == L_ACTIVE) {
                lane_ready((lane_t *)w->u, w->which, evs[i].events);
            }
        }
        serve_control(r, ctl);
        for (int i = 0; i < n; i++) {
            watch_t *w = (watch_t *)evs[i].data.ptr;
            if (w != NULL && w->u->kind == K_LANE && ((lane_t *)w->u)->state == L_ACTIVE) {
                pump(r, (lane_t *)w->u);
            }
        }
        /* 3. What was removed before this turn's collection. */
        while (dead != NULL) {
            unit_t *u = dead;
            dead = u->next_dead;
            free_unit(u);
        }
        double now = mono();
        if (now - last_check >= 0.05) {
            last_check = now;
            check_clocks(r, now);
        }
    }
    return NULL;
}

/* == the Python type ========================================================================= */

static unit_t *
lookup(Core *r, uint64_t handle, int kind)
{
    uint32_t slot = (uint32_t)(handle & 0xffffffffu);
    if (slot >= r->nslots) {
        return NULL;
    }
    unit_t *u = r->slots[slot];
    return (u != NULL && u->handle == handle && u->kind == kind) ? u : NULL;
}

static int
ensure_open(Core *r)
{
    if (r->closed) {
        PyErr_SetString(PyExc_RuntimeError, "the offload thread is closed");
        return -1;
    }
    if (r->pid != getpid()) {
        PyErr_SetString(PyExc_RuntimeError, "the offload thread belongs to another process");
        return -1;
    }
    return 0;
}

static PyObject *
Core_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *buckets = NULL;
    (void)kwds;
    if (!PyArg_ParseTuple(args, "|O:Thread", &buckets)) {
        return NULL;
    }
    PyObject *seq = buckets ? PySequence_Fast(buckets, "buckets must be a sequence") : PyTuple_New(0);
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t nb = PySequence_Fast_GET_SIZE(seq);
    if (nb > MAX_BUCKETS) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "too many buckets");
        return NULL;
    }
    Core *r = (Core *)type->tp_alloc(type, 0);
    if (r == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nb; i++) {
        r->buckets[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
    }
    Py_DECREF(seq);
    r->epfd = r->wakefd = r->notifyfd = -1;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->idle, NULL);
    r->pid = getpid();
    if (PyErr_Occurred()) {
        Py_DECREF(r);
        return NULL;
    }
    r->nbuckets = (int)nb;
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

/* With mu held: room for more units (slots, free list, events() array). */
static int
grow_slots(Core *r)
{
    if (r->nslots >= (1u << 30)) {
        return -1; /* the doubling would wrap */
    }
    uint32_t grow = r->nslots ? r->nslots : 256;
    uint32_t n = r->nslots + grow;
    unit_t **slots = realloc(r->slots, n * sizeof(unit_t *));
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

/* With mu held: u gets a slot and a handle, and its sockets are watched; -1 (nothing taken,
 * a Python error set) when it cannot. */
static int
place(Core *r, unit_t *u, watch_t *cw, watch_t *ww, uint32_t cev, uint32_t wev)
{
    if (r->nfree == 0 && grow_slots(r) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    uint32_t slot = r->free_slots[--r->nfree];
    r->generation++;
    u->handle = ((uint64_t)r->generation << 32) | slot;
    if (watch(r, u, cw, ww, cev, wev) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        r->free_slots[r->nfree++] = slot;
        return -1;
    }
    r->slots[slot] = u;
    r->live++;
    return 0;
}

/* With mu held: the thread lets go of u (it never serves it again); it is freed after the
 * thread's next collection (at once when no thread runs). */
static void
release_unit(Core *r, unit_t *u)
{
    unqueue(r, u);
    uint32_t slot = (uint32_t)(u->handle & 0xffffffffu);
    r->slots[slot] = NULL;
    r->free_slots[r->nfree++] = slot;
    r->live--;
    if (r->started) {
        u->next_dead = r->graveyard;
        r->graveyard = u;
    }
    else { /* no thread to hold it: the lane's descriptors close now */
        free_unit(u);
    }
}

/* The thread, started at the first unit. */
static int
start(Core *r)
{
    if (r->started) {
        return 0;
    }
    if (pthread_create(&r->thread, NULL, run, r) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "the offload thread could not start");
        return -1;
    }
    r->started = 1;
    return 0;
}

/* Two dup()s of the caller's descriptors; -1 (a Python error set, none left open) on failure. */
static int
dup_fds(long cfd, long wfd, unit_t *u)
{
    u->cfd = u->wfd = -1;
    if (cfd < 0 || wfd < 0 || cfd > INT_MAX || wfd > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "bad descriptor");
        return -1;
    }
    u->cfd = fcntl((int)cfd, F_DUPFD_CLOEXEC, 0);
    u->wfd = fcntl((int)wfd, F_DUPFD_CLOEXEC, 0);
    if (u->cfd < 0 || u->wfd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        if (u->cfd >= 0) {
            close(u->cfd);
        }
        if (u->wfd >= 0) {
            close(u->wfd);
        }
        u->cfd = u->wfd = -1;
        return -1;
    }
    return 0;
}

/* -- sessions ------------------------------------------------------------------------------ */

static PyObject *
Core_add(Core *r, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "add(worker_fd, client_fd, limit, record[, chunked])");
        return NULL;
    }
    if (ensure_open(r) < 0) {
        return NULL;
    }
    long wfd = PyLong_AsLong(args[0]);
    long cfd = PyLong_AsLong(args[1]);
    long limit = PyLong_AsLong(args[2]);
    int record = PyObject_IsTrue(args[3]);
    int chunked = nargs == 5 ? PyObject_IsTrue(args[4]) : 0;
    if (PyErr_Occurred() || record < 0 || chunked < 0) {
        return NULL;
    }
    if (limit < 0) {
        PyErr_SetString(PyExc_ValueError, "add: bad limit");
        return NULL;
    }
    sess_t *s = calloc(1, sizeof(sess_t));
    if (s == NULL) {
        return PyErr_NoMemory();
    }
    if (dup_fds(cfd, wfd, &s->u) < 0) {
        free(s);
        return NULL;
    }
    s->u.kind = K_SESSION;
    s->limit = limit > 65535 ? 65535 : limit;
    s->record = record;
    s->chunked = chunked;
    s->ww.u = s->cw.u = &s->u;
    s->ww.which = W_WORKER;
    s->cw.which = W_CLIENT;
    pthread_mutex_lock(&r->mu);
    int rc = place(r, &s->u, &s->cw, &s->ww, EPOLLOUT, EPOLLIN | EPOLLRDHUP);
    pthread_mutex_unlock(&r->mu);
    if (rc < 0) {
        close(s->u.wfd);
        close(s->u.cfd);
        free(s);
        return NULL;
    }
    if (start(r) < 0) {
        pthread_mutex_lock(&r->mu);
        unwatch(r, &s->u);
        release_unit(r, &s->u);
        pthread_mutex_unlock(&r->mu);
        close(s->u.wfd);
        close(s->u.cfd);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(s->u.handle);
}

static PyObject *
bytes_of(const unsigned char *p, size_t n)
{
    return PyBytes_FromStringAndSize((const char *)(n ? p : (const unsigned char *)""), (Py_ssize_t)n);
}

static PyObject *
Core_remove(Core *r, PyObject *arg)
{
    uint64_t handle = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (ensure_open(r) < 0) {
        return NULL;
    }
    pthread_mutex_lock(&r->mu);
    sess_t *s = (sess_t *)lookup(r, handle, K_SESSION);
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
    int wfd = s->u.wfd, cfd = s->u.cfd;
    unwatch(r, &s->u);
    s->state = S_RELEASED;
    release_unit(r, &s->u);
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
Core_counts(Core *r, PyObject *arg)
{
    uint64_t handle = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) {
        return NULL;
    }
    pthread_mutex_lock(&r->mu);
    sess_t *s = (sess_t *)lookup(r, handle, K_SESSION);
    unsigned long long frames = s ? s->frames : 0, nbytes = s ? s->bytes : 0;
    pthread_mutex_unlock(&r->mu);
    if (s == NULL) {
        PyErr_SetString(PyExc_KeyError, "no such relayed session");
        return NULL;
    }
    return Py_BuildValue("(KK)", frames, nbytes);
}

static PyObject *
Core_take_record(Core *r, PyObject *arg)
{
    uint64_t handle = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) {
        return NULL;
    }
    pthread_mutex_lock(&r->mu);
    sess_t *s = (sess_t *)lookup(r, handle, K_SESSION);
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

/* -- lanes --------------------------------------------------------------------------------- */

static int
copy_bytes(PyObject *o, str_t *out)
{
    char *p;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(o, &p, &n) < 0) {
        return -1;
    }
    out->p = malloc((size_t)n + 1);
    if (out->p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(out->p, p, (size_t)n);
    out->p[n] = 0;
    out->n = (size_t)n;
    return 0;
}

static int
copy_names(PyObject *o, str_t **out, int *count)
{
    PyObject *seq = PySequence_Fast(o, "names must be a sequence of bytes");
    if (seq == NULL) {
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > MAX_FIELDS) { /* an int count, and a search per header line */
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "too many names");
        return -1;
    }
    *out = calloc((size_t)n + 1, sizeof **out);
    if (*out == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (copy_bytes(PySequence_Fast_GET_ITEM(seq, i), &(*out)[i]) < 0) {
            *count = (int)i;
            Py_DECREF(seq);
            return -1;
        }
    }
    *count = (int)n;
    Py_DECREF(seq);
    return 0;
}

/* add(client_fd, worker_fd, carry, spec) -> handle. spec: (sig, sig_names, target, pre, post,
 * drop, resp_drop, resp_add, max_head, max_headers, max_body, t_request, t_server, t_idle,
 * t_stall, peer, key, pool, backend). */
static PyObject *
Core_add_lane(Core *r, PyObject *args)
{
    int cfd, wfd;
    Py_buffer carry;
    PyObject *sig, *sig_names, *target, *pre, *post, *drop, *resp_drop, *resp_add, *peer, *key,
        *pool, *backend;
    long max_head, max_headers;
    long long max_body;
    double t_request, t_server, t_idle, t_stall;
    if (!PyArg_ParseTuple(args, "iiy*(SOSSSOOSllLddddSSSS):add_lane", &cfd, &wfd, &carry, &sig,
                          &sig_names, &target, &pre, &post, &drop, &resp_drop, &resp_add,
                          &max_head, &max_headers, &max_body, &t_request, &t_server, &t_idle,
                          &t_stall, &peer, &key, &pool, &backend)) {
        return NULL;
    }
    if (ensure_open(r) < 0) {
        PyBuffer_Release(&carry);
        return NULL;
    }
    lane_t *l = calloc(1, sizeof *l);
    if (l == NULL) {
        PyBuffer_Release(&carry);
        return PyErr_NoMemory();
    }
    l->u.cfd = l->u.wfd = -1;
    int bad = copy_bytes(sig, &l->sig) || copy_names(sig_names, &l->sig_names, &l->n_sig) ||
              copy_bytes(target, &l->target) || copy_bytes(pre, &l->pre) ||
              copy_bytes(post, &l->post) || copy_names(drop, &l->drop, &l->n_drop) ||
              copy_names(resp_drop, &l->resp_drop, &l->n_resp_drop) ||
              copy_bytes(resp_add, &l->resp_add) || copy_bytes(pool, &l->pool);
    if (!bad && buf_add(&l->cin, carry.buf, (size_t)carry.len) < 0) {
        PyErr_NoMemory();
        bad = 1;
    }
    PyBuffer_Release(&carry);
    if (bad) {
        free_lane(l);
        return NULL;
    }
    l->max_head = max_head;
    l->max_headers = max_headers;
    l->max_body = max_body;
    l->t_request = t_request;
    l->t_server = t_server;
    l->t_idle = t_idle;
    l->t_stall = t_stall;
    l->c_moved = mono();
    if (dup_fds(cfd, wfd, &l->u) < 0) {
        free_lane(l);
        return NULL;
    }
    l->u.kind = K_LANE;
    l->cw.u = l->ww.u = &l->u;
    l->cw.which = W_CLIENT;
    l->ww.which = W_WORKER;
    l->phase = P_IDLE;
    l->worker_keep = 1; /* the event loop hands over only a worker connection that may go on */
    l->idle_since = mono();
    l->c_rd = 1; /* try a read at once: bytes may have come before the watch */
    l->c_wr = l->w_wr = 1;
    l->state = L_ACTIVE;
    uint32_t all = EPOLLIN | EPOLLOUT | EPOLLRDHUP;
    pthread_mutex_lock(&r->mu);
    int rc = place(r, &l->u, &l->cw, &l->ww, all, all);
    pthread_mutex_unlock(&r->mu);
    if (rc < 0) {
        free_lane(l);
        return NULL;
    }
    /* The first pump: the thread sees the edge of what came before the watch as its EPOLLOUT. */
    if (start(r) < 0) {
        pthread_mutex_lock(&r->mu);
        unwatch(r, &l->u);
        release_unit(r, &l->u);
        pthread_mutex_unlock(&r->mu);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(l->u.handle);
}

/* take_log() -> [(handle, at, method, path, status, sse, headers_s, duration, bytes_in, bytes_out,
 * end, user_agent or None)]: the records of the exchanges ended since the last call. */
static PyObject *
Core_take_log(Core *r, PyObject *Py_UNUSED(ignored))
{
    pthread_mutex_lock(&r->mu);
    exch_t *log = r->log;
    size_t n = r->nlog;
    r->log = NULL;
    r->nlog = r->log_cap = 0;
    pthread_mutex_unlock(&r->mu);
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list != NULL && i < n; i++) {
        exch_t *x = &log[i];
        PyObject *ua = x->has_ua ? PyBytes_FromStringAndSize((char *)x->ua, (Py_ssize_t)x->ua_len)
                                 : Py_NewRef(Py_None);
        PyObject *t = ua == NULL ? NULL
                                 : Py_BuildValue("(Kdy#y#iNddLLsN)", (unsigned long long)x->handle,
                                                 x->at, x->method, (Py_ssize_t)x->method_len,
                                                 x->path, (Py_ssize_t)x->path_len, x->status,
                                                 PyBool_FromLong(x->sse), x->headers_s,
                                                 x->duration, x->bytes_in, x->bytes_out, x->end, ua);
        if (t == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, t);
    }
    free(log);
    return list;
}

/* take_stats() -> (tallies [(pool, sse, status, (bucket counts), n, sum)], bytes_in, bytes_out,
 * exchanges): what was counted since the last call. */
static PyObject *
Core_take_stats(Core *r, PyObject *Py_UNUSED(ignored))
{
    pthread_mutex_lock(&r->mu);
    tally_t *tallies = r->tallies;
    size_t nt = r->ntallies;
    unsigned long long bin = r->bytes_in, bout = r->bytes_out, ex = r->exchanges;
    r->tallies = NULL;
    r->ntallies = r->tallies_cap = 0;
    r->bytes_in = r->bytes_out = r->exchanges = 0;
    pthread_mutex_unlock(&r->mu);
    PyObject *tl = PyList_New(0), *out = NULL;
    if (tl == NULL) {
        goto done;
    }
    for (size_t i = 0; i < nt; i++) {
        tally_t *c = &tallies[i];
        PyObject *b = PyTuple_New(r->nbuckets);
        if (b == NULL) {
            goto done;
        }
        for (int k = 0; k < r->nbuckets; k++) {
            PyObject *v = PyLong_FromUnsignedLongLong(c->counts[k]);
            if (v == NULL) {
                Py_DECREF(b);
                goto done;
            }
            PyTuple_SET_ITEM(b, k, v);
        }
        PyObject *t = Py_BuildValue("(siiNKd)", c->pool, c->kind, c->status, b, c->n, c->sum);
        if (t == NULL || PyList_Append(tl, t) < 0) {
            Py_XDECREF(t);
            goto done;
        }
        Py_DECREF(t);
    }
    out = Py_BuildValue("(OKKK)", tl, bin, bout, ex);
done:
    Py_XDECREF(tl);
    free(tallies);
    return out;
}

static PyObject *
Core_set_log(Core *r, PyObject *arg)
{
    int on = PyObject_IsTrue(arg);
    if (on < 0) {
        return NULL;
    }
    pthread_mutex_lock(&r->mu);
    r->log_on = on;
    pthread_mutex_unlock(&r->mu);
    Py_RETURN_NONE;
}


static PyObject *
Core_control(Core *r, PyObject *args, int what)
{
    unsigned long long handle;
    const char *why = NULL;
    if (!PyArg_ParseTuple(args, "K|s", &handle, &why)) {
        return NULL;
    }
    if (ensure_open(r) < 0) {
        return NULL;
    }
    pthread_mutex_lock(&r->mu);
    lane_t *l = (lane_t *)lookup(r, handle, K_LANE);
    int found = l != NULL && l->state == L_ACTIVE;
    if (found) {
        if (why != NULL && what == CTL_ABORT) {
            snprintf(l->abort_why, sizeof l->abort_why, "%s", why);
        }
        l->ctl |= what;
        if (!l->in_ctl) {
            l->in_ctl = 1;
            l->ctl_next = r->ctl_head;
            r->ctl_head = l;
        }
    }
    pthread_mutex_unlock(&r->mu);
    if (found) {
        uint64_t one = 1;
        ssize_t w = write(r->wakefd, &one, sizeof one);
        (void)w;
    }
    return PyBool_FromLong(found);
}

static PyObject *
Core_release(Core *r, PyObject *args)
{
    return Core_control(r, args, CTL_RELEASE);
}

static PyObject *
Core_abort(Core *r, PyObject *args)
{
    return Core_control(r, args, CTL_ABORT);
}

/* remove_lane(handle) -> (carry, reason, worker_ok, client_eof, exchanges, idle_for): a RETURNED
 * lane's (the event loop's alone from its RETURNED event on). */
static PyObject *
Core_remove_lane(Core *r, PyObject *args)
{
    unsigned long long handle;
    if (!PyArg_ParseTuple(args, "K:remove_lane", &handle)) {
        return NULL;
    }
    pthread_mutex_lock(&r->mu);
    lane_t *l = (lane_t *)lookup(r, handle, K_LANE);
    int returned = l != NULL && l->state == L_RETURNED;
    pthread_mutex_unlock(&r->mu);
    if (!returned) {
        PyErr_SetString(PyExc_KeyError, l == NULL ? "no such lane" : "the lane is not returned");
        return NULL;
    }
    /* The worker's connection goes on only from IDLE with nothing of it pending. */
    int worker_ok = l->phase == P_IDLE && l->worker_keep && buf_avail(&l->wout) == 0 &&
                    (l->reason == LR_RELEASED || l->reason == LR_IDLE ||
                     l->reason == LR_CLIENT_EOF || l->reason == LR_HANDBACK ||
                     l->reason == LR_CLOSED);
    double idle_for = l->phase == P_IDLE ? mono() - l->idle_since : 0.0;
    PyObject *out = Py_BuildValue("(y#iiiKd)", l->cin.p ? (char *)l->cin.p + l->cin.off : "",
                                  (Py_ssize_t)buf_avail(&l->cin), l->reason, worker_ok, l->c_eof,
                                  l->exchanges, idle_for);
    if (out != NULL) {
        pthread_mutex_lock(&r->mu);
        release_unit(r, &l->u);
        pthread_mutex_unlock(&r->mu);
    }
    return out;
}

/* With mu held: queue again what events() took and could not hand over. */
static int
requeue(Core *r, size_t n)
{
    int wake = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t h = r->evout[i].handle;
        unit_t *u = lookup(r, h, K_SESSION);
        if (u == NULL) {
            u = lookup(r, h, K_LANE);
        }
        if (u != NULL) {
            wake |= push_event(r, u, r->evout[i].kinds);
        }
    }
    return wake;
}

static PyObject *
Core_events(Core *r, PyObject *Py_UNUSED(ignored))
{
    if (r->closed) {
        return PyList_New(0);
    }
    uint64_t v;
    ssize_t got = read(r->notifyfd, &v, sizeof v);
    (void)got;
    size_t n = 0, items = 0;
    pthread_mutex_lock(&r->mu);
    for (unit_t *u = r->ev_head; u != NULL; u = u->ev_next) {
        r->evout[n].handle = u->handle; /* at most one entry per slot: evout has room */
        r->evout[n].kinds = u->pending;
        items += (u->pending & EV_RECORD ? 1 : 0) + (u->pending & EV_RETURNED ? 1 : 0) +
                 (u->pending & EV_FLUSH ? 1 : 0);
        n++;
    }
    while (r->ev_head != NULL) {
        unqueue(r, r->ev_head);
    }
    r->notified = 0;
    pthread_mutex_unlock(&r->mu);
    PyObject *list = take_fail(&fail_events) ? PyErr_NoMemory() : PyList_New((Py_ssize_t)items);
    Py_ssize_t k = 0;
    static const int order[] = {EV_FLUSH, EV_RECORD, EV_RETURNED}; /* what came before it first */
    for (size_t i = 0; list != NULL && i < n; i++) {
        for (int j = 0; j < 3; j++) {
            if (!(r->evout[i].kinds & order[j])) {
                continue;
            }
            PyObject *t = Py_BuildValue("(Ki)", (unsigned long long)r->evout[i].handle, order[j]);
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
Core_fileno(Core *r, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLong(r->notifyfd);
}

static PyObject *
Core_live(Core *r, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLong(r->live);
}

/* close() -> the handles of the lanes left, RETURNED with CLOSED (remove_lane each); every
 * session is let go (its descriptors closed). */
static PyObject *
Core_close(Core *r, PyObject *Py_UNUSED(ignored))
{
    if (r->closed) {
        return PyList_New(0);
    }
    if (r->pid != getpid()) {
        r->closed = 1; /* a forked copy: the thread and the sockets are the parent's */
        return PyList_New(0);
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
                         "the offload thread did not stop within %d s; its connections are left "
                         "to the process's exit",
                         JOIN_DEADLINE_S);
            return NULL;
        }
        r->started = 0;
    }
    /* The thread is gone: nothing is busy, and nothing goes to the graveyard any more. */
    r->closed = 1;
    pthread_mutex_lock(&r->mu);
    unit_t *dead = r->graveyard;
    r->graveyard = NULL;
    PyObject *list = PyList_New(0);
    for (uint32_t i = 0; i < r->nslots; i++) {
        unit_t *u = r->slots[i];
        if (u == NULL) {
            continue;
        }
        unwatch(r, u);
        if (u->kind == K_SESSION) {
            int wfd = u->wfd, cfd = u->cfd;
            ((sess_t *)u)->state = S_RELEASED;
            release_unit(r, u);
            close(wfd);
            close(cfd);
            continue;
        }
        lane_t *l = (lane_t *)u;
        if (l->state == L_ACTIVE) {
            l->state = L_RETURNED;
            l->reason = LR_CLOSED;
        }
        PyObject *h = list ? PyLong_FromUnsignedLongLong(u->handle) : NULL;
        if (h == NULL || PyList_Append(list, h) < 0) {
            Py_CLEAR(list);
        }
        Py_XDECREF(h);
    }
    pthread_mutex_unlock(&r->mu);
    while (dead != NULL) {
        unit_t *u = dead;
        dead = u->next_dead;
        free_unit(u);
    }
    return list;
}

static void
Core_dealloc(Core *r)
{
    if (!r->closed && r->pid == getpid()) {
        PyObject *res = Core_close(r, NULL);
        if (res == NULL) {
            PyErr_WriteUnraisable((PyObject *)r);
        }
        Py_XDECREF(res);
    }
    if (r->stuck) {
        return; /* a thread that did not stop may still use all of it: leaked on purpose */
    }
    if (r->pid == getpid()) {
        for (uint32_t i = 0; i < r->nslots; i++) {
            if (r->slots[i] != NULL) {
                free_unit(r->slots[i]); /* lanes close() left RETURNED and nobody removed */
            }
        }
        while (r->graveyard != NULL) {
            unit_t *u = r->graveyard;
            r->graveyard = u->next_dead;
            free_unit(u);
        }
    }
    free(r->buf);
    free(r->slots);
    free(r->free_slots);
    free(r->evout);
    free(r->log);
    free(r->tallies);
    if (r->epfd >= 0) {
        close(r->epfd);
    }
    if (r->wakefd >= 0) {
        close(r->wakefd);
    }
    if (r->notifyfd >= 0) {
        close(r->notifyfd);
    }
    pthread_cond_destroy(&r->idle);
    pthread_mutex_destroy(&r->mu);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyMethodDef Core_methods[] = {
    {"add", (PyCFunction)(void (*)(void))Core_add, METH_FASTCALL,
     "add(worker_fd, client_fd, limit, record[, chunked]) -> handle: relay the worker's fast "
     "frames (chunked: the whole chunks of an HTTP response body)."},
    {"remove", (PyCFunction)Core_remove, METH_O,
     "remove(handle) -> (carry, backlog, record, frames, bytes, reason, errno): take it back."},
    {"counts", (PyCFunction)Core_counts, METH_O, "counts(handle) -> (frames, bytes) so far."},
    {"take_record", (PyCFunction)Core_take_record, METH_O,
     "take_record(handle) -> bytes forwarded since the last take (record set)."},
    {"add_lane", (PyCFunction)Core_add_lane, METH_VARARGS,
     "add_lane(client_fd, worker_fd, carry, spec) -> handle: serve a kept-alive connection."},
    {"release", (PyCFunction)Core_release, METH_VARARGS, "Return the lane at its next boundary."},
    {"abort", (PyCFunction)Core_abort, METH_VARARGS, "End the lane's exchange now (503 or a cut)."},
    {"remove_lane", (PyCFunction)Core_remove_lane, METH_VARARGS,
     "Take a returned lane's leftovers."},
    {"take_log", (PyCFunction)Core_take_log, METH_NOARGS, "Exchanges ended since the last call."},
    {"take_stats", (PyCFunction)Core_take_stats, METH_NOARGS, "Counts since the last call."},
    {"set_log", (PyCFunction)Core_set_log, METH_O, "Keep the exchanges' records (or not)."},
    {"events", (PyCFunction)Core_events, METH_NOARGS,
     "events() -> [(handle, kind)]: what happened since the last call (clears fileno())."},
    {"fileno", (PyCFunction)Core_fileno, METH_NOARGS,
     "fileno() -> the descriptor that is readable while events are queued."},
    {"close", (PyCFunction)Core_close, METH_NOARGS,
     "close() -> the lanes left: stop the thread, let go of every session."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Core_getset[] = {
    {"live", (getter)Core_live, NULL, "sessions and lanes held now", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "balancer._offload.Thread",
    .tp_basicsize = sizeof(Core),
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The offload thread (see balancer/_offload.c).",
    .tp_methods = Core_methods,
    .tp_getset = Core_getset,
    .tp_new = Core_new,
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

static PyObject *
spin(PyObject *Py_UNUSED(module), PyObject *arg)
{
    int on = PyObject_IsTrue(arg);
    if (on < 0) {
        return NULL;
    }
    __atomic_store_n(&test_spin, on, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"_fail_next", fail_next, METH_VARARGS,
     "_fail_next(kind, n) -> what was left of the last: test-only, the next n allocations of a "
     "session's I/O ('alloc') or events() lists ('events') fail (n < 0: only tell)."},
    {"_spin", spin, METH_O,
     "_spin(on): test-only, every offload thread spins (without a lock) until it is cleared."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef offload_module = {
    PyModuleDef_HEAD_INIT, "_offload", "The offload thread (see balancer/_offload.c).", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__offload(void)
{
    init_heads();
    if (init_chunked_body() < 0 || init_reframe() < 0) {
        PyErr_SetString(PyExc_ImportError, "llhttp did not read a chunked response's head");
        return NULL;
    }
    if (PyType_Ready(&CoreType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&offload_module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Thread", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    const struct {
        const char *name;
        int value;
    } consts[] = {
        {"RETURNED", EV_RETURNED},       {"RECORD", EV_RECORD},       {"FLUSH", EV_FLUSH},
        {"TAKEN_BACK", R_NONE},          {"FRAME", R_FRAME},          {"EOF", R_EOF},
        {"READ_ERROR", R_READ_ERROR},    {"WRITE_ERROR", R_WRITE_ERROR}, {"NOMEM", R_NOMEM},
        {"BUF_SIZE", BUF_SIZE},          {"REC_NOTIFY", REC_NOTIFY},
        {"HANDBACK", LR_HANDBACK},       {"RETRY", LR_RETRY},         {"WORKER_DONE", LR_WORKER_DONE},
        {"RELEASED", LR_RELEASED},       {"IDLE", LR_IDLE},           {"CLIENT_EOF", LR_CLIENT_EOF},
        {"CLIENT_GONE", LR_CLIENT_GONE}, {"FAILED", LR_FAILED},       {"CLOSED", LR_CLOSED},
    };
    for (size_t i = 0; i < sizeof consts / sizeof consts[0]; i++) {
        if (PyModule_AddIntConstant(m, consts[i].name, consts[i].value) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
