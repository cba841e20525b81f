/*
 * _pollfast.c - the gateway listener's one request shape in compiled code.
 *
 * A picker sends the same head bytes at every poll, and between two steps of the engine
 * the answer is the same bytes too. `kvsidecar.web.poll_server` keeps both: per
 * connection the exact head its route answered from a `Slot` (`_Conn.fast_head`), per
 * route the `Slot`: the bytes built for the answer of the route's last full check, and
 * what keeps them current (a word of the segment equal to the sequence read at that check,
 * a deadline, a poll cycle's version).
 *
 * wait() is the listener's select: it waits on the selector's own epoll descriptor with
 * the GIL released, and serves in C every ready connection whose bytes are exactly its
 * fast head and whose slot is current: one recv, one compare, one load of the word, one
 * send, the same counts as the Python path (the connection's `served` and `progress`, the
 * server's `requests`, the slot's `counts[key]`). A slot whose word moved, or whose
 * deadline passed, may still be served: its owner's `advance(now)` (compiled too:
 * kvsidecar/daemon/_gatewaystep.c for the gateway) checks the state now and hands back the
 * new bytes, sequence and deadline, or None. Everything else is handed back, as
 * (fd, events, bytes received or None, answer bytes not yet sent or None), to the Python
 * path, which decides it as before: new or different heads, pipelining, parse errors,
 * a stale slot, EOF and errors, a partial send, listeners, the wake socket.
 *
 * The GIL is held while a ready connection is served (non-blocking calls, a few
 * microseconds) so that the Python objects it counts in are exactly as the Python path
 * leaves them; it is released while waiting.
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
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define RECV_MAX 8192 /* poll_server._RECV: what one read of a connection takes */
#define MAX_EVENTS 64

typedef struct {
    PyObject_HEAD
    PyObject *answer;  /* the answer tuple `out` was built for (None: nothing to serve) */
    PyObject *out;     /* the response bytes (None: not built yet) */
    PyObject *load;    /* load(mm, off) -> int: the word that must still equal `seq` */
    PyObject *mm;
    PyObject *off;
    PyObject *seq;
    PyObject *epoch;   /* an object whose .version must still equal `version` */
    PyObject *version;
    PyObject *counts;  /* a dict: counts[key] += 1 for each answer served here */
    PyObject *key;
    PyObject *advance; /* advance(now) -> (out, seq, until) | None, for a moved word */
    double until;      /* CLOCK_MONOTONIC seconds (time.monotonic()): served before it */
    unsigned long long served; /* answers served by wait() from this slot */
    unsigned long long advanced; /* of which built by `advance` for a new word */
} Slot;

static PyObject *one_int; /* 1 */
static PyObject *s_fast_head, *s_inbuf, *s_out, *s_slot, *s_served, *s_progress, *s_version;

static double mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int is_set(PyObject *o) { return o != NULL && o != Py_None; }

static int slot_traverse(Slot *s, visitproc visit, void *arg) {
    Py_VISIT(s->answer);
    Py_VISIT(s->out);
    Py_VISIT(s->load);
    Py_VISIT(s->mm);
    Py_VISIT(s->off);
    Py_VISIT(s->seq);
    Py_VISIT(s->epoch);
    Py_VISIT(s->version);
    Py_VISIT(s->counts);
    Py_VISIT(s->key);
    Py_VISIT(s->advance);
    return 0;
}

static int slot_clear(Slot *s) {
    Py_CLEAR(s->answer);
    Py_CLEAR(s->out);
    Py_CLEAR(s->load);
    Py_CLEAR(s->mm);
    Py_CLEAR(s->off);
    Py_CLEAR(s->seq);
    Py_CLEAR(s->epoch);
    Py_CLEAR(s->version);
    Py_CLEAR(s->counts);
    Py_CLEAR(s->key);
    Py_CLEAR(s->advance);
    return 0;
}

