/*
 * _seqlock.c - the two-slot seqcount latch over a shared-memory segment.
 *
 * The protocol (see docs/segment-format.md and kvsidecar/protocol/layout.py):
 *
 *   published_seq (u64, header offset 64) = k  means  "slot k & 1 holds a
 *   complete snapshot numbered k". 0 means nothing published yet.
 *
 *   writer (one thread, never waits):           reader (any process, read-only):
 *     k = published_seq + 1                       s = load_acquire(published_seq)
 *     fence_release()            (W1)             if s == 0: not ready
 *     slot[k&1] = {k, len, crc, payload}          copy slot[s&1] (header+payload)
 *     fence_release()            (W2)             fence_acquire()           (R1)
 *     store(published_seq, k)                     if load(published_seq) != s: retry
 *     store(heartbeats)                           check slot_seq == s, crc32
 *
 * Readers always copy the last *completed* slot and never spin on a write in
 * progress (kernel raw_write_seqcount_latch). A reader is only disturbed when
 * the writer laps it: publishing k+1 leaves slot s&1 alone, publishing k+2
 * overwrites it, and by then published_seq has moved, so the re-check fails.
 *
 * Why each fence (Python cannot emit these; that is why this file exists):
 *  W1: orders the previous publish's store of published_seq before this
 *      publish's slot stores. Without it a lapped reader could see new slot
 *      bytes and still read the old sequence number (store-store reordering on
 *      aarch64) and accept a torn copy.
 *  W2: orders the slot stores before the store of published_seq, so a reader
 *      that sees k also sees all of slot k (release half of message passing).
 *  load_acquire of published_seq: slot loads cannot be hoisted above it.
 *  R1: the slot copy completes before published_seq is re-read (Boehm,
 *      "Can seqlocks get along with programming language memory models?").
 * On x86-64 (TSO) all four compile to compiler barriers only; on aarch64 they
 * are dmb ish / dmb ishld (dora-rs #3288 is what happens without them).
 *
 * The CRC32 (IEEE, same as zlib.crc32) is a second, independent check: a torn
 * or corrupted slot is rejected even if the ordering above were broken.
 *
 * Reads are guarded against SIGBUS: if the segment is truncated under a
 * reader, touching the lost pages raises SIGBUS, which would kill the daemon.
 * Like HotSpot's handling of faults in mapped files, the copy runs under a
 * thread-local sigjmp_buf and the handler jumps back, turning the fault into
 * an error status. Faults outside a guarded copy go to the previous handler.
 *
 * The latch itself (latch_publish, latch_read) uses no Python API: with
 * -DKVSIDECAR_LATCH_ONLY this file compiles without Python.h, which is how
 * tests/protocol/aarch64/stress.c runs these exact code paths under qemu.
 * They are noinline so the fence checks (tests/protocol/test_fences_*.py) find
 * them as functions of their own in the compiler's output; with LATCH_ONLY they
 * are emitted even unused, so the checks need no Python headers for aarch64.
 */
#define _GNU_SOURCE
#ifndef KVSIDECAR_LATCH_ONLY
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif
#include <setjmp.h>
#include <sys/stat.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#ifndef KVSIDECAR_LATCH_ONLY
#include "_seqlock_api.h" /* the C API, for the other extensions (Python-only) */
#endif

#ifdef KVSIDECAR_LATCH_ONLY
#define LATCH_FN static __attribute__((noinline, noclone, used))
#else
#define LATCH_FN static __attribute__((noinline, noclone))
#endif

/* Header offsets used here; must match layout.py (tested). */
#define OFF_PUBLISHED_SEQ 64
#define OFF_HEARTBEAT_MONO 128
#define OFF_HEARTBEAT_WALL 136
#define OFF_SLOT_OFF 192
#define OFF_SLOT_STRIDE 196
#define OFF_SLOT_CAPACITY 200
#define SLOT_HEADER_LEN 16 /* u64 slot_seq, u32 payload_len, u32 payload_crc32 */
#define OFF_PUBLISH_ERRORS 208 /* layout v1.1: outside the payload, see layout.py */
#define OFF_LAST_PUBLISH_ERROR 216
#define OFF_LAST_PUBLISH_ERROR_MONO 224

enum {
    ST_OK = 0,
    ST_NOT_PUBLISHED = 1,
    ST_RETRIES_EXHAUSTED = 2,
    ST_BAD_LAYOUT = 3,
    ST_BAD_CRC = 4,
    ST_SIGBUS = 5,
    ST_BAD_SLOT = 6,
    ST_TRUNCATED = 7, /* fstat: the file is now shorter than the mapping */
    ST_TOO_BIG = 8,   /* publish: payload exceeds the slot capacity */
};

/* ---- CRC-32 (IEEE 802.3, reflected, poly 0xEDB88320), slicing-by-8 ---- */
static uint32_t crc_table[8][256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
}

static uint32_t crc32_ieee(const uint8_t *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    while (n >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= c; /* little-endian host assumed; checked at import */
        c = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^
            crc_table[5][(lo >> 16) & 0xFF] ^ crc_table[4][lo >> 24] ^
            crc_table[3][hi & 0xFF] ^ crc_table[2][(hi >> 8) & 0xFF] ^
            crc_table[1][(hi >> 16) & 0xFF] ^ crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) c = crc_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

static inline uint64_t ld64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint32_t ld32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static inline uint64_t now_ns(clockid_t clk) {
    struct timespec ts;
    clock_gettime(clk, &ts); /* vDSO on Linux: no system call */
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Slot geometry from the header, bounds-checked against the buffer. */
static int slot_geometry(const uint8_t *base, size_t len, uint32_t *off, uint32_t *stride,
                         uint32_t *cap) {
    if (len < 256) return -1;
    *off = ld32(base + OFF_SLOT_OFF);
    *stride = ld32(base + OFF_SLOT_STRIDE);
    *cap = ld32(base + OFF_SLOT_CAPACITY);
    if (*off < 256 || *stride < SLOT_HEADER_LEN || (uint64_t)*cap + SLOT_HEADER_LEN > *stride)
        return -1;
    if ((uint64_t)*off + 2 * (uint64_t)*stride > (uint64_t)len) return -1;
    return 0;
}

/* ----------------------------- SIGBUS guard ----------------------------- */

static _Thread_local sigjmp_buf *guard_jb = NULL;

/* The handler reads guard_jb, but nothing else in the guarded region does: as plain
 * stores, "guard_jb = &jb; memcpy(...); guard_jb = NULL" lets the compiler drop the
 * first store as dead (GCC -O2 did, in guarded_copy: a truncated segment then killed
 * the reader with SIGBUS). Atomic stores are kept; signal fences (compiler barriers,
 * no instruction) keep the guarded accesses between them. */
static inline void guard_set(sigjmp_buf *jb) {
    __atomic_store_n(&guard_jb, jb, __ATOMIC_RELAXED);
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
}

static inline void guard_clear(void) {
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    __atomic_store_n(&guard_jb, NULL, __ATOMIC_RELAXED);
}

static struct sigaction previous_sigbus;

static int guard_installed = 0;

static void on_sigbus(int sig, siginfo_t *info, void *uctx) {
    (void)info;
    (void)uctx;
    sigjmp_buf *jb = __atomic_load_n(&guard_jb, __ATOMIC_RELAXED);
    if (jb != NULL) siglongjmp(*jb, 1);
    /* Not ours: restore the previous disposition; the faulting access re-executes
     * on return and is handled (or kills the process) as it would without us. */
    sigaction(sig, &previous_sigbus, NULL);
}

static void install_guard(void) {
    if (guard_installed) return;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    /* SA_NODEFER: we leave the handler by siglongjmp without restoring the
     * signal mask, so SIGBUS must not stay blocked afterwards. */
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &previous_sigbus) == 0) guard_installed = 1;
}

