/* tiered_kv.storage._fastread: read one stored record's parts and hash them, GIL released.
 *
 * The disk tier's verified reads spend most of their time in two loops that need no Python:
 * the preadv of a record's parts (header, the caller's payload buffers, the stored checksum)
 * and the xxh3-128 of header + payload. python-xxhash releases the GIL only for pieces over
 * 64 KiB, so a record read into a scatter list of pool rows (62 pieces of 0.6-18 KiB for a
 * Flash block) hashes with the GIL held. read_and_hash() does both with the GIL released.
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

static PyMethodDef methods[] = {
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
