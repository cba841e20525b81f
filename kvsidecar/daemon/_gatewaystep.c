/*
 * _gatewaystep.c - a gateway rank's answer for a new step, built in compiled code.
 *
 * At 50 steps/s nearly every poll of a rank finds a new step. The Python full check
 * (gateway.Gateway._answer: the target's poll with every check, then the body) costs
 * ~26 us warm but 155-235 us on the listener thread, which runs it cold between the
 * polls its compiled path serves (docs/gateway.md, "The cost of a poll"). Most of a new
 * step is what the last full check already decided: the same segment, header, identity,
 * strings, record shapes and body text; only counters moved. A `Step` holds what that
 * check decided (its header and payload bytes, the body's text around its numbers) and
 * decides a new step against it:
 *
 *   1. every `every` seconds, the probes of the full check, on the descriptor: the
 *      mapped file still has a name and is not shorter than the mapping (one fstat: a
 *      segment unlinked, or replaced by a rename over its name, has no link left), the
 *      writer holds its OFD lock (fcntl F_OFD_GETLK). The full check looks the path up
 *      (lstat: its inode); a path walk cost the listener 10 us a probe, cold, so the one
 *      case only it sees (the name given to another file while this one keeps a second
 *      link elsewhere) is left to the poller's own probe: its re-attach, within a poll
 *      cycle, gives the reader another map. The reader must still hold this map and
 *      descriptor (checked under the GIL, which the poller's re-attach needs);
 *   2. one seqlock read on the first attempt: the latch's own guarded read (a SIGBUS is a
 *      status) through its C API (kvsidecar/protocol/_seqlock_api.h) into the Step's
 *      buffers, where `read` is `_seqlock.read_latest` (`c_read`; a test's stand-in is
 *      called through Python);
 *   3. the 256-byte header equal to the checked one outside the bytes that move at each
 *      publish (`free`: the published sequence, the heartbeat): the state byte still
 *      READY, the same incarnation, writer, geometry and error counts;
 *   4. the payload walked beside the checked one, MessagePack element by element:
 *      [runtime, pools, ...] with the same shape, each field's bytes equal, or both
 *      unsigned integers below 2^53 in a field the owner named volatile (counts and
 *      counters: never an identity, string, bool, stamp, block size or capacity), and
 *      nothing after the top array. A new value there is in the range budget.py accepts
 *      ([0, 2^63), finite), and the typed decode reads the same shape as before;
 *   5. progress as the full check counts it (Target._still_for): the sequence or the
 *      heartbeat moved, on the daemon's clock; none for longer than `stale_after` (the
 *      gateway's bound) declines, and an answer is current until the earlier of `every`
 *      from now and that bound. So a quiet engine's heartbeat keeps its answer current
 *      (the listener asks again once the window ends), and a hung one reads 503 as before;
 *   6. the body, into the Step's own buffer: the kept text with the three numbers
 *      formatted as `gateway_body` formats them (repr of a float: a count below 2^53 is
 *      its digits and ".0"; the usage computed as the engine does, in [0, 1], SGLang's
 *      rounded as Python's round rounds it), Content-Length and the step header.
 *
 * Anything else (a probe that fails, a retry, a header or a field that moved where it
 * should not, a value out of that range) is declined (None from Python, 0 from C): the
 * listener hands the poll to the Python path, whose full check decides it and words any
 * error, as before. The listener calls it through `_c_advance` (_pollfast_api.h).
 * tests/daemon/test_gateway_step.py checks the bytes equal to the Python path's on random
 * steps, and each refusal.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../protocol/_seqlock_api.h"
#include "../web/_pollfast_api.h"

#define HEADER_LEN 256
#define OFF_SLOT_CAPACITY 200 /* layout.OFF_SLOT_CAPACITY (tested beside _seqlock's) */
#define SLOT_HEADER_LEN 16
#define MAX_SLOT (64u << 20) /* a larger slot capacity is read through Python */
#define MAX_DEPTH 8      /* a snapshot nests 3 deep; deeper is not ours: refused */
#define EXACT (1ULL << 53) /* integers a double holds exactly */