/* Copy len bytes at off, or return -1 if the pages are gone (SIGBUS). */
static int guarded_copy(uint8_t *dst, const uint8_t *src, size_t n) {
    sigjmp_buf jb;
    if (sigsetjmp(jb, 0) != 0) {
        guard_clear();
        return -1;
    }
    guard_set(&jb);
    memcpy(dst, src, n);
    guard_clear();
    return 0;
}

/* ------------------------------- writer -------------------------------- */

/* Publish payload[0, n) as the next snapshot: ST_OK and the new sequence number
 * in *k_out, or ST_BAD_LAYOUT / ST_TOO_BIG / ST_SIGBUS. *cap_out is the slot capacity. */
LATCH_FN int latch_publish(uint8_t *base, size_t len, const uint8_t *payload, size_t n,
                           uint64_t *k_out, uint32_t *cap_out) {
    uint32_t off, stride, cap;
    /* Someone with write access (only the owner: segments are 0640) may truncate the
     * file under us; touching lost pages would SIGBUS and kill the engine. Guarded,
     * the publish fails instead and the agent disables itself. */
    sigjmp_buf jb;
    if (sigsetjmp(jb, 0) != 0) {
        guard_clear();
        return ST_SIGBUS;
    }
    guard_set(&jb);
    if (slot_geometry(base, len, &off, &stride, &cap) != 0) {
        guard_clear();
        return ST_BAD_LAYOUT;
    }
    *cap_out = cap;
    if (n > cap) {
        guard_clear();
        return ST_TOO_BIG;
    }
    uint64_t *seqp = (uint64_t *)(base + OFF_PUBLISHED_SEQ);
    /* Only this writer stores published_seq, so a relaxed load is enough. */
    uint64_t k = __atomic_load_n(seqp, __ATOMIC_RELAXED) + 1;
    uint8_t *slot = base + off + (k & 1) * (uint64_t)stride;
    uint32_t n32 = (uint32_t)n;
    uint32_t crc = crc32_ieee(payload, n);

    __atomic_thread_fence(__ATOMIC_RELEASE); /* W1: see the header comment */
    memcpy(slot, &k, 8);
    memcpy(slot + 8, &n32, 4);
    memcpy(slot + 12, &crc, 4);
    memcpy(slot + SLOT_HEADER_LEN, payload, n);
    __atomic_thread_fence(__ATOMIC_RELEASE); /* W2: slot before sequence */
    __atomic_store_n(seqp, k, __ATOMIC_RELAXED);
    /* Heartbeats are single aligned 8-byte stores: never torn, no ordering needed. */
    __atomic_store_n((uint64_t *)(base + OFF_HEARTBEAT_MONO), now_ns(CLOCK_MONOTONIC),
                     __ATOMIC_RELAXED);
    __atomic_store_n((uint64_t *)(base + OFF_HEARTBEAT_WALL), now_ns(CLOCK_REALTIME),
                     __ATOMIC_RELAXED);
    guard_clear();
    *k_out = k;
    return ST_OK;
}

/* ------------------------------- reader -------------------------------- */

/* The read loop over a validated slot geometry. scratch holds cap + SLOT_HEADER_LEN
 * bytes; on ST_OK it holds the slot header and payload of snapshot *s_out. */
LATCH_FN int latch_read(const uint8_t *base, uint32_t off, uint32_t stride, uint32_t cap,
                        int retries, uint8_t *scratch, uint64_t *s_out, uint32_t *n_out,
                        int *attempts_out) {
    int status = ST_RETRIES_EXHAUSTED;
    uint64_t s = 0;
    uint32_t n = 0;
    volatile int attempt; /* live across sigsetjmp */
    const uint64_t *seqp = (const uint64_t *)(base + OFF_PUBLISHED_SEQ);
    for (attempt = 1; attempt <= retries; attempt++) {
        *attempts_out = attempt;
        /* The slot's loads may not move above this load (acquire). Also a
         * guarded access: this page can vanish too. */
        sigjmp_buf jb;
        if (sigsetjmp(jb, 0) != 0) {
            guard_clear();
            return ST_SIGBUS;
        }
        guard_set(&jb);
        s = __atomic_load_n(seqp, __ATOMIC_ACQUIRE);
        guard_clear();
        *s_out = s;
        if (s == 0) return ST_NOT_PUBLISHED;
        const uint8_t *slot = base + off + (s & 1) * (uint64_t)stride;
        if (guarded_copy(scratch, slot, SLOT_HEADER_LEN) != 0) return ST_SIGBUS;
        n = ld32(scratch + 8);
        if (n > cap) { /* a lapped read, or a corrupt slot; re-check decides */
            n = 0;
            status = ST_BAD_SLOT;
        } else if (guarded_copy(scratch + SLOT_HEADER_LEN, slot + SLOT_HEADER_LEN, n) != 0) {
            return ST_SIGBUS;
        } else {
            status = ST_OK;
        }
        __atomic_thread_fence(__ATOMIC_ACQUIRE); /* R1: copy before the re-check */
        uint64_t s2 = __atomic_load_n(seqp, __ATOMIC_RELAXED);
        if (s2 != s) {
            status = ST_RETRIES_EXHAUSTED; /* lapped by the writer: try again */
            continue;
        }
        if (status == ST_BAD_SLOT) continue;
        if (ld64(scratch) != s) {
            status = ST_BAD_SLOT;
            continue;
        }
        if (crc32_ieee(scratch + SLOT_HEADER_LEN, n) != ld32(scratch + 12)) {
            status = ST_BAD_CRC;
            continue;
        }
        *n_out = n;
        return ST_OK;
    }
    return status;
}

#ifndef KVSIDECAR_LATCH_ONLY

/* In a Python wrapper holding the buffer `seg`: from here on, a SIGBUS (the segment's
 * pages gone under us) releases seg and raises OSError instead of killing the process.
 * A macro: sigsetjmp must run in the wrapper's own frame. */
#define GUARD_SEG_OR_RAISE()                                                                  \
    sigjmp_buf jb;                                                                            \
    if (sigsetjmp(jb, 0) != 0) {                                                              \
        guard_clear();                                                                        \
        PyBuffer_Release(&seg);                                                               \
        PyErr_SetString(PyExc_OSError, "segment pages are gone (truncated by another process)"); \
        return NULL;                                                                          \
    }                                                                                         \
    guard_set(&jb)

