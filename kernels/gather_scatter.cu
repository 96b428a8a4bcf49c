// Block gather / scatter between a Classical pool's parts and block records.
//
// Compiled at run time by NVRTC (cupy.RawModule, see cuda_ops.py) and standalone by
// `nvcc -c` in tests/test_cuda_compile.py: no #include, extern "C" entry points.
//
// The Python launcher flattens every part into *segments*: one segment is a run of
// bytes that is contiguous inside one block of one part (usually one layer's
// [entries, bytes] slice, 18688 B for a Flash CSA layer). Segment s of block b lives at
//
//     src = seg[s].base + b * seg[s].block_stride           (in the pool)
//     dst = records + i * record_stride + seg[s].record_offset   (record row i)
//
// and is seg[s].run_bytes long. The segment table is int64 [num_segments, 4]:
// (base address, block stride in bytes, run bytes, offset in the record).
//
// Grid: x = segment, y = record row (grid-stride over rows past gridDim.y); every
// thread block copies whole runs with the widest word (16/8/4/1 B) that the two
// addresses and the run length all allow.

typedef long long i64;
typedef unsigned long long u64;

// ---- shared copy helper (identical text in swap_in.cu; tests check they match) ----
template <typename W>
__device__ __forceinline__ void tkv_copy_words(unsigned char* __restrict__ dst,
                                               const unsigned char* __restrict__ src,
                                               i64 nbytes, i64 t, i64 nt) {
    W* d = reinterpret_cast<W*>(dst);
    const W* s = reinterpret_cast<const W*>(src);
    const i64 n = nbytes / (i64)sizeof(W);
#pragma unroll 4
    for (i64 k = t; k < n; k += nt) d[k] = s[k];  // unrolled: several loads in flight (UVA latency)
}

// Copy nbytes from src to dst with threads t = 0..nt-1 of a group cooperating.
// The word width is the widest that divides both addresses and the length, so it is
// uniform across the group (no divergence) and no bytes are left over.
__device__ __forceinline__ void tkv_copy_run(unsigned char* __restrict__ dst,
                                             const unsigned char* __restrict__ src,
                                             i64 nbytes, i64 t, i64 nt) {
    const u64 a = (u64)dst | (u64)src | (u64)nbytes;
    if ((a & 15) == 0) {
        tkv_copy_words<uint4>(dst, src, nbytes, t, nt);
    } else if ((a & 7) == 0) {
        tkv_copy_words<uint2>(dst, src, nbytes, t, nt);
    } else if ((a & 3) == 0) {
        tkv_copy_words<unsigned int>(dst, src, nbytes, t, nt);
    } else {
        tkv_copy_words<unsigned char>(dst, src, nbytes, t, nt);
    }
}
// ---- end shared copy helper ----

__device__ __forceinline__ void tkv_block_segments(const i64* __restrict__ seg,
                                                   const i64* __restrict__ block_ids, i64 n,
                                                   i64 num_blocks, unsigned char* records,
                                                   i64 record_stride, bool to_records) {
    const int s = blockIdx.x;
    const i64 base = seg[4 * s + 0];
    const i64 block_stride = seg[4 * s + 1];
    const i64 run_bytes = seg[4 * s + 2];
    const i64 record_offset = seg[4 * s + 3];
    for (i64 i = blockIdx.y; i < n; i += gridDim.y) {
        const i64 b = block_ids[i];
        // The launcher validates ids; an id out of range here is a broken invariant.
        if (b < 0 || b >= num_blocks) __trap();
        unsigned char* pool = reinterpret_cast<unsigned char*>(base + b * block_stride);
        unsigned char* rec = records + i * record_stride + record_offset;
        if (to_records) {
            tkv_copy_run(rec, pool, run_bytes, threadIdx.x, blockDim.x);
        } else {
            tkv_copy_run(pool, rec, run_bytes, threadIdx.x, blockDim.x);
        }
    }
}

// records[i, off_s : off_s + run_s] = segment s of block block_ids[i], for every s, i.
extern "C" __global__ void tkv_gather_blocks(const i64* __restrict__ seg,
                                             const i64* __restrict__ block_ids, i64 n,
                                             i64 num_blocks, unsigned char* records,
                                             i64 record_stride) {
    tkv_block_segments(seg, block_ids, n, num_blocks, records, record_stride, true);
}

// The inverse: segment s of block block_ids[i] = records[i, off_s : off_s + run_s].
// Block ids must be unique (the launcher checks), so no two threads write one byte.
extern "C" __global__ void tkv_scatter_blocks(const i64* __restrict__ seg,
                                              const i64* __restrict__ block_ids, i64 n,
                                              i64 num_blocks, unsigned char* records,
                                              i64 record_stride) {
    tkv_block_segments(seg, block_ids, n, num_blocks, records, record_stride, false);
}
