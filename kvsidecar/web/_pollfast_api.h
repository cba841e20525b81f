/*
 * _pollfast_api.h - what a slot's `advance` may offer the listener's compiled path in C.
 *
 * A `_pollfast.Slot`'s `advance(now)` builds the answer for a moved word (a new step). A
 * Python callable costs its call, the argument float and a result tuple; an object whose
 * type carries the capsule `_c_advance` (named below) is called through its function
 * instead: the bytes stay the object's own (valid until its next call or its end), the
 * slot keeps a reference to it. Called with the GIL held.
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