/* record_error(segment, code): count a failed publish in the header (not the payload),
 * so a reader sees it even when no snapshot could ever be published. Failure path only. */
static PyObject *py_record_error(PyObject *self, PyObject *args) {
    Py_buffer seg;
    unsigned int code;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*I", &seg, &code)) return NULL;
    if (seg.len < 256) {
        PyBuffer_Release(&seg);
        PyErr_SetString(PyExc_ValueError, "segment too small");
        return NULL;
    }
    uint8_t *base = seg.buf;
    GUARD_SEG_OR_RAISE();
    /* Aligned single stores: a reader never sees a torn counter. One writer thread, so a
     * relaxed load + store is an increment. */
    uint64_t *n = (uint64_t *)(base + OFF_PUBLISH_ERRORS);
    __atomic_store_n(n, __atomic_load_n(n, __ATOMIC_RELAXED) + 1, __ATOMIC_RELAXED);
    __atomic_store_n((uint32_t *)(base + OFF_LAST_PUBLISH_ERROR), (uint32_t)code,
                     __ATOMIC_RELAXED);
    __atomic_store_n((uint64_t *)(base + OFF_LAST_PUBLISH_ERROR_MONO), now_ns(CLOCK_MONOTONIC),
                     __ATOMIC_RELAXED);
    guard_clear();
    PyBuffer_Release(&seg);
    Py_RETURN_NONE;
}

/* ------------------- KV events: per-slot seqlock + ring ------------------- */
/* The KV-event segment (docs/segment-format.md, "KV-event segment"; layout in
 * kv_events_layout.py). Two structures, one writer thread:
 *
 *   table slot (one per block): u64 seq, then the slot's fields. A classic seqlock:
 *     writer: s = seq; seq = s+1 (odd); fence_release (K1); fields; fence_release (K2);
 *             seq = s+2
 *     reader: s1 = load_acquire(seq); odd: retry; copy; fence_acquire (K3);
 *             seq == s1 or retry
 *   ring of change records, head (u64) = number of the last record written (1-based):
 *     writer: fence_release (K4); record n at ((n-1) & (cap-1)); fence_release (K5);
 *             head = n
 *     reader: h = load_acquire(head); copy records; fence_acquire (K6); h2 = load(head);
 *             record i is intact iff i > h2 - cap + 1 (record i+cap, which overwrites
 *             it, is written only once head reached i+cap-1).
 * The writer never reads what a reader writes (readers map the file read-only). */

static int kv_bounds(Py_ssize_t len, Py_ssize_t off, Py_ssize_t n) {
    return off >= 0 && n >= 0 && (off & 7) == 0 && off <= len && n <= len - off;
}

/* kv_commit(seg, slot_off, slot_data, clear_mask, rec_off, rec_data, head_off) -> head
 * slot_off < 0: no slot write. Else the slot at slot_off is rewritten under its seqlock:
 * slot_data (may be empty) lands at slot_off + 8, then the flags byte at
 * slot_off + KV_SLOT_FLAGS_AT loses clear_mask. Then, unless rec_off < 0 (returns 0),
 * rec_data is appended at rec_off and head (u64 at head_off) is incremented; returns the
 * new head. One call per event: no
 * system call, no lock, no allocation. */
#define KV_SLOT_FLAGS_AT 36
static PyObject *py_kv_commit(PyObject *self, PyObject *args) {
    Py_buffer seg, slot, rec;
    Py_ssize_t slot_off, rec_off, head_off;
    unsigned int clear_mask;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*ny*Iny*n", &seg, &slot_off, &slot, &clear_mask, &rec_off,
                          &rec, &head_off))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t len = seg.len;
    if ((slot_off >= 0 && (!kv_bounds(len, slot_off, 8 + slot.len) ||
                           !kv_bounds(len, slot_off, KV_SLOT_FLAGS_AT + 1))) ||
        (rec_off >= 0 && (!kv_bounds(len, rec_off, rec.len) || !kv_bounds(len, head_off, 8)))) {
        PyErr_SetString(PyExc_ValueError, "kv_commit: offset out of the segment");
        goto done;
    }
    uint8_t *base = seg.buf;
    uint64_t head;
    sigjmp_buf jb;
    if (sigsetjmp(jb, 0) != 0) {
        guard_clear();
        PyErr_SetString(PyExc_OSError, "segment pages are gone (truncated by another process)");
        goto done;
    }
    guard_set(&jb);
    if (slot_off >= 0) {
        uint64_t *seqp = (uint64_t *)(base + slot_off);
        uint64_t s = __atomic_load_n(seqp, __ATOMIC_RELAXED) & ~(uint64_t)1;
        __atomic_store_n(seqp, s + 1, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_RELEASE); /* K1: odd before the fields */
        if (slot.len) memcpy(base + slot_off + 8, slot.buf, (size_t)slot.len);
        if (clear_mask) base[slot_off + KV_SLOT_FLAGS_AT] &= (uint8_t)~clear_mask;
        __atomic_thread_fence(__ATOMIC_RELEASE); /* K2: the fields before even */
        __atomic_store_n(seqp, s + 2, __ATOMIC_RELAXED);
    }
    if (rec_off < 0) { /* a slot alone (a name-table entry): no record */
        guard_clear();
        result = PyLong_FromLong(0);
        goto done;
    }
    uint64_t *headp = (uint64_t *)(base + head_off);
    head = __atomic_load_n(headp, __ATOMIC_RELAXED) + 1;
    __atomic_thread_fence(__ATOMIC_RELEASE); /* K4: the previous head before this record */
    memcpy(base + rec_off, rec.buf, (size_t)rec.len);
    __atomic_thread_fence(__ATOMIC_RELEASE); /* K5: the record before the head */
    __atomic_store_n(headp, head, __ATOMIC_RELAXED);
    guard_clear();
    result = PyLong_FromUnsignedLongLong(head);
done:
    PyBuffer_Release(&seg);
    PyBuffer_Release(&slot);
    PyBuffer_Release(&rec);
    return result;
}

/* The stored and removed records, one C call each (kv_stored, kv_removed): the slot's
 * fields and the ring record written here from their values, the token ids copied from
 * the list, so the engine thread does no struct packing. The bytes are kv_commit's with
 * SLOT_BODY and RECORD (kv_events_layout.py; segment-format.md section 9). Every argument
 * is checked before anything is written: a bad one raises and leaves the segment as it
 * was. */
#define KV_RECORD_SIZE 32
#define KV_SLOT_FIXED 56

static int kv_u64(PyObject *o, uint64_t *out) {
    /* An int taken modulo 2**64 (the writer masks hashes the same way). */
    if (!PyLong_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "kv: an int is required");
        return -1;
    }
    *out = (uint64_t)PyLong_AsUnsignedLongLongMask(o);
    return (*out == (uint64_t)-1 && PyErr_Occurred()) ? -1 : 0;
}

