/* tiered_kv.storage._fastread: read one stored record's parts and hash them, GIL released.
 *
 * The disk tier's verified reads spend most of their time in two loops that need no Python:
 * the preadv of a record's parts (header, the caller's payload buffers, the stored checksum)
 * and the xxh3-128 of header + payload. python-xxhash releases the GIL only for pieces over
 * 64 KiB, so a record read into a scatter list of pool rows (62 pieces of 0.6-18 KiB for a
 * Flash block) hashes with the GIL held. read_and_hash() does both with the GIL released;
 * read_verify_many() does it for a whole batch of records in one call (one GIL release) and
 * also checks each header's known fields and checksum, as PartsVerifier does in Python.
 *
 * xxh3 itself is not reimplemented here: bind_xxh3() takes the addresses of xxHash's public
 * streaming API (XXH3_createState, XXH3_freeState, XXH3_128bits_reset, _update, _digest) as
 * exported by the python-xxhash extension module already loaded in the process (found by
 * ctypes in storage/fastread.py, which checks the result against python-xxhash before using
 * it). Without this module, or without those symbols, fastread.py falls back to os.preadv +
 * python-xxhash with the same results.
 *
 * Built by `pip install` (setup.py, an optional extension: where it cannot be compiled the
 * package installs without it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

typedef struct {
    unsigned long long low64;
    unsigned long long high64;
} xxh128_hash;

typedef void *(*create_fn)(void);
typedef int (*free_fn)(void *);
typedef int (*reset_fn)(void *);
typedef int (*update_fn)(void *, const void *, size_t);
typedef xxh128_hash (*digest_fn)(const void *);

static create_fn xxh_create;
static free_fn xxh_free;
static reset_fn xxh_reset;
static update_fn xxh_update;
static digest_fn xxh_digest;

#define DIGEST_BYTES 16

static PyObject *
bind_xxh3(PyObject *self, PyObject *args)
{
    unsigned long long c, f, r, u, d;
    if (!PyArg_ParseTuple(args, "KKKKK", &c, &f, &r, &u, &d))
        return NULL;
    if (!c || !f || !r || !u || !d) {
        PyErr_SetString(PyExc_ValueError, "bind_xxh3: expected five non-null function addresses");
        return NULL;
    }
    xxh_create = (create_fn)(uintptr_t)c;
    xxh_free = (free_fn)(uintptr_t)f;
    xxh_reset = (reset_fn)(uintptr_t)r;
    xxh_update = (update_fn)(uintptr_t)u;
    xxh_digest = (digest_fn)(uintptr_t)d;
    Py_RETURN_NONE;
}

/* Read iov[0..n) from fd at offset until full or end of file (EINTR retried). Returns the
 * bytes read, or -1 with errno set. Advances through iov in place. */
static Py_ssize_t
preadv_full(int fd, struct iovec *iov, int n, off_t offset)
{
    Py_ssize_t got = 0;
    while (n > 0) {
        ssize_t r = preadv(fd, iov, n < IOV_MAX ? n : IOV_MAX, offset + got);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (r == 0)
            break;
        got += r;
        while (n > 0 && (size_t)r >= iov->iov_len) {
            r -= (ssize_t)iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0 && r > 0) {
            iov->iov_base = (char *)iov->iov_base + r;
            iov->iov_len -= (size_t)r;
        }
    }
    return got;
}

static void
canonical(xxh128_hash h, unsigned char out[DIGEST_BYTES])
{
    for (int i = 0; i < 8; i++) {
        out[i] = (unsigned char)(h.high64 >> (56 - 8 * i));
        out[8 + i] = (unsigned char)(h.low64 >> (56 - 8 * i));
    }
}

PyDoc_STRVAR(read_and_hash_doc,
"read_and_hash(fd, offset, bufs, /) -> (bytes_read, digest)\n\n"
"preadv the writable buffers ``bufs`` (header, payload pieces, stored checksum: in file\n"
"order) from ``fd`` at ``offset`` until they are full or the file ends, then the\n"
"canonical xxh3-128 of every buffer but the last (16 bytes), or None when the read came\n"
"back short. The GIL is released meanwhile. OSError on a read error.");

