/* Plain HTTP's steady state out of the interpreter: a thread that serves the requests of a
 * kept-alive client connection on the worker connection the event loop chose for it
 * (balancer/aio/lanes.py drives it; docs/architecture.md).
 *
 * Why. A small JSON request through the event loop costs about 25x nginx's CPU: two protocol
 * callbacks, two writes, the routing, the header rules and the access line, all in Python, per
 * request. Most requests on a kept-alive connection are the one before again: the same target
 * and the same routing headers (the key, the credential, the host), so the same pool, key and
 * worker. A *lane* is such a connection, handed over with everything routing decided: the thread
 * parses each next request, and when its routing inputs are byte for byte the first one's, it
 * rewrites the head as the event loop would, forwards it and its body, parses the answer, rewrites
 * its head, forwards its body and writes the access line - no Python at all. Anything else goes
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
 * - The end of an exchange: both messages done. Its access line and counts are queued (``take_log``,
 *   ``take_stats``). The lane goes back to IDLE, or is RETURNED: WORKER_DONE when the worker's
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
 * RESP_HEAD_LIMIT. Every buffer's
 * growth is checked before the sum and capped at BUF_MAX; the access lines waiting for the event
 * loop at LOG_MAX (more are dropped, the counts go on). What the thread cannot take is a failure
 * like any other (502 before the answer's head, a cut after), never a spin: a worker's
 * ``ffffffffffffffff`` once made it copy SIZE_MAX bytes, ``8000000000000000`` spin forever.
 *
 * Shutdown. ``close`` waits JOIN_DEADLINE_S for the thread to stop (it looks at ``stopping``
 * every 50 ms, and ``close`` takes no lock on the way). Past that it raises TimeoutError: the
 * thread, its lanes and their sockets are left as they are, never freed (it may still touch
 * them), for the process's exit to end. Test-only: ``_spin(on)`` makes every lane thread spin
 * without a lock until it is cleared (tests/test_hostile_worker.py); inert unless set.
 *
 * Locking. One mutex ``mu`` guards the slots, the event queue, the control list, the graveyard,
 * the log buffer and the counts. Everything else of an ACTIVE lane is the thread's alone; a
 * RETURNED lane's is the event loop's (``remove``). The thread never holds ``mu`` across I/O. The
 * event loop asks for a release or an abort by linking the lane into the control list (under
 * ``mu``) and waking the thread; the thread takes the list and the graveyard (lanes removed since)
 * in one lock round after each epoll_wait, serves the control list first and frees the graveyard
 * after it, so no pointer it holds is ever freed under it: a RETURNED lane has left the epoll set
 * (in the thread, before its event was queued), and ``remove`` only ever follows that event.
 *
 * Python objects are touched only by the calling thread, with the GIL; the thread never takes it.
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

#define READ_SIZE (64 * 1024)
#define RESP_HEAD_LIMIT (64 * 1024)
#define BUF_MAX ((size_t)64 << 20)        /* no buffer of a lane ever holds more */
#define LOG_MAX ((size_t)16 << 20)        /* access lines beyond this wait are dropped */
#define CHUNK_LINE_LIMIT 4096             /* a chunk-size line with its extension */
#define CHUNK_MAX ((unsigned long long)1 << 40) /* a larger chunk is refused */
#define JOIN_DEADLINE_S 5                 /* close() waits this long for the thread */
#define MAX_FIELDS 256
#define MAX_EVENTS 256
#define LOG_NOTIFY (256 * 1024)
#define MAX_BUCKETS 32

enum { L_ACTIVE = 0, L_RETURNED = 1 };
enum { P_IDLE = 0, P_EXCHANGE = 1 };
enum {
    R_NONE = 0,
    R_HANDBACK,
    R_RETRY,
    R_WORKER_DONE,
    R_RELEASED,
    R_IDLE,
    R_CLIENT_EOF,
    R_CLIENT_GONE,
    R_FAILED,
    R_CLOSED,
};
enum { RS_HEAD, RS_CL, RS_CHUNKED, RS_CLOSE, RS_DONE };
enum { LOG_OFF = 0, LOG_TEXT = 1, LOG_JSON = 2, LOG_FIELDS = 3 };
enum { CTL_RELEASE = 1, CTL_ABORT = 2 };

typedef struct {
    unsigned char *p;
    size_t off, len, cap;
} buf_t;

typedef struct {
    unsigned char *p;
    size_t n;
} str_t;

typedef struct lane lane_t;

typedef struct {
    lane_t *l;
    int which; /* 0: the client socket, 1: the worker socket */
} watch_t;

typedef struct {
    size_t name, name_len, value, value_len;
} field_t;

struct lane {
    uint64_t handle;
    int cfd, wfd;
    int state, reason;
    watch_t cw, ww;
    /* The spec (the event loop's, copied at add). */
    str_t sig, target, pre, post, resp_add, peer, key, pool, backend;
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
    int has_ua, ua_cut;
    unsigned long long exchanges;
    char why[96];
    /* Under mu. */
    char abort_why[96];
    int queued, ctl, in_ctl;
    lane_t *ev_next, *ctl_next, *next_dead;
};

typedef struct {
    char pool[64];
    int kind, status;
    unsigned long long n;
} count_t;

typedef struct {
    char pool[64];
    int kind;
    unsigned long long counts[MAX_BUCKETS], n;
    double sum;
} hist_t;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_t thread;
    int started, stopping, closed, stuck; /* stopping: atomic (stop() takes no lock) */
    int epfd, wakefd, notifyfd;
    pid_t pid;
    double buckets[MAX_BUCKETS];
    int nbuckets;
    /* Under mu. */
    int log_mode;
    char log_tag[64];
    lane_t **slots;
    uint32_t nslots, live;
    uint32_t *free_slots;
    uint32_t nfree, generation;
    lane_t *ev_head, *ev_tail, *ctl_head, *graveyard;
    int notified;
    buf_t log;
    count_t *counts;
    size_t ncounts, counts_cap;
    hist_t *hists;
    size_t nhists, hists_cap;
    unsigned long long bytes_in, bytes_out, exchanges;
} Lanes;

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