static int kv_range(PyObject *o, uint64_t max, uint64_t *out) {
    /* An int (or an object with __index__) in 0..max (else OverflowError). */
    int overflow = 0;
    long long v;
    if (PyLong_Check(o)) {
        v = PyLong_AsLongLongAndOverflow(o, &overflow);
    } else {
        PyObject *i = PyNumber_Index(o);
        if (i == NULL) return -1;
        v = PyLong_AsLongLongAndOverflow(i, &overflow);
        Py_DECREF(i);
    }
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow || v < 0 || (uint64_t)v > max) {
        PyErr_SetString(PyExc_OverflowError, "kv: a value out of its field's range");
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static int kv_ssize(PyObject *o, Py_ssize_t *out) {
    Py_ssize_t v = PyNumber_AsSsize_t(o, PyExc_OverflowError);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

/* The ring record, then the head (kv_commit's K4/K5). Inside the caller's guard. */
static uint64_t kv_append(uint8_t *base, Py_ssize_t ring_off, uint64_t ring_mask,
                          Py_ssize_t head_off, uint8_t kind, uint8_t rec_flags, uint16_t group,
                          uint32_t slot, uint64_t version, uint64_t block_hash) {
    uint64_t *headp = (uint64_t *)(base + head_off);
    uint64_t head = __atomic_load_n(headp, __ATOMIC_RELAXED) + 1;
    uint8_t rec[KV_RECORD_SIZE];
    memcpy(rec, &head, 8);
    rec[8] = kind;
    rec[9] = rec_flags;
    memcpy(rec + 10, &group, 2);
    memcpy(rec + 12, &slot, 4);
    memcpy(rec + 16, &version, 8);
    memcpy(rec + 24, &block_hash, 8);
    __atomic_thread_fence(__ATOMIC_RELEASE); /* K4 */
    memcpy(base + ring_off + ((head - 1) & ring_mask) * KV_RECORD_SIZE, rec, KV_RECORD_SIZE);
    __atomic_thread_fence(__ATOMIC_RELEASE); /* K5 */
    __atomic_store_n(headp, head, __ATOMIC_RELAXED);
    return head;
}

static int kv_ring_ok(Py_ssize_t len, Py_ssize_t ring_off, uint64_t ring_mask,
                      Py_ssize_t head_off) {
    return ring_mask < (uint64_t)PY_SSIZE_T_MAX / KV_RECORD_SIZE &&
           ((ring_mask + 1) & ring_mask) == 0 &&
           kv_bounds(len, ring_off, (Py_ssize_t)(ring_mask + 1) * KV_RECORD_SIZE) &&
           kv_bounds(len, head_off, 8);
}

/* The slot at slot_off under its seqlock (body at +8, then the n token ids at
 * KV_SLOT_FIXED, then the flags byte loses clear_mask), then the ring record: returns the
 * new head, or 0 with OSError set when the pages are gone (SIGBUS). */
static uint64_t kv_write(uint8_t *base, Py_ssize_t slot_off, const uint8_t *body, size_t body_len,
                         PyObject **items, Py_ssize_t n, uint8_t clear_mask, Py_ssize_t ring_off,
                         uint64_t ring_mask, Py_ssize_t head_off, uint8_t kind, uint8_t rec_flags,
                         uint16_t group, uint32_t slot, uint64_t version, uint64_t block_hash) {
    sigjmp_buf jb;
    if (sigsetjmp(jb, 0) != 0) {
        guard_clear();
        PyErr_SetString(PyExc_OSError, "segment pages are gone (truncated by another process)");
        return 0;
    }
    guard_set(&jb);
    uint64_t *seqp = (uint64_t *)(base + slot_off);
    uint64_t s = __atomic_load_n(seqp, __ATOMIC_RELAXED) & ~(uint64_t)1;
    __atomic_store_n(seqp, s + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE); /* K1 */
    if (body_len) memcpy(base + slot_off + 8, body, body_len);
    uint8_t *tok = base + slot_off + KV_SLOT_FIXED;
    for (Py_ssize_t i = 0; i < n; i++) { /* checked by the caller: u32 each */
        uint32_t t = (uint32_t)PyLong_AsUnsignedLongMask(items[i]);
        memcpy(tok + 4 * i, &t, 4);
    }
    if (clear_mask) base[slot_off + KV_SLOT_FLAGS_AT] &= (uint8_t)~clear_mask;
    __atomic_thread_fence(__ATOMIC_RELEASE); /* K2 */
    __atomic_store_n(seqp, s + 2, __ATOMIC_RELAXED);
    uint64_t head = kv_append(base, ring_off, ring_mask, head_off, kind, rec_flags, group, slot,
                              version, block_hash);
    guard_clear();
    return head;
}

/* kv_stored(seg, slot_off, stride, slot, version, block_hash, parent, epoch, flags, medium,
 *           group, name_idx, spec_idx, lora, token_ids, ring_off, ring_mask, head_off,
 *           rec_flags) -> head
 * The slot at slot_off (stride bytes, little-endian fields at +8: version, block_hash,
 * parent, epoch, flags, medium, group, n = len(token_ids), name_idx, spec_idx, 0, lora,
 * then the n token ids as u32) under its seqlock, then a KIND_STORED record. */
static PyObject *py_kv_stored(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 19) {
        PyErr_SetString(PyExc_TypeError, "kv_stored takes 19 arguments");
        return NULL;
    }
    Py_ssize_t slot_off, stride, ring_off, head_off;
    uint64_t slot, version, block_hash, parent, epoch, flags, medium, group, name_idx,
        spec_idx, lora, ring_mask, rec_flags;
    if (kv_ssize(args[1], &slot_off) || kv_ssize(args[2], &stride) ||
        kv_range(args[3], 0xFFFFFFFFu, &slot) || kv_u64(args[4], &version) ||
        kv_u64(args[5], &block_hash) || kv_u64(args[6], &parent) || kv_u64(args[7], &epoch) ||
        kv_range(args[8], 0xFF, &flags) || kv_range(args[9], 0xFF, &medium) ||
        kv_range(args[10], 0xFFFF, &group) || kv_range(args[11], 0xFFFF, &name_idx) ||
        kv_range(args[12], 0xFFFF, &spec_idx) || kv_u64(args[13], &lora) ||
        kv_ssize(args[15], &ring_off) || kv_u64(args[16], &ring_mask) ||
        kv_ssize(args[17], &head_off) || kv_range(args[18], 0xFF, &rec_flags))
        return NULL;
    PyObject *tokens = PySequence_Fast(args[14], "kv_stored: token_ids must be a sequence");
    if (tokens == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(tokens);
    PyObject **items = PySequence_Fast_ITEMS(tokens);
    Py_buffer seg;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(args[0], &seg, PyBUF_WRITABLE) != 0) {
        Py_DECREF(tokens);
        return NULL;
    }
    if (n > 0xFFFF || stride < KV_SLOT_FIXED || n > (stride - KV_SLOT_FIXED) / 4) {
        PyErr_Format(PyExc_ValueError, "kv_stored: %zd token ids do not fit the slot", n);
        goto done;
    }
    if (!kv_bounds(seg.len, slot_off, stride) || !kv_ring_ok(seg.len, ring_off, ring_mask, head_off)) {
        PyErr_SetString(PyExc_ValueError, "kv_stored: offset out of the segment");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* checked before anything is written */
        uint64_t t;
        if (kv_range(items[i], 0xFFFFFFFFu, &t)) goto done;
    }
    uint8_t body[KV_SLOT_FIXED - 8];
    uint32_t epoch32 = (uint32_t)epoch, n16 = (uint32_t)n;
    uint16_t g16 = (uint16_t)group, nm16 = (uint16_t)name_idx, sp16 = (uint16_t)spec_idx,
             nn16 = (uint16_t)n16, zero = 0;
    memcpy(body + 0, &version, 8);
    memcpy(body + 8, &block_hash, 8);
    memcpy(body + 16, &parent, 8);
    memcpy(body + 24, &epoch32, 4);
    body[28] = (uint8_t)flags;
    body[29] = (uint8_t)medium;
    memcpy(body + 30, &g16, 2);
    memcpy(body + 32, &nn16, 2);
    memcpy(body + 34, &nm16, 2);
    memcpy(body + 36, &sp16, 2);
    memcpy(body + 38, &zero, 2);
    memcpy(body + 40, &lora, 8);
    uint64_t head = kv_write(seg.buf, slot_off, body, sizeof body, items, n, 0, ring_off, ring_mask,
                             head_off, 1 /* KIND_STORED */, (uint8_t)rec_flags, g16,
                             (uint32_t)slot, version, block_hash);
    if (head == 0) goto done;
    result = PyLong_FromUnsignedLongLong(head);
done:
    PyBuffer_Release(&seg);
    Py_DECREF(tokens);
    return result;
}

/* kv_removed(seg, slot_off, slot, version, block_hash, group, ring_off, ring_mask, head_off)
 * -> head: the slot's FLAG_CACHED cleared under its seqlock, then a KIND_REMOVED record. */
static PyObject *py_kv_removed(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "kv_removed takes 9 arguments");
        return NULL;
    }
    Py_ssize_t slot_off, ring_off, head_off;
    uint64_t slot, version, block_hash, group, ring_mask;
    if (kv_ssize(args[1], &slot_off) || kv_range(args[2], 0xFFFFFFFFu, &slot) ||
        kv_u64(args[3], &version) || kv_u64(args[4], &block_hash) ||
        kv_range(args[5], 0xFFFF, &group) || kv_ssize(args[6], &ring_off) ||
        kv_u64(args[7], &ring_mask) || kv_ssize(args[8], &head_off))
        return NULL;
    Py_buffer seg;
    if (PyObject_GetBuffer(args[0], &seg, PyBUF_WRITABLE) != 0) return NULL;
    PyObject *result = NULL;
    if (!kv_bounds(seg.len, slot_off, KV_SLOT_FLAGS_AT + 1) ||
        !kv_ring_ok(seg.len, ring_off, ring_mask, head_off)) {
        PyErr_SetString(PyExc_ValueError, "kv_removed: offset out of the segment");
        goto done;
    }
    uint64_t head = kv_write(seg.buf, slot_off, NULL, 0, NULL, 0, 1 /* FLAG_CACHED */, ring_off,
                             ring_mask, head_off, 2 /* KIND_REMOVED */, 0, (uint16_t)group,
                             (uint32_t)slot, version, block_hash);
    if (head == 0) goto done;
    result = PyLong_FromUnsignedLongLong(head);