static PyObject *
read_and_hash(PyObject *self, PyObject *args)
{
    int fd;
    long long offset;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "iLO", &fd, &offset, &seq))
        return NULL;
    if (xxh_create == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "read_and_hash: xxh3 is not bound (bind_xxh3)");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(seq, "read_and_hash: bufs must be a sequence of buffers");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n < 1 || n > INT_MAX) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "read_and_hash: expected at least one buffer");
        return NULL;
    }
    Py_buffer *views = PyMem_Calloc((size_t)n, sizeof(Py_buffer));
    struct iovec *iov = PyMem_Calloc((size_t)n, sizeof(struct iovec));
    struct iovec *rest = PyMem_Calloc((size_t)n, sizeof(struct iovec));
    Py_ssize_t held = 0, want = 0, got = 0;
    PyObject *result = NULL;
    if (views == NULL || iov == NULL || rest == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(items[i], &views[i], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        held++;
        iov[i].iov_base = views[i].buf;
        iov[i].iov_len = (size_t)views[i].len;
        want += views[i].len;
    }
    if (views[n - 1].len != DIGEST_BYTES) {
        PyErr_Format(PyExc_ValueError, "read_and_hash: the last buffer (the stored checksum) must "
                     "be %d bytes, got %zd", DIGEST_BYTES, views[n - 1].len);
        goto done;
    }
    memcpy(rest, iov, (size_t)n * sizeof(struct iovec));
    int err = 0, short_read = 0, nomem = 0;
    unsigned char digest[DIGEST_BYTES];
    Py_BEGIN_ALLOW_THREADS
    got = preadv_full(fd, rest, (int)n, (off_t)offset);
    if (got < 0) {
        err = errno;
    } else if (got < want) {
        short_read = 1;
    } else {
        void *state = xxh_create();
        if (state == NULL) {
            nomem = 1;
        } else {
            xxh_reset(state);
            for (Py_ssize_t i = 0; i + 1 < n; i++)
                xxh_update(state, iov[i].iov_base, iov[i].iov_len);
            canonical(xxh_digest(state), digest);
            xxh_free(state);
        }
    }
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    if (nomem) {
        PyErr_NoMemory();
        goto done;
    }
    if (short_read)
        result = Py_BuildValue("nO", got, Py_None);
    else
        result = Py_BuildValue("ny#", got, (const char *)digest, (Py_ssize_t)DIGEST_BYTES);
done:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(iov);
    PyMem_Free(rest);
    Py_DECREF(fast);
    return result;
}

/* ------------------------------------------------------------------ read_verify_many */

/* expect: identity (72 B: magic, version, kind, flags, fingerprint, block hash), payload
 * length (8 B LE), the index's checksum (16 B), optionally the token digest (32 B). */
#define ID_BYTES 72
#define EXPECT_BYTES (ID_BYTES + 8 + DIGEST_BYTES)
#define EXPECT_WITH_DIGEST (EXPECT_BYTES + 32)
#define HEADER_BYTES 144
#define PARENT_AT 72
#define DIGEST_AT 104
#define LENGTH_AT 136

enum { ST_OK = 0, ST_SHORT = 1, ST_BAD = 2 };

typedef struct {
    int fd;
    long long offset;
    Py_ssize_t first, count;   /* its pieces: iov[first .. first + count) */
    Py_ssize_t want;
    const unsigned char *expect;
    Py_ssize_t expect_len;
    int status;
} job_t;