enum { USAGE_NONE = -1, USAGE_FREE = 0, USAGE_USED = 1, USAGE_FULLEST = 2 };
enum { NUM_WAITING = 0, NUM_RUNNING = 1, NUM_USAGE = 2 };

typedef struct {
    PyObject_HEAD
    PyObject *read;     /* _seqlock.read_latest */
    PyObject *reader;   /* the SegmentReader: must still hold `mm` and `fd` */
    PyObject *mm;
    PyObject *header;   /* bytes[256]: the checked header */
    PyObject *free;     /* bytes[256]: nonzero where a byte may differ */
    PyObject *payload;  /* bytes: the checked payload */
    PyObject *sized;    /* bytes: per pool, 1 if its blocks count in the usage */
    PyObject *parts;    /* tuple of bytes | int (NUM_*): the body */
    PyObject *start;    /* bytes: the status line, headers, "Content-Length: " */
    PyObject *step_head; /* bytes: "Kvsidecar-Step: " */
    PyObject *read_args[3]; /* (mm, retries, -1): read_latest's, built once */
    unsigned long long rt_volatile, pool_volatile; /* field bitmasks */
    int f_step, f_running, f_waiting;            /* runtime field indices */
    int f_total, f_allocated, f_available;       /* pool field indices */
    int usage;       /* USAGE_* */
    int usage_digits;
    int retries;
    int fd;
    unsigned long long inode;
    long long size;
    double every;    /* seconds between probes, and the most an answer stays current */
    double stale_after; /* seconds without progress after which the full check says 503 */
    double probed;   /* CLOCK_MONOTONIC seconds: probes needed again from then */
    double progress; /* CLOCK_MONOTONIC seconds of the last progress seen */
    uint64_t seq;    /* the last sequence seen, and the heartbeat: progress when they move */
    uint64_t beat;
    int beat_off;    /* the heartbeat's offset in the header */
    unsigned long long built; /* answers built here */
    /* The read in C (`read` is _seqlock.read_latest: through its C API, into these):
     * the header, the payload (the slot's capacity + its header), the response. */
    int c_read;
    uint8_t hdr[HEADER_LEN];
    uint8_t *pay;
    size_t pay_cap;
    char *out;
    size_t out_cap;
    Py_ssize_t out_len;
} Step;

static const KvsSeqlockAPI *seqlock; /* the C API of kvsidecar.protocol._seqlock */
static PyObject *read_latest_py;     /* _seqlock.read_latest: `read` that means "in C" */

/* ------------------------------ MessagePack ------------------------------ */

/* The byte after the element at p (NULL: malformed or past end). */
static const uint8_t *mp_skip(const uint8_t *p, const uint8_t *end, int depth);

static const uint8_t *mp_skip_n(const uint8_t *p, const uint8_t *end, uint64_t n, int depth) {
    while (n-- > 0 && p != NULL) p = mp_skip(p, end, depth);
    return p;
}

static uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* Length of a header of `n` bytes after the type byte, then the element's extent. */
static const uint8_t *mp_sized(const uint8_t *p, const uint8_t *end, int n, uint64_t extra) {
    if (end - p < 1 + n) return NULL;
    uint64_t len = be(p + 1, n) + extra;
    if ((uint64_t)(end - p - 1 - n) < len) return NULL;
    return p + 1 + n + len;
}