done:
    PyBuffer_Release(&seg);
    return result;
}

/* kv_store_u64(seg, off, value): fence_release, then one aligned 8-byte store. */
static PyObject *py_kv_store_u64(PyObject *self, PyObject *args) {
    Py_buffer seg;
    Py_ssize_t off;
    unsigned long long v;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*nK", &seg, &off, &v)) return NULL;
    if (!kv_bounds(seg.len, off, 8)) {
        PyBuffer_Release(&seg);
        PyErr_SetString(PyExc_ValueError, "kv_store_u64: offset out of the segment");
        return NULL;
    }
    GUARD_SEG_OR_RAISE();
    __atomic_thread_fence(__ATOMIC_RELEASE);
    __atomic_store_n((uint64_t *)((uint8_t *)seg.buf + off), (uint64_t)v, __ATOMIC_RELAXED);
    guard_clear();
    PyBuffer_Release(&seg);
    Py_RETURN_NONE;
}

/* kv_load_u64(seg, off) -> int: one aligned 8-byte acquire load (guarded). */
static PyObject *py_kv_load_u64(PyObject *self, PyObject *args) {
    Py_buffer seg;
    Py_ssize_t off;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*n", &seg, &off)) return NULL;
    if (!kv_bounds(seg.len, off, 8)) {
        PyBuffer_Release(&seg);
        PyErr_SetString(PyExc_ValueError, "kv_load_u64: offset out of the segment");
        return NULL;
    }
    install_guard();
    uint64_t v = 0;
    GUARD_SEG_OR_RAISE();
    v = __atomic_load_n((const uint64_t *)((const uint8_t *)seg.buf + off), __ATOMIC_ACQUIRE);
    guard_clear();
    PyBuffer_Release(&seg);
    return PyLong_FromUnsignedLongLong(v);
}

/* kv_slot_read(seg, off, n, retries) -> bytes | None: a consistent copy of the n bytes of
 * the slot at off (its seq first, always even), or None if every attempt met a write. */
static PyObject *py_kv_slot_read(PyObject *self, PyObject *args) {
    Py_buffer seg;
    Py_ssize_t off, n;
    int retries;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nni", &seg, &off, &n, &retries)) return NULL;
    if (n < 8 || !kv_bounds(seg.len, off, n)) {
        PyBuffer_Release(&seg);
        PyErr_SetString(PyExc_ValueError, "kv_slot_read: slot out of the segment");
        return NULL;
    }
    install_guard();
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out == NULL) {
        PyBuffer_Release(&seg);
        return NULL;
    }
    uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(out);
    const uint8_t *src = (const uint8_t *)seg.buf + off;
    const uint64_t *seqp = (const uint64_t *)src;
    int ok = 0, attempt;
    for (attempt = 0; attempt < retries && !ok; attempt++) {
        sigjmp_buf jb;
        if (sigsetjmp(jb, 0) != 0) {
            guard_clear();
            Py_DECREF(out);
            PyBuffer_Release(&seg);
            PyErr_SetString(PyExc_OSError,
                            "segment pages are gone (truncated by another process)");
            return NULL;
        }
        guard_set(&jb);
        uint64_t s1 = __atomic_load_n(seqp, __ATOMIC_ACQUIRE);
        if (!(s1 & 1)) {
            memcpy(dst, src, (size_t)n);
            __atomic_thread_fence(__ATOMIC_ACQUIRE); /* K3: the copy before the re-check */
            uint64_t s2 = __atomic_load_n(seqp, __ATOMIC_RELAXED);
            if (s2 == s1) {
                memcpy(dst, &s1, 8);
                ok = 1;
            }
        }
        guard_clear();
    }
    PyBuffer_Release(&seg);
    if (!ok) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return out;
}