static int
verify_one(job_t *j, struct iovec *iov, struct iovec *scratch, void *state)
{
    struct iovec *mine = iov + j->first;
    memcpy(scratch, mine, (size_t)j->count * sizeof(struct iovec));
    Py_ssize_t got = preadv_full(j->fd, scratch, (int)j->count, (off_t)j->offset);
    if (got < j->want)
        return ST_SHORT;   /* end of file or a read error: a miss */
    const unsigned char *header = mine[0].iov_base;
    const unsigned char *tail = mine[j->count - 1].iov_base;
    const unsigned char *e = j->expect;
    if (memcmp(header, e, ID_BYTES) != 0 || memcmp(header + LENGTH_AT, e + ID_BYTES, 8) != 0)
        return ST_BAD;
    if (memcmp(tail, e + ID_BYTES + 8, DIGEST_BYTES) != 0)
        return ST_BAD;     /* not the checksum the index holds */
    if (j->expect_len == EXPECT_WITH_DIGEST && memcmp(header + DIGEST_AT, e + EXPECT_BYTES, 32) != 0)
        return ST_BAD;
    unsigned char digest[DIGEST_BYTES];
    xxh_reset(state);
    for (Py_ssize_t i = 0; i + 1 < j->count; i++)
        xxh_update(state, mine[i].iov_base, mine[i].iov_len);
    canonical(xxh_digest(state), digest);
    return memcmp(digest, tail, DIGEST_BYTES) == 0 ? ST_OK : ST_BAD;
}

PyDoc_STRVAR(read_verify_many_doc,
"read_verify_many(items, /) -> list[int]\n\n"
"For each ``(fd, offset, bufs, expect)`` of ``items``: preadv the writable buffers ``bufs``\n"
"(a record's 144-byte header, its payload pieces, its 16-byte checksum) from ``fd`` at\n"
"``offset``, then check it: the header's identity fields and payload length against\n"
"``expect`` (72 + 8 bytes), the stored checksum against the index's (``expect``'s next\n"
"16 bytes) and against the xxh3-128 of header + payload, and the header's token digest\n"
"against ``expect``'s last 32 bytes when given. Returns one status each: 0 verified, 1\n"
"not read whole (end of file or a read error), 2 read but failing a check. The GIL is\n"
"released for the whole batch.");

