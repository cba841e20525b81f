/*
 * _pollfast_api.h - what a slot's `advance` may offer the listener's compiled path in C.
 *
 * A `_pollfast.Slot`'s `advance` builds the answer for a moved word (a new step), in C:
 * an object whose type carries the capsule `_c_advance` (named below) is called through
 * its function, with the GIL held (anything else is never called: the Python path decides
 * the new word). The bytes are the object's own until its next call (by anyone); the slot
 * copies them before it serves them, and keeps a reference to the object.
 */
#ifndef KVSIDECAR_POLLFAST_API_H
#define KVSIDECAR_POLLFAST_API_H

#include <Python.h>
#include <stdint.h>

#define KVS_ADVANCE_CAPSULE "kvsidecar.web._pollfast.advance"

/* 1: built (*out, *len: the response, *seq the word it is current for, *until its deadline
 * in CLOCK_MONOTONIC seconds); 0: declined; -1: an error (a Python exception set: the
 * caller clears it and declines). */
typedef int (*kvs_advance_fn)(PyObject *self, double now, const char **out, Py_ssize_t *len,
                              uint64_t *seq, double *until);

#endif
