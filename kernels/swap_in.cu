// HiSparse swap-in, the copy half: buffer[slots[i]] = host[host_rows[i]] for i < m.
//
// `host` is pinned (page-locked) CPU memory read DIRECTLY by the kernel over unified
// virtual addressing: one launch moves every missed entry of a decode step, instead of
// one cudaMemcpy per entry. It may also be device memory (then it is a plain gather).
//
// Compiled at run time by NVRTC (cupy.RawModule, see cuda_ops.py) and standalone by
// `nvcc -c` in tests/test_cuda_compile.py: no #include, extern "C" entry point.
//
// One warp per row (grid-stride over rows); a Flash fp8 CSA entry is 584 B, i.e. 73
// 8-byte words, so a warp finishes it in three rounds of coalesced loads.

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

// Row r of `host` lives at host + (r / rows_per_block) * host_block_stride
//                               + (r % rows_per_block) * host_row_stride,
// so the CSA part of block-contiguous host records is addressed in place (a 2-D host is
// rows_per_block = num_rows, host_block_stride = 0).
extern "C" __global__ void tkv_swap_in(const unsigned char* __restrict__ host,
                                       i64 host_block_stride, i64 rows_per_block,
                                       i64 host_row_stride, i64 num_rows,
                                       const i64* __restrict__ host_rows,
                                       unsigned char* __restrict__ buffer,
                                       i64 buffer_row_stride, i64 num_slots,
                                       const i64* __restrict__ slots, i64 m,
                                       i64 entry_bytes) {
    const i64 lane = threadIdx.x & 31;
    const i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const i64 num_warps = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 i = warp; i < m; i += num_warps) {
        const i64 r = host_rows[i];
        const i64 s = slots[i];
        // The launcher validates both; out of range here is a broken invariant.
        if (r < 0 || r >= num_rows || s < 0 || s >= num_slots) __trap();
        const unsigned char* src =
            host + (r / rows_per_block) * host_block_stride + (r % rows_per_block) * host_row_stride;
        tkv_copy_run(buffer + s * buffer_row_stride, src, entry_bytes, lane, 32);
    }
}