/* kv_ring_read(seg, head_off, ring_off, rec_size, cap, first, max_n)
 *   -> (head, first_intact, data)
 * Copies records first .. min(head, first + max_n - 1) (data: their bytes in order) and
 * reports head (the last written, loaded before the copy) and first_intact, the oldest
 * record number that was certainly not being overwritten during the copy (head after the
 * copy - cap + 2, at least 1). The caller checks first >= first_intact: else it lost its
 * place (overrun) and must not use data. cap is a power of two. */
static PyObject *py_kv_ring_read(PyObject *self, PyObject *args) {
    Py_buffer seg;
    Py_ssize_t head_off, ring_off, rec_size, max_n;
    unsigned long long cap, first;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nnnKKn", &seg, &head_off, &ring_off, &rec_size, &cap, &first,
                          &max_n))
        return NULL;
    if (cap == 0 || (cap & (cap - 1)) != 0 || rec_size <= 0 || first == 0 || max_n < 0 ||
        !kv_bounds(seg.len, head_off, 8) || cap > (unsigned long long)PY_SSIZE_T_MAX / rec_size ||
        !kv_bounds(seg.len, ring_off, (Py_ssize_t)cap * rec_size)) {
        PyBuffer_Release(&seg);
        PyErr_SetString(PyExc_ValueError, "kv_ring_read: bad ring geometry");
        return NULL;
    }
    install_guard();
    const uint8_t *base = seg.buf;
    const uint64_t *headp = (const uint64_t *)(base + head_off);
    uint64_t head = 0, head2 = 0;
    PyObject *volatile data = NULL; /* live across sigsetjmp */
    sigjmp_buf jb;
    if (sigsetjmp(jb, 0) != 0) {
        guard_clear();
        Py_XDECREF(data);
        PyBuffer_Release(&seg);
        PyErr_SetString(PyExc_OSError, "segment pages are gone (truncated by another process)");
        return NULL;
    }
    guard_set(&jb);
    head = __atomic_load_n(headp, __ATOMIC_ACQUIRE);
    guard_clear();
    uint64_t last = head;
    if (first > head) last = first - 1; /* nothing new */
    else if (last - first + 1 > (uint64_t)max_n) last = first - 1 + (uint64_t)max_n;
    if (last - (first - 1) > cap) last = first - 1 + cap; /* never more than the ring */
    Py_ssize_t count = (Py_ssize_t)(last - (first - 1));
    data = PyBytes_FromStringAndSize(NULL, count * rec_size);
    if (data == NULL) {
        PyBuffer_Release(&seg);
        return NULL;
    }
    uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(data);
    guard_set(&jb);
    for (uint64_t i = first; i <= last; i++) {
        memcpy(dst, base + ring_off + ((i - 1) & (cap - 1)) * (uint64_t)rec_size,
               (size_t)rec_size);
        dst += rec_size;
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* K6: the copies before the re-check */
    head2 = __atomic_load_n(headp, __ATOMIC_RELAXED);
    guard_clear();
    PyBuffer_Release(&seg);
    uint64_t intact = head2 + 2 > cap ? head2 + 2 - cap : 1;
    if (intact < 1) intact = 1;
    PyObject *result = Py_BuildValue("KKN", (unsigned long long)head, (unsigned long long)intact,
                                     data);
    return result;
}

/* kv_table_scan(seg, table_off, stride, n_slots, epoch, start, max_out, retries)
 *   -> (next, data)
 * From slot start on, a seqlock-consistent copy (stride bytes; its first 8 bytes hold the
 * slot's number instead of its seq) of each slot
 * whose flags have CACHED and whose epoch (u32 at +32) equals epoch, until max_out copies
 * or the end; next is the slot to continue from (n_slots: done). A slot met mid-write on
 * every attempt is skipped: its change is in the ring after any head loaded before. */
static PyObject *py_kv_table_scan(PyObject *self, PyObject *args) {
    Py_buffer seg;
    Py_ssize_t table_off, stride, n_slots, start, max_out;
    unsigned int epoch;
    int retries;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nnnInni", &seg, &table_off, &stride, &n_slots, &epoch, &start,
                          &max_out, &retries))
        return NULL;
    if (stride < KV_SLOT_FLAGS_AT + 1 || n_slots < 0 || start < 0 || max_out < 1 ||
        n_slots > PY_SSIZE_T_MAX / stride || !kv_bounds(seg.len, table_off, n_slots * stride) ||
        (stride & 7) != 0) {
        PyBuffer_Release(&seg);
        PyErr_SetString(PyExc_ValueError, "kv_table_scan: bad table geometry");
        return NULL;
    }
    install_guard();
    PyObject *volatile out = PyBytes_FromStringAndSize(NULL, max_out * stride);
    if (out == NULL) {
        PyBuffer_Release(&seg);
        return NULL;
    }
    uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(out);
    const uint8_t *table = (const uint8_t *)seg.buf + table_off;
    volatile Py_ssize_t got = 0, slot;
    sigjmp_buf jb;
    if (sigsetjmp(jb, 0) != 0) {
        guard_clear();
        Py_DECREF(out);
        PyBuffer_Release(&seg);
        PyErr_SetString(PyExc_OSError, "segment pages are gone (truncated by another process)");
        return NULL;
    }
    guard_set(&jb);
    for (slot = start; slot < n_slots && got < max_out; slot++) {
        const uint8_t *src = table + slot * stride;
        const uint64_t *seqp = (const uint64_t *)src;
        uint8_t *d = dst + got * stride;
        for (int attempt = 0; attempt < retries; attempt++) {
            uint64_t s1 = __atomic_load_n(seqp, __ATOMIC_ACQUIRE);
            if (s1 & 1) continue;
            if (!(src[KV_SLOT_FLAGS_AT] & 1) || ld32(src + 32) != epoch) {
                /* not cached now: confirm with the sequence, or it was being written */
                __atomic_thread_fence(__ATOMIC_ACQUIRE);
                if (__atomic_load_n(seqp, __ATOMIC_RELAXED) == s1) break;
                continue;
            }
            memcpy(d, src, (size_t)stride);
            __atomic_thread_fence(__ATOMIC_ACQUIRE); /* K3 */
            if (__atomic_load_n(seqp, __ATOMIC_RELAXED) != s1) continue;
            if (!(d[KV_SLOT_FLAGS_AT] & 1) || ld32(d + 32) != epoch) break;
            uint64_t index = (uint64_t)slot; /* the copy's first 8 bytes: its slot */
            memcpy(d, &index, 8);
            got++;
            break;
        }
    }
    guard_clear();
    PyBuffer_Release(&seg);
    if (got < max_out && _PyBytes_Resize((PyObject **)&out, got * stride) < 0) return NULL;
    return Py_BuildValue("nN", (Py_ssize_t)slot, out);
}

