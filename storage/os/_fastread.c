/* tiered_kv.storage.os._fastread: read one stored record's parts and hash them, GIL released.
 *
 * The disk tier's verified reads spend most of their time in two loops that need no Python:
 * the preadv of a record's parts (header, the caller's payload buffers, the stored checksum)
 * and the xxh3-128 of header + payload. python-xxhash releases the GIL only for pieces over
 * 64 KiB, so a record read into a scatter list of pool rows (62 pieces of 0.6-18 KiB for a
 * Flash block) hashes with the GIL held. read_and_hash() does both with the GIL released;
 * read_verify_many() does it for a whole batch of records in one call (one GIL release) and
 * also checks each header's known fields and checksum, as PartsVerifier does in Python;
 * VerifyBatch takes the same records one at a time (add), so that reading starts while the
 * caller prepares the next record, and is waited for by finish(). With threads > 1 a batch
 * is shared by helper pthreads (started once, kept; no GIL, no Python thread hand-off),
 * which take records from the front as they are published, and the calling thread, which
 * takes the rest from the back once it has added them all. Each record is read in runs of
 * 128 KiB, each hashed right after its preadv, while it is in the CPU's cache; with
 * cached_only, a record whose pages are not all in the page cache (cachestat) is left
 * unread for the caller's cold path.
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
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

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

/* ------------------------------------------------------------------ batches of records */

/* expect: identity (72 B: magic, version, kind, flags, fingerprint, block hash), payload
 * length (8 B LE), the index's checksum (16 B), optionally the token digest (32 B). */
#define ID_BYTES 72
#define EXPECT_BYTES (ID_BYTES + 8 + DIGEST_BYTES)
#define EXPECT_WITH_DIGEST (EXPECT_BYTES + 32)
/* An ``expect`` one byte longer (that byte EXPECT_UNHASHED) asks for a record whose payload
 * authenticates itself (a sealed envelope's GCM tag covers every byte the checksum covers):
 * every check but the xxh3 of header + payload, which is not computed. */
#define EXPECT_UNHASHED 0x55

/* Whether an expect of elen bytes (its last byte: last) asks for no hash; -1: a bad length. */
static int
expect_mode(Py_ssize_t elen, unsigned char last)
{
    if (elen == EXPECT_BYTES || elen == EXPECT_WITH_DIGEST)
        return 0;
    if ((elen == EXPECT_BYTES + 1 || elen == EXPECT_WITH_DIGEST + 1) && last == EXPECT_UNHASHED)
        return 1;
    return -1;
}
#define HEADER_BYTES 144
#define DIGEST_AT 104
#define LENGTH_AT 136

enum { ST_OK = 0, ST_SHORT = 1, ST_BAD = 2, ST_UNCACHED = 3 };

/* One record to read and check. Its buffers, iovecs and ``expect`` are held by the batch
 * until it is finished. */
typedef struct {
    int fd;
    long long offset;
    struct iovec *iov;   /* header, payload pieces, checksum */
    Py_buffer *views;
    Py_ssize_t count, held;
    Py_ssize_t want;
    PyObject *expect;    /* bytes, a reference */
    int status;
} job_t;

/* Bytes read per preadv of a record, each run hashed right after it is read, while it is
 * still in the CPU's L1/L2 cache (a whole Flash block, 481 KiB, read before hashing is
 * partly evicted by the time the hash reaches it, more so into fresh pages the kernel
 * clears first). */
#ifndef RUN_BYTES
#define RUN_BYTES (128 * 1024)
#endif

/* Linux's cachestat(2) (6.5+): the same number on x86_64 and aarch64 (the generic table). */
#if defined(__x86_64__) || defined(__aarch64__)
#define SYS_CACHESTAT 451
#endif
#define PAGE 4096

struct cs_range { unsigned long long off, len; };
struct cs_stat { unsigned long long cache, dirty, writeback, evicted, recently_evicted; };

/* Whether the page cache holds every page of the record (1 where that cannot be asked:
 * then it is read buffered, as storage/segments.py does). Asking moves no data and starts
 * no I/O (a buffered read of a record it lacks would start readahead behind the direct
 * reads of the cold path). */
static int
record_cached(int fd, long long offset, Py_ssize_t length)
{
#ifdef SYS_CACHESTAT
    unsigned long long first = (unsigned long long)offset & ~(unsigned long long)(PAGE - 1);
    unsigned long long end = ((unsigned long long)offset + (unsigned long long)length + PAGE - 1)
                             & ~(unsigned long long)(PAGE - 1);
    struct cs_range r = {first, end - first};
    struct cs_stat st;
    if (syscall(SYS_CACHESTAT, fd, &r, &st, 0) != 0)
        return 1;
    return st.cache >= (end - first) / PAGE;
#else
    (void)fd; (void)offset; (void)length;
    return 1;
#endif
}

/* Read job j in runs of about RUN_BYTES (scratch: room for 2 * j->count iovecs), hashing
 * header + payload as it goes, then check it. */