/* -- the queues (mu held) ------------------------------------------------------------------ */

static int
push_event(Lanes *r, lane_t *l)
{
    if (!l->queued) {
        l->queued = 1;
        l->ev_next = NULL;
        if (r->ev_tail != NULL) {
            r->ev_tail->ev_next = l;
        }
        else {
            r->ev_head = l;
        }
        r->ev_tail = l;
    }
    if (!r->notified) {
        r->notified = 1;
        return 1;
    }
    return 0;
}

static void
unqueue(Lanes *r, lane_t *l)
{
    if (!l->queued) {
        return;
    }
    lane_t *prev = NULL;
    for (lane_t *x = r->ev_head; x != NULL; prev = x, x = x->ev_next) {
        if (x == l) {
            if (prev != NULL) {
                prev->ev_next = l->ev_next;
            }
            else {
                r->ev_head = l->ev_next;
            }
            if (r->ev_tail == l) {
                r->ev_tail = prev;
            }
            break;
        }
    }
    l->queued = 0;
    l->ev_next = NULL;
}

static void
notify(Lanes *r)
{
    uint64_t one = 1;
    ssize_t w = write(r->notifyfd, &one, sizeof one);
    (void)w;
}

/* -- the access line and the counts -------------------------------------------------------- */

static void
json_str(buf_t *b, const unsigned char *p, size_t n)
{
    static const char hex[] = "0123456789abcdef";
    buf_add(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = p[i];
        if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            buf_add(b, e, 2);
        }
        else if (c >= 0x20 && c < 0x7f) {
            buf_add(b, &c, 1);
        }
        else if (c == '\n') {
            buf_add(b, "\\n", 2);
        }
        else if (c == '\r') {
            buf_add(b, "\\r", 2);
        }
        else if (c == '\t') {
            buf_add(b, "\\t", 2);
        }
        else if (c == '\b') {
            buf_add(b, "\\b", 2);
        }
        else if (c == '\f') {
            buf_add(b, "\\f", 2);
        }
        else {
            char e[6] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15]};
            buf_add(b, e, 6);
        }
    }
    buf_add(b, "\"", 1);
}

/* logs.py's _quote: as it is when every byte is of [A-Za-z0-9._:/@,+=[]-], else JSON. */
static void
text_value(buf_t *b, const unsigned char *p, size_t n)
{
    int plain = n > 0;
    for (size_t i = 0; i < n && plain; i++) {
        unsigned char c = p[i];
        plain = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                strchr("._:/@,+=[]-", c) != NULL;
    }
    if (plain) {
        buf_add(b, p, n);
    }
    else {
        json_str(b, p, n);
    }
}

/* repr(round(v, digits)) for the values an access line has (not huge, not negative). */
static void
py_float(buf_t *b, double v, int digits)
{
    char s[64];
    int n = snprintf(s, sizeof s, "%.*f", digits, v);
    if (n <= 0 || n >= (int)sizeof s) {
        return;
    }
    while (n > 2 && s[n - 1] == '0' && s[n - 2] != '.') {
        n--;
    }
    buf_add(b, s, (size_t)n);
}

static void
iso_now(char *out, size_t size)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    time_t t = ts.tv_sec;
    struct tm tm;
    localtime_r(&t, &tm);
    long off = tm.tm_gmtoff;
    char sign = off < 0 ? '-' : '+';
    if (off < 0) {
        off = -off;
    }
    char date[24];
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(out, size, "%s.%03ld%c%02ld:%02ld", date, ts.tv_nsec / 1000000, sign, off / 3600,
             (off % 3600) / 60);
}

/* The access line of an exchange that has ended (logs.py's http_access_text and the
 * JsonFormatter's object, or only the fields for the event loop to log). mu held. */