/* ---------------------------- Python wrappers ---------------------------- */

static PyObject *py_publish(PyObject *self, PyObject *args) {
    Py_buffer seg, payload;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*", &seg, &payload)) return NULL;
    uint64_t k = 0;
    uint32_t cap = 0;
    int status = latch_publish(seg.buf, (size_t)seg.len, payload.buf, (size_t)payload.len, &k,
                               &cap);
    PyObject *result = NULL;
    if (status == ST_OK)
        result = PyLong_FromUnsignedLongLong(k);
    else if (status == ST_SIGBUS)
        PyErr_SetString(PyExc_OSError, "segment pages are gone (truncated by another process)");
    else if (status == ST_TOO_BIG)
        PyErr_Format(PyExc_ValueError, "payload of %zd bytes exceeds slot capacity %u",
                     payload.len, cap);
    else
        PyErr_SetString(PyExc_ValueError, "segment header has an invalid slot layout");
    PyBuffer_Release(&seg);
    PyBuffer_Release(&payload);
    return result;
}

static PyObject *py_heartbeat(PyObject *self, PyObject *arg) {
    Py_buffer seg;
    (void)self;
    if (PyObject_GetBuffer(arg, &seg, PyBUF_WRITABLE) < 0) return NULL;
    if (seg.len < 256) {
        PyBuffer_Release(&seg);
        PyErr_SetString(PyExc_ValueError, "segment too small");
        return NULL;
    }
    uint8_t *base = seg.buf;
    GUARD_SEG_OR_RAISE();
    __atomic_store_n((uint64_t *)(base + OFF_HEARTBEAT_MONO), now_ns(CLOCK_MONOTONIC),
                     __ATOMIC_RELAXED);
    __atomic_store_n((uint64_t *)(base + OFF_HEARTBEAT_WALL), now_ns(CLOCK_REALTIME),
                     __ATOMIC_RELAXED);
    guard_clear();
    PyBuffer_Release(&seg);
    Py_RETURN_NONE;
}

/* read_latest(seg, retries=8, fd=-1)
 *   -> (status, seq, header: bytes|None, payload: bytes|None, attempts)
 * With fd >= 0 the file is fstat'ed first: shorter than the mapping is ST_TRUNCATED
 * (doing it here saves building an os.stat_result per read). FASTCALL: this is the
 * daemon's per-target, per-poll call. */
static PyObject *py_read_latest(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer seg;
    long retries = 8, fd = -1;
    (void)self;
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "read_latest(segment, retries=8, fd=-1)");
        return NULL;
    }
    if (nargs > 1 && (retries = PyLong_AsLong(args[1])) == -1 && PyErr_Occurred()) return NULL;
    if (nargs > 2 && (fd = PyLong_AsLong(args[2])) == -1 && PyErr_Occurred()) return NULL;
    if (retries > 1000000) retries = 1000000; /* fits an int; < 1 reads nothing */
    if (PyObject_GetBuffer(args[0], &seg, PyBUF_SIMPLE) < 0) return NULL;
    install_guard();
    const uint8_t *base = seg.buf;
    uint8_t header[256];
    uint8_t *scratch = NULL;
    int status;
    uint64_t s = 0;
    uint32_t n = 0;
    int attempt = 0;
    PyObject *result = NULL;

    if (fd >= 0) {
        struct stat st;
        if (fstat((int)fd, &st) != 0) {
            PyBuffer_Release(&seg);
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        if (st.st_size < (off_t)seg.len) {
            status = ST_TRUNCATED;
            goto out;
        }
    }
    if (seg.len < 256 || guarded_copy(header, base, 256) != 0) {
        status = seg.len < 256 ? ST_BAD_LAYOUT : ST_SIGBUS;
        goto out;
    }
    uint32_t off, stride, cap;
    if (slot_geometry(header, (size_t)seg.len, &off, &stride, &cap) != 0) {
        status = ST_BAD_LAYOUT;
        goto out;
    }
    scratch = PyMem_Malloc((size_t)cap + SLOT_HEADER_LEN);
    if (scratch == NULL) {
        PyBuffer_Release(&seg);
        return PyErr_NoMemory();
    }
    status = latch_read(base, off, stride, cap, (int)retries, scratch, &s, &n, &attempt);
out:
    if (status == ST_OK) {
        result = Py_BuildValue("iKy#y#i", status, (unsigned long long)s, (const char *)header,
                               (Py_ssize_t)256, (const char *)scratch + SLOT_HEADER_LEN,
                               (Py_ssize_t)n, attempt);
    } else if (status == ST_SIGBUS || status == ST_BAD_LAYOUT || status == ST_TRUNCATED) {
        result = Py_BuildValue("iKOOi", status, (unsigned long long)s, Py_None, Py_None, attempt);
    } else {
        result = Py_BuildValue("iKy#Oi", status, (unsigned long long)s, (const char *)header,
                               (Py_ssize_t)256, Py_None, attempt);
    }
    PyMem_Free(scratch);
    PyBuffer_Release(&seg);
    return result;
}
/* copy_range(seg, offset, length) -> bytes | None (None: pages gone or out of range) */
static PyObject *py_copy_range(PyObject *self, PyObject *args) {
    Py_buffer seg;
    Py_ssize_t off, n;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nn", &seg, &off, &n)) return NULL;
    if (off < 0 || n < 0 || off > seg.len || n > seg.len - off) {
        PyBuffer_Release(&seg);
        Py_RETURN_NONE;
    }
    install_guard();
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out == NULL) {
        PyBuffer_Release(&seg);
        return NULL;
    }
    if (guarded_copy((uint8_t *)PyBytes_AS_STRING(out), (const uint8_t *)seg.buf + off,
                     (size_t)n) != 0) {
        Py_DECREF(out);
        out = Py_None;
        Py_INCREF(out);
    }
    PyBuffer_Release(&seg);
    return out;
}

static PyObject *py_install_sigbus_guard(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    install_guard();
    Py_RETURN_NONE;
}