static int
verify_one(job_t *j, struct iovec *scratch, void *state, int cached_only)
{
    if (cached_only && !record_cached(j->fd, j->offset, j->want))
        return ST_UNCACHED;   /* (not read: the caller reads it on its cold path) */
    const unsigned char *e = (const unsigned char *)PyBytes_AS_STRING(j->expect);
    Py_ssize_t elen = PyBytes_GET_SIZE(j->expect);
    int unhashed = expect_mode(elen, e[elen - 1]) == 1;
    struct iovec *mine = j->iov;
    struct iovec *run = scratch, *keep = scratch + j->count;
    Py_ssize_t last = j->count - 1, i = 0, pos = 0;
    size_t within = 0;
    xxh_reset(state);
    while (i < j->count) {
        int m = 0, hashed = 0;
        size_t len = 0;
        while (i < j->count && len < RUN_BYTES && m < IOV_MAX) {
            size_t take = mine[i].iov_len - within;
            if (take > RUN_BYTES - len && i < last)
                take = RUN_BYTES - len;   /* (the 16-byte checksum is never split) */
            run[m].iov_base = (char *)mine[i].iov_base + within;
            run[m].iov_len = take;
            if (i < last)
                hashed = m + 1;
            m++;
            len += take;
            within += take;
            if (within == mine[i].iov_len) {
                i++;
                within = 0;
            }
        }
        memcpy(keep, run, (size_t)m * sizeof(struct iovec));
        Py_ssize_t got = preadv_full(j->fd, run, m, (off_t)(j->offset + pos));
        if (got < (Py_ssize_t)len)
            return ST_SHORT;   /* end of file or a read error: a miss */
        for (int k = 0; k < hashed && !unhashed; k++)
            xxh_update(state, keep[k].iov_base, keep[k].iov_len);
        pos += (Py_ssize_t)len;
    }
    const unsigned char *header = mine[0].iov_base;
    const unsigned char *tail = mine[last].iov_base;
    if (memcmp(header, e, ID_BYTES) != 0 || memcmp(header + LENGTH_AT, e + ID_BYTES, 8) != 0)
        return ST_BAD;
    if (memcmp(tail, e + ID_BYTES + 8, DIGEST_BYTES) != 0)
        return ST_BAD;     /* not the checksum the index holds */
    if (elen >= EXPECT_WITH_DIGEST && memcmp(header + DIGEST_AT, e + EXPECT_BYTES, 32) != 0)
        return ST_BAD;
    if (unhashed)
        return ST_OK;      /* the payload authenticates itself (the caller checks it) */
    unsigned char digest[DIGEST_BYTES];
    canonical(xxh_digest(state), digest);
    return memcmp(digest, tail, DIGEST_BYTES) == 0 ? ST_OK : ST_BAD;
}

/* Take the buffers of (fd, offset, bufs, expect) into job j (GIL held). -1: an exception. */
static int
job_fill(job_t *j, int fd, long long offset, PyObject *bufs, PyObject *expect, Py_ssize_t k)
{
    if (!PyBytes_Check(expect) || PyBytes_GET_SIZE(expect) < 1
            || expect_mode(PyBytes_GET_SIZE(expect),
                           (unsigned char)PyBytes_AS_STRING(expect)[PyBytes_GET_SIZE(expect) - 1]) < 0) {
        PyErr_Format(PyExc_ValueError, "read_verify_many: items[%zd]: expect must be %d or %d bytes "
                     "(one more, the last %d: unhashed)", k, EXPECT_BYTES, EXPECT_WITH_DIGEST, EXPECT_UNHASHED);
        return -1;
    }
    PyObject *seq = PySequence_Fast(bufs, "read_verify_many: bufs must be a sequence of buffers");
    if (seq == NULL)
        return -1;
    Py_ssize_t c = PySequence_Fast_GET_SIZE(seq);
    if (c < 2 || c > INT_MAX / 2) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "read_verify_many: items[%zd]: expected header, payload pieces, checksum", k);
        return -1;
    }
    j->fd = fd;
    j->offset = offset;
    j->count = c;
    j->status = ST_SHORT;   /* (until a reader sets it: a record nobody read is a miss) */
    j->views = PyMem_Calloc((size_t)c, sizeof(Py_buffer));
    j->iov = PyMem_Calloc((size_t)c, sizeof(struct iovec));
    if (j->views == NULL || j->iov == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    PyObject **pieces = PySequence_Fast_ITEMS(seq);
    Py_ssize_t want = 0;
    for (Py_ssize_t i = 0; i < c; i++) {
        if (PyObject_GetBuffer(pieces[i], &j->views[i], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            Py_DECREF(seq);
            return -1;
        }
        j->held = i + 1;
        j->iov[i].iov_base = j->views[i].buf;
        j->iov[i].iov_len = (size_t)j->views[i].len;
        want += j->views[i].len;
    }
    Py_DECREF(seq);
    if (j->views[0].len != HEADER_BYTES || j->views[c - 1].len != DIGEST_BYTES) {
        PyErr_Format(PyExc_ValueError, "read_verify_many: items[%zd]: expected a %d-byte header first and a "
                     "%d-byte checksum last", k, HEADER_BYTES, DIGEST_BYTES);
        return -1;
    }
    j->want = want;
    Py_INCREF(expect);
    j->expect = expect;
    return 0;
}

static void
job_clear(job_t *j)
{
    for (Py_ssize_t i = 0; i < j->held; i++)
        PyBuffer_Release(&j->views[i]);
    PyMem_Free(j->views);
    PyMem_Free(j->iov);
    Py_CLEAR(j->expect);
    j->views = NULL;
    j->iov = NULL;
    j->held = 0;
}

/* A batch shared by the threads reading it. Records are published one by one (``end``)
 * and the helpers take them from the front; once the batch is closed the calling thread
 * takes the rest from the back, so that each thread fills a run of the destination of its
 * own (threads faulting in fresh pages side by side contend for the same page tables). */
typedef struct {
    job_t *jobs;
    Py_ssize_t cap;
    Py_ssize_t added;    /* jobs[0 .. added) are filled (written by the adding thread only) */
    Py_ssize_t next;     /* the next one to take from the front (under pool.mu) */
    Py_ssize_t end;      /* records [next, end) are left to take (under pool.mu; also stored
                            by a publish, atomically, while no thread takes from the back) */
    int waiting;         /* helpers waiting for a record (atomic; changed under pool.mu) */
    int threads;         /* threads to offer it to at its first publish (VerifyBatch) */
    int closed;          /* nothing more is added (under pool.mu) */
    int cached_only;     /* a record the page cache lacks is not read: ST_UNCACHED */
    int offered;         /* the helpers were offered it */
    int helpers_wanted;  /* helpers that may join (under pool.mu) */
    int helpers_in;      /* helpers that joined (under pool.mu) */
    int helpers_active;  /* helpers still reading it (under pool.mu) */
    int failed;          /* a helper ran out of memory */
} batch_t;

#define MAX_THREADS 64
#define HELPER_STACK (256 * 1024)

/* Helper threads, started on first use and kept (a thread per call would cost more than a
 * small batch takes to read). One batch at a time is offered to them (``busy``); a caller
 * that finds them busy reads its batch alone. A helper joins the batch on offer while it
 * is there and has room; the caller withdraws it once it is closed and it ran out of
 * records itself, and waits until no helper reads it any more (so the batch outlives every
 * use). After a fork the child has no helpers: it starts its own. */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t offered, more, finished;
    int started;          /* helpers running */
    int busy;             /* a batch owns the helpers */
    unsigned long gen;    /* bumped at every offer */
    batch_t *batch;       /* the batch on offer, or NULL */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, 0, 0, 0, NULL};

