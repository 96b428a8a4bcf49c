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

/* ------------------------------------------------------------------ read_verify_rows */

/* An int64 array argument of `count` values, C-contiguous (numpy int64): its buffer. */
static int
int64_arg(PyObject *o, Py_buffer *view, Py_ssize_t count, const char *name)
{
    if (PyObject_GetBuffer(o, view, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len != count * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "read_verify_rows: %s: expected %zd int64 values (%zd bytes), got %zd bytes",
                     name, count, count * (Py_ssize_t)sizeof(int64_t), view->len);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int64_t
int64_at(const Py_buffer *view, Py_ssize_t i)
{
    int64_t v;
    memcpy(&v, (const char *)view->buf + i * (Py_ssize_t)sizeof(int64_t), sizeof(v));
    return v;
}

PyDoc_STRVAR(read_verify_rows_doc,
"read_verify_rows(dests, dest_of, lengths, offsets, where, expects, /) -> bytes\n\n"
"read_verify_many for records whose payloads land in a few large buffers (a cache's pools),\n"
"each record's pieces given as byte offsets instead of one buffer object per piece.\n"
"``dests``: a sequence of writable C-contiguous buffers. Piece j of every record is\n"
"``lengths[j]`` bytes long and lands in ``dests[dest_of[j]]``, at byte ``offsets[k, j]`` for\n"
"record k (int64 arrays [m], [m] and [n, m]); record k (header, pieces, checksum) is read\n"
"from fd ``where[k, 0]`` at offset ``where[k, 1]`` (int64 [n, 2]) and checked against\n"
"``expects[k]`` (uint8 [n, E], E = 96 or 128: as read_verify_many's ``expect``). Every piece is\n"
"checked to lie within its buffer before anything is read. Returns one status byte per record:\n"
"0 verified, 1 not read whole, 2 failing a check. The GIL is released for the whole batch.");

static PyObject *
read_verify_rows(PyObject *self, PyObject *args)
{
    PyObject *dests_o, *dest_of_o, *lengths_o, *offsets_o, *where_o, *expects_o;
    if (!PyArg_ParseTuple(args, "OOOOOO", &dests_o, &dest_of_o, &lengths_o, &offsets_o, &where_o, &expects_o))
        return NULL;
    if (xxh_create == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "read_verify_rows: xxh3 is not bound (bind_xxh3)");
        return NULL;
    }
    PyObject *dests = PySequence_Fast(dests_o, "read_verify_rows: dests must be a sequence of buffers");
    if (dests == NULL)
        return NULL;
    Py_ssize_t nd = PySequence_Fast_GET_SIZE(dests), held = 0;
    Py_buffer *dv = PyMem_Calloc((size_t)(nd ? nd : 1), sizeof(Py_buffer));
    Py_buffer lengths = {0}, dest_of = {0}, offsets = {0}, where = {0}, expects = {0};
    int have_lengths = 0, have_dest_of = 0, have_offsets = 0, have_where = 0, have_expects = 0;
    struct iovec *iov = NULL, *scratch = NULL;
    PyObject *result = NULL;
    if (dv == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject **dest_items = PySequence_Fast_ITEMS(dests);
    for (Py_ssize_t d = 0; d < nd; d++) {
        if (PyObject_GetBuffer(dest_items[d], &dv[d], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        held = d + 1;
    }
    if (PyObject_GetBuffer(lengths_o, &lengths, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    have_lengths = 1;
    Py_ssize_t m = lengths.len / (Py_ssize_t)sizeof(int64_t);
    if (m < 1 || lengths.len % (Py_ssize_t)sizeof(int64_t) || m > INT_MAX - 2) {
        PyErr_SetString(PyExc_ValueError, "read_verify_rows: lengths: expected int64 values, at least one");
        goto done;
    }
    if (PyObject_GetBuffer(where_o, &where, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    have_where = 1;
    Py_ssize_t n = where.len / (Py_ssize_t)(2 * sizeof(int64_t));
    if (where.len % (Py_ssize_t)(2 * sizeof(int64_t))) {
        PyErr_SetString(PyExc_ValueError, "read_verify_rows: where: expected int64 [n, 2] (fd, offset)");
        goto done;
    }
    if (int64_arg(dest_of_o, &dest_of, m, "dest_of") < 0)
        goto done;
    have_dest_of = 1;
    if (int64_arg(offsets_o, &offsets, n * m, "offsets") < 0)
        goto done;
    have_offsets = 1;
    if (PyObject_GetBuffer(expects_o, &expects, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    have_expects = 1;
    Py_ssize_t elen = n ? expects.len / n : 0;
    if (n && (expects.len % n || (elen != EXPECT_BYTES && elen != EXPECT_WITH_DIGEST))) {
        PyErr_Format(PyExc_ValueError, "read_verify_rows: expects: expected uint8 [%zd, %d or %d], got %zd bytes",
                     n, EXPECT_BYTES, EXPECT_WITH_DIGEST, expects.len);
        goto done;
    }
    /* Every piece within its buffer, checked before anything is read (no overflow:
     * offset <= len - length with both sides non-negative). */
    Py_ssize_t want = HEADER_BYTES + DIGEST_BYTES;
    for (Py_ssize_t j = 0; j < m; j++) {
        int64_t d = int64_at(&dest_of, j), len = int64_at(&lengths, j);
        if (d < 0 || d >= nd || len < 0 || len > dv[d].len) {
            PyErr_Format(PyExc_ValueError, "read_verify_rows: piece %zd: dest %lld of %zd, length %lld: "
                         "expected a dest index and a length within it", j, (long long)d, nd, (long long)len);
            goto done;
        }
        want += (Py_ssize_t)len;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t fd = int64_at(&where, 2 * k), at = int64_at(&where, 2 * k + 1);
        if (fd < 0 || fd > INT_MAX || at < 0) {
            PyErr_Format(PyExc_ValueError, "read_verify_rows: where[%zd]: expected a fd and an offset >= 0", k);
            goto done;
        }
        for (Py_ssize_t j = 0; j < m; j++) {
            int64_t off = int64_at(&offsets, k * m + j), d = int64_at(&dest_of, j);
            if (off < 0 || off > dv[d].len - int64_at(&lengths, j)) {
                PyErr_Format(PyExc_ValueError, "read_verify_rows: offsets[%zd, %zd] = %lld: expected a piece "
                             "within dests[%lld] (%zd bytes)", k, j, (long long)off, (long long)d, dv[d].len);
                goto done;
            }
        }
    }
    iov = PyMem_Calloc((size_t)(m + 2), sizeof(struct iovec));
    scratch = PyMem_Calloc((size_t)(m + 2), sizeof(struct iovec));
    result = PyBytes_FromStringAndSize(NULL, n);
    if (iov == NULL || scratch == NULL || result == NULL) {
        Py_CLEAR(result);
        PyErr_NoMemory();
        goto done;
    }
    unsigned char *status = (unsigned char *)PyBytes_AS_STRING(result);
    int nomem = 0;
    Py_BEGIN_ALLOW_THREADS
    unsigned char header[HEADER_BYTES], tail[DIGEST_BYTES];
    void *state = xxh_create();
    if (state == NULL) {
        nomem = 1;
    } else {
        iov[0].iov_base = header;
        iov[0].iov_len = HEADER_BYTES;
        iov[m + 1].iov_base = tail;
        iov[m + 1].iov_len = DIGEST_BYTES;
        for (Py_ssize_t k = 0; k < n; k++) {
            for (Py_ssize_t j = 0; j < m; j++) {
                iov[j + 1].iov_base = (char *)dv[int64_at(&dest_of, j)].buf + int64_at(&offsets, k * m + j);
                iov[j + 1].iov_len = (size_t)int64_at(&lengths, j);
            }
            job_t job = {.fd = (int)int64_at(&where, 2 * k), .offset = int64_at(&where, 2 * k + 1),
                         .first = 0, .count = m + 2, .want = want,
                         .expect = (const unsigned char *)expects.buf + k * elen, .expect_len = elen};
            status[k] = (unsigned char)verify_one(&job, iov, scratch, state);
        }
        xxh_free(state);
    }
    Py_END_ALLOW_THREADS
    if (nomem) {
        Py_CLEAR(result);
        PyErr_NoMemory();
    }
done:
    for (Py_ssize_t d = 0; d < held; d++)
        PyBuffer_Release(&dv[d]);
    if (have_lengths)
        PyBuffer_Release(&lengths);
    if (have_dest_of)
        PyBuffer_Release(&dest_of);
    if (have_offsets)
        PyBuffer_Release(&offsets);
    if (have_where)
        PyBuffer_Release(&where);
    if (have_expects)
        PyBuffer_Release(&expects);
    PyMem_Free(dv);
    PyMem_Free(iov);
    PyMem_Free(scratch);
    Py_DECREF(dests);
    return result;
}

/* ------------------------------------------------------------------ verify_rows */

PyDoc_STRVAR(verify_rows_doc,
"verify_rows(src, at, dests, dest_of, lengths, offsets, expects, /) -> bytes\n\n"
"read_verify_rows for records already in memory (e.g. read with O_DIRECT into a bounce\n"
"buffer): record k (header, payload, checksum: 144 + sum(lengths) + 16 bytes) starts at byte\n"
"``at[k]`` (int64 [n]) of the buffer ``src``; its payload is copied into the pieces the plan\n"
"gives it and checked as read_verify_rows checks it. Status 1 for a record that does not lie\n"
"within ``src`` (not read whole). The GIL is released for the whole batch.");

static PyObject *
verify_rows(PyObject *self, PyObject *args)
{
    PyObject *src_o, *at_o, *dests_o, *dest_of_o, *lengths_o, *offsets_o, *expects_o;
    if (!PyArg_ParseTuple(args, "OOOOOOO", &src_o, &at_o, &dests_o, &dest_of_o, &lengths_o, &offsets_o, &expects_o))
        return NULL;
    if (xxh_create == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "verify_rows: xxh3 is not bound (bind_xxh3)");
        return NULL;
    }
    Py_buffer src = {0}, at = {0};
    if (PyObject_GetBuffer(src_o, &src, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(at_o, &at, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = at.len / (Py_ssize_t)sizeof(int64_t);
    if (at.len % (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "verify_rows: at: expected int64 [n]");
        goto out;
    }
    /* the plan: checked as read_verify_rows checks it */
    PyObject *dests = PySequence_Fast(dests_o, "verify_rows: dests must be a sequence of buffers");
    if (dests == NULL)
        goto out;
    Py_ssize_t nd = PySequence_Fast_GET_SIZE(dests), held = 0;
    Py_buffer *dv = PyMem_Calloc((size_t)(nd ? nd : 1), sizeof(Py_buffer));
    Py_buffer lengths = {0}, dest_of = {0}, offsets = {0}, expects = {0};
    int have_lengths = 0, have_dest_of = 0, have_offsets = 0, have_expects = 0;
    void *state = NULL;
    if (dv == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject **dest_items = PySequence_Fast_ITEMS(dests);
    for (Py_ssize_t d = 0; d < nd; d++) {
        if (PyObject_GetBuffer(dest_items[d], &dv[d], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        held = d + 1;
    }
    if (PyObject_GetBuffer(lengths_o, &lengths, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    have_lengths = 1;
    Py_ssize_t m = lengths.len / (Py_ssize_t)sizeof(int64_t);
    if (m < 1 || lengths.len % (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "verify_rows: lengths: expected int64 values, at least one");
        goto done;
    }
    if (int64_arg(dest_of_o, &dest_of, m, "dest_of") < 0)
        goto done;
    have_dest_of = 1;
    if (int64_arg(offsets_o, &offsets, n * m, "offsets") < 0)
        goto done;
    have_offsets = 1;
    if (PyObject_GetBuffer(expects_o, &expects, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    have_expects = 1;
    Py_ssize_t elen = n ? expects.len / n : 0;
    if (n && (expects.len % n || (elen != EXPECT_BYTES && elen != EXPECT_WITH_DIGEST))) {
        PyErr_Format(PyExc_ValueError, "verify_rows: expects: expected uint8 [%zd, %d or %d], got %zd bytes",
                     n, EXPECT_BYTES, EXPECT_WITH_DIGEST, expects.len);
        goto done;
    }
    Py_ssize_t payload = 0;
    for (Py_ssize_t j = 0; j < m; j++) {
        int64_t d = int64_at(&dest_of, j), len = int64_at(&lengths, j);
        if (d < 0 || d >= nd || len < 0 || len > dv[d].len) {
            PyErr_Format(PyExc_ValueError, "verify_rows: piece %zd: dest %lld of %zd, length %lld: "
                         "expected a dest index and a length within it", j, (long long)d, nd, (long long)len);
            goto done;
        }
        payload += (Py_ssize_t)len;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        for (Py_ssize_t j = 0; j < m; j++) {
            int64_t off = int64_at(&offsets, k * m + j), d = int64_at(&dest_of, j);
            if (off < 0 || off > dv[d].len - int64_at(&lengths, j)) {
                PyErr_Format(PyExc_ValueError, "verify_rows: offsets[%zd, %zd] = %lld: expected a piece "
                             "within dests[%lld] (%zd bytes)", k, j, (long long)off, (long long)d, dv[d].len);
                goto done;
            }
        }
    }
    result = PyBytes_FromStringAndSize(NULL, n);
    if (result == NULL)
        goto done;
    unsigned char *status = (unsigned char *)PyBytes_AS_STRING(result);
    int nomem = 0;
    Py_BEGIN_ALLOW_THREADS
    state = xxh_create();
    if (state == NULL) {
        nomem = 1;
    } else {
        Py_ssize_t want = HEADER_BYTES + payload + DIGEST_BYTES;
        for (Py_ssize_t k = 0; k < n; k++) {
            int64_t a = int64_at(&at, k);
            if (a < 0 || a > src.len - want) {
                status[k] = ST_SHORT;
                continue;
            }
            const unsigned char *header = (const unsigned char *)src.buf + a;
            const unsigned char *tail = header + HEADER_BYTES + payload;
            const unsigned char *e = (const unsigned char *)expects.buf + k * elen;
            if (memcmp(header, e, ID_BYTES) != 0 || memcmp(header + LENGTH_AT, e + ID_BYTES, 8) != 0
                    || memcmp(tail, e + ID_BYTES + 8, DIGEST_BYTES) != 0
                    || (elen == EXPECT_WITH_DIGEST && memcmp(header + DIGEST_AT, e + EXPECT_BYTES, 32) != 0)) {
                status[k] = ST_BAD;
                continue;
            }
            unsigned char digest[DIGEST_BYTES];
            xxh_reset(state);
            xxh_update(state, header, (size_t)(HEADER_BYTES + payload));  /* contiguous here: one update */
            canonical(xxh_digest(state), digest);
            if (memcmp(digest, tail, DIGEST_BYTES) != 0) {
                status[k] = ST_BAD;
                continue;
            }
            const unsigned char *p = header + HEADER_BYTES;
            for (Py_ssize_t j = 0; j < m; j++) {  /* verified: now into the pieces */
                size_t len = (size_t)int64_at(&lengths, j);
                memcpy((char *)dv[int64_at(&dest_of, j)].buf + int64_at(&offsets, k * m + j), p, len);
                p += len;
            }
            status[k] = ST_OK;
        }
        xxh_free(state);
    }
    Py_END_ALLOW_THREADS
    if (nomem) {
        Py_CLEAR(result);
        PyErr_NoMemory();
    }
done:
    for (Py_ssize_t d = 0; d < held; d++)
        PyBuffer_Release(&dv[d]);
    if (have_lengths)
        PyBuffer_Release(&lengths);
    if (have_dest_of)
        PyBuffer_Release(&dest_of);
    if (have_offsets)
        PyBuffer_Release(&offsets);
    if (have_expects)
        PyBuffer_Release(&expects);
    PyMem_Free(dv);
    Py_DECREF(dests);
out:
    PyBuffer_Release(&src);
    PyBuffer_Release(&at);
    return result;
}

static PyMethodDef methods[] = {
    {"verify_rows", verify_rows, METH_VARARGS, verify_rows_doc},
    {"read_verify_rows", read_verify_rows, METH_VARARGS, read_verify_rows_doc},
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
