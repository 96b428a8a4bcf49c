// HiSparse swap-in, batched and whole: hit detection, LRU victims, the copy of misses
// from pinned host memory (over UVA) and the table updates, for every request of a decode
// step and one CSA layer, in ONE launch. No host sync, no data-dependent shapes: the
// launch can be captured in a CUDA graph and replayed.
//
// Compiled at run time by NVRTC (cupy.RawModule, see cuda_ops.py) and standalone by
// `nvcc -c` in tests/test_cuda_compile.py: no #include, extern "C" entry points. Executed on
// the CPU, unmodified, by the emulator of tests/cuda_emu (make test-cuda-emu).
// The algorithm is the one of kernels/torch_ops.py::hisparse_swap_in (CPU CI proves it;
// the gpu tests compare the two).
//
// Grid: one block of 1024 threads per request row b (State slot s = state_slots[b]); the row's
// tables live at base = (s * C + part) * N. Per block, a work area of
//
//   hkey  [H] u64   open-addressing hash of the row's ids (H = pow2 >= 2k), empty = ~0
//   hpos  [H] i32   first position of each id (its owner)
//   hslot [H] i32   the slot serving each id (hit slot, then victim), -1 none
//   lru   [N] i32   the row's LRU order (slots, least recently used first)
//   flag  [N] i32   per slot: 0 unused, 1 hit, 2 victim
//   rank  [N] i32   exclusive scan of "not hit" over the LRU order
//   vict  [N] i32   vict[r] = r-th victim
//   used  [N] i32   exclusive scan of "used" over slot order
//   hof   [k] i32   hash index of each position (-1 padding)
//   mscan [k] i32   exclusive scan of "owner and miss" over positions
//   mlist [k] i32   mlist[r] = position of the r-th miss
//   wsum  [32] i32  scan scratch
//
// i.e. 16*H + 20*N + 12*k + 128 bytes (cuda_ops.hisparse_work_bytes). Two entry points
// share the algorithm: tkv_hisparse_swap_in keeps the work area in dynamic shared memory
// (the fast one, while it fits: N up to ~7,000 at k = 512), tkv_hisparse_swap_in_global in
// a global-memory scratch of one area per block (any N whose tables fit the device).
//
//   1. insert ids into the hash (atomicCAS; atomicMin keeps the first position)
//   2. scan the row's N resident entries, look each up: a hit records its slot
//   3. misses = owner positions without a slot; m = their count (block scan)
//   4. victims = the first m slots in LRU order that no hit uses (block scan)
//   5. miss r -> victim r (order of first occurrence); entry_of_slot updated
//   6. warps copy the m missed rows host -> buffer; every position gets its slot (-1 pad)
//   7. new LRU order = unused slots in old order, then used slots by slot index;
//      last_used = step; step += 1; counters += (hits, misses)
//
// Buffer row r (= (s*C + part)*N + slot) starts at buffer + r * buffer_row_stride and holds
// entry_bytes bytes; the two differ when rows are padded (the padding is never written).

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

#define TKV_EMPTY_KEY (~0ull)

__device__ __forceinline__ unsigned tkv_hash(u64 key, int mask) {
    return (unsigned)((key * 0x9E3779B97F4A7C15ull) >> 40) & (unsigned)mask;
}

// Slot of `key` in the hash, or -1.
__device__ __forceinline__ int tkv_find(const u64* hkey, int mask, u64 key) {
    unsigned h = tkv_hash(key, mask);
    for (int probe = 0; probe <= mask; ++probe) {
        const u64 k = hkey[h];
        if (k == key) return (int)h;
        if (k == TKV_EMPTY_KEY) return -1;
        h = (h + 1) & (unsigned)mask;
    }
    return -1;
}

// In-place exclusive prefix sum of a[0..n) (all threads of the block call it); returns the
// total. Each thread scans a contiguous chunk; warp and block totals via shuffles.
__device__ int tkv_block_scan(int* a, int n, int* wsum) {
    const int t = threadIdx.x, nt = blockDim.x;
    const int per = (n + nt - 1) / nt;
    const int lo = min(n, t * per), hi = min(n, lo + per);
    int local = 0;
    for (int i = lo; i < hi; ++i) local += a[i];
    const int lane = t & 31, warp = t >> 5, nwarps = (nt + 31) >> 5;
    int incl = local;
    for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += v;
    }
    if (lane == 31) wsum[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        int w = lane < nwarps ? wsum[lane] : 0;
        for (int d = 1; d < 32; d <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, w, d);
            if (lane >= d) w += v;
        }
        wsum[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    int run = (warp ? wsum[warp - 1] : 0) + incl - local;
    const int total = wsum[nwarps - 1];
    for (int i = lo; i < hi; ++i) {
        const int v = a[i];
        a[i] = run;
        run += v;
    }
    __syncthreads();
    return total;
}