/* Read records of b, from the front or (``from_back``) the back, until it is closed and
 * none is left (scratch grown as needed). Returns 0, or -1 when scratch could not be had
 * (that record stays a miss: ST_SHORT). */
static int
run_jobs(batch_t *b, int from_back, struct iovec **scratch, Py_ssize_t *room, void *state)
{
    for (;;) {
        Py_ssize_t k = -1;
        pthread_mutex_lock(&pool.mu);
        for (;;) {
            Py_ssize_t end = __atomic_load_n(&b->end, __ATOMIC_SEQ_CST);
            if (b->next < end) {
                if (from_back)
                    __atomic_store_n(&b->end, end - 1, __ATOMIC_SEQ_CST);
                k = from_back ? end - 1 : b->next++;
                break;
            }
            if (b->closed)
                break;
            /* (a publish stores end, then reads waiting: one of the two sees the other) */
            __atomic_add_fetch(&b->waiting, 1, __ATOMIC_SEQ_CST);
            if (b->next >= __atomic_load_n(&b->end, __ATOMIC_SEQ_CST) && !b->closed)
                pthread_cond_wait(&pool.more, &pool.mu);
            __atomic_sub_fetch(&b->waiting, 1, __ATOMIC_SEQ_CST);
        }
        pthread_mutex_unlock(&pool.mu);
        if (k < 0)
            return 0;
        job_t *j = &b->jobs[k];
        if (2 * j->count + 2 > *room) {
            struct iovec *grown = realloc(*scratch, (size_t)(2 * j->count + 2) * sizeof(struct iovec));
            if (grown == NULL)
                return -1;
            *scratch = grown;
            *room = 2 * j->count + 2;
        }
        j->status = verify_one(j, *scratch, state, b->cached_only);
    }
}

static void *
helper_main(void *arg)
{
    (void)arg;
    unsigned long seen = 0;
    struct iovec *scratch = NULL;
    Py_ssize_t room = 0;
    void *state = xxh_create();
    pthread_mutex_lock(&pool.mu);
    for (;;) {
        while (pool.gen == seen)
            pthread_cond_wait(&pool.offered, &pool.mu);
        seen = pool.gen;
        batch_t *b = pool.batch;
        if (b == NULL || state == NULL || b->helpers_in >= b->helpers_wanted)
            continue;
        b->helpers_in++;
        b->helpers_active++;
        pthread_mutex_unlock(&pool.mu);
        if (run_jobs(b, 0, &scratch, &room, state) < 0)
            b->failed = 1;
        pthread_mutex_lock(&pool.mu);
        if (--b->helpers_active == 0)
            pthread_cond_broadcast(&pool.finished);
    }
    return NULL;
}

static void
pool_after_fork_in_child(void)
{
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.offered, NULL);
    pthread_cond_init(&pool.more, NULL);
    pthread_cond_init(&pool.finished, NULL);
    pool.started = 0;
    pool.busy = 0;
    pool.batch = NULL;
}

/* Offer b to up to threads - 1 helpers (none when another batch has them). */
static void
batch_offer(batch_t *b, int threads)
{
    if (threads <= 1)
        return;
    pthread_mutex_lock(&pool.mu);
    if (!pool.busy) {
        pool.busy = 1;
        pthread_attr_t attr;
        int have_attr = pthread_attr_init(&attr) == 0;
        if (have_attr)
            pthread_attr_setstacksize(&attr, HELPER_STACK);
        while (pool.started < threads - 1) {
            pthread_t t;
            if (pthread_create(&t, have_attr ? &attr : NULL, helper_main, NULL) != 0)
                break;  /* fewer helpers: the calling thread takes what they would have */
            pthread_detach(t);
            pool.started++;
        }
        if (have_attr)
            pthread_attr_destroy(&attr);
        b->helpers_wanted = threads - 1;
        pool.batch = b;
        pool.gen++;
        pthread_cond_broadcast(&pool.offered);
        b->offered = 1;
    }
    pthread_mutex_unlock(&pool.mu);
}

