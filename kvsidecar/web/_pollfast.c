/*
 * _pollfast.c - the gateway listener's one request shape in compiled code.
 *
 * A picker sends the same head bytes at every poll, and between two steps of the engine
 * the answer is the same bytes too. `kvsidecar.web.poll_server` keeps both: per
 * connection the exact head its route answered from a `Slot`, armed in a `Table` (per
 * descriptor: the connection, its head, its slot) while the connection is idle and clean;
 * per route the `Slot`: the bytes built for the answer of the route's last full check,
 * and what keeps them current (a word of a mapped segment equal to the sequence read at
 * that check, a deadline, a poll cycle's version in an `Epoch`).
 *
 * Table.wait() is the listener's select: it waits on the selector's own epoll descriptor
 * with the GIL released, and serves in C every ready armed descriptor whose bytes are
 * exactly its head and whose slot is current: one recv, one compare, one guarded load of
 * the word (the seqlock's C API, kvsidecar/protocol/_seqlock_api.h), one send. A slot
 * whose word moved, or whose deadline passed, may still be served: its `advance` (an
 * object whose type offers `_c_advance`, kvsidecar/web/_pollfast_api.h: the gateway's
 * kvsidecar/daemon/_gatewaystep.c) checks the state now and builds the new bytes in C.
 * Everything else is handed back, as (fd, events, bytes received or None, answer bytes
 * not yet sent or None), to the Python path, which decides it as before: new or
 * different heads, pipelining, parse errors, a stale slot, EOF and errors, a partial
 * send, listeners, the wake socket. A descriptor handed back is disarmed first: the
 * Python path arms it again once it has answered it and the connection is clean.
 *
 * What a poll served here touches is C: no Python object is made, looked up or counted
 * in. Its counts are C integers: the slot's `served` (the route's answers, read by the
 * server beside its Python counts), and per descriptor the requests answered and the
 * last progress, folded into the connection's `served` and `progress` before wait
 * returns (the Python path's deadlines and evictions read them only after it has).
 *
 * The GIL is held while a ready descriptor is served (non-blocking calls, a few
 * microseconds): the segment map and the slot's objects cannot be closed or replaced
 * under it. It is released while waiting.
 *
 * native_floor() is no part of the listener: the bench's `native` candidate
 * (kvsidecar/bench/gateway_floor.py), a listener with no interpreter and no checks at all,
 * what any listener costs a poll on the host.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "../protocol/_seqlock_api.h"
#include "_pollfast_api.h"

#define RECV_MAX 8192 /* poll_server._RECV: what one read of a connection takes */
#define MAX_EVENTS 64
#define MAX_FD (1 << 20) /* descriptors above are never armed (served by Python) */

static const KvsSeqlockAPI *seqlock; /* kvsidecar.protocol._seqlock's C API */
static PyObject *s_served, *s_progress;

static double mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int is_set(PyObject *o) { return o != NULL && o != Py_None; }

/* --------------------------------- Epoch ---------------------------------- */

/* A version a poll cycle bumps when what it decided changes (targets.Claims subclasses
 * it): read here as a C integer. */
typedef struct {
    PyObject_HEAD
    unsigned long long version;
} Epoch;

static PyMemberDef epoch_members[] = {
    {"version", T_ULONGLONG, offsetof(Epoch, version), 0, "bumped at each change"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject EpochType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvsidecar.web._pollfast.Epoch",
    .tp_doc = "A version number the compiled path reads in C (subclass it).",
    .tp_basicsize = sizeof(Epoch),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_members = epoch_members,
};

/* ---------------------------------- Slot ---------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *answer;  /* the answer tuple `out` was built for (None: nothing to serve) */
    PyObject *out;     /* the response bytes (None: not built yet) */
    PyObject *mm;      /* a mapped segment: its word at `off` must still equal `seq` */
    PyObject *epoch;   /* an Epoch whose version must still equal `version` (None: any) */
    PyObject *advance; /* an object with `_c_advance`, for a moved word (None: none) */
    kvs_advance_fn adv;
    Py_ssize_t off;
    unsigned long long seq;
    unsigned long long version;
    double until;      /* CLOCK_MONOTONIC seconds (time.monotonic()): served before it */
    int ok;            /* `answer` is a 200 answer: the only kind served here */
    /* A copy of the bytes `advance` built last (valid while `built`), served in place of
     * `out`: the advance's own buffer is its to change at its next call, by anyone. */
    int built;
    char *buf;
    size_t buf_cap;
    Py_ssize_t built_len;
    unsigned long long served;   /* answers served by wait() from this slot */
    unsigned long long advanced; /* of which built by `advance` for a new word */
} Slot;

