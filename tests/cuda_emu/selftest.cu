// Small kernels that test the emulator itself (tests/test_cuda_emu.py): each exercises one
// promise of cuda_emu.h / runtime.cpp against values computed independently in Python.
// Plain CUDA C: it compiles with nvcc too.

typedef long long i64;

// out[4 * t + j]: __shfl_sync(src = (lane * 7) % 32), __shfl_up_sync(d), __shfl_down_sync(d),
// __shfl_xor_sync(d), each at `width`, of value 100 + t.
extern "C" __global__ void emu_shuffles(int* out, int d, int width) {
    const int t = threadIdx.x;
    const int v = 100 + t;
    out[4 * t + 0] = __shfl_sync(0xffffffffu, v, (t * 7) % 32, width);
    out[4 * t + 1] = __shfl_up_sync(0xffffffffu, v, d, width);
    out[4 * t + 2] = __shfl_down_sync(0xffffffffu, v, d, width);
    out[4 * t + 3] = __shfl_xor_sync(0xffffffffu, v, d, width);
}

// out[3 * t + j]: ballot, any, all of predicate (t % m == 0), and a 64-bit shuffle
extern "C" __global__ void emu_votes(unsigned* out, i64* wide, int m) {
    const int t = threadIdx.x;
    const int p = t % m == 0;
    out[3 * t + 0] = __ballot_sync(0xffffffffu, p);
    out[3 * t + 1] = __any_sync(0xffffffffu, p);
    out[3 * t + 2] = __all_sync(0xffffffffu, p);
    wide[t] = __shfl_down_sync(0xffffffffu, (i64)t << 40, 1);
}

// Lanes disagree on the delta of one shuffle (lane 3 asks for 2, the others for 1).
extern "C" __global__ void emu_shfl_disagree(int* out) {
    const int t = threadIdx.x;
    out[t] = __shfl_down_sync(0xffffffffu, t, t == 3 ? 2 : 1);
}

// Even and odd threads wait at two different __syncthreads.
extern "C" __global__ void emu_divergent_barrier(int* out) {
    if (threadIdx.x % 2) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1;
}

// Thread `quitter` returns before the barrier the others wait at.
extern "C" __global__ void emu_partial_barrier(int* out, int quitter) {
    if ((int)threadIdx.x == quitter) return;
    __syncthreads();
    out[threadIdx.x] = 1;
}

// A lane exits while the rest of its warp waits in a shuffle with a full mask.
extern "C" __global__ void emu_warp_lane_exits(int* out) {
    if (threadIdx.x == 5) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}

// out[i] = the dynamic shared memory's byte i as the block starts (i < n); then every thread
// writes byte `write_at` (it may be past the launch's size).
extern "C" __global__ void emu_shared_bytes(unsigned char* out, int n, int write_at) {
    extern __shared__ __align__(16) unsigned char dyn[];
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[blockIdx.x * n + i] = dyn[i];
    __syncthreads();
    if (write_at >= 0 && threadIdx.x == 0) dyn[write_at] = 1;
}

// order[r] = the r-th thread to pass each of two points (before / after a barrier), and
// the sum of all thread ids through atomicAdd.
extern "C" __global__ void emu_order(int* order, int* counter, unsigned long long* sum) {
    const int t = threadIdx.x + blockDim.x * blockIdx.x;
    order[atomicAdd(&counter[0], 1)] = t;
    __syncthreads();
    order[atomicAdd(&counter[0], 1)] = t;
    atomicAdd(sum, (unsigned long long)t);
}

// Traps in block `bad_block`, thread `bad_thread`.
extern "C" __global__ void emu_trap(int* out, int bad_block, int bad_thread) {
    if ((int)blockIdx.x == bad_block && (int)threadIdx.x == bad_thread) __trap();
    out[blockIdx.x * blockDim.x + threadIdx.x] = 1;
}

// __syncthreads_count / _and / _or of predicate (t % m == 0).
extern "C" __global__ void emu_sync_reduce(int* out, int m) {
    const int p = threadIdx.x % m == 0;
    const int c = __syncthreads_count(p);
    const int a = __syncthreads_and(p);
    const int o = __syncthreads_or(p);
    if (threadIdx.x == 0) { out[0] = c; out[1] = a; out[2] = o; }
}

// A multi-dimensional grid and block: out[linear thread] = packed coordinates.
extern "C" __global__ void __launch_bounds__(256) emu_coordinates(i64* out) {
    const i64 block = blockIdx.x + (i64)gridDim.x * (blockIdx.y + (i64)gridDim.y * blockIdx.z);
    const i64 thread = threadIdx.x + (i64)blockDim.x * (threadIdx.y + (i64)blockDim.y * threadIdx.z);
    const i64 per = (i64)blockDim.x * blockDim.y * blockDim.z;
    out[block * per + thread] = ((i64)blockIdx.z << 48) | ((i64)blockIdx.y << 40) | ((i64)blockIdx.x << 32) |
                                (threadIdx.z << 20) | (threadIdx.y << 10) | threadIdx.x;
}

// Thread 3 never reaches a synchronisation point: the emulator cannot preempt it, so its
// watchdog ends the process (tests/test_cuda_emu.py runs this in a subprocess).
extern "C" __global__ void emu_endless(int* out) {
    volatile int x = 0;
    if (threadIdx.x == 3) {
        while (true) x = x + 1;
    }
    out[threadIdx.x] = x;
}