/* Publish job k of b (filled): a helper waiting for a record is woken; the first publish
 * of a VerifyBatch offers it to the helpers (then the first one to wake finds a record).
 * A busy helper costs the publisher no lock and no system call. */
static void
batch_publish(batch_t *b, Py_ssize_t k)
{
    b->added = k + 1;
    __atomic_store_n(&b->end, k + 1, __ATOMIC_SEQ_CST);
    if (k == 0 && b->threads > 1) {
        batch_offer(b, b->threads);
        return;
    }
    if (b->offered && __atomic_load_n(&b->waiting, __ATOMIC_SEQ_CST) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.more);
        pthread_mutex_unlock(&pool.mu);
    }
}

/* Close b, read what is left on the calling thread (from the back), wait for the helpers
 * (GIL released). Returns 0, or -1 when a thread ran out of memory (a record unread). */
static int
batch_finish(batch_t *b)
{
    pthread_mutex_lock(&pool.mu);
    b->closed = 1;
    pthread_cond_broadcast(&pool.more);
    pthread_mutex_unlock(&pool.mu);
    struct iovec *scratch = NULL;
    Py_ssize_t room = 0;
    int rc = -1;
    void *state = xxh_create();
    if (state != NULL) {
        rc = run_jobs(b, 1, &scratch, &room, state);
        xxh_free(state);
    }
    free(scratch);
    if (b->offered) {
        pthread_mutex_lock(&pool.mu);
        pool.batch = NULL;        /* no helper joins it from now on */
        while (b->helpers_active > 0)
            pthread_cond_wait(&pool.finished, &pool.mu);
        pool.busy = 0;
        b->offered = 0;
        pthread_mutex_unlock(&pool.mu);
    }
    if (state != NULL && rc == 0 && !b->failed)
        return 0;
    /* Out of memory somewhere: any record left untaken is a miss (ST_SHORT, as filled). */
    return -1;
}

static PyObject *
statuses(batch_t *b)
{
    PyObject *result = PyList_New(b->added);
    if (result == NULL)
        return NULL;
    for (Py_ssize_t k = 0; k < b->added; k++) {
        PyObject *st = PyLong_FromLong(b->jobs[k].status);
        if (st == NULL) {
            Py_DECREF(result);
            return NULL;
        }
        PyList_SET_ITEM(result, k, st);
    }
    return result;
}

PyDoc_STRVAR(read_verify_many_doc,
"read_verify_many(items, threads=1, /) -> list[int]\n\n"
"For each ``(fd, offset, bufs, expect)`` of ``items``: preadv the writable buffers ``bufs``\n"
"(a record's 144-byte header, its payload pieces, its 16-byte checksum) from ``fd`` at\n"
"``offset``, then check it: the header's identity fields and payload length against\n"
"``expect`` (72 + 8 bytes), the stored checksum against the index's (``expect``'s next\n"
"16 bytes) and against the xxh3-128 of header + payload, and the header's token digest\n"
"against ``expect``'s last 32 bytes when given. Returns one status each: 0 verified, 1\n"
"not read whole (end of file or a read error), 2 read but failing a check. The GIL is\n"
"released for the whole batch; ``threads`` > 1 reads it on that many threads (the\n"
"calling one and helpers, each taking the next record), for batches worth spreading.");

static PyObject *
read_verify_many(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *arg;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "O|i:read_verify_many", &arg, &threads))
        return NULL;
    if (threads < 1 || threads > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "read_verify_many: threads: expected 1 to %d, got %d", MAX_THREADS, threads);
        return NULL;
    }
    if (xxh_create == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "read_verify_many: xxh3 is not bound (bind_xxh3)");
        return NULL;
    }
    PyObject *items = PySequence_Fast(arg, "read_verify_many: expected a sequence of items");
    if (items == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
    PyObject **item_v = PySequence_Fast_ITEMS(items);
    batch_t b = {0};
    PyObject *result = NULL;
    Py_ssize_t filled = 0;
    b.jobs = PyMem_Calloc((size_t)(n ? n : 1), sizeof(job_t));
    if (b.jobs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    b.cap = n;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (!PyTuple_Check(item_v[k]) || PyTuple_GET_SIZE(item_v[k]) != 4) {
            PyErr_Format(PyExc_TypeError, "read_verify_many: items[%zd]: expected (fd, offset, bufs, expect)", k);
            goto done;
        }
        int fd = (int)PyLong_AsLong(PyTuple_GET_ITEM(item_v[k], 0));
        long long offset = PyLong_AsLongLong(PyTuple_GET_ITEM(item_v[k], 1));
        if (PyErr_Occurred())
            goto done;
        filled = k + 1;
        if (job_fill(&b.jobs[k], fd, offset, PyTuple_GET_ITEM(item_v[k], 2), PyTuple_GET_ITEM(item_v[k], 3), k) < 0)
            goto done;
    }
    b.added = b.end = n;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    batch_offer(&b, threads < n ? threads : (int)(n ? n : 1));
    rc = batch_finish(&b);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = statuses(&b);
done:
    for (Py_ssize_t k = 0; k < filled; k++)
        job_clear(&b.jobs[k]);
    PyMem_Free(b.jobs);
    Py_DECREF(items);
    return result;
}