static int slot_traverse(Slot *s, visitproc visit, void *arg) {
    Py_VISIT(s->answer);
    Py_VISIT(s->out);
    Py_VISIT(s->mm);
    Py_VISIT(s->epoch);
    Py_VISIT(s->advance);
    return 0;
}

static int slot_clear(Slot *s) {
    s->built = 0;
    s->adv = NULL;
    s->ok = 0;
    Py_CLEAR(s->answer);
    Py_CLEAR(s->out);
    Py_CLEAR(s->mm);
    Py_CLEAR(s->epoch);
    Py_CLEAR(s->advance);
    return 0;
}

static void slot_dealloc(Slot *s) {
    PyObject_GC_UnTrack(s);
    slot_clear(s);
    PyMem_Free(s->buf);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *get_obj(PyObject *o) { return Py_NewRef(o ? o : Py_None); }

static PyObject *slot_get_answer(Slot *s, void *c) { (void)c; return get_obj(s->answer); }
static PyObject *slot_get_out(Slot *s, void *c) { (void)c; return get_obj(s->out); }
static PyObject *slot_get_advance(Slot *s, void *c) { (void)c; return get_obj(s->advance); }

/* Each of these makes the bytes served those of `out` again (a new answer, new bytes or
 * a new owner of the next steps). */
static int slot_set_answer(Slot *s, PyObject *v, void *c) {
    (void)c;
    s->built = 0;
    s->ok = v != NULL && PyTuple_Check(v) && PyTuple_GET_SIZE(v) > 0 &&
            PyLong_CheckExact(PyTuple_GET_ITEM(v, 0)) &&
            PyLong_AsLong(PyTuple_GET_ITEM(v, 0)) == 200;
    PyErr_Clear();
    Py_XSETREF(s->answer, v ? Py_NewRef(v) : NULL);
    return 0;
}

static int slot_set_out(Slot *s, PyObject *v, void *c) {
    (void)c;
    s->built = 0;
    Py_XSETREF(s->out, v ? Py_NewRef(v) : NULL);
    return 0;
}

static int slot_set_advance(Slot *s, PyObject *v, void *c) {
    (void)c;
    s->built = 0;
    s->adv = NULL;
    if (is_set(v)) {
        PyObject *cap = PyObject_GetAttrString(v, "_c_advance");
        if (cap != NULL && PyCapsule_IsValid(cap, KVS_ADVANCE_CAPSULE))
            s->adv = (kvs_advance_fn)PyCapsule_GetPointer(cap, KVS_ADVANCE_CAPSULE);
        Py_XDECREF(cap);
        PyErr_Clear(); /* no capsule: never called (the Python path decides a new word) */
    }
    Py_XSETREF(s->advance, v ? Py_NewRef(v) : NULL);
    return 0;
}

static PyGetSetDef slot_getset[] = {
    {"answer", (getter)slot_get_answer, (setter)slot_set_answer, NULL, NULL},
    {"out", (getter)slot_get_out, (setter)slot_set_out, NULL, NULL},
    {"advance", (getter)slot_get_advance, (setter)slot_set_advance, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef slot_members[] = {
    {"mm", T_OBJECT, offsetof(Slot, mm), 0, NULL},
    {"epoch", T_OBJECT, offsetof(Slot, epoch), 0, NULL},
    {"off", T_PYSSIZET, offsetof(Slot, off), 0, NULL},
    {"seq", T_ULONGLONG, offsetof(Slot, seq), 0, NULL},
    {"version", T_ULONGLONG, offsetof(Slot, version), 0, NULL},
    {"until", T_DOUBLE, offsetof(Slot, until), 0, NULL},
    {"served", T_ULONGLONG, offsetof(Slot, served), 0, NULL},
    {"advanced", T_ULONGLONG, offsetof(Slot, advanced), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject SlotType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvsidecar.web._pollfast.Slot",
    .tp_doc = "One route's answer bytes and what keeps them current (see the module).",
    .tp_basicsize = sizeof(Slot),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)slot_dealloc,
    .tp_traverse = (traverseproc)slot_traverse,
    .tp_clear = (inquiry)slot_clear,
    .tp_members = slot_members,
    .tp_getset = slot_getset,
};

/* The poll cycle unchanged: no epoch, or an Epoch at the slot's version (any other
 * object is not read here: not current, the Python path decides). */
static int epoch_same(Slot *s) {
    if (!is_set(s->epoch)) return 1;
    return PyObject_TypeCheck(s->epoch, &EpochType) &&
           ((Epoch *)s->epoch)->version == s->version;
}

/* The slot's word now (0), or -1: no map, a closed one, lost pages. */
static int load_word(Slot *s, uint64_t *word) {
    if (!is_set(s->mm)) return -1;
    Py_buffer view;
    if (PyObject_GetBuffer(s->mm, &view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        return -1;
    }
    int rc = s->off < 0 ? -1 : seqlock->load_u64(view.buf, (size_t)view.len, (size_t)s->off, word);
    PyBuffer_Release(&view);
    return rc;
}

/* The bytes to serve now, or NULL: the answer is not served here, or not current (not
 * built, another poll cycle, the word moved or the deadline passed and `advance`
 * declined or failed). */
static const char *slot_current(Slot *s, double now, Py_ssize_t *len) {
    if (!s->ok || !is_set(s->out) || !PyBytes_Check(s->out) || !epoch_same(s)) return NULL;
    uint64_t word;
    if (load_word(s, &word) < 0) return NULL;
    if (word != s->seq || !(now < s->until)) {
        if (s->adv == NULL) return NULL;
        const char *out;
        Py_ssize_t n;
        uint64_t seq;
        double until;
        int rc = s->adv(s->advance, now, &out, &n, &seq, &until);
        if (rc != 1) {
            if (rc < 0) PyErr_Clear();
            return NULL;
        }
        if ((size_t)n > s->buf_cap) {
            char *grown = PyMem_Realloc(s->buf, (size_t)n);
            if (grown == NULL) {
                s->built = 0;
                return NULL;
            }
            s->buf = grown;
            s->buf_cap = (size_t)n;
        }
        memcpy(s->buf, out, (size_t)n);
        s->built = 1;
        s->built_len = n;
        s->seq = seq;
        s->until = until;
        s->advanced++;
    }
    if (s->built) {
        *len = s->built_len;
        return s->buf;
    }
    *len = PyBytes_GET_SIZE(s->out);
    return PyBytes_AS_STRING(s->out);
}

/* ---------------------------------- Table --------------------------------- */

/* One armed descriptor: its connection, the exact head answered from `slot`, and what
 * was served here since the last fold. */
typedef struct {
    PyObject *conn;
    PyObject *head; /* bytes */
    Slot *slot;
    unsigned long long served;
    double progress;
} Entry;

typedef struct {
    PyObject_HEAD
    Entry *e; /* indexed by descriptor; conn NULL: not armed */
    int cap;
    int *dirty; /* descriptors served since the last fold (each once) */
    int ndirty;
} Table;

static int table_traverse(Table *t, visitproc visit, void *arg) {
    for (int fd = 0; fd < t->cap; fd++) {
        Py_VISIT(t->e[fd].conn);
        Py_VISIT(t->e[fd].head);
        Py_VISIT((PyObject *)t->e[fd].slot);
    }
    return 0;
}

static void entry_drop(Entry *e) {
    Py_CLEAR(e->conn);
    Py_CLEAR(e->head);
    Py_CLEAR(e->slot);
    e->served = 0;
}

static int table_clear(Table *t) {
    for (int fd = 0; fd < t->cap; fd++) entry_drop(&t->e[fd]);
    t->ndirty = 0;
    return 0;
}

static void table_dealloc(Table *t) {
    PyObject_GC_UnTrack(t);
    table_clear(t);
    PyMem_Free(t->e);
    PyMem_Free(t->dirty);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

/* conn.served += n; conn.progress = at. */
static int count_conn(PyObject *conn, unsigned long long n, double at) {
    PyObject *served = PyObject_GetAttr(conn, s_served);
    if (served == NULL) return -1;
    PyObject *k = PyLong_FromUnsignedLongLong(n);
    PyObject *sum = k == NULL ? NULL : PyNumber_Add(served, k);
    Py_DECREF(served);
    Py_XDECREF(k);
    if (sum == NULL) return -1;
    int r = PyObject_SetAttr(conn, s_served, sum);
    Py_DECREF(sum);
    if (r < 0) return -1;
    PyObject *t = PyFloat_FromDouble(at);
    if (t == NULL) return -1;
    r = PyObject_SetAttr(conn, s_progress, t);
    Py_DECREF(t);
    return r;
}

/* The entry's counts into its connection. */
static int entry_fold(Entry *e) {
    if (e->conn == NULL || e->served == 0) return 0;
    unsigned long long n = e->served;
    e->served = 0;
    return count_conn(e->conn, n, e->progress);
}

static int table_fold(Table *t) {
    int rc = 0;
    for (int i = 0; i < t->ndirty; i++) {
        int fd = t->dirty[i];
        if (fd < t->cap && entry_fold(&t->e[fd]) < 0) rc = -1;
    }
    t->ndirty = 0;
    return rc;
}

static int disarm(Table *t, int fd) {
    if (fd < 0 || fd >= t->cap || t->e[fd].conn == NULL) return 0;
    int rc = entry_fold(&t->e[fd]);
    entry_drop(&t->e[fd]);
    return rc;
}

/* arm(fd, conn, head, slot): serve this descriptor's polls of `head` from `slot`. */
static PyObject *table_arm(Table *t, PyObject *args) {
    int fd;
    PyObject *conn, *head, *slot;
    if (!PyArg_ParseTuple(args, "iOO!O!", &fd, &conn, &PyBytes_Type, &head, &SlotType, &slot))
        return NULL;
    if (fd < 0 || fd >= MAX_FD) Py_RETURN_FALSE;
    if (fd >= t->cap) {
        int cap = t->cap ? t->cap : 64;
        while (cap <= fd) cap *= 2;
        Entry *e = PyMem_Realloc(t->e, sizeof(Entry) * (size_t)cap);
        if (e == NULL) return PyErr_NoMemory();
        memset(e + t->cap, 0, sizeof(Entry) * (size_t)(cap - t->cap));
        int *dirty = PyMem_Realloc(t->dirty, sizeof(int) * (size_t)cap);
        if (dirty == NULL) {
            t->e = e; /* kept: its entries are valid */
            return PyErr_NoMemory();
        }
        t->e = e;
        t->dirty = dirty;
        t->cap = cap;
    }
    if (disarm(t, fd) < 0) return NULL;
    Entry *e = &t->e[fd];
    e->conn = Py_NewRef(conn);
    e->head = Py_NewRef(head);
    e->slot = (Slot *)Py_NewRef(slot);
    Py_RETURN_TRUE;
}

static PyObject *table_disarm(Table *t, PyObject *arg) {
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred()) return NULL;
    int fd = v < 0 || v > MAX_FD ? -1 : (int)v;
    if (disarm(t, fd) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *table_armed(Table *t, PyObject *arg) {
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred()) return NULL;
    int fd = v < 0 || v > MAX_FD ? -1 : (int)v;
    return PyBool_FromLong(fd >= 0 && fd < t->cap && t->e[fd].conn != NULL);
}

static int hand_back(PyObject *list, int fd, unsigned events, const char *data, Py_ssize_t n,
                     PyObject *rest) {
    PyObject *got;
    if (data != NULL) {
        got = PyBytes_FromStringAndSize(data, n);
        if (got == NULL) return -1;
    } else {
        got = Py_NewRef(Py_None);
    }
    PyObject *item = Py_BuildValue("(iINO)", fd, events, got, rest ? rest : Py_None);
    if (item == NULL) return -1;
    int r = PyList_Append(list, item);
    Py_DECREF(item);
    return r;
}

/* One ready descriptor: served here (0), handed back (0, appended), or an error (-1). */
static int serve_one(Table *t, PyObject *list, int fd, unsigned events, char *buf, double now) {
    Entry *e = fd >= 0 && fd < t->cap && t->e[fd].conn != NULL ? &t->e[fd] : NULL;
    if (e == NULL) return hand_back(list, fd, events, NULL, 0, NULL); /* Python's */
    if (events != EPOLLIN) {
        if (disarm(t, fd) < 0) return -1;
        return hand_back(list, fd, events, NULL, 0, NULL);
    }
    ssize_t n = recv(fd, buf, RECV_MAX, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return 0; /* nothing after all: still armed */
    if (n <= 0) { /* EOF or an error: the Python path's own recv sees it again */
        if (disarm(t, fd) < 0) return -1;
        return hand_back(list, fd, events, NULL, 0, NULL);
    }
    Py_ssize_t hn = PyBytes_GET_SIZE(e->head), len = 0;
    const char *out = NULL;
    /* Held while `advance` runs (it may allocate, and so collect). */
    Slot *slot = (Slot *)Py_NewRef(e->slot);
    if (n == hn && memcmp(buf, PyBytes_AS_STRING(e->head), (size_t)hn) == 0)
        out = slot_current(slot, now, &len);
    e = fd < t->cap && t->e[fd].conn != NULL && t->e[fd].slot == slot ? &t->e[fd] : NULL;
    if (out == NULL || e == NULL) {
        Py_DECREF(slot);
        if (disarm(t, fd) < 0) return -1;
        return hand_back(list, fd, events, buf, n, NULL);
    }
    ssize_t sent = send(fd, out, (size_t)len, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (sent < 0) sent = 0; /* the Python path's flush meets the error and closes */
    slot->served++;
    Py_DECREF(slot); /* the entry holds it still */
    if (e->served++ == 0 && t->ndirty < t->cap) t->dirty[t->ndirty++] = fd;
    e->progress = now;
    if (sent < len) { /* the rest waits for the client: the Python path's */
        PyObject *rest = PyBytes_FromStringAndSize(out + sent, len - sent);
        if (rest == NULL || disarm(t, fd) < 0) {
            Py_XDECREF(rest);
            return -1;
        }
        int r = hand_back(list, fd, 0, NULL, 0, rest);
        Py_DECREF(rest);
        return r;
    }
    return 0;
}

/* wait(epfd, timeout) -> [(fd, events, data, rest)]: handed back; the counts folded. */
static PyObject *table_wait(Table *t, PyObject *args) {
    int epfd;
    double timeout;
    if (!PyArg_ParseTuple(args, "id", &epfd, &timeout)) return NULL;
    char *buf = PyMem_Malloc(RECV_MAX);
    if (buf == NULL) return PyErr_NoMemory();
    PyObject *list = PyList_New(0);
    if (list == NULL) {
        PyMem_Free(buf);
        return NULL;
    }
    struct epoll_event evs[MAX_EVENTS];
    double deadline = mono() + (timeout > 0 ? timeout : 0);
    for (;;) {
        double left = deadline - mono();
        int ms = left > 0 ? (int)ceil(left * 1000) : 0;
        int n;
        Py_BEGIN_ALLOW_THREADS
        n = epoll_wait(epfd, evs, MAX_EVENTS, ms);
        Py_END_ALLOW_THREADS
        if (n < 0) {
            if (errno == EINTR) continue;
            PyErr_SetFromErrno(PyExc_OSError);
            goto fail;
        }
        double now = mono();
        for (int i = 0; i < n; i++) {
            if (serve_one(t, list, evs[i].data.fd, evs[i].events, buf, now) < 0) goto fail;
        }
        /* Back to Python when it has work, or the time is up. */
        if (PyList_GET_SIZE(list) > 0 || n == 0 || now >= deadline) break;
    }
    PyMem_Free(buf);
    if (table_fold(t) < 0) {
        Py_DECREF(list);
        return NULL;
    }
    return list;
fail:
    PyMem_Free(buf);
    Py_DECREF(list);
    table_fold(t);
    return NULL;
}

static PyMethodDef table_methods[] = {
    {"arm", (PyCFunction)table_arm, METH_VARARGS,
     "arm(fd, conn, head, slot) -> bool: serve the descriptor's polls of `head` from `slot` "
     "(False: a descriptor too high to be armed)."},
    {"disarm", (PyCFunction)table_disarm, METH_O,
     "disarm(fd): serve it no more (its counts folded into its connection)."},
    {"armed", (PyCFunction)table_armed, METH_O, "armed(fd) -> bool."},
    {"wait", (PyCFunction)table_wait, METH_VARARGS,
     "wait(epfd, timeout) -> [(fd, events, data, rest)]: wait on the epoll descriptor, "
     "serve the armed descriptors' polls, hand back the rest (disarmed), fold the counts."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvsidecar.web._pollfast.Table",
    .tp_doc = "The armed descriptors of one listener, and its compiled wait (see the module).",
    .tp_basicsize = sizeof(Table),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)table_dealloc,
    .tp_traverse = (traverseproc)table_traverse,
    .tp_clear = (inquiry)table_clear,
    .tp_methods = table_methods,
};

static long long thread_cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

#define NATIVE_CONNS 1024

/* The native floor's loop, no GIL held: accept on `lfd` (non-blocking), and on each read
 * of a connection send `answer` once per head end (CRLF CRLF) in the bytes read (a
 * picker's head comes in one read), for `seconds` or until `most` answers (0: no limit).
 * Counts the answers sent in *polls. -1: errno set. */
static int native_loop(int lfd, const char *answer, size_t alen, double seconds,
                       unsigned long long most, unsigned long long *polls) {
    int conns[NATIVE_CONNS];
    int nconns = 0, rc = 0;
    char buf[RECV_MAX];
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = lfd}, evs[MAX_EVENTS];
    int ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0) return -1;
    if (epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev) < 0) {
        close(ep);
        return -1;
    }
    double deadline = mono() + seconds;
    for (;;) {
        double left = deadline - mono();
        if (left <= 0 || (most && *polls >= most)) break;
        int n = epoll_wait(ep, evs, MAX_EVENTS, (int)ceil(left * 1000));
        if (n < 0) {
            if (errno == EINTR) continue;
            rc = -1;
            break;
        }
        for (int i = 0; i < n; i++) {
            int fd = evs[i].data.fd;
            if (fd == lfd) {
                int c;
                while ((c = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC)) >= 0) {
                    struct epoll_event cev = {.events = EPOLLIN, .data.fd = c};
                    if (nconns == NATIVE_CONNS || epoll_ctl(ep, EPOLL_CTL_ADD, c, &cev) < 0) {
                        close(c);
                        continue;
                    }
                    conns[nconns++] = c;
                }
                continue;
            }
            ssize_t got = recv(fd, buf, sizeof buf, 0);
            if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
            if (got <= 0) { /* EOF or an error: this connection is done */
                for (int k = 0; k < nconns; k++) {
                    if (conns[k] == fd) {
                        conns[k] = conns[--nconns];
                        break;
                    }
                }
                close(fd); /* closing also takes it out of the epoll set */
                continue;
            }
            for (ssize_t k = 0; k + 3 < got; k++) {
                if (memcmp(buf + k, "\r\n\r\n", 4) == 0) {
                    send(fd, answer, alen, MSG_DONTWAIT | MSG_NOSIGNAL);
                    (*polls)++;
                    k += 3;
                }
            }
        }
    }
    for (int k = 0; k < nconns; k++) close(conns[k]);
    close(ep);
    return rc;
}

/* native_floor(listen_fd, answer, seconds, most=0) -> (answers sent, thread CPU ns) */
static PyObject *py_native_floor(PyObject *self, PyObject *args) {
    int lfd;
    Py_buffer answer;
    double seconds;
    unsigned long long most = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*d|K", &lfd, &answer, &seconds, &most)) return NULL;
    unsigned long long polls = 0;
    long long cpu = 0;
    int rc, flags = fcntl(lfd, F_GETFL);
    Py_BEGIN_ALLOW_THREADS
    long long cpu0 = thread_cpu_ns();
    rc = flags < 0 ? -1 : fcntl(lfd, F_SETFL, flags | O_NONBLOCK);
    if (rc == 0) rc = native_loop(lfd, answer.buf, (size_t)answer.len, seconds, most, &polls);
    cpu = thread_cpu_ns() - cpu0;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&answer);
    if (rc < 0) return PyErr_SetFromErrno(PyExc_OSError);
    return Py_BuildValue("(KL)", polls, cpu);
}

static PyMethodDef methods[] = {
    {"native_floor", py_native_floor, METH_VARARGS,
     "native_floor(listen_fd, answer, seconds, most=0) -> (answers sent, thread CPU ns): "
     "for `seconds` (or until `most` answers), with the GIL released, accept on the "
     "listening socket and send `answer` for each request head read (no parse, no checks): "
     "the host's floor, for the bench."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pollfast", "The gateway listener's one request shape in C.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pollfast(void) {
    if (PyType_Ready(&SlotType) < 0 || PyType_Ready(&TableType) < 0 ||
        PyType_Ready(&EpochType) < 0)
        return NULL;
    if ((seqlock = kvs_seqlock_import()) == NULL) return NULL;
#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL;
    INTERN(s_served, "served");
    INTERN(s_progress, "progress");
#undef INTERN
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Slot", (PyObject *)&SlotType) < 0 ||
        PyModule_AddObjectRef(m, "Table", (PyObject *)&TableType) < 0 ||
        PyModule_AddObjectRef(m, "Epoch", (PyObject *)&EpochType) < 0 ||
        PyModule_AddIntConstant(m, "RECV_MAX", RECV_MAX) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