static const uint8_t *mp_skip(const uint8_t *p, const uint8_t *end, int depth) {
    if (p >= end || depth > MAX_DEPTH) return NULL;
    uint8_t t = *p;
    if (t <= 0x7f || t >= 0xe0 || t == 0xc0 || t == 0xc2 || t == 0xc3) return p + 1;
    if (t >= 0xa0 && t <= 0xbf) return (uint64_t)(end - p - 1) < (uint64_t)(t & 0x1f) ? NULL : p + 1 + (t & 0x1f);
    if (t >= 0x90 && t <= 0x9f) return mp_skip_n(p + 1, end, t & 0x0f, depth + 1);
    if (t >= 0x80 && t <= 0x8f) return mp_skip_n(p + 1, end, 2ULL * (t & 0x0f), depth + 1);
    switch (t) {
    case 0xcc: case 0xd0: return end - p < 2 ? NULL : p + 2;
    case 0xcd: case 0xd1: return end - p < 3 ? NULL : p + 3;
    case 0xca: case 0xce: case 0xd2: return end - p < 5 ? NULL : p + 5;
    case 0xcb: case 0xcf: case 0xd3: return end - p < 9 ? NULL : p + 9;
    case 0xd4: return end - p < 3 ? NULL : p + 3;
    case 0xd5: return end - p < 4 ? NULL : p + 4;
    case 0xd6: return end - p < 6 ? NULL : p + 6;
    case 0xd7: return end - p < 10 ? NULL : p + 10;
    case 0xd8: return end - p < 18 ? NULL : p + 18;
    case 0xc4: case 0xd9: return mp_sized(p, end, 1, 0);
    case 0xc5: case 0xda: return mp_sized(p, end, 2, 0);
    case 0xc6: case 0xdb: return mp_sized(p, end, 4, 0);
    case 0xc7: return mp_sized(p, end, 1, 1);
    case 0xc8: return mp_sized(p, end, 2, 1);
    case 0xc9: return mp_sized(p, end, 4, 1);
    case 0xdc: case 0xde:
        if (end - p < 3) return NULL;
        return mp_skip_n(p + 3, end, be(p + 1, 2) * (t == 0xde ? 2 : 1), depth + 1);
    case 0xdd: case 0xdf:
        if (end - p < 5) return NULL;
        return mp_skip_n(p + 5, end, be(p + 1, 4) * (t == 0xdf ? 2 : 1), depth + 1);
    default: return NULL; /* 0xc1: never used */
    }
}

/* An array header at *p: its length, *p moved past it (-1: not an array). */
static int64_t mp_array(const uint8_t **p, const uint8_t *end) {
    const uint8_t *q = *p;
    if (q >= end) return -1;
    if (*q >= 0x90 && *q <= 0x9f) {
        *p = q + 1;
        return *q & 0x0f;
    }
    if (*q == 0xdc && end - q >= 3) {
        *p = q + 3;
        return (int64_t)be(q + 1, 2);
    }
    if (*q == 0xdd && end - q >= 5) {
        *p = q + 5;
        return (int64_t)be(q + 1, 4);
    }
    return -1;
}

/* An unsigned integer below EXACT spanning [p, q) exactly (0: not one). */
static int mp_uint(const uint8_t *p, const uint8_t *q, uint64_t *v) {
    int n;
    if (q - p == 1 && *p <= 0x7f) {
        *v = *p;
        return 1;
    }
    switch (*p) {
    case 0xcc: n = 1; break;
    case 0xcd: n = 2; break;
    case 0xce: n = 4; break;
    case 0xcf: n = 8; break;
    default: return 0;
    }
    if (q - p != 1 + n) return 0;
    *v = be(p + 1, n);
    return *v < EXACT;
}

/* One record (an array) beside its checked self: the same field count, each field's bytes
 * equal or both unsigned integers in a volatile field; the values of `want` (field
 * indices, -1: none) read into `got` (those must be unsigned integers). 0: refused. */
static int walk_record(const uint8_t **np, const uint8_t *nend, const uint8_t **bp,
                       const uint8_t *bend, unsigned long long volatile_mask, const int *want,
                       uint64_t *got, int nwant) {
    int64_t n = mp_array(np, nend), b = mp_array(bp, bend);
    if (n < 0 || n != b) return 0;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *n0 = *np, *b0 = *bp;
        const uint8_t *n1 = mp_skip(n0, nend, 1), *b1 = mp_skip(b0, bend, 1);
        if (n1 == NULL || b1 == NULL) return 0;
        int same = n1 - n0 == b1 - b0 && memcmp(n0, b0, (size_t)(n1 - n0)) == 0;
        uint64_t v, bv;
        if (!same && !(i < 64 && (volatile_mask >> i) & 1 && mp_uint(n0, n1, &v) &&
                       mp_uint(b0, b1, &bv)))
            return 0;
        for (int k = 0; k < nwant; k++) {
            if (want[k] == i && !mp_uint(n0, n1, &got[k])) return 0;
        }
        *np = n1;
        *bp = b1;
    }
    return 1;
}

/* --------------------------------- Step ---------------------------------- */