// The whole swap-in of request row blockIdx.x, with its work area at `work` (16-byte aligned).
__device__ __forceinline__ void tkv_hisparse_swap_in_row(
    unsigned char* __restrict__ work,
    const i64* __restrict__ ids, i64 k, i64 ids_stride,
    const i64* __restrict__ state_slots, i64 part, i64 num_parts, i64 N,
    i64* __restrict__ entry_of_slot, i64* __restrict__ last_used, i64* __restrict__ lru_g,
    i64* __restrict__ step, u64* __restrict__ counters,
    unsigned char* __restrict__ buffer, i64 buffer_row_stride, i64 entry_bytes,
    const unsigned char* __restrict__ host, i64 host_block_stride,
    i64 rows_per_block, i64 host_row_stride, i64 num_host_blocks,
    const i64* __restrict__ host_block, i64 max_blocks, i64 entries_per_block,
    const i64* __restrict__ host_rows, i64 host_rows_stride,
    i64* __restrict__ out, i64 out_stride, int hash_size) {
    const int H = hash_size, mask = H - 1;
    const int n = (int)N, kk = (int)k;
    u64* hkey = reinterpret_cast<u64*>(work);
    int* hpos = reinterpret_cast<int*>(hkey + H);
    int* hslot = hpos + H;
    int* lru = hslot + H;
    int* flag = lru + n;
    int* rank = flag + n;
    int* vict = rank + n;
    int* used = vict + n;
    int* hof = used + n;
    int* mscan = hof + kk;
    int* mlist = mscan + kk;
    int* wsum = mlist + kk;

    const int b = blockIdx.x, t = threadIdx.x, nt = blockDim.x;
    const i64 s = state_slots[b];
    const i64 base = (s * num_parts + part) * N;
    const i64* row_ids = ids + b * ids_stride;
    const i64 step_new = step[s * num_parts + part] + 1;

    for (int h = t; h < H; h += nt) { hkey[h] = TKV_EMPTY_KEY; hpos[h] = 0x7fffffff; hslot[h] = -1; }
    for (int p = t; p < n; p += nt) { lru[p] = (int)lru_g[base + p]; flag[p] = 0; }
    __syncthreads();
    // 1. hash the ids
    for (int i = t; i < kk; i += nt) {
        const i64 id = row_ids[i];
        int at = -1;
        if (id < -1) __trap();  // -1 is padding; below it a broken id (checked on the host on CPU)
        if (id >= 0) {
            unsigned h = tkv_hash((u64)id, mask);
            for (int probe = 0; probe <= mask; ++probe) {
                const u64 prev = atomicCAS(&hkey[h], TKV_EMPTY_KEY, (u64)id);
                if (prev == TKV_EMPTY_KEY || prev == (u64)id) { at = (int)h; break; }
                h = (h + 1) & (unsigned)mask;
            }
            if (at < 0) __trap();  // H >= 2k: the table cannot fill up
            atomicMin(&hpos[at], i);
        }
        hof[i] = at;
    }
    __syncthreads();
    // 2. hits: resident entries found among the ids (entries are unique within a row)
    for (int p = t; p < n; p += nt) {
        const i64 e = entry_of_slot[base + p];
        if (e >= 0) {
            const int h = tkv_find(hkey, mask, (u64)e);
            if (h >= 0) { hslot[h] = p; flag[p] = 1; }
        }
    }
    __syncthreads();
    // 3. misses in order of first occurrence
    int my_hits = 0;
    for (int i = t; i < kk; i += nt) {
        const int h = hof[i];
        const bool owner = h >= 0 && hpos[h] == i;
        mscan[i] = owner && hslot[h] < 0;
        my_hits += owner && hslot[h] >= 0;
    }
    __syncthreads();
    const int m = tkv_block_scan(mscan, kk, wsum);
    // 4. victims: the first m not-hit slots in LRU order
    for (int p = t; p < n; p += nt) rank[p] = flag[lru[p]] == 0;
    __syncthreads();
    tkv_block_scan(rank, n, wsum);
    for (int p = t; p < n; p += nt) {
        const int slot = lru[p];
        if (flag[slot] == 0 && rank[p] < m) vict[rank[p]] = slot;
    }
    __syncthreads();
    for (int p = t; p < n; p += nt) {
        const int slot = lru[p];
        if (flag[slot] == 0 && rank[p] < m) flag[slot] = 2;  // lru is a permutation: no race
    }
    // 5. miss r -> victim r
    for (int i = t; i < kk; i += nt) {
        const int h = hof[i];
        if (h >= 0 && hpos[h] == i && hslot[h] < 0) {
            const int r = mscan[i];
            const int v = vict[r];
            mlist[r] = i;
            hslot[h] = v;
            entry_of_slot[base + v] = row_ids[i];
        }
    }
    __syncthreads();
    // 6. copy the misses (one warp per row) and write every position's slot
    const int lane = t & 31, warp = t >> 5, nwarps = nt >> 5;
    for (int r = warp; r < m; r += nwarps) {
        const int i = mlist[r];
        const i64 id = row_ids[i];
        i64 blk, row;
        if (host_rows != nullptr) {
            const i64 hr = host_rows[b * host_rows_stride + i];
            blk = hr / rows_per_block;
            row = hr % rows_per_block;
        } else {
            const i64 j = id / entries_per_block;
            blk = j < max_blocks ? host_block[s * max_blocks + j] : -1;
            row = part * entries_per_block + id % entries_per_block;
        }
        // The caller maps every id to a sealed block (checked under TIERED_KV_DEBUG=1).
        if (blk < 0 || blk >= num_host_blocks || row < 0 || row >= rows_per_block) __trap();
        const unsigned char* src = host + blk * host_block_stride + row * host_row_stride;
        tkv_copy_run(buffer + (base + hslot[hof[i]]) * buffer_row_stride, src, entry_bytes, lane, 32);
    }
    for (int i = t; i < kk; i += nt) {
        const int h = hof[i];
        out[b * out_stride + i] = h < 0 ? -1 : (i64)hslot[h];
    }
    // 7. LRU order, last use, step, counters
    for (int p = t; p < n; p += nt) used[p] = flag[p] != 0;
    __syncthreads();
    const int num_used = tkv_block_scan(used, n, wsum);
    for (int p = t; p < n; p += nt) {
        const int slot = lru[p];
        if (flag[slot] != 0) {
            lru_g[base + (n - num_used) + used[slot]] = slot;
            last_used[base + slot] = step_new;
        } else {
            lru_g[base + rank[p] - m] = slot;
        }
    }
    for (int d = 16; d > 0; d >>= 1) my_hits += __shfl_down_sync(0xffffffffu, my_hits, d);
    if (lane == 0 && my_hits) atomicAdd(&counters[0], (u64)my_hits);
    if (t == 0) {
        step[s * num_parts + part] = step_new;
        if (m) atomicAdd(&counters[1], (u64)m);
    }
}