/* ------------------------------------------------------------------ VerifyBatch */

typedef struct {
    PyObject_HEAD
    batch_t b;
    int finished;
} VerifyBatch;

static void
vb_finish_quietly(VerifyBatch *self)
{
    if (!self->finished) {
        self->finished = 1;
        Py_BEGIN_ALLOW_THREADS
        batch_finish(&self->b);
        Py_END_ALLOW_THREADS
    }
}

static void
vb_release(VerifyBatch *self)
{
    if (self->b.jobs != NULL) {
        for (Py_ssize_t k = 0; k < self->b.cap; k++)
            job_clear(&self->b.jobs[k]);
        PyMem_Free(self->b.jobs);
        self->b.jobs = NULL;
    }
}

static int
vb_init(VerifyBatch *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"capacity", "threads", "cached_only", NULL};
    Py_ssize_t cap;
    int threads = 1, cached_only = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n|ip:VerifyBatch", names, &cap, &threads, &cached_only))
        return -1;
    if (self->b.jobs != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "VerifyBatch: already initialized");
        return -1;
    }
    if (cap < 0 || threads < 1 || threads > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "VerifyBatch: expected capacity >= 0 and 1 <= threads <= %d", MAX_THREADS);
        return -1;
    }
    if (xxh_create == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "VerifyBatch: xxh3 is not bound (bind_xxh3)");
        return -1;
    }
    self->b.jobs = PyMem_Calloc((size_t)(cap ? cap : 1), sizeof(job_t));
    if (self->b.jobs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->b.cap = cap;
    self->b.cached_only = cached_only;
    self->b.threads = cap > 1 ? (threads < cap ? threads : (int)cap) : 1;  /* (offered at the first add) */
    return 0;
}

