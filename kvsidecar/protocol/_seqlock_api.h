/*
 * _seqlock_api.h - the seqlock read, for the other extensions' C code (a PyCapsule).
 *
 * The gateway's compiled paths (kvsidecar/web/_pollfast.c, kvsidecar/daemon/_gatewaystep.c)
 * read a segment at every poll. Through Python (`_seqlock.read_latest`, `kv_load_u64`)
 * each read builds argument tuples, bytes and ints; through this table they call the
 * same guarded code (the latch's read loop, the SIGBUS guard) on C buffers. One table,
 * exported by `kvsidecar.protocol._seqlock` as the capsule named below; a user takes it
 * with PyCapsule_Import (once, at its module's init) and holds the GIL while it reads a
 * buffer it got from a Python object (the object cannot be closed under it then).
 */
#ifndef KVSIDECAR_SEQLOCK_API_H
#define KVSIDECAR_SEQLOCK_API_H

#include <stddef.h>
#include <stdint.h>

#define KVS_SEQLOCK_CAPSULE "kvsidecar.protocol._seqlock._C_API"
#define KVS_SEQLOCK_API_VERSION 1
#define KVS_HEADER_LEN 256

typedef struct {
    int version; /* KVS_SEQLOCK_API_VERSION */
    /* The latest snapshot of the segment mapped at [base, base + len), as read_latest
     * reads it: the 256-byte header into `header`, the slot's payload into `payload`
     * (`cap` bytes: at least the slot's capacity + 16, the slot header's room while it
     * reads; fewer: status 8, TOO_BIG, and *n the size needed), *seq its sequence, *n its
     * length, *attempts the tries. Returns the
     * status (0: OK; the module's constants). Guarded: lost pages are status 5, SIGBUS. */
    int (*read_latest)(const uint8_t *base, size_t len, int retries, uint8_t *header,
                       uint8_t *payload, size_t cap, uint64_t *seq, uint32_t *n,
                       int *attempts);
    /* One aligned 8-byte acquire load at `off` (kv_load_u64): 0, or -1 when `off` is out
     * of [0, len - 8] or misaligned, or the pages are gone. */
    int (*load_u64)(const uint8_t *base, size_t len, size_t off, uint64_t *out);
} KvsSeqlockAPI;

/* The table, taken once at a user's module init (Python.h included before this header):
 * NULL with ImportError set when it is missing or of another version. */
#ifdef Py_PYTHON_H
static inline const KvsSeqlockAPI *kvs_seqlock_import(void) {
    const KvsSeqlockAPI *api = PyCapsule_Import(KVS_SEQLOCK_CAPSULE, 0);
    if (api != NULL && api->version != KVS_SEQLOCK_API_VERSION) {
        PyErr_SetString(PyExc_ImportError, "kvsidecar.protocol._seqlock: another C API version");
        return NULL;
    }
    return api;
}
#endif

#endif