static void
log_line(Lanes *r, lane_t *l, double duration)
{
    int mode = r->log_mode;
    if (mode == LOG_OFF || buf_avail(&r->log) >= LOG_MAX) {
        return; /* off, or the event loop has not taken the lines for long: the counts go on */
    }
    buf_t *b = &r->log;
    const char *end = l->why[0] ? l->why : "done";
    const char *kind = l->kind_sse ? "sse" : "plain";
    double headers_ms = l->t_head > 0 ? (l->t_head - l->t0) * 1000.0 : 0.0;
    char num[64];
    if (mode == LOG_TEXT || mode == LOG_JSON) {
        buf_t msg = {0};
        text_value(&msg, l->peer.p, l->peer.n);
        buf_add(&msg, " ", 1);
        text_value(&msg, l->method, l->method_len);
        buf_add(&msg, " ", 1);
        text_value(&msg, l->path, l->path_len);
        snprintf(num, sizeof num, " status=%d session=", l->status);
        buf_addstr(&msg, num);
        text_value(&msg, l->key.p, l->key.n);
        buf_addstr(&msg, " pool=");
        text_value(&msg, l->pool.p, l->pool.n);
        buf_addstr(&msg, " backend=");
        text_value(&msg, l->backend.p, l->backend.n);
        buf_addstr(&msg, " kind=");
        buf_addstr(&msg, kind);
        buf_addstr(&msg, " connect=0.0ms headers=");
        py_float(&msg, headers_ms, 1);
        snprintf(num, sizeof num, "ms duration=%.3fs bytes_in=%lld bytes_out=%lld end=", duration,
                 l->bytes_in, l->bytes_out);
        buf_addstr(&msg, num);
        text_value(&msg, (const unsigned char *)end, strlen(end));
        buf_addstr(&msg, " ua=");
        if (l->has_ua) {
            text_value(&msg, l->ua, l->ua_len);
        }
        else {
            buf_add(&msg, "-", 1);
        }
        char ts[96];
        iso_now(ts, sizeof ts);
        if (mode == LOG_TEXT) {
            buf_addstr(b, ts);
            buf_addstr(b, " INFO wslb.access");
            buf_addstr(b, r->log_tag);
            buf_addstr(b, ": ");
            buf_add(b, msg.p, msg.len);
            buf_add(b, "\n", 1);
            buf_free(&msg);
            return;
        }
        buf_addstr(b, "{\"ts\":\"");
        buf_addstr(b, ts);
        buf_addstr(b, "\",\"level\":\"info\",\"logger\":\"wslb.access\",\"message\":");
        json_str(b, msg.p, msg.len);
        buf_free(&msg);
        if (r->log_tag[0]) {
            buf_addstr(b, ",\"process\":");
            json_str(b, (const unsigned char *)r->log_tag, strlen(r->log_tag));
        }
        buf_add(b, ",", 1);
    }
    else {
        buf_add(b, "{", 1);
    }
    buf_addstr(b, "\"client\":");
    json_str(b, l->peer.p, l->peer.n);
    buf_addstr(b, ",\"method\":");
    json_str(b, l->method, l->method_len);
    buf_addstr(b, ",\"path\":");
    json_str(b, l->path, l->path_len);
    snprintf(num, sizeof num, ",\"status\":%d,\"session\":", l->status);
    buf_addstr(b, num);
    json_str(b, l->key.p, l->key.n);
    buf_addstr(b, ",\"pool\":");
    json_str(b, l->pool.p, l->pool.n);
    buf_addstr(b, ",\"backend\":");
    json_str(b, l->backend.p, l->backend.n);
    buf_addstr(b, ",\"kind\":\"");
    buf_addstr(b, kind);
    buf_addstr(b, "\",\"connect_ms\":0.0,\"headers_ms\":");
    py_float(b, headers_ms, 1);
    buf_addstr(b, ",\"duration_s\":");
    py_float(b, duration, 3);
    snprintf(num, sizeof num, ",\"bytes_in\":%lld,\"bytes_out\":%lld,\"end\":", l->bytes_in,
             l->bytes_out);
    buf_addstr(b, num);
    json_str(b, (const unsigned char *)end, strlen(end));
    buf_addstr(b, ",\"user_agent\":");
    if (l->has_ua) {
        json_str(b, l->ua, l->ua_len);
    }
    else {
        buf_addstr(b, "null");
    }
    buf_addstr(b, "}\n");
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
count_exchange(Lanes *r, lane_t *l, double duration)
{
    char pool[64];
    pool_name(l, pool);
    r->exchanges++;
    r->bytes_in += (unsigned long long)l->bytes_in;
    r->bytes_out += (unsigned long long)l->bytes_out;
    count_t *c = NULL;
    for (size_t i = 0; i < r->ncounts; i++) {
        if (r->counts[i].kind == l->kind_sse && r->counts[i].status == l->status &&
            strcmp(r->counts[i].pool, pool) == 0) {
            c = &r->counts[i];
            break;
        }
    }
    if (c == NULL) {
        void *grown = grow(r->counts, &r->counts_cap, r->ncounts, sizeof *r->counts, 16);
        if (grown == NULL) {
            return;
        }
        r->counts = grown;
        c = &r->counts[r->ncounts++];
        memset(c, 0, sizeof *c);
        memcpy(c->pool, pool, sizeof pool);
        c->kind = l->kind_sse;
        c->status = l->status;
    }
    c->n++;
    hist_t *h = NULL;
    for (size_t i = 0; i < r->nhists; i++) {
        if (r->hists[i].kind == l->kind_sse && strcmp(r->hists[i].pool, pool) == 0) {
            h = &r->hists[i];
            break;
        }
    }
    if (h == NULL) {
        void *grown = grow(r->hists, &r->hists_cap, r->nhists, sizeof *r->hists, 8);
        if (grown == NULL) {
            return;
        }
        r->hists = grown;
        h = &r->hists[r->nhists++];
        memset(h, 0, sizeof *h);
        memcpy(h->pool, pool, sizeof pool);
        h->kind = l->kind_sse;
    }
    h->n++;
    h->sum += duration;
    for (int i = 0; i < r->nbuckets; i++) {
        if (duration <= r->buckets[i]) {
            h->counts[i]++;
        }
    }
}

/* -- a lane's I/O (the thread) ------------------------------------------------------------- */

static void
unwatch(Lanes *r, lane_t *l)
{
    epoll_ctl(r->epfd, EPOLL_CTL_DEL, l->cfd, NULL);
    epoll_ctl(r->epfd, EPOLL_CTL_DEL, l->wfd, NULL);
}

static void
give_back(Lanes *r, lane_t *l, int reason)
{
    if (l->state != L_ACTIVE) {
        return;
    }
    unwatch(r, l);
    l->state = L_RETURNED;
    l->reason = reason;
    pthread_mutex_lock(&r->mu);
    int wake = push_event(r, l);
    pthread_mutex_unlock(&r->mu);
    if (wake) {
        notify(r);
    }
}

static void
end_exchange(Lanes *r, lane_t *l)
{
    double now = mono();
    double duration = now - l->t0;
    l->exchanges++;
    pthread_mutex_lock(&r->mu);
    log_line(r, l, duration);
    count_exchange(r, l, duration);
    int wake = buf_avail(&r->log) >= LOG_NOTIFY && push_event(r, l) == 1;
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
fail(Lanes *r, lane_t *l, int status, const char *message, const char *why)
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
            ssize_t w = send(l->cfd, l->cout.p, l->cout.len, MSG_DONTWAIT | MSG_NOSIGNAL);
            (void)w; /* best effort: the connection closes next */
        }
    }
    else if (buf_avail(&l->cout) > 0) { /* a cut: what the client can take of it still goes */
        ssize_t w = send(l->cfd, l->cout.p + l->cout.off, buf_avail(&l->cout),
                         MSG_DONTWAIT | MSG_NOSIGNAL);
        (void)w;
    }
    if (l->phase == P_EXCHANGE) {
        end_exchange(r, l);
    }
    shutdown(l->cfd, SHUT_WR);
    give_back(r, l, R_FAILED);
}

static void
client_gone(Lanes *r, lane_t *l, const char *why)
{
    if (l->phase == P_EXCHANGE) {
        if (!l->answered) {
            l->status = 499;
        }
        snprintf(l->why, sizeof l->why, "%s", why);
        end_exchange(r, l);
    }
    give_back(r, l, R_CLIENT_GONE);
}