static void
vb_dealloc(VerifyBatch *self)
{
    if (self->b.jobs != NULL)
        vb_finish_quietly(self);   /* helpers may still read into its buffers */
    vb_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
vb_add(VerifyBatch *self, PyObject *args)
{
    int fd;
    long long offset;
    PyObject *bufs, *expect;
    if (!PyArg_ParseTuple(args, "iLOO:add", &fd, &offset, &bufs, &expect))
        return NULL;
    if (self->b.jobs == NULL || self->finished) {
        PyErr_SetString(PyExc_RuntimeError, "VerifyBatch.add: the batch is finished");
        return NULL;
    }
    Py_ssize_t k = self->b.added;
    if (k >= self->b.cap) {
        PyErr_Format(PyExc_ValueError, "VerifyBatch.add: the batch holds %zd records", self->b.cap);
        return NULL;
    }
    if (job_fill(&self->b.jobs[k], fd, offset, bufs, expect, k) < 0) {
        job_clear(&self->b.jobs[k]);
        return NULL;
    }
    batch_publish(&self->b, k);
    return PyLong_FromSsize_t(k);
}

static PyObject *
vb_finish(VerifyBatch *self, PyObject *unused)
{
    (void)unused;
    if (self->b.jobs == NULL || self->finished) {
        PyErr_SetString(PyExc_RuntimeError, "VerifyBatch.finish: already finished");
        return NULL;
    }
    self->finished = 1;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = batch_finish(&self->b);
    Py_END_ALLOW_THREADS
    PyObject *result = rc < 0 ? PyErr_NoMemory() : statuses(&self->b);
    vb_release(self);
    return result;
}

static PyMethodDef vb_methods[] = {
    {"add", (PyCFunction)vb_add, METH_VARARGS,
     "add(fd, offset, bufs, expect, /) -> int: one record, as an item of read_verify_many; a helper "
     "may start reading it at once. Returns its index in the statuses."},
    {"finish", (PyCFunction)vb_finish, METH_NOARGS,
     "finish() -> list[int]: read what no helper took yet (GIL released), wait for the helpers; "
     "one status per record added: 0 verified, 1 short, 2 failed a check, 3 not read: not (all) in "
     "the page cache (cached_only)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject VerifyBatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tiered_kv.storage.os._fastread.VerifyBatch",
    .tp_basicsize = sizeof(VerifyBatch),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "VerifyBatch(capacity, threads=1, cached_only=False): read_verify_many fed one record "
              "at a time, so that helper threads read and check the first records while the caller "
              "prepares the next ones. cached_only: a record whose pages are not all in the page "
              "cache (cachestat) is not read (status 3).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)vb_init,
    .tp_dealloc = (destructor)vb_dealloc,
    .tp_methods = vb_methods,
};

/* ------------------------------------------------------------------ read_verify_rows */

/* An int64 array argument of `count` values, C-contiguous (numpy int64): its buffer. */
static int
int64_arg(PyObject *o, Py_buffer *view, Py_ssize_t count, const char *fn, const char *name)
{
    if (PyObject_GetBuffer(o, view, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len != count * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "%s: %s: expected %zd int64 values (%zd bytes), got %zd bytes",
                     fn, name, count, count * (Py_ssize_t)sizeof(int64_t), view->len);
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

/* The plan of read_verify_rows and verify_rows: n records of m pieces each; piece j of
 * record k is lengths[j] bytes at byte offsets[k, j] of dests[dest_of[j]], and record k is
 * checked against expects[k] (elen bytes: EXPECT_BYTES or EXPECT_WITH_DIGEST). */
typedef struct {
    PyObject *dests;  /* PySequence_Fast of the dests argument */
    Py_buffer *dv;    /* [nd] the dests' buffers, the first `held` of them held */
    Py_ssize_t nd, held;
    Py_buffer lengths, dest_of, offsets, expects;
    int have_lengths, have_dest_of, have_offsets, have_expects;
    Py_ssize_t n, m, elen, payload;  /* payload: sum(lengths) */
} row_plan_t;

static void
row_plan_release(row_plan_t *p)
{
    for (Py_ssize_t d = 0; d < p->held; d++)
        PyBuffer_Release(&p->dv[d]);
    if (p->have_lengths)
        PyBuffer_Release(&p->lengths);
    if (p->have_dest_of)
        PyBuffer_Release(&p->dest_of);
    if (p->have_offsets)
        PyBuffer_Release(&p->offsets);
    if (p->have_expects)
        PyBuffer_Release(&p->expects);
    PyMem_Free(p->dv);
    Py_XDECREF(p->dests);
}

/* Take the plan of n records (fn: the caller, for errors) and check that every piece lies
 * within its buffer, before anything is read or written (no overflow: offset <= len - length
 * with both sides non-negative). 0, or -1 with an exception set; row_plan_release() the plan
 * (zero-initialised) either way. */
static int
row_plan_take(row_plan_t *p, const char *fn, Py_ssize_t n, PyObject *dests_o, PyObject *dest_of_o,
              PyObject *lengths_o, PyObject *offsets_o, PyObject *expects_o)
{
    char what[64];
    p->n = n;
    PyOS_snprintf(what, sizeof(what), "%s: dests must be a sequence of buffers", fn);
    p->dests = PySequence_Fast(dests_o, what);
    if (p->dests == NULL)
        return -1;
    p->nd = PySequence_Fast_GET_SIZE(p->dests);
    p->dv = PyMem_Calloc((size_t)(p->nd ? p->nd : 1), sizeof(Py_buffer));
    if (p->dv == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject **dest_items = PySequence_Fast_ITEMS(p->dests);
    for (Py_ssize_t d = 0; d < p->nd; d++) {
        if (PyObject_GetBuffer(dest_items[d], &p->dv[d], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            return -1;
        p->held = d + 1;
    }
    if (PyObject_GetBuffer(lengths_o, &p->lengths, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    p->have_lengths = 1;
    Py_ssize_t m = p->m = p->lengths.len / (Py_ssize_t)sizeof(int64_t);
    if (m < 1 || p->lengths.len % (Py_ssize_t)sizeof(int64_t) || m > INT_MAX - 2) {
        PyErr_Format(PyExc_ValueError, "%s: lengths: expected int64 values, at least one", fn);
        return -1;
    }
    if (int64_arg(dest_of_o, &p->dest_of, m, fn, "dest_of") < 0)
        return -1;
    p->have_dest_of = 1;
    if (int64_arg(offsets_o, &p->offsets, n * m, fn, "offsets") < 0)
        return -1;
    p->have_offsets = 1;
    if (PyObject_GetBuffer(expects_o, &p->expects, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    p->have_expects = 1;
    Py_ssize_t elen = p->elen = n ? p->expects.len / n : 0;
    if (n && (p->expects.len % n || (elen != EXPECT_BYTES && elen != EXPECT_WITH_DIGEST))) {
        PyErr_Format(PyExc_ValueError, "%s: expects: expected uint8 [%zd, %d or %d], got %zd bytes",
                     fn, n, EXPECT_BYTES, EXPECT_WITH_DIGEST, p->expects.len);
        return -1;
    }
    for (Py_ssize_t j = 0; j < m; j++) {
        int64_t d = int64_at(&p->dest_of, j), len = int64_at(&p->lengths, j);
        if (d < 0 || d >= p->nd || len < 0 || len > p->dv[d].len) {
            PyErr_Format(PyExc_ValueError, "%s: piece %zd: dest %lld of %zd, length %lld: "
                         "expected a dest index and a length within it", fn, j, (long long)d, p->nd, (long long)len);
            return -1;
        }
        p->payload += (Py_ssize_t)len;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        for (Py_ssize_t j = 0; j < m; j++) {
            int64_t off = int64_at(&p->offsets, k * m + j), d = int64_at(&p->dest_of, j);
            if (off < 0 || off > p->dv[d].len - int64_at(&p->lengths, j)) {
                PyErr_Format(PyExc_ValueError, "%s: offsets[%zd, %zd] = %lld: expected a piece "
                             "within dests[%lld] (%zd bytes)", fn, k, j, (long long)off, (long long)d, p->dv[d].len);
                return -1;
            }
        }
    }
    return 0;
}

/* Where piece j of record k lands. */
static char *
row_plan_piece(const row_plan_t *p, Py_ssize_t k, Py_ssize_t j)
{
    return (char *)p->dv[int64_at(&p->dest_of, j)].buf + int64_at(&p->offsets, k * p->m + j);
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
    Py_buffer where = {0};
    if (PyObject_GetBuffer(where_o, &where, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    row_plan_t plan = {0};
    struct iovec *iov = NULL, *scratch = NULL;
    PyObject **exp = NULL;
    PyObject *result = NULL;
    Py_ssize_t n = where.len / (Py_ssize_t)(2 * sizeof(int64_t));
    if (where.len % (Py_ssize_t)(2 * sizeof(int64_t))) {
        PyErr_SetString(PyExc_ValueError, "read_verify_rows: where: expected int64 [n, 2] (fd, offset)");
        goto done;
    }
    if (row_plan_take(&plan, "read_verify_rows", n, dests_o, dest_of_o, lengths_o, offsets_o, expects_o) < 0)
        goto done;
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t fd = int64_at(&where, 2 * k), at = int64_at(&where, 2 * k + 1);
        if (fd < 0 || fd > INT_MAX || at < 0) {
            PyErr_Format(PyExc_ValueError, "read_verify_rows: where[%zd]: expected a fd and an offset >= 0", k);
            goto done;
        }
    }
    Py_ssize_t m = plan.m, elen = plan.elen, want = HEADER_BYTES + plan.payload + DIGEST_BYTES;
    iov = PyMem_Calloc((size_t)(m + 2), sizeof(struct iovec));
    scratch = PyMem_Calloc((size_t)(2 * (m + 2)), sizeof(struct iovec));  /* (verify_one's runs) */
    exp = PyMem_Calloc((size_t)(n ? n : 1), sizeof(PyObject *));
    result = PyBytes_FromStringAndSize(NULL, n);
    if (iov == NULL || scratch == NULL || exp == NULL || result == NULL) {
        Py_CLEAR(result);
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {  /* each record's expect as verify_one takes it */
        exp[k] = PyBytes_FromStringAndSize((const char *)plan.expects.buf + k * elen, elen);
        if (exp[k] == NULL) {
            Py_CLEAR(result);
            goto done;
        }
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
                iov[j + 1].iov_base = row_plan_piece(&plan, k, j);
                iov[j + 1].iov_len = (size_t)int64_at(&plan.lengths, j);
            }
            job_t job = {.fd = (int)int64_at(&where, 2 * k), .offset = int64_at(&where, 2 * k + 1),
                         .iov = iov, .views = NULL, .count = m + 2, .held = 0, .want = want,
                         .expect = exp[k], .status = 0};
            status[k] = (unsigned char)verify_one(&job, scratch, state, 0);
        }
        xxh_free(state);
    }
    Py_END_ALLOW_THREADS
    if (nomem) {
        Py_CLEAR(result);
        PyErr_NoMemory();
    }
done:
    row_plan_release(&plan);
    PyBuffer_Release(&where);
    if (exp != NULL)
        for (Py_ssize_t k = 0; k < n; k++)
            Py_XDECREF(exp[k]);
    PyMem_Free(exp);
    PyMem_Free(iov);
    PyMem_Free(scratch);
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
    row_plan_t plan = {0};
    PyObject *result = NULL;
    Py_ssize_t n = at.len / (Py_ssize_t)sizeof(int64_t);
    if (at.len % (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "verify_rows: at: expected int64 [n]");
        goto done;
    }
    if (row_plan_take(&plan, "verify_rows", n, dests_o, dest_of_o, lengths_o, offsets_o, expects_o) < 0)
        goto done;
    result = PyBytes_FromStringAndSize(NULL, n);
    if (result == NULL)
        goto done;
    unsigned char *status = (unsigned char *)PyBytes_AS_STRING(result);
    Py_ssize_t m = plan.m, elen = plan.elen, payload = plan.payload;
    int nomem = 0;
    Py_BEGIN_ALLOW_THREADS
    void *state = xxh_create();
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
            const unsigned char *e = (const unsigned char *)plan.expects.buf + k * elen;
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
                size_t len = (size_t)int64_at(&plan.lengths, j);
                memcpy(row_plan_piece(&plan, k, j), p, len);
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
    row_plan_release(&plan);
    PyBuffer_Release(&src);
    PyBuffer_Release(&at);
    return result;
}

/* ------------------------------------------------------------------ verify_copy_many */

PyDoc_STRVAR(verify_copy_many_doc,
"verify_copy_many(src, items, /) -> list[int]\n\n"
"read_verify_many for records already in memory (a cold read's O_DIRECT bounce buffer):\n"
"for each ``(at, bufs, expect)`` of ``items`` the record (header, payload, checksum) starting\n"
"at byte ``at`` of the buffer ``src`` is copied into the writable buffers ``bufs`` (its\n"
"144-byte header, its payload pieces, its 16-byte checksum) and checked as read_verify_many\n"
"checks it, the copy and the hash fused (each run of 128 KiB hashed, then copied while it\n"
"is in the CPU's cache: one pass over the bytes from memory). Status 1 for a record that does\n"
"not lie within ``src``. The GIL is released for the whole batch.");

/* Copy and check job j, whose record lies at src (its fd and offset unused). */
static int
verify_copy_one(job_t *j, const unsigned char *src, void *state)
{
    Py_ssize_t last = j->count - 1, payload = j->want - HEADER_BYTES - DIGEST_BYTES;
    const unsigned char *header = src, *tail = src + HEADER_BYTES + payload;
    const unsigned char *e = (const unsigned char *)PyBytes_AS_STRING(j->expect);
    Py_ssize_t elen = PyBytes_GET_SIZE(j->expect);
    int unhashed = expect_mode(elen, e[elen - 1]) == 1;
    if (memcmp(header, e, ID_BYTES) != 0 || memcmp(header + LENGTH_AT, e + ID_BYTES, 8) != 0
            || memcmp(tail, e + ID_BYTES + 8, DIGEST_BYTES) != 0
            || (elen >= EXPECT_WITH_DIGEST && memcmp(header + DIGEST_AT, e + EXPECT_BYTES, 32) != 0))
        return ST_BAD;
    xxh_reset(state);
    if (!unhashed)
        xxh_update(state, header, HEADER_BYTES);
    memcpy(j->iov[0].iov_base, header, HEADER_BYTES);
    const unsigned char *p = header + HEADER_BYTES;
    for (Py_ssize_t i = 1; i < last; i++) {
        size_t len = j->iov[i].iov_len, done = 0;
        while (done < len) {
            size_t take = len - done < RUN_BYTES ? len - done : RUN_BYTES;
            if (!unhashed)
                xxh_update(state, p, take);
            memcpy((char *)j->iov[i].iov_base + done, p, take);
            p += take;
            done += take;
        }
    }
    memcpy(j->iov[last].iov_base, tail, DIGEST_BYTES);
    if (unhashed)
        return ST_OK;
    unsigned char digest[DIGEST_BYTES];
    canonical(xxh_digest(state), digest);
    return memcmp(digest, tail, DIGEST_BYTES) == 0 ? ST_OK : ST_BAD;
}

static PyObject *
verify_copy_many(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *src_o, *arg;
    if (!PyArg_ParseTuple(args, "OO:verify_copy_many", &src_o, &arg))
        return NULL;
    if (xxh_create == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "verify_copy_many: xxh3 is not bound (bind_xxh3)");
        return NULL;
    }
    Py_buffer src = {0};
    if (PyObject_GetBuffer(src_o, &src, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    PyObject *items = PySequence_Fast(arg, "verify_copy_many: expected a sequence of items");
    if (items == NULL) {
        PyBuffer_Release(&src);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items), filled = 0;
    PyObject **item_v = PySequence_Fast_ITEMS(items);
    job_t *jobs = PyMem_Calloc((size_t)(n ? n : 1), sizeof(job_t));
    PyObject *result = NULL;
    if (jobs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (!PyTuple_Check(item_v[k]) || PyTuple_GET_SIZE(item_v[k]) != 3) {
            PyErr_Format(PyExc_TypeError, "verify_copy_many: items[%zd]: expected (at, bufs, expect)", k);
            goto done;
        }
        long long at = PyLong_AsLongLong(PyTuple_GET_ITEM(item_v[k], 0));
        if (PyErr_Occurred())
            goto done;
        filled = k + 1;
        if (job_fill(&jobs[k], -1, at, PyTuple_GET_ITEM(item_v[k], 1), PyTuple_GET_ITEM(item_v[k], 2), k) < 0)
            goto done;
    }
    int nomem = 0;
    Py_BEGIN_ALLOW_THREADS
    void *state = xxh_create();
    if (state == NULL) {
        nomem = 1;
    } else {
        for (Py_ssize_t k = 0; k < n; k++) {
            job_t *j = &jobs[k];
            if (j->offset < 0 || j->offset > (long long)src.len - (long long)j->want)
                j->status = ST_SHORT;   /* past the end of what was read: torn, a miss */
            else
                j->status = verify_copy_one(j, (const unsigned char *)src.buf + j->offset, state);
        }
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
    for (Py_ssize_t k = 0; k < filled; k++)
        job_clear(&jobs[k]);
    PyMem_Free(jobs);
    Py_DECREF(items);
    PyBuffer_Release(&src);
    return result;
}

static PyMethodDef methods[] = {
    {"verify_copy_many", verify_copy_many, METH_VARARGS, verify_copy_many_doc},
    {"verify_rows", verify_rows, METH_VARARGS, verify_rows_doc},
    {"read_verify_rows", read_verify_rows, METH_VARARGS, read_verify_rows_doc},
    {"read_verify_many", read_verify_many, METH_VARARGS, read_verify_many_doc},
    {"bind_xxh3", bind_xxh3, METH_VARARGS,
     "bind_xxh3(create, free, reset, update, digest): addresses of xxHash's XXH3_createState, "
     "XXH3_freeState, XXH3_128bits_reset, XXH3_128bits_update, XXH3_128bits_digest."},
    {"read_and_hash", read_and_hash, METH_VARARGS, read_and_hash_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastread",
    "Read stored records' parts and hash / check them with the GIL released (see fastread.py).",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__fastread(void)
{
    static int atfork_set = 0;
    if (!atfork_set && pthread_atfork(NULL, NULL, pool_after_fork_in_child) == 0)
        atfork_set = 1;
    if (PyType_Ready(&VerifyBatchType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    /* The layout and statuses compiled in: fastread.py uses this module only if they are
     * the Python definitions' (format/record.py HEADER_LAYOUT, format/status.py). */
    if (PyModule_AddIntConstant(m, "HEADER_BYTES", HEADER_BYTES) < 0
            || PyModule_AddIntConstant(m, "ID_BYTES", ID_BYTES) < 0
            || PyModule_AddIntConstant(m, "DIGEST_AT", DIGEST_AT) < 0
            || PyModule_AddIntConstant(m, "LENGTH_AT", LENGTH_AT) < 0
            || PyModule_AddIntConstant(m, "DIGEST_BYTES", DIGEST_BYTES) < 0
            || PyModule_AddIntConstant(m, "ST_OK", ST_OK) < 0
            || PyModule_AddIntConstant(m, "ST_SHORT", ST_SHORT) < 0
            || PyModule_AddIntConstant(m, "ST_BAD", ST_BAD) < 0
            || PyModule_AddIntConstant(m, "ST_UNCACHED", ST_UNCACHED) < 0
            || PyModule_AddIntConstant(m, "EXPECT_UNHASHED", EXPECT_UNHASHED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&VerifyBatchType);
    if (PyModule_AddObject(m, "VerifyBatch", (PyObject *)&VerifyBatchType) < 0) {
        Py_DECREF(&VerifyBatchType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