static PyObject *
read_verify_many(PyObject *self, PyObject *arg)
{
    if (xxh_create == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "read_verify_many: xxh3 is not bound (bind_xxh3)");
        return NULL;
    }
    PyObject *items = PySequence_Fast(arg, "read_verify_many: expected a sequence of items");
    if (items == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
    PyObject **item_v = PySequence_Fast_ITEMS(items);
    job_t *jobs = PyMem_Calloc((size_t)(n ? n : 1), sizeof(job_t));
    PyObject **seqs = PyMem_Calloc((size_t)(n ? n : 1), sizeof(PyObject *));
    Py_ssize_t total = 0, cap = 0, held = 0, max_count = 0;
    Py_buffer *views = NULL;
    struct iovec *iov = NULL, *scratch = NULL;
    PyObject *result = NULL;
    void *state = NULL;
    if (jobs == NULL || seqs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *fd_o, *off_o, *bufs_o, *expect_o;
        if (!PyTuple_Check(item_v[k]) || PyTuple_GET_SIZE(item_v[k]) != 4) {
            PyErr_Format(PyExc_TypeError, "read_verify_many: items[%zd]: expected (fd, offset, bufs, expect)", k);
            goto done;
        }
        fd_o = PyTuple_GET_ITEM(item_v[k], 0);
        off_o = PyTuple_GET_ITEM(item_v[k], 1);
        bufs_o = PyTuple_GET_ITEM(item_v[k], 2);
        expect_o = PyTuple_GET_ITEM(item_v[k], 3);
        jobs[k].fd = (int)PyLong_AsLong(fd_o);
        jobs[k].offset = PyLong_AsLongLong(off_o);
        if (PyErr_Occurred())
            goto done;
        if (!PyBytes_Check(expect_o) || (PyBytes_GET_SIZE(expect_o) != EXPECT_BYTES
                                        && PyBytes_GET_SIZE(expect_o) != EXPECT_WITH_DIGEST)) {
            PyErr_Format(PyExc_ValueError, "read_verify_many: items[%zd]: expect must be %d or %d bytes",
                         k, EXPECT_BYTES, EXPECT_WITH_DIGEST);
            goto done;
        }
        jobs[k].expect = (const unsigned char *)PyBytes_AS_STRING(expect_o);
        jobs[k].expect_len = PyBytes_GET_SIZE(expect_o);
        seqs[k] = PySequence_Fast(bufs_o, "read_verify_many: bufs must be a sequence of buffers");
        if (seqs[k] == NULL)
            goto done;
        Py_ssize_t c = PySequence_Fast_GET_SIZE(seqs[k]);
        if (c < 2 || c > INT_MAX) {
            PyErr_Format(PyExc_ValueError, "read_verify_many: items[%zd]: expected header, payload pieces, checksum", k);
            goto done;
        }
        jobs[k].first = total;
        jobs[k].count = c;
        total += c;
        if (c > max_count)
            max_count = c;
    }
    cap = total ? total : 1;
    views = PyMem_Calloc((size_t)cap, sizeof(Py_buffer));
    iov = PyMem_Calloc((size_t)cap, sizeof(struct iovec));
    scratch = PyMem_Calloc((size_t)(max_count ? max_count : 1), sizeof(struct iovec));
    if (views == NULL || iov == NULL || scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject **pieces = PySequence_Fast_ITEMS(seqs[k]);
        Py_ssize_t want = 0;
        for (Py_ssize_t i = 0; i < jobs[k].count; i++) {
            Py_ssize_t at = jobs[k].first + i;
            if (PyObject_GetBuffer(pieces[i], &views[at], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
                goto done;
            held = at + 1;
            iov[at].iov_base = views[at].buf;
            iov[at].iov_len = (size_t)views[at].len;
            want += views[at].len;
        }
        if (views[jobs[k].first].len != HEADER_BYTES || views[jobs[k].first + jobs[k].count - 1].len != DIGEST_BYTES) {
            PyErr_Format(PyExc_ValueError, "read_verify_many: items[%zd]: expected a %d-byte header first and a "
                         "%d-byte checksum last", k, HEADER_BYTES, DIGEST_BYTES);
            goto done;
        }
        jobs[k].want = want;
    }
    int nomem = 0;
    Py_BEGIN_ALLOW_THREADS
    state = xxh_create();
    if (state == NULL) {
        nomem = 1;
    } else {
        for (Py_ssize_t k = 0; k < n; k++)
            jobs[k].status = verify_one(&jobs[k], iov, scratch, state);
        xxh_free(state);
    }
    Py_END_ALLOW_THREADS
    if (nomem) {
        PyErr_NoMemory();
        goto done;
    }
    result = PyList_New(n);
    if (result == NULL)
        goto done;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *st = PyLong_FromLong(jobs[k].status);
        if (st == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, k, st);
    }
done:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    if (seqs != NULL)
        for (Py_ssize_t k = 0; k < n; k++)
            Py_XDECREF(seqs[k]);
    PyMem_Free(views);
    PyMem_Free(iov);
    PyMem_Free(scratch);
    PyMem_Free(jobs);
    PyMem_Free(seqs);
    Py_DECREF(items);
    return result;
}

static PyMethodDef methods[] = {
    {"read_verify_many", read_verify_many, METH_O, read_verify_many_doc},
    {"bind_xxh3", bind_xxh3, METH_VARARGS,
     "bind_xxh3(create, free, reset, update, digest): addresses of xxHash's XXH3_createState, "
     "XXH3_freeState, XXH3_128bits_reset, XXH3_128bits_update, XXH3_128bits_digest."},
    {"read_and_hash", read_and_hash, METH_VARARGS, read_and_hash_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastread",
    "Read a stored record's parts and hash them with the GIL released (see fastread.py).",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__fastread(void)
{
    return PyModule_Create(&module);
}