static PyObject *s_mm, *s_fd;

static int step_traverse(Step *s, visitproc visit, void *arg) {
    Py_VISIT(s->read);
    Py_VISIT(s->reader);
    Py_VISIT(s->mm);
    Py_VISIT(s->read_args[0]);
    return 0;
}

static int step_clear(Step *s) {
    Py_CLEAR(s->read);
    Py_CLEAR(s->reader);
    Py_CLEAR(s->mm);
    Py_CLEAR(s->header);
    Py_CLEAR(s->free);
    Py_CLEAR(s->payload);
    Py_CLEAR(s->sized);
    Py_CLEAR(s->parts);
    Py_CLEAR(s->start);
    Py_CLEAR(s->step_head);
    Py_CLEAR(s->read_args[0]);
    Py_CLEAR(s->read_args[1]);
    Py_CLEAR(s->read_args[2]);
    return 0;
}

static void step_dealloc(Step *s) {
    PyObject_GC_UnTrack(s);
    step_clear(s);
    PyMem_Free(s->pay);
    PyMem_Free(s->out);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static int step_init(Step *s, PyObject *args, PyObject *kw) {
    static char *names[] = {"read", "reader", "mm", "header", "free", "payload", "sized",
                            "parts", "start", "step_head", "rt_volatile",
                            "pool_volatile", "fields", "usage", "usage_digits", "retries",
                            "fd", "inode", "size", "every", "stale_after", "probed",
                            "progress", "seq", "beat", "beat_off", NULL};
    PyObject *read, *reader, *mm, *header, *free_, *payload, *sized, *parts, *start, *step_head;
    unsigned long long rt_v, pool_v, inode, seq, beat;
    long long size;
    int f[6];
    if (!PyArg_ParseTupleAndKeywords(
            args, kw, "$OOOSSSSO!SSKK(iiiiii)iiiiKLddddKKi", names, &read, &reader, &mm, &header,
            &free_, &payload, &sized, &PyTuple_Type, &parts, &start, &step_head, &rt_v,
            &pool_v, &f[0], &f[1], &f[2], &f[3], &f[4], &f[5], &s->usage, &s->usage_digits,
            &s->retries, &s->fd, &inode, &size, &s->every, &s->stale_after, &s->probed,
            &s->progress, &seq, &beat, &s->beat_off))
        return -1;
    if (PyBytes_GET_SIZE(header) != HEADER_LEN || PyBytes_GET_SIZE(free_) != HEADER_LEN ||
        s->beat_off < 0 || s->beat_off > HEADER_LEN - 8) {
        PyErr_SetString(PyExc_ValueError, "header and free are 256 bytes, beat_off within");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(parts); i++) {
        PyObject *p = PyTuple_GET_ITEM(parts, i);
        if (!PyBytes_Check(p) && !PyLong_Check(p)) {
            PyErr_SetString(PyExc_TypeError, "parts are bytes or ints");
            return -1;
        }
    }
    step_clear(s);
    s->read = Py_NewRef(read);
    s->reader = Py_NewRef(reader);
    s->mm = Py_NewRef(mm);
    s->header = Py_NewRef(header);
    s->free = Py_NewRef(free_);
    s->payload = Py_NewRef(payload);
    s->sized = Py_NewRef(sized);
    s->parts = Py_NewRef(parts);
    s->start = Py_NewRef(start);
    s->step_head = Py_NewRef(step_head);
    s->read_args[0] = Py_NewRef(mm);
    s->read_args[1] = PyLong_FromLong(s->retries);
    s->read_args[2] = PyLong_FromLong(-1);
    if (s->read_args[1] == NULL || s->read_args[2] == NULL) return -1;
    s->rt_volatile = rt_v;
    s->pool_volatile = pool_v;
    s->f_step = f[0];
    s->f_running = f[1];
    s->f_waiting = f[2];
    s->f_total = f[3];
    s->f_allocated = f[4];
    s->f_available = f[5];
    s->inode = inode;
    s->size = size;
    s->seq = seq;
    s->beat = beat;
    /* The payload's room: the checked slot's capacity (the header is checked equal at
     * every step, so it is this segment's for the Step's life). */
    uint32_t cap;
    memcpy(&cap, PyBytes_AS_STRING(header) + OFF_SLOT_CAPACITY, 4);
    s->c_read = read == read_latest_py && seqlock != NULL && cap <= MAX_SLOT;
    if (s->c_read) {
        PyMem_Free(s->pay);
        s->pay_cap = (size_t)cap + SLOT_HEADER_LEN;
        s->pay = PyMem_Malloc(s->pay_cap);
        if (s->pay == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    return 0;
}

/* The reader still holds this map and descriptor (not re-attached, not closed). */
static int still_held(Step *s) {
    PyObject *mm = PyObject_GetAttr(s->reader, s_mm);
    if (mm == NULL) {
        PyErr_Clear();
        return 0;
    }
    int same = mm == s->mm;
    Py_DECREF(mm);
    if (!same) return 0;
    PyObject *fd = PyObject_GetAttr(s->reader, s_fd);
    if (fd == NULL) {
        PyErr_Clear();
        return 0;
    }
    long v = PyLong_AsLong(fd);
    Py_DECREF(fd);
    if (v == -1 && PyErr_Occurred()) PyErr_Clear();
    return v == s->fd;
}

/* The full check's probes on the descriptor: a name, the size, the writer's lock. */
static int probes_pass(Step *s) {
    struct stat st;
    if (fstat(s->fd, &st) != 0 || (unsigned long long)st.st_ino != s->inode ||
        st.st_nlink == 0 || st.st_size < s->size)
        return 0;
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    if (fcntl(s->fd, F_OFD_GETLK, &fl) != 0) return 0;
    return fl.l_type == F_WRLCK;
}

/* The header moved only where it may. */
static int header_same(Step *s, const uint8_t *raw) {
    const char *a = (const char *)raw, *b = PyBytes_AS_STRING(s->header);
    const char *fr = PyBytes_AS_STRING(s->free);
    for (int i = 0; i < HEADER_LEN; i++) {
        if (a[i] != b[i] && !fr[i]) return 0;
    }
    return 1;
}

typedef struct {
    uint64_t step, running, waiting;
    double usage;
} Numbers;

/* The payload beside the checked one (step 4 above), and the numbers the body prints:
 * 1, or 0 (declined). */
static int walk(Step *s, const uint8_t *payload, size_t len, Numbers *out) {
    const uint8_t *np = payload;
    const uint8_t *nend = np + len;
    const uint8_t *bp = (const uint8_t *)PyBytes_AS_STRING(s->payload);
    const uint8_t *bend = bp + PyBytes_GET_SIZE(s->payload);
    int64_t top = mp_array(&np, nend);
    if (top < 2 || top != mp_array(&bp, bend)) return 0;
    int rt_want[3] = {s->f_step, s->f_running, s->f_waiting};
    uint64_t rt[3];
    if (!walk_record(&np, nend, &bp, bend, s->rt_volatile, rt_want, rt, 3)) return 0;
    out->step = rt[0];
    out->running = rt[1];
    out->waiting = rt[2];
    int64_t pools = mp_array(&np, nend);
    if (pools < 0 || pools != mp_array(&bp, bend) || pools != PyBytes_GET_SIZE(s->sized))
        return 0;
    const char *sized = PyBytes_AS_STRING(s->sized);
    int pool_want[3] = {s->f_total, s->f_allocated, s->f_available};
    uint64_t total = 0, allocated = 0, available = 0;
    double fullest = -1.0;
    for (int64_t j = 0; j < pools; j++) {
        uint64_t got[3];
        int want = sized[j] ? (s->usage == USAGE_FREE ? 3 : 2) : 0;
        if (!walk_record(&np, nend, &bp, bend, s->pool_volatile, pool_want, got, want)) return 0;
        if (!want) continue;
        if (got[0] == 0) return 0; /* a sized pool has a capacity (never volatile) */
        total += got[0];
        allocated += got[1];
        if (want == 3) available += got[2];
        double share = (double)got[1] / (double)got[0];
        if (share > fullest) fullest = share;
    }
    /* The rest of the top array, and nothing after it: as checked. */
    if (nend - np != bend - bp || memcmp(np, bp, (size_t)(nend - np)) != 0) return 0;
    if (total >= EXACT || allocated >= EXACT || available >= EXACT) return 0;
    double usage;
    switch (s->usage) {
    case USAGE_FREE: usage = 1.0 - (double)available / (double)total; break;
    case USAGE_USED: usage = (double)allocated / (double)total; break;
    case USAGE_FULLEST: usage = fullest; break;
    default: usage = 0.0;
    }
    if (s->usage != USAGE_NONE && !(usage >= 0.0 && usage <= 1.0)) usage = 1.0;
    if (s->usage_digits >= 0 && s->usage != USAGE_NONE) {
        /* Python's round(x, n): the exact binary value rounded half-even to n decimals,
         * read back; glibc's %.nf rounds the exact value the same way (tested). More
         * digits than a double's 15 (no engine asks; SGLang: 2) are the full check's. */
        if (s->usage_digits > 15) return 0;
        char text[32];
        snprintf(text, sizeof text, "%.*f", s->usage_digits, usage);
        usage = strtod(text, NULL);
    }
    out->usage = usage;
    return 1;
}

/* repr(float(v)), as gateway_body._number prints it (v finite here). */
static char *number(double v) { return PyOS_double_to_string(v, 'r', 0, Py_DTSF_ADD_DOT_0, NULL); }

/* Decimal digits of v at the end of buf[0, 24): their start. */
static char *digits(uint64_t v, char *end) {
    do {
        *--end = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    return end;
}

/* repr(float(n)) of a count below 2^53 (< 1e16, so never an exponent): "n.0", at the
 * end of buf[0, 24), NUL-terminated: its start. */
static char *count_text(uint64_t n, char *buf) {
    char *end = buf + 24 - 3;
    char *start = digits(n, end);
    memcpy(end, ".0", 3);
    return start;
}

/* The response into s->out: start, Content-Length, the step header, the body with its
 * numbers. 0, or -1 with an exception set. */
static int render(Step *s, const Numbers *n) {
    char waiting[24], running[24];
    char *usage = number(n->usage);
    const char *text[3] = {count_text(n->waiting, waiting), count_text(n->running, running),
                           usage};
    int rc = -1;
    if (usage == NULL) goto done;
    Py_ssize_t len = 0;
    Py_ssize_t parts = PyTuple_GET_SIZE(s->parts);
    for (Py_ssize_t i = 0; i < parts; i++) {
        PyObject *p = PyTuple_GET_ITEM(s->parts, i);
        if (PyBytes_Check(p)) {
            len += PyBytes_GET_SIZE(p);
        } else {
            long k = PyLong_AsLong(p);
            if (k < 0 || k > 2) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a part's number");
                goto done;
            }
            len += (Py_ssize_t)strlen(text[k]);
        }
    }
    /* "<length>\r\n" and "<step>\r\n\r\n", without printf's machinery. */
    char lbuf[32], sbuf[32];
    char *lengths = digits((uint64_t)len, lbuf + sizeof lbuf - 2);
    memcpy(lbuf + sizeof lbuf - 2, "\r\n", 2);
    int m = (int)(lbuf + sizeof lbuf - lengths);
    char *step = digits(n->step, sbuf + sizeof sbuf - 4);
    memcpy(sbuf + sizeof sbuf - 4, "\r\n\r\n", 4);
    int k = (int)(sbuf + sizeof sbuf - step);
    Py_ssize_t a = PyBytes_GET_SIZE(s->start), b = PyBytes_GET_SIZE(s->step_head);
    size_t need = (size_t)(a + m + b + k + len);
    if (need > s->out_cap) {
        char *grown = PyMem_Realloc(s->out, need);
        if (grown == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        s->out = grown;
        s->out_cap = need;
    }
    char *w = s->out;
    memcpy(w, PyBytes_AS_STRING(s->start), (size_t)a);
    memcpy(w += a, lengths, (size_t)m);
    memcpy(w += m, PyBytes_AS_STRING(s->step_head), (size_t)b);
    memcpy(w += b, step, (size_t)k);
    w += k;
    for (Py_ssize_t i = 0; i < parts; i++) {
        PyObject *p = PyTuple_GET_ITEM(s->parts, i);
        const char *src;
        size_t len_i;
        if (PyBytes_Check(p)) {
            src = PyBytes_AS_STRING(p);
            len_i = (size_t)PyBytes_GET_SIZE(p);
        } else {
            src = text[PyLong_AsLong(p)];
            len_i = strlen(src);
        }
        memcpy(w, src, len_i);
        w += len_i;
    }
    s->out_len = (Py_ssize_t)need;
    rc = 0;
done:
    PyMem_Free(usage);
    return rc;
}

/* The latest snapshot as the full check would read it: 1 with *hdr, *pay, *n, *seq set,
 * 0 when it is not a first-attempt OK read (the full check counts retries and words
 * errors), -1 with an exception set. In C (`c_read`) into the Step's buffers, from the
 * map's buffer held for the read; else through `read` (a test's stand-in). */
static int read_now(Step *s, PyObject **held, const uint8_t **hdr, const uint8_t **pay,
                    size_t *n, uint64_t *seq) {
    if (s->c_read) {
        Py_buffer view;
        if (PyObject_GetBuffer(s->mm, &view, PyBUF_SIMPLE) < 0) {
            PyErr_Clear(); /* closed: the Python path decides */
            return 0;
        }
        uint32_t got = 0;
        int attempts = 0;
        int status = seqlock->read_latest(view.buf, (size_t)view.len, s->retries, s->hdr,
                                          s->pay, s->pay_cap, seq, &got, &attempts);
        PyBuffer_Release(&view);
        if (status != 0 || attempts != 1) return 0;
        *hdr = s->hdr;
        *pay = s->pay;
        *n = got;
        return 1;
    }
    PyObject *r = PyObject_Vectorcall(s->read, s->read_args, 3, NULL);
    if (r == NULL) { /* an unmapped or re-attached map: the Python path decides */
        PyErr_Clear();
        return 0;
    }
    *held = r;
    /* (status, seq, header, payload, attempts): OK (0) on the first attempt. */
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 5 ||
        PyLong_AsLong(PyTuple_GET_ITEM(r, 0)) != 0 || PyLong_AsLong(PyTuple_GET_ITEM(r, 4)) != 1 ||
        !PyBytes_Check(PyTuple_GET_ITEM(r, 2)) || PyBytes_GET_SIZE(PyTuple_GET_ITEM(r, 2)) != HEADER_LEN ||
        !PyBytes_Check(PyTuple_GET_ITEM(r, 3))) {
        PyErr_Clear();
        return 0;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(r, 1));
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *seq = v;
    *hdr = (const uint8_t *)PyBytes_AS_STRING(PyTuple_GET_ITEM(r, 2));
    *pay = (const uint8_t *)PyBytes_AS_STRING(PyTuple_GET_ITEM(r, 3));
    *n = (size_t)PyBytes_GET_SIZE(PyTuple_GET_ITEM(r, 3));
    return 1;
}

/* The answer for `now`, in s->out (see the module): 1 built, 0 declined, -1 an error
 * (an exception set). Called for a moved word, and for an unchanged one whose answer's
 * window ended (a quiet engine: progress is then its heartbeat). */
static int step_advance(Step *s, double now, uint64_t *seq_out, double *until) {
    if (!still_held(s)) return 0;
    if (now >= s->probed) {
        if (!probes_pass(s)) return 0;
        s->probed = now + s->every;
    }
    PyObject *held = NULL;
    const uint8_t *hdr, *pay;
    size_t n;
    uint64_t seq;
    Numbers num;
    int rc = read_now(s, &held, &hdr, &pay, &n, &seq);
    if (rc <= 0) goto done;
    rc = 0;
    if (!header_same(s, hdr) || !walk(s, pay, n, &num)) goto done;
    /* Progress as the full check counts it (Target._still_for): the sequence or the
     * heartbeat moved, on the daemon's clock. Declined past the gateway's bound: the
     * full check answers that 503 and words it. */
    uint64_t beat;
    memcpy(&beat, hdr + s->beat_off, 8);
    if (seq != s->seq || beat != s->beat) {
        s->seq = seq;
        s->beat = beat;
        s->progress = now;
    }
    double still = now - s->progress;
    if (!(still <= s->stale_after)) goto done;
    double left = s->stale_after - still;
    if (render(s, &num) < 0) {
        rc = -1;
        goto done;
    }
    s->built++;
    *seq_out = seq;
    *until = now + (left < s->every ? left : s->every);
    rc = 1;
done:
    Py_XDECREF(held);
    return rc;
}

/* The listener's entry (_pollfast_api.h): the response stays in the Step's buffer. */
static int advance_c(PyObject *self, double now, const char **out, Py_ssize_t *len,
                     uint64_t *seq, double *until) {
    Step *s = (Step *)self;
    int rc = step_advance(s, now, seq, until);
    if (rc == 1) {
        *out = s->out;
        *len = s->out_len;
    }
    return rc;
}

/* step(now) -> (response bytes, seq, until) | None: step_advance from Python. */
static PyObject *step_call(Step *s, PyObject *args, PyObject *kw) {
    double now;
    if (!PyArg_ParseTuple(args, "d", &now) || (kw != NULL && PyDict_GET_SIZE(kw) > 0)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "step(now)");
        return NULL;
    }
    uint64_t seq;
    double until;
    int rc = step_advance(s, now, &seq, &until);
    if (rc < 0) return NULL;
    if (rc == 0) Py_RETURN_NONE;
    return Py_BuildValue("(y#Kd)", s->out, s->out_len, (unsigned long long)seq, until);
}

static PyMemberDef step_members[] = {
    {"probed", T_DOUBLE, offsetof(Step, probed), 0, "monotonic seconds: probes due then"},
    {"built", T_ULONGLONG, offsetof(Step, built), READONLY, "answers built"},
    {"c_read", T_INT, offsetof(Step, c_read), READONLY,
     "1: the segment is read through the seqlock's C API (0: through `read`)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject StepType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvsidecar.daemon._gatewaystep.Step",
    .tp_doc = "A rank's last full check, and step(now) -> (bytes, seq, until) | None.",
    .tp_basicsize = sizeof(Step),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)step_init,
    .tp_dealloc = (destructor)step_dealloc,
    .tp_traverse = (traverseproc)step_traverse,
    .tp_clear = (inquiry)step_clear,
    .tp_call = (ternaryfunc)step_call,
    .tp_members = step_members,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_gatewaystep", "A gateway rank's answer for a new step, in C.", -1,
    NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__gatewaystep(void) {
    if (PyType_Ready(&StepType) < 0) return NULL;
    /* The seqlock's C API, and the function object that selects it (`read`). */
    PyObject *sl = PyImport_ImportModule("kvsidecar.protocol._seqlock");
    if (sl == NULL) return NULL;
    read_latest_py = PyObject_GetAttrString(sl, "read_latest");
    Py_DECREF(sl);
    if (read_latest_py == NULL) return NULL;
    if ((seqlock = kvs_seqlock_import()) == NULL) return NULL;
    /* For the listener's compiled path: a Step as a slot's `advance`, called in C. */
    PyObject *fn = PyCapsule_New((void *)advance_c, KVS_ADVANCE_CAPSULE, NULL);
    if (fn == NULL || PyDict_SetItemString(StepType.tp_dict, "_c_advance", fn) < 0) {
        Py_XDECREF(fn);
        return NULL;
    }
    Py_DECREF(fn);
    PyType_Modified(&StepType);
    if ((s_mm = PyUnicode_InternFromString("mm")) == NULL) return NULL;
    if ((s_fd = PyUnicode_InternFromString("fd")) == NULL) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Step", (PyObject *)&StepType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "USAGE_NONE", USAGE_NONE);
    PyModule_AddIntConstant(m, "USAGE_FREE", USAGE_FREE);
    PyModule_AddIntConstant(m, "USAGE_USED", USAGE_USED);
    PyModule_AddIntConstant(m, "USAGE_FULLEST", USAGE_FULLEST);
    PyModule_AddIntConstant(m, "WAITING", NUM_WAITING);
    PyModule_AddIntConstant(m, "RUNNING", NUM_RUNNING);
    PyModule_AddIntConstant(m, "USAGE", NUM_USAGE);
    return m;
}