/* The worker failed (closed, broke, or sent what wslb refuses). */
static void
worker_failed(Lanes *r, lane_t *l, const char *why)
{
    if (l->phase != P_EXCHANGE) {
        give_back(r, l, R_WORKER_DONE);
        return;
    }
    if (!l->answered && l->rs == RS_HEAD && buf_avail(&l->win) == 0 && l->bodyless_idem) {
        /* Rule 3: a kept-alive connection that died before any answer; the request again. */
        l->cin.off = l->req_start;
        l->phase = P_IDLE;
        give_back(r, l, R_RETRY);
        return;
    }
    fail(r, l, 502, "the worker failed to answer", why);
}

/* The head of the next request, if whole: take it (EXCHANGE) or hand it back. */
static void
start_request(Lanes *r, lane_t *l)
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
            give_back(r, l, R_HANDBACK);
        }
        return;
    }
    l->req_start = l->cin.off;
    l->req_seen = 0;
    if (got < 0 || (long)head_len > l->max_head + 2048) {
        give_back(r, l, R_HANDBACK);
        return;
    }
    /* The request line as h11 reads it (llhttp takes more spaces): the method, one space, the
     * target, one space, HTTP/1.1, CRLF, the fields from there. */
    int nf = hd.nf;
    size_t method_len = hd.method_len, ts = hd.first, target_len = hd.first_len;
    size_t line_end = nf > 0 ? f[0].name : head_len - 2;
    if (method_len > sizeof l->method || ts != method_len + 1 || hd.major != 1 || hd.minor != 1 ||
        line_end != ts + target_len + 11) {
        give_back(r, l, R_HANDBACK);
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
                give_back(r, l, R_HANDBACK);
                return;
            }
        }
        else if (ieq(nm, nl, "transfer-encoding") || ieq(nm, nl, "upgrade") ||
                 ieq(nm, nl, "expect") || ieq(nm, nl, "sec-websocket-key") ||
                 ieq(nm, nl, "sec-websocket-version")) {
            /* The last two make it a (broken) WebSocket handshake: httpmsg.is_handshake. */
            give_back(r, l, R_HANDBACK);
            return;
        }
        else if (ieq(nm, nl, "connection")) {
            if (!ieq(v, vl, "keep-alive")) {
                give_back(r, l, R_HANDBACK);
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
        give_back(r, l, R_HANDBACK);
        return;
    }
    /* The signature: the target, then each routing header's values ("\0name\0v1\1v2"). */
    size_t sp = 0;
    const unsigned char *sig = l->sig.p;
    size_t sn = l->sig.n;
    if (target_len > sn || memcmp(sig, base + ts, target_len) != 0) {
        give_back(r, l, R_HANDBACK);
        return;
    }
    sp = target_len;
    for (int s = 0; s < l->n_sig; s++) {
        const str_t *name = &l->sig_names[s];
        if (sp + 2 + name->n > sn || sig[sp] != 0 || memcmp(sig + sp + 1, name->p, name->n) != 0 ||
            sig[sp + 1 + name->n] != 0) {
            give_back(r, l, R_HANDBACK);
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
                    give_back(r, l, R_HANDBACK);
                    return;
                }
                sp++;
            }
            first = 0;
            size_t vl = f[k].value_len;
            if (sp + vl > sn || memcmp(sig + sp, base + f[k].value, vl) != 0) {
                give_back(r, l, R_HANDBACK);
                return;
            }
            sp += vl;
        }
        if (sp < sn && sig[sp] != 0) { /* the lane's has more values of this header */
            give_back(r, l, R_HANDBACK);
            return;
        }
    }
    if (sp != sn) {
        give_back(r, l, R_HANDBACK);
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
        give_back(r, l, R_HANDBACK);
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
    static const char head[] = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n";
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
    static llhttp_settings_t none; /* the head is read without the body's callbacks */
    llhttp_settings_init(&none);
    llhttp_init(&chunked_answer, HTTP_RESPONSE, &none);
    llhttp_set_lenient_spaces_after_chunk_size(&chunked_answer, 1);
    if (llhttp_execute(&chunked_answer, head, sizeof head - 1) != HPE_OK) {
        return -1;
    }
    chunked_answer.settings = &reframe_settings;
    return 0;
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
reframe(Lanes *r, lane_t *l, const unsigned char *p, size_t n)
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
response_head(Lanes *r, lane_t *l)
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
response_bytes(Lanes *r, lane_t *l)
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
pump(Lanes *r, lane_t *l)
{
    while (l->state == L_ACTIVE) {
        int progress = 0;
        /* Writes first: what waits for a socket goes before anything else is read. */
        if (buf_avail(&l->cout) > 0 && l->c_wr) {
            size_t before = buf_avail(&l->cout);
            if (flush(l->cfd, &l->cout, &l->c_wr) < 0) {
                client_gone(r, l, "client went away");
                return;
            }
            progress |= buf_avail(&l->cout) != before;
            l->c_sent += before - buf_avail(&l->cout);
            l->last = mono();
        }
        if (buf_avail(&l->wout) > 0 && l->w_wr) {
            size_t before = buf_avail(&l->wout);
            if (flush(l->wfd, &l->wout, &l->w_wr) < 0) {
                worker_failed(r, l, "the worker closed the connection");
                return;
            }
            progress |= buf_avail(&l->wout) != before;
        }
        if (l->phase == P_IDLE) {
            if (l->release_asked) {
                give_back(r, l, R_RELEASED);
                return;
            }
            if (l->w_rd) { /* a worker has nothing to say between requests: a byte or its EOF */
                unsigned char probe;
                ssize_t n = recv(l->wfd, &probe, 1, MSG_DONTWAIT | MSG_PEEK);
                if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
                    l->w_rd = 0;
                }
                else {
                    l->worker_keep = 0;
                    give_back(r, l, R_WORKER_DONE);
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
                ssize_t n = fill(l->cfd, &l->cin, &l->c_rd, l->c_hup);
                if (n == 0 || n == -2) {
                    l->c_eof = 1;
                    give_back(r, l, buf_avail(&l->cin) ? R_HANDBACK : R_CLIENT_EOF);
                    return;
                }
                if (n == -3) {
                    give_back(r, l, R_HANDBACK);
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
                    ssize_t n = fill(l->cfd, &l->cin, &l->c_rd, l->c_hup);
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
                ssize_t n = fill(l->wfd, &l->win, &l->w_rd, l->w_hup);
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
                    give_back(r, l, R_WORKER_DONE);
                    return;
                }
                progress = 1;
            }
            else if (l->rs == RS_DONE && l->req_left > 0 && buf_avail(&l->cout) == 0) {
                snprintf(l->why, sizeof l->why, "answered before the request body ended");
                end_exchange(r, l);
                shutdown(l->cfd, SHUT_WR);
                give_back(r, l, R_FAILED);
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
check_clocks(Lanes *r, double now)
{
    pthread_mutex_lock(&r->mu);
    uint32_t n = r->nslots;
    lane_t **copy = n ? malloc(n * sizeof *copy) : NULL;
    uint32_t m = 0;
    if (copy != NULL) {
        for (uint32_t i = 0; i < n; i++) {
            lane_t *l = r->slots[i];
            if (l != NULL && l->state == L_ACTIVE) {
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
                give_back(r, l, R_IDLE);
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
                    &l->peer, &l->key, &l->pool, &l->backend};
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
    if (l->cfd >= 0) {
        close(l->cfd);
    }
    if (l->wfd >= 0) {
        close(l->wfd);
    }
    free(l);
}

/* Test-only (``_spin``, tests/test_hostile_worker.py): while set, the thread spins without a
 * lock, as one that met what it could not handle once did; inert unless a test sets it. */
static int test_spin;

static void *
run(void *arg)
{
    Lanes *r = (Lanes *)arg;
    struct epoll_event evs[MAX_EVENTS];
    double last_check = mono();
    for (;;) {
        int n = epoll_wait(r->epfd, evs, MAX_EVENTS, 50);
        while (__atomic_load_n(&test_spin, __ATOMIC_RELAXED)) {
        }
        if (__atomic_load_n(&r->stopping, __ATOMIC_ACQUIRE)) {
            break;
        }
        pthread_mutex_lock(&r->mu);
        lane_t *ctl = r->ctl_head;
        r->ctl_head = NULL;
        lane_t *dead = r->graveyard;
        r->graveyard = NULL;
        for (lane_t *x = ctl; x != NULL; x = x->ctl_next) {
            x->in_ctl = 0;
        }
        pthread_mutex_unlock(&r->mu);
        for (int i = 0; i < n; i++) {
            watch_t *w = (watch_t *)evs[i].data.ptr;
            if (w == NULL) {
                uint64_t v;
                ssize_t got = read(r->wakefd, &v, sizeof v);
                (void)got;
                continue;
            }
            lane_t *l = w->l;
            if (l->state != L_ACTIVE) {
                continue;
            }
            uint32_t e = evs[i].events;
            if (e & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
                int hup = (e & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) != 0;
                if (w->which) {
                    l->w_rd = 1;
                    l->w_hup |= hup;
                }
                else {
                    l->c_rd = 1;
                    l->c_hup |= hup;
                }
            }
            if (e & (EPOLLOUT | EPOLLHUP | EPOLLERR)) {
                if (w->which) {
                    l->w_wr = 1;
                }
                else {
                    l->c_wr = 1;
                }
            }
        }
        /* The event loop's requests (a lane may have returned since: then nothing). */
        for (lane_t *x = ctl; x != NULL;) {
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
                        give_back(r, x, R_RELEASED);
                    }
                }
                else if (what & CTL_RELEASE) {
                    x->release_asked = 1;
                    if (x->phase == P_IDLE) {
                        give_back(r, x, R_RELEASED);
                    }
                }
            }
            x = next;
        }
        for (int i = 0; i < n; i++) {
            watch_t *w = (watch_t *)evs[i].data.ptr;
            if (w != NULL && w->l->state == L_ACTIVE) {
                pump(r, w->l);
            }
        }
        while (dead != NULL) {
            lane_t *l = dead;
            dead = l->next_dead;
            free_lane(l);
        }
        double now = mono();
        if (now - last_check >= 0.05) {
            last_check = now;
            check_clocks(r, now);
        }
    }
    return NULL;
}

/* -- the Python type ----------------------------------------------------------------------- */

static lane_t *
lookup(Lanes *r, uint64_t handle)
{
    uint32_t slot = (uint32_t)(handle & 0xffffffffu);
    if (slot >= r->nslots) {
        return NULL;
    }
    lane_t *l = r->slots[slot];
    return (l != NULL && l->handle == handle) ? l : NULL;
}

static int
ensure_open(Lanes *r)
{
    if (r->closed) {
        PyErr_SetString(PyExc_RuntimeError, "the lanes are closed");
        return -1;
    }
    if (r->pid != getpid()) {
        PyErr_SetString(PyExc_RuntimeError, "the lanes belong to another process");
        return -1;
    }
    return 0;
}

/* Stop the thread: 0 once it has exited, -1 when it has not within JOIN_DEADLINE_S (stuck: it
 * keeps everything it may touch, which is then never freed; the process's exit ends it). No
 * lock is taken on the way, so a thread stuck holding ``mu`` cannot hold up a shutdown. */
static int
Lanes_stop(Lanes *r)
{
    if (r->stuck) {
        return -1;
    }
    if (!r->started) {
        return 0;
    }
    __atomic_store_n(&r->stopping, 1, __ATOMIC_RELEASE);
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
    if (rc != 0) {
        r->stuck = 1;
        return -1;
    }
    r->started = 0;
    return 0;
}

static PyObject *
Lanes_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *buckets;
    (void)kwds;
    if (!PyArg_ParseTuple(args, "O:Lanes", &buckets)) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(buckets, "buckets must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t nb = PySequence_Fast_GET_SIZE(seq);
    if (nb > MAX_BUCKETS) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "too many buckets");
        return NULL;
    }
    Lanes *r = (Lanes *)type->tp_alloc(type, 0);
    if (r == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nb; i++) {
        r->buckets[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
    }
    Py_DECREF(seq);
    if (PyErr_Occurred()) {
        Py_DECREF(r);
        return NULL;
    }
    r->nbuckets = (int)nb;
    r->epfd = r->wakefd = r->notifyfd = -1;
    pthread_mutex_init(&r->mu, NULL);
    r->pid = getpid();
    r->log_mode = LOG_OFF;
    r->epfd = epoll_create1(EPOLL_CLOEXEC);
    r->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    r->notifyfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (r->epfd < 0 || r->wakefd < 0 || r->notifyfd < 0) {
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
Lanes_dealloc(Lanes *r)
{
    if (Lanes_stop(r) < 0) {
        return; /* a thread that did not stop may still use all of it: leaked on purpose */
    }
    for (uint32_t i = 0; i < r->nslots; i++) {
        if (r->slots[i] != NULL) {
            free_lane(r->slots[i]);
        }
    }
    while (r->graveyard != NULL) {
        lane_t *l = r->graveyard;
        r->graveyard = l->next_dead;
        free_lane(l);
    }
    free(r->slots);
    free(r->free_slots);
    buf_free(&r->log);
    free(r->counts);
    free(r->hists);
    if (r->epfd >= 0) {
        close(r->epfd);
    }
    if (r->wakefd >= 0) {
        close(r->wakefd);
    }
    if (r->notifyfd >= 0) {
        close(r->notifyfd);
    }
    pthread_mutex_destroy(&r->mu);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

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
Lanes_add(Lanes *r, PyObject *args)
{
    int cfd, wfd;
    Py_buffer carry;
    PyObject *sig, *sig_names, *target, *pre, *post, *drop, *resp_drop, *resp_add, *peer, *key,
        *pool, *backend;
    long max_head, max_headers;
    long long max_body;
    double t_request, t_server, t_idle, t_stall;
    if (!PyArg_ParseTuple(args, "iiy*(SOSSSOOSllLddddSSSS):add", &cfd, &wfd, &carry, &sig,
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
    l->cfd = l->wfd = -1;
    int bad = copy_bytes(sig, &l->sig) || copy_names(sig_names, &l->sig_names, &l->n_sig) ||
              copy_bytes(target, &l->target) || copy_bytes(pre, &l->pre) ||
              copy_bytes(post, &l->post) || copy_names(drop, &l->drop, &l->n_drop) ||
              copy_names(resp_drop, &l->resp_drop, &l->n_resp_drop) ||
              copy_bytes(resp_add, &l->resp_add) || copy_bytes(peer, &l->peer) ||
              copy_bytes(key, &l->key) || copy_bytes(pool, &l->pool) ||
              copy_bytes(backend, &l->backend);
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
    l->cfd = fcntl(cfd, F_DUPFD_CLOEXEC, 0);
    l->wfd = fcntl(wfd, F_DUPFD_CLOEXEC, 0);
    if (l->cfd < 0 || l->wfd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        free_lane(l);
        return NULL;
    }
    l->cw.l = l->ww.l = l;
    l->cw.which = 0;
    l->ww.which = 1;
    l->phase = P_IDLE;
    l->worker_keep = 1; /* the event loop hands over only a worker connection that may go on */
    l->idle_since = mono();
    l->c_rd = 1; /* try a read at once: bytes may have come before the watch */
    l->c_wr = l->w_wr = 1;
    pthread_mutex_lock(&r->mu);
    if (r->nfree == 0) {
        if (r->nslots >= (1u << 30)) { /* the doubling below would wrap */
            pthread_mutex_unlock(&r->mu);
            free_lane(l);
            return PyErr_NoMemory();
        }
        uint32_t cap = r->nslots ? r->nslots * 2 : 64;
        lane_t **slots = realloc(r->slots, cap * sizeof *slots);
        uint32_t *fr = slots ? realloc(r->free_slots, cap * sizeof *fr) : NULL;
        if (slots != NULL) {
            r->slots = slots;
        }
        if (fr == NULL) {
            pthread_mutex_unlock(&r->mu);
            free_lane(l);
            return PyErr_NoMemory();
        }
        r->free_slots = fr;
        for (uint32_t i = r->nslots; i < cap; i++) {
            r->slots[i] = NULL;
            r->free_slots[r->nfree++] = cap - 1 - (i - r->nslots);
        }
        r->nslots = cap;
    }
    uint32_t slot = r->free_slots[--r->nfree];
    r->generation++;
    l->handle = ((uint64_t)r->generation << 32) | slot;
    l->state = L_ACTIVE;
    r->slots[slot] = l;
    r->live++;
    struct epoll_event ev;
    memset(&ev, 0, sizeof ev);
    ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
    ev.data.ptr = &l->cw;
    int rc = epoll_ctl(r->epfd, EPOLL_CTL_ADD, l->cfd, &ev);
    if (rc == 0) {
        ev.data.ptr = &l->ww;
        rc = epoll_ctl(r->epfd, EPOLL_CTL_ADD, l->wfd, &ev);
        if (rc < 0) {
            epoll_ctl(r->epfd, EPOLL_CTL_DEL, l->cfd, NULL);
        }
    }
    if (rc < 0) {
        int e = errno;
        r->slots[slot] = NULL;
        r->free_slots[r->nfree++] = slot;
        r->live--;
        pthread_mutex_unlock(&r->mu);
        free_lane(l);
        errno = e;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    /* The first pump: the thread sees the edge of what came before the watch as its EPOLLOUT. */
    int start = !r->started;
    pthread_mutex_unlock(&r->mu);
    if (start) {
        if (pthread_create(&r->thread, NULL, run, r) != 0) {
            PyErr_SetString(PyExc_OSError, "cannot start the lane thread");
            return NULL;
        }
        r->started = 1;
    }
    return PyLong_FromUnsignedLongLong(l->handle);
}

static PyObject *
Lanes_control(Lanes *r, PyObject *args, int what)
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
    lane_t *l = lookup(r, handle);
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
Lanes_release(Lanes *r, PyObject *args)
{
    return Lanes_control(r, args, CTL_RELEASE);
}

static PyObject *
Lanes_abort(Lanes *r, PyObject *args)
{
    return Lanes_control(r, args, CTL_ABORT);
}

/* remove(handle) -> (carry, reason, worker_ok, exchanges, idle_for): a RETURNED lane's. */
static PyObject *
Lanes_remove(Lanes *r, PyObject *args)
{
    unsigned long long handle;
    if (!PyArg_ParseTuple(args, "K:remove", &handle)) {
        return NULL;
    }
    pthread_mutex_lock(&r->mu);
    lane_t *l = lookup(r, handle);
    if (l == NULL || l->state != L_RETURNED) {
        pthread_mutex_unlock(&r->mu);
        PyErr_SetString(PyExc_KeyError, l == NULL ? "no such lane" : "the lane is not returned");
        return NULL;
    }
    unqueue(r, l);
    uint32_t slot = (uint32_t)(handle & 0xffffffffu);
    r->slots[slot] = NULL;
    r->free_slots[r->nfree++] = slot;
    r->live--;
    pthread_mutex_unlock(&r->mu);
    /* The worker's connection goes on only from IDLE with nothing of it pending. */
    int worker_ok = l->phase == P_IDLE && l->worker_keep && buf_avail(&l->wout) == 0 &&
                    (l->reason == R_RELEASED || l->reason == R_IDLE || l->reason == R_CLIENT_EOF ||
                     l->reason == R_HANDBACK || l->reason == R_CLOSED);
    double idle_for = l->phase == P_IDLE ? mono() - l->idle_since : 0.0;
    PyObject *out = Py_BuildValue("(y#iiiKd)", l->cin.p ? (char *)l->cin.p + l->cin.off : "",
                                  (Py_ssize_t)buf_avail(&l->cin), l->reason, worker_ok, l->c_eof,
                                  l->exchanges, idle_for);
    pthread_mutex_lock(&r->mu);
    if (r->started && !r->closed) {
        l->next_dead = r->graveyard;
        r->graveyard = l;
        l = NULL;
    }
    pthread_mutex_unlock(&r->mu);
    if (l != NULL) {
        free_lane(l);
    }
    return out;
}

static PyObject *
Lanes_events(Lanes *r, PyObject *Py_UNUSED(ignored))
{
    uint64_t v;
    ssize_t got = read(r->notifyfd, &v, sizeof v);
    (void)got;
    pthread_mutex_lock(&r->mu);
    r->notified = 0;
    size_t n = 0;
    for (lane_t *l = r->ev_head; l != NULL; l = l->ev_next) {
        n++;
    }
    uint64_t *hs = n ? malloc(n * sizeof *hs) : NULL;
    if (n && hs == NULL) {
        pthread_mutex_unlock(&r->mu);
        return PyErr_NoMemory();
    }
    size_t k = 0;
    for (lane_t *l = r->ev_head; l != NULL;) {
        lane_t *next = l->ev_next;
        if (l->state == L_RETURNED) {
            hs[k++] = l->handle;
        }
        l->queued = 0;
        l->ev_next = NULL;
        l = next;
    }
    r->ev_head = r->ev_tail = NULL;
    pthread_mutex_unlock(&r->mu);
    PyObject *list = PyList_New((Py_ssize_t)k);
    for (size_t i = 0; list != NULL && i < k; i++) {
        PyObject *h = PyLong_FromUnsignedLongLong(hs[i]);
        if (h == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, h);
    }
    free(hs);
    return list;
}

static PyObject *
Lanes_take_log(Lanes *r, PyObject *Py_UNUSED(ignored))
{
    pthread_mutex_lock(&r->mu);
    buf_t b = r->log;
    memset(&r->log, 0, sizeof r->log);
    pthread_mutex_unlock(&r->mu);
    PyObject *out = PyBytes_FromStringAndSize(b.p ? (char *)b.p + b.off : "",
                                              (Py_ssize_t)buf_avail(&b));
    buf_free(&b);
    return out;
}

/* take_stats() -> (counts [(pool, sse, status, n)], hists [(pool, sse, (bucket counts), n, sum)],
 * bytes_in, bytes_out, exchanges): what was counted since the last call. */
static PyObject *
Lanes_take_stats(Lanes *r, PyObject *Py_UNUSED(ignored))
{
    pthread_mutex_lock(&r->mu);
    count_t *counts = r->counts;
    size_t nc = r->ncounts;
    hist_t *hists = r->hists;
    size_t nh = r->nhists;
    unsigned long long bin = r->bytes_in, bout = r->bytes_out, ex = r->exchanges;
    r->counts = NULL;
    r->ncounts = r->counts_cap = 0;
    r->hists = NULL;
    r->nhists = r->hists_cap = 0;
    r->bytes_in = r->bytes_out = r->exchanges = 0;
    pthread_mutex_unlock(&r->mu);
    PyObject *cl = PyList_New(0), *hl = PyList_New(0), *out = NULL;
    if (cl == NULL || hl == NULL) {
        goto done;
    }
    for (size_t i = 0; i < nc; i++) {
        PyObject *t = Py_BuildValue("(siiK)", counts[i].pool, counts[i].kind, counts[i].status,
                                    counts[i].n);
        if (t == NULL || PyList_Append(cl, t) < 0) {
            Py_XDECREF(t);
            goto done;
        }
        Py_DECREF(t);
    }
    for (size_t i = 0; i < nh; i++) {
        PyObject *b = PyTuple_New(r->nbuckets);
        if (b == NULL) {
            goto done;
        }
        for (int k = 0; k < r->nbuckets; k++) {
            PyTuple_SET_ITEM(b, k, PyLong_FromUnsignedLongLong(hists[i].counts[k]));
        }
        PyObject *t =
            Py_BuildValue("(siNKd)", hists[i].pool, hists[i].kind, b, hists[i].n, hists[i].sum);
        if (t == NULL || PyList_Append(hl, t) < 0) {
            Py_XDECREF(t);
            goto done;
        }
        Py_DECREF(t);
    }
    out = Py_BuildValue("(OOKKK)", cl, hl, bin, bout, ex);
done:
    Py_XDECREF(cl);
    Py_XDECREF(hl);
    free(counts);
    free(hists);
    return out;
}

static PyObject *
Lanes_set_log(Lanes *r, PyObject *args)
{
    int mode;
    const char *tag;
    if (!PyArg_ParseTuple(args, "is:set_log", &mode, &tag)) {
        return NULL;
    }
    pthread_mutex_lock(&r->mu);
    r->log_mode = mode;
    snprintf(r->log_tag, sizeof r->log_tag, "%s", tag);
    pthread_mutex_unlock(&r->mu);
    Py_RETURN_NONE;
}

static PyObject *
Lanes_live(Lanes *r, PyObject *Py_UNUSED(ignored))
{
    pthread_mutex_lock(&r->mu);
    uint32_t n = r->live;
    pthread_mutex_unlock(&r->mu);
    return PyLong_FromUnsignedLong(n);
}

static PyObject *
Lanes_fileno(Lanes *r, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLong(r->notifyfd);
}

/* close() -> handles of the lanes still ACTIVE, now RETURNED with CLOSED (remove each). */
static PyObject *
Lanes_close(Lanes *r, PyObject *Py_UNUSED(ignored))
{
    if (r->closed) {
        return PyList_New(0);
    }
    if (Lanes_stop(r) < 0) {
        r->closed = 1;
        PyErr_Format(PyExc_TimeoutError,
                     "the lane thread did not stop within %d s; its connections are left to the "
                     "process's exit",
                     JOIN_DEADLINE_S);
        return NULL;
    }
    r->closed = 1;
    while (r->graveyard != NULL) {
        lane_t *l = r->graveyard;
        r->graveyard = l->next_dead;
        free_lane(l);
    }
    PyObject *list = PyList_New(0);
    for (uint32_t i = 0; list != NULL && i < r->nslots; i++) {
        lane_t *l = r->slots[i];
        if (l == NULL) {
            continue;
        }
        if (l->state == L_ACTIVE) {
            unwatch(r, l);
            l->state = L_RETURNED;
            l->reason = R_CLOSED;
        }
        PyObject *h = PyLong_FromUnsignedLongLong(l->handle);
        if (h == NULL || PyList_Append(list, h) < 0) {
            Py_XDECREF(h);
            Py_CLEAR(list);
            break;
        }
        Py_DECREF(h);
    }
    return list;
}

static PyMethodDef Lanes_methods[] = {
    {"add", (PyCFunction)Lanes_add, METH_VARARGS, "Hand a kept-alive connection to the thread."},
    {"release", (PyCFunction)Lanes_release, METH_VARARGS, "Return the lane at its next boundary."},
    {"abort", (PyCFunction)Lanes_abort, METH_VARARGS, "End the lane's exchange now (503 or a cut)."},
    {"remove", (PyCFunction)Lanes_remove, METH_VARARGS, "Take a returned lane's leftovers."},
    {"events", (PyCFunction)Lanes_events, METH_NOARGS, "Handles of the lanes returned since."},
    {"take_log", (PyCFunction)Lanes_take_log, METH_NOARGS, "Access lines since the last call."},
    {"take_stats", (PyCFunction)Lanes_take_stats, METH_NOARGS, "Counts since the last call."},
    {"set_log", (PyCFunction)Lanes_set_log, METH_VARARGS, "The access log's form and tag."},
    {"live", (PyCFunction)Lanes_live, METH_NOARGS, "Lanes not removed yet."},
    {"fileno", (PyCFunction)Lanes_fileno, METH_NOARGS, "The eventfd that says events wait."},
    {"close", (PyCFunction)Lanes_close, METH_NOARGS, "Stop the thread; the lanes left."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LanesType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "balancer._lanes.Lanes",
    .tp_basicsize = sizeof(Lanes),
    .tp_dealloc = (destructor)Lanes_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The lane thread (see balancer/_lanes.c).",
    .tp_methods = Lanes_methods,
    .tp_new = Lanes_new,
};

static PyObject *
lanes_spin(PyObject *module, PyObject *arg)
{
    (void)module;
    int on = PyObject_IsTrue(arg);
    if (on < 0) {
        return NULL;
    }
    __atomic_store_n(&test_spin, on, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

static PyMethodDef lanes_functions[] = {
    {"_spin", lanes_spin, METH_O,
     "_spin(on): test-only, every lane thread spins (without a lock) until it is cleared."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef lanes_module = {
    PyModuleDef_HEAD_INIT, "_lanes", "The lane thread (see balancer/_lanes.c).", -1, lanes_functions, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__lanes(void)
{
    init_heads();
    if (init_reframe() < 0) {
        PyErr_SetString(PyExc_ImportError, "llhttp did not read a chunked answer's head");
        return NULL;
    }
    if (PyType_Ready(&LanesType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&lanes_module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&LanesType);
    if (PyModule_AddObject(m, "Lanes", (PyObject *)&LanesType) < 0) {
        Py_DECREF(&LanesType);
        Py_DECREF(m);
        return NULL;
    }
    const struct {
        const char *name;
        int value;
    } consts[] = {
        {"HANDBACK", R_HANDBACK},       {"RETRY", R_RETRY},       {"WORKER_DONE", R_WORKER_DONE},
        {"RELEASED", R_RELEASED},       {"IDLE", R_IDLE},         {"CLIENT_EOF", R_CLIENT_EOF},
        {"CLIENT_GONE", R_CLIENT_GONE}, {"FAILED", R_FAILED},     {"CLOSED", R_CLOSED},
        {"LOG_OFF", LOG_OFF},           {"LOG_TEXT", LOG_TEXT},   {"LOG_JSON", LOG_JSON},
        {"LOG_FIELDS", LOG_FIELDS},
    };
    for (size_t i = 0; i < sizeof consts / sizeof consts[0]; i++) {
        if (PyModule_AddIntConstant(m, consts[i].name, consts[i].value) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