#define TKV_SWAP_IN_PARAMS                                                                          \
    const i64* __restrict__ ids, i64 k, i64 ids_stride,                /* [B, k] */                  \
    const i64* __restrict__ state_slots,                              /* [B] */                     \
    i64 part, i64 num_parts, i64 N,                                                                 \
    i64* __restrict__ entry_of_slot, i64* __restrict__ last_used,      /* [S, C, N] */               \
    i64* __restrict__ lru_g, i64* __restrict__ step,                  /* [S, C, N], [S, C] */       \
    u64* __restrict__ counters,                                       /* [2]: hits, misses */       \
    unsigned char* __restrict__ buffer, i64 buffer_row_stride,        /* rows (s*C + c)*N + slot */ \
    i64 entry_bytes,                                                                                \
    const unsigned char* __restrict__ host, i64 host_block_stride,    /* [HB, rows_per_block, EB] */\
    i64 rows_per_block, i64 host_row_stride, i64 num_host_blocks,                                   \
    const i64* __restrict__ host_block, i64 max_blocks,               /* [S, MB] */                 \
    i64 entries_per_block,                                                                          \
    const i64* __restrict__ host_rows, i64 host_rows_stride,          /* [B, k] or null */          \
    i64* __restrict__ out, i64 out_stride,                            /* [B, k] */                  \
    int hash_size
#define TKV_SWAP_IN_ARGS                                                                             \
    ids, k, ids_stride, state_slots, part, num_parts, N, entry_of_slot, last_used, lru_g, step,      \
    counters, buffer, buffer_row_stride, entry_bytes, host, host_block_stride, rows_per_block,       \
    host_row_stride, num_host_blocks, host_block, max_blocks, entries_per_block, host_rows,          \
    host_rows_stride, out, out_stride, hash_size

// The work area in dynamic shared memory (hisparse_work_bytes(N, k) of it per block).
extern "C" __global__ void __launch_bounds__(1024) tkv_hisparse_swap_in(TKV_SWAP_IN_PARAMS) {
    extern __shared__ __align__(16) unsigned char smem[];
    tkv_hisparse_swap_in_row(smem, TKV_SWAP_IN_ARGS);
}

// The work area in global memory: block b uses scratch + b * scratch_stride (16-byte aligned,
// scratch_stride >= hisparse_work_bytes(N, k)), for rows whose tables exceed shared memory.
extern "C" __global__ void __launch_bounds__(1024) tkv_hisparse_swap_in_global(
    TKV_SWAP_IN_PARAMS, unsigned char* __restrict__ scratch, i64 scratch_stride) {
    tkv_hisparse_swap_in_row(scratch + blockIdx.x * scratch_stride, TKV_SWAP_IN_ARGS);
}