static void slot_dealloc(Slot *s) {
    PyObject_GC_UnTrack(s);
    slot_clear(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyMemberDef slot_members[] = {
    {"answer", T_OBJECT, offsetof(Slot, answer), 0, NULL},
    {"out", T_OBJECT, offsetof(Slot, out), 0, NULL},
    {"load", T_OBJECT, offsetof(Slot, load), 0, NULL},
    {"mm", T_OBJECT, offsetof(Slot, mm), 0, NULL},
    {"off", T_OBJECT, offsetof(Slot, off), 0, NULL},
    {"seq", T_OBJECT, offsetof(Slot, seq), 0, NULL},
    {"epoch", T_OBJECT, offsetof(Slot, epoch), 0, NULL},
    {"version", T_OBJECT, offsetof(Slot, version), 0, NULL},
    {"counts", T_OBJECT, offsetof(Slot, counts), 0, NULL},
    {"key", T_OBJECT, offsetof(Slot, key), 0, NULL},
    {"advance", T_OBJECT, offsetof(Slot, advance), 0, NULL},
    {"advanced", T_ULONGLONG, offsetof(Slot, advanced), 0, NULL},
    {"until", T_DOUBLE, offsetof(Slot, until), 0, NULL},
    {"served", T_ULONGLONG, offsetof(Slot, served), 0, NULL},
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
};

/* 1: a == b; 0: not (or an error, cleared: the Python path decides then). */
static int equal(PyObject *a, PyObject *b) {
    int eq = PyObject_RichCompareBool(a, b, Py_EQ);
    if (eq < 0) PyErr_Clear();
    return eq == 1;
}

/* The slot's bytes for a moved word, from its owner's `advance`: 1 when it built them
 * (out, seq and until replaced), 0 when it declined or failed (the Python path decides). */
static int slot_advance(Slot *s, double now) {
    PyObject *t = PyFloat_FromDouble(now);
    if (t == NULL) {
        PyErr_Clear();
        return 0;
    }
    PyObject *r = PyObject_CallOneArg(s->advance, t);
    Py_DECREF(t);
    if (r == NULL) {
        PyErr_Clear();
        return 0;
    }
    int ok = PyTuple_Check(r) && PyTuple_GET_SIZE(r) == 3 && PyBytes_Check(PyTuple_GET_ITEM(r, 0));
    double until = ok ? PyFloat_AsDouble(PyTuple_GET_ITEM(r, 2)) : 0.0;
    if (ok && until == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        ok = 0;
    }
    if (ok) {
        Py_SETREF(s->out, Py_NewRef(PyTuple_GET_ITEM(r, 0)));
        Py_SETREF(s->seq, Py_NewRef(PyTuple_GET_ITEM(r, 1)));
        s->until = until;
        s->advanced++;
    }
    Py_DECREF(r);
    return ok;
}

/* Whether the slot's bytes may be served now: built, before the deadline, the same poll
 * cycle, the word unchanged (a closed or re-attached map raises in load: not current).
 * A word that moved, or a deadline passed, is offered to the slot's `advance` (its owner's
 * compiled check of the state now; None: the Python path decides). */
static int slot_current(Slot *s, double now) {
    if (!is_set(s->answer) || !is_set(s->out) || !PyBytes_Check(s->out)) return 0;
    if (!is_set(s->load) || !is_set(s->mm) || !is_set(s->off) || !is_set(s->seq)) return 0;
    if (is_set(s->epoch)) {
        PyObject *v = PyObject_GetAttr(s->epoch, s_version);
        if (v == NULL) {
            PyErr_Clear();
            return 0;
        }
        int eq = equal(v, s->version);
        Py_DECREF(v);
        if (!eq) return 0;
    }
    PyObject *args[2] = {s->mm, s->off};
    PyObject *word = PyObject_Vectorcall(s->load, args, 2, NULL);
    if (word == NULL) {
        PyErr_Clear();
        return 0;
    }
    int eq = equal(word, s->seq);
    Py_DECREF(word);
    if (eq && now < s->until) return 1;
    return is_set(s->advance) && slot_advance(s, now);
}

/* d[key] += 1 for a key already there (a new key would change the dict's size under a
 * reader iterating it: the Python path counts the first answer of each key). */
static int bump(PyObject *d, PyObject *key) {
    PyObject *v = PyDict_GetItemWithError(d, key);
    if (v == NULL || !PyLong_CheckExact(v)) {
        PyErr_Clear();
        return -1;
    }
    PyObject *n = PyNumber_Add(v, one_int);
    if (n == NULL) return -1;
    int r = PyDict_SetItem(d, key, n);
    Py_DECREF(n);
    return r;
}

static int has_key(PyObject *d, PyObject *key) {
    if (!PyDict_Check(d)) return 0;
    PyObject *v = PyDict_GetItemWithError(d, key);
    if (v == NULL) PyErr_Clear();
    return v != NULL && PyLong_CheckExact(v);
}

static Py_ssize_t attr_len(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) {
        PyErr_Clear();
        return -1;
    }
    Py_ssize_t n = PyObject_Length(v);
    Py_DECREF(v);
    if (n < 0) PyErr_Clear();
    return n;
}

/* conn.served += 1; conn.progress = now. */
static int count_conn(PyObject *conn, double now) {
    PyObject *served = PyObject_GetAttr(conn, s_served);
    if (served == NULL) return -1;
    PyObject *n = PyNumber_Add(served, one_int);
    Py_DECREF(served);
    if (n == NULL) return -1;
    int r = PyObject_SetAttr(conn, s_served, n);
    Py_DECREF(n);
    if (r < 0) return -1;
    PyObject *t = PyFloat_FromDouble(now);
    if (t == NULL) return -1;
    r = PyObject_SetAttr(conn, s_progress, t);
    Py_DECREF(t);
    return r;
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
static int serve_one(PyObject *list, int fd, unsigned events, PyObject *conns,
                     PyObject *requests, char *buf, double now) {
    PyObject *fdo = PyLong_FromLong(fd);
    if (fdo == NULL) return -1;
    PyObject *conn = PyDict_GetItemWithError(conns, fdo);
    Py_DECREF(fdo);
    if (conn == NULL) {
        if (PyErr_Occurred()) return -1;
        return hand_back(list, fd, events, NULL, 0, NULL); /* a listener, the wake socket */
    }
    if (events != EPOLLIN) return hand_back(list, fd, events, NULL, 0, NULL);
    PyObject *head = PyObject_GetAttr(conn, s_fast_head);
    if (head == NULL) {
        PyErr_Clear();
        return hand_back(list, fd, events, NULL, 0, NULL);
    }
    Py_INCREF(conn); /* borrowed from the dict: held while its attributes are set */
    PyObject *slot_o = PyObject_GetAttr(conn, s_slot);
    if (slot_o == NULL) PyErr_Clear();
    int r;
    if (!PyBytes_Check(head) || slot_o == NULL || !PyObject_TypeCheck(slot_o, &SlotType) ||
        attr_len(conn, s_inbuf) != 0 || attr_len(conn, s_out) != 0) {
        r = hand_back(list, fd, events, NULL, 0, NULL);
        goto done;
    }
    Slot *slot = (Slot *)slot_o;
    ssize_t n = recv(fd, buf, RECV_MAX, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        r = 0; /* nothing after all: still registered for reading */
        goto done;
    }
    if (n <= 0) { /* EOF or an error: the Python path's own recv sees it again */
        r = hand_back(list, fd, events, NULL, 0, NULL);
        goto done;
    }
    Py_ssize_t hn = PyBytes_GET_SIZE(head);
    PyObject *status = is_set(slot->answer) && PyTuple_Check(slot->answer) &&
                               PyTuple_GET_SIZE(slot->answer) > 0
                           ? PyTuple_GET_ITEM(slot->answer, 0)
                           : NULL;
    if (n != hn || memcmp(buf, PyBytes_AS_STRING(head), (size_t)hn) != 0 || status == NULL ||
        !has_key(requests, status) || !is_set(slot->counts) || !is_set(slot->key) ||
        !has_key(slot->counts, slot->key) || !slot_current(slot, now)) {
        r = hand_back(list, fd, events, buf, n, NULL);
        goto done;
    }
    PyObject *out = Py_NewRef(slot->out); /* kept: a count below could run Python code */
    Py_ssize_t len = PyBytes_GET_SIZE(out);
    ssize_t sent = send(fd, PyBytes_AS_STRING(out), (size_t)len, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (sent < 0) sent = 0; /* the Python path's flush meets the error and closes */
    slot->served++;
    if (count_conn(conn, now) < 0 || bump(requests, status) < 0 ||
        bump(slot->counts, slot->key) < 0) {
        Py_DECREF(out);
        r = -1;
        goto done;
    }
    if (sent < len) {
        PyObject *rest = PyBytes_FromStringAndSize(PyBytes_AS_STRING(out) + sent, len - sent);
        r = rest == NULL ? -1 : hand_back(list, fd, 0, NULL, 0, rest);
        Py_XDECREF(rest);
    } else {
        r = 0;
    }
    Py_DECREF(out);
done:
    Py_DECREF(head);
    Py_XDECREF(slot_o);
    Py_DECREF(conn);
    return r;
}

/* wait(epfd, timeout, conns, requests) -> [(fd, events, data, rest)]: handed back */
static PyObject *py_wait(PyObject *self, PyObject *args) {
    int epfd;
    double timeout;
    PyObject *conns, *requests;
    (void)self;
    if (!PyArg_ParseTuple(args, "idO!O!", &epfd, &timeout, &PyDict_Type, &conns, &PyDict_Type,
                          &requests))
        return NULL;
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
            if (serve_one(list, evs[i].data.fd, evs[i].events, conns, requests, buf, now) < 0)
                goto fail;
        }
        /* Back to Python when it has work, or the time is up. */
        if (PyList_GET_SIZE(list) > 0 || n == 0 || now >= deadline) break;
    }
    PyMem_Free(buf);
    return list;
fail:
    PyMem_Free(buf);
    Py_DECREF(list);
    return NULL;
}

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
    {"wait", py_wait, METH_VARARGS,
     "wait(epfd, timeout, conns, requests) -> [(fd, events, data, rest)]: wait on the epoll "
     "descriptor, serve the fast polls (each counted in its slot), hand back the rest."},
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
    if (PyType_Ready(&SlotType) < 0) return NULL;
    if ((one_int = PyLong_FromLong(1)) == NULL) return NULL;
#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL;
    INTERN(s_fast_head, "fast_head");
    INTERN(s_inbuf, "inbuf");
    INTERN(s_out, "out");
    INTERN(s_slot, "slot");
    INTERN(s_served, "served");
    INTERN(s_progress, "progress");
    INTERN(s_version, "version");
#undef INTERN
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Slot", (PyObject *)&SlotType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "RECV_MAX", RECV_MAX) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