static PyObject *py_crc32(PyObject *self, PyObject *arg) {
    Py_buffer b;
    (void)self;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    uint32_t c = crc32_ieee(b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(c);
}

static PyObject *py_fence_acquire(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    Py_RETURN_NONE;
}

static PyObject *py_fence_release(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    __atomic_thread_fence(__ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* ------------------------- the C API (_seqlock_api.h) ------------------------ */

static int api_read_latest(const uint8_t *base, size_t len, int retries, uint8_t *header,
                           uint8_t *payload, size_t cap, uint64_t *seq, uint32_t *n,
                           int *attempts) {
    install_guard();
    *seq = 0;
    *n = 0;
    *attempts = 0;
    if (len < KVS_HEADER_LEN) return ST_BAD_LAYOUT;
    if (guarded_copy(header, base, KVS_HEADER_LEN) != 0) return ST_SIGBUS;
    uint32_t off, stride, slot_cap;
    if (slot_geometry(header, len, &off, &stride, &slot_cap) != 0) return ST_BAD_LAYOUT;
    /* latch_read's scratch is the slot header then the payload: `payload` holds both
     * while reading, the payload moved to its start after. */
    if (cap < (size_t)slot_cap + SLOT_HEADER_LEN) {
        *n = slot_cap + SLOT_HEADER_LEN;
        return ST_TOO_BIG;
    }
    int status = latch_read(base, off, stride, slot_cap, retries, payload, seq, n, attempts);
    if (status == ST_OK) memmove(payload, payload + SLOT_HEADER_LEN, *n);
    return status;
}

static int api_load_u64(const uint8_t *base, size_t len, size_t off, uint64_t *out) {
    if (len < 8 || off > len - 8 || (uintptr_t)(base + off) % 8 != 0) return -1;
    install_guard();
    sigjmp_buf jb;
    if (sigsetjmp(jb, 0) != 0) {
        guard_clear();
        return -1;
    }
    guard_set(&jb);
    *out = __atomic_load_n((const uint64_t *)(base + off), __ATOMIC_ACQUIRE);
    guard_clear();
    return 0;
}

static KvsSeqlockAPI c_api = {KVS_SEQLOCK_API_VERSION, api_read_latest, api_load_u64};

static PyMethodDef methods[] = {
    {"publish", py_publish, METH_VARARGS,
     "publish(segment, payload) -> seq: write payload into the next slot and publish it."},
    {"heartbeat", py_heartbeat, METH_O, "heartbeat(segment): store both heartbeat clocks."},
    {"record_error", py_record_error, METH_VARARGS,
     "record_error(segment, code): count a failed publish in the header."},
    {"read_latest", (PyCFunction)(void (*)(void))py_read_latest, METH_FASTCALL,
     "read_latest(segment, retries=8, fd=-1) -> (status, seq, header, payload, attempts)."},
    {"copy_range", py_copy_range, METH_VARARGS,
     "copy_range(segment, offset, length) -> bytes or None if the pages are gone."},
    {"crc32", py_crc32, METH_O, "crc32(data) -> int, identical to zlib.crc32."},
    {"install_sigbus_guard", py_install_sigbus_guard, METH_NOARGS,
     "Install the SIGBUS handler that turns faults in guarded copies into errors."},
    {"kv_commit", py_kv_commit, METH_VARARGS,
     "kv_commit(seg, slot_off, slot_data, clear_mask, rec_off, rec_data, head_off) -> head."},
    {"kv_stored", (PyCFunction)(void (*)(void))py_kv_stored, METH_FASTCALL,
     "kv_stored(seg, slot_off, stride, slot, version, block_hash, parent, epoch, flags, medium,"
     " group, name_idx, spec_idx, lora, token_ids, ring_off, ring_mask, head_off, rec_flags)"
     " -> head."},
    {"kv_removed", (PyCFunction)(void (*)(void))py_kv_removed, METH_FASTCALL,
     "kv_removed(seg, slot_off, slot, version, block_hash, group, ring_off, ring_mask,"
     " head_off) -> head."},
    {"kv_store_u64", py_kv_store_u64, METH_VARARGS, "kv_store_u64(seg, off, value): release store."},
    {"kv_load_u64", py_kv_load_u64, METH_VARARGS, "kv_load_u64(seg, off) -> int: acquire load."},
    {"kv_slot_read", py_kv_slot_read, METH_VARARGS,
     "kv_slot_read(seg, off, n, retries) -> bytes or None: a seqlock-consistent slot copy."},
    {"kv_ring_read", py_kv_ring_read, METH_VARARGS,
     "kv_ring_read(seg, head_off, ring_off, rec_size, cap, first, max_n) -> (head, intact, data)."},
    {"kv_table_scan", py_kv_table_scan, METH_VARARGS,
     "kv_table_scan(seg, table_off, stride, n_slots, epoch, start, max_out, retries)"
     " -> (next, data): cached slots, seqlock-consistent."},
    {"fence_acquire", py_fence_acquire, METH_NOARGS, "atomic_thread_fence(acquire)."},
    {"fence_release", py_fence_release, METH_NOARGS, "atomic_thread_fence(release)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_seqlock", "Seqlock latch primitives for kvsidecar segments.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__seqlock(void) {
    crc_init();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyModule_AddIntConstant(m, "OK", ST_OK);
    PyModule_AddIntConstant(m, "NOT_PUBLISHED", ST_NOT_PUBLISHED);
    PyModule_AddIntConstant(m, "RETRIES_EXHAUSTED", ST_RETRIES_EXHAUSTED);
    PyModule_AddIntConstant(m, "BAD_LAYOUT", ST_BAD_LAYOUT);
    PyModule_AddIntConstant(m, "BAD_CRC", ST_BAD_CRC);
    PyModule_AddIntConstant(m, "SIGBUS", ST_SIGBUS);
    PyModule_AddIntConstant(m, "BAD_SLOT", ST_BAD_SLOT);
    PyModule_AddIntConstant(m, "TRUNCATED", ST_TRUNCATED);
    PyModule_AddIntConstant(m, "KV_SLOT_FLAGS_AT", KV_SLOT_FLAGS_AT);
    PyModule_AddIntConstant(m, "OFF_PUBLISHED_SEQ", OFF_PUBLISHED_SEQ);
    PyModule_AddIntConstant(m, "OFF_HEARTBEAT_MONO", OFF_HEARTBEAT_MONO);
    PyModule_AddIntConstant(m, "OFF_HEARTBEAT_WALL", OFF_HEARTBEAT_WALL);
    PyModule_AddIntConstant(m, "OFF_SLOT_OFF", OFF_SLOT_OFF);
    PyModule_AddIntConstant(m, "OFF_SLOT_STRIDE", OFF_SLOT_STRIDE);
    PyModule_AddIntConstant(m, "OFF_SLOT_CAPACITY", OFF_SLOT_CAPACITY);
    PyModule_AddIntConstant(m, "SLOT_HEADER_LEN", SLOT_HEADER_LEN);
    PyModule_AddIntConstant(m, "OFF_PUBLISH_ERRORS", OFF_PUBLISH_ERRORS);
    PyModule_AddIntConstant(m, "OFF_LAST_PUBLISH_ERROR", OFF_LAST_PUBLISH_ERROR);
    PyModule_AddIntConstant(m, "OFF_LAST_PUBLISH_ERROR_MONO", OFF_LAST_PUBLISH_ERROR_MONO);
    PyModule_AddIntConstant(m, "TOO_BIG", ST_TOO_BIG);
    PyObject *api = PyCapsule_New(&c_api, KVS_SEQLOCK_CAPSULE, NULL);
    if (api == NULL || PyModule_AddObjectRef(m, "_C_API", api) < 0) {
        Py_XDECREF(api);
        Py_DECREF(m);
        return NULL;
    }
    Py_DECREF(api);
    return m;
}
#endif /* KVSIDECAR_LATCH_ONLY */
