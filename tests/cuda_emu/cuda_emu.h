// CUDA C on the CPU: the language surface kernels/*.cu use, for g++ -std=c++17.
//
// tests/cuda_emu/build.py compiles each UNMODIFIED kernels/*.cu as
//
//     #include "cuda_emu.h"          (this file)
//     #include "kernels/<name>.cu"   (the source, byte for byte)
//     <registration of its extern "C" kernels and dynamic shared arrays>
//
// and links it with runtime.cpp, which runs a launch the way a GPU would, only slower:
//
//   - every CUDA thread is a fiber with a stack of its own; blocks run one after the other,
//     a block's threads interleave at every synchronisation point (and at atomics)
//   - __syncthreads() is a counting barrier over the whole block; a barrier that only part
//     of the block reaches (threads exited, or wait elsewhere) is reported as a deadlock
//   - warp intrinsics work on 32-lane warps (lane = linear thread index % 32), block the
//     lanes their mask names until all of them arrive, and check that those lanes agree
//     (same intrinsic, mask, width and delta); a lane outside its own mask is an error
//   - dynamic shared memory is exactly the launch's size, filled with a poison byte at the
//     start of every block; bytes past it are a canary checked after each block (and
//     poisoned for AddressSanitizer in the sanitizer build)
//   - __trap() fails the launch, naming the block and thread
//
// Only what the kernels need, plus the neighbours a kernel is likely to reach for next
// (ballot/any/all, __syncthreads_count, the CUDA atomic overloads). A construct the
// emulator lacks fails to compile here, never runs wrong: e.g. static `__shared__`
// arrays are refused by build.py, since a block-scope static would be shared by all blocks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <utility>

// ---------------------------------------------------------------- qualifiers
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// `extern __shared__ T name[];` (dynamic shared memory): the array is defined by the
// registration build.py appends, one per name, and filled per block by the runtime.
#define __shared__

// ---------------------------------------------------------------- vector types
struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x, y, z; };
struct __attribute__((aligned(8))) uint2 { unsigned x, y; };
struct __attribute__((aligned(16))) uint4 { unsigned x, y, z, w; };
struct __attribute__((aligned(8))) int2 { int x, y; };
struct __attribute__((aligned(16))) int4 { int x, y, z, w; };
struct __attribute__((aligned(8))) float2 { float x, y; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct __attribute__((aligned(16))) ulonglong2 { unsigned long long x, y; };
struct __attribute__((aligned(16))) longlong2 { long long x, y; };

namespace tkv_emu {

// The running thread's coordinates: the scheduler sets them before resuming a fiber.
extern uint3 thread_idx;
extern uint3 block_idx;
extern dim3 block_dim;
extern dim3 grid_dim;

void syncthreads(const char* file, int line);
int syncthreads_reduce(int op, int predicate, const char* file, int line);
[[noreturn]] void trap(const char* file, int line);
void atomic_point();  // a scheduling point before every atomic (random order mode)

enum WarpOp : int { kShflIdx, kShflUp, kShflDown, kShflXor, kSyncWarp, kBallot, kAny, kAll };
// One warp collective of the calling lane: blocks until every lane of `mask` arrives.
unsigned long long warp_collective(WarpOp op, unsigned mask, unsigned long long value, int arg, int width,
                                   const char* file, int line);

template <typename T>
unsigned long long bits_of(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffles move at most 8 bytes");
    unsigned long long b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <typename T>
T from_bits(unsigned long long b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}

}  // namespace tkv_emu

#define threadIdx (::tkv_emu::thread_idx)
#define blockIdx (::tkv_emu::block_idx)
#define blockDim (::tkv_emu::block_dim)
#define gridDim (::tkv_emu::grid_dim)
static constexpr int warpSize = 32;

// ---------------------------------------------------------------- synchronisation
#define __syncthreads() ::tkv_emu::syncthreads(__FILE__, __LINE__)
#define __syncthreads_count(p) ::tkv_emu::syncthreads_reduce(0, (p), __FILE__, __LINE__)
#define __syncthreads_and(p) ::tkv_emu::syncthreads_reduce(1, (p), __FILE__, __LINE__)
#define __syncthreads_or(p) ::tkv_emu::syncthreads_reduce(2, (p), __FILE__, __LINE__)
#define __trap() ::tkv_emu::trap(__FILE__, __LINE__)
#define __syncwarp(...) ::tkv_emu::syncwarp_at(__FILE__, __LINE__, ##__VA_ARGS__)
inline void __threadfence() {}        // one thread runs at a time: memory is always coherent
inline void __threadfence_block() {}

namespace tkv_emu {
inline void syncwarp_at(const char* file, int line, unsigned mask = 0xffffffffu) {
    warp_collective(kSyncWarp, mask, 0, 0, 32, file, line);
}
}  // namespace tkv_emu

// Warp shuffles and votes: templates so every 1-8 byte type goes through one path.
#define TKV_SHFL(NAME, OP)                                                                                  \
    template <typename T>                                                                                   \
    T NAME##_at(const char* file, int line, unsigned mask, T var, int arg, int width = 32) {                \
        return ::tkv_emu::from_bits<T>(                                                                     \
            ::tkv_emu::warp_collective(::tkv_emu::OP, mask, ::tkv_emu::bits_of(var), arg, width, file, line)); \
    }
namespace tkv_emu {
TKV_SHFL(shfl, kShflIdx)
TKV_SHFL(shfl_up, kShflUp)
TKV_SHFL(shfl_down, kShflDown)
TKV_SHFL(shfl_xor, kShflXor)
}  // namespace tkv_emu
#undef TKV_SHFL
#define __shfl_sync(mask, var, ...) ::tkv_emu::shfl_at(__FILE__, __LINE__, (mask), (var), __VA_ARGS__)
#define __shfl_up_sync(mask, var, ...) ::tkv_emu::shfl_up_at(__FILE__, __LINE__, (mask), (var), __VA_ARGS__)
#define __shfl_down_sync(mask, var, ...) ::tkv_emu::shfl_down_at(__FILE__, __LINE__, (mask), (var), __VA_ARGS__)
#define __shfl_xor_sync(mask, var, ...) ::tkv_emu::shfl_xor_at(__FILE__, __LINE__, (mask), (var), __VA_ARGS__)
#define __ballot_sync(mask, p) \
    ((unsigned)::tkv_emu::warp_collective(::tkv_emu::kBallot, (mask), (p) != 0, 0, 32, __FILE__, __LINE__))
#define __any_sync(mask, p) \
    ((int)::tkv_emu::warp_collective(::tkv_emu::kAny, (mask), (p) != 0, 0, 32, __FILE__, __LINE__))
#define __all_sync(mask, p) \
    ((int)::tkv_emu::warp_collective(::tkv_emu::kAll, (mask), (p) != 0, 0, 32, __FILE__, __LINE__))

// ---------------------------------------------------------------- device math
__device__ inline int min(int a, int b) { return a < b ? a : b; }
__device__ inline int max(int a, int b) { return a > b ? a : b; }
__device__ inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
__device__ inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
__device__ inline long long min(long long a, long long b) { return a < b ? a : b; }
__device__ inline long long max(long long a, long long b) { return a > b ? a : b; }
__device__ inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
__device__ inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
__device__ inline int __popc(unsigned x) { return __builtin_popcount(x); }
__device__ inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
__device__ inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
__device__ inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
__device__ inline int __ffs(int x) { return __builtin_ffs(x); }
__device__ inline int __ffsll(long long x) { return __builtin_ffsll(x); }
template <typename T>
__device__ inline T __ldg(const T* p) { return *p; }

// ---------------------------------------------------------------- atomics
// Exactly CUDA's overloads (a kernel using one nvcc lacks fails tests/test_cuda_compile.py).
// Fibers never run at once, so each read-modify-write is atomic; atomic_point() lets other
// threads run first (random order mode), so atomics from many threads interleave.
// Integer arithmetic wraps as on the GPU (computed unsigned: no signed-overflow UB).
#define TKV_RMW(NAME, T, EXPR)                   \
    __device__ inline T NAME(T* address, T val) { \
        ::tkv_emu::atomic_point();               \
        const T old = *address;                  \
        *address = (EXPR);                       \
        return old;                              \
    }
TKV_RMW(atomicAdd, int, (int)((unsigned)old + (unsigned)val))
TKV_RMW(atomicAdd, unsigned, old + val)
TKV_RMW(atomicAdd, unsigned long long, old + val)
TKV_RMW(atomicAdd, float, old + val)
TKV_RMW(atomicAdd, double, old + val)
TKV_RMW(atomicSub, int, (int)((unsigned)old - (unsigned)val))
TKV_RMW(atomicSub, unsigned, old - val)
TKV_RMW(atomicExch, int, val)
TKV_RMW(atomicExch, unsigned, val)
TKV_RMW(atomicExch, unsigned long long, val)
TKV_RMW(atomicExch, float, val)
TKV_RMW(atomicMin, int, val < old ? val : old)
TKV_RMW(atomicMin, unsigned, val < old ? val : old)
TKV_RMW(atomicMin, long long, val < old ? val : old)
TKV_RMW(atomicMin, unsigned long long, val < old ? val : old)
TKV_RMW(atomicMax, int, val > old ? val : old)
TKV_RMW(atomicMax, unsigned, val > old ? val : old)
TKV_RMW(atomicMax, long long, val > old ? val : old)
TKV_RMW(atomicMax, unsigned long long, val > old ? val : old)
TKV_RMW(atomicAnd, int, old & val)
TKV_RMW(atomicAnd, unsigned, old & val)
TKV_RMW(atomicAnd, unsigned long long, old & val)
TKV_RMW(atomicOr, int, old | val)
TKV_RMW(atomicOr, unsigned, old | val)
TKV_RMW(atomicOr, unsigned long long, old | val)
TKV_RMW(atomicXor, int, old ^ val)
TKV_RMW(atomicXor, unsigned, old ^ val)
TKV_RMW(atomicXor, unsigned long long, old ^ val)
TKV_RMW(atomicInc, unsigned, old >= val ? 0u : old + 1u)
TKV_RMW(atomicDec, unsigned, (old == 0u || old > val) ? val : old - 1u)
#undef TKV_RMW
#define TKV_CAS(T)                                                      \
    __device__ inline T atomicCAS(T* address, T compare, T val) {       \
        ::tkv_emu::atomic_point();                                      \
        const T old = *address;                                         \
        if (old == compare) *address = val;                             \
        return old;                                                     \
    }
TKV_CAS(int)
TKV_CAS(unsigned)
TKV_CAS(unsigned long long)
TKV_CAS(unsigned short)
#undef TKV_CAS

// ---------------------------------------------------------------- registration
// build.py appends TKV_EMU_KERNEL(name) per extern "C" kernel and TKV_EMU_SHARED(name) per
// dynamic shared array; the runtime then knows each kernel's parameter types (so a launch's
// argument sizes are checked against the signature) and where dynamic shared memory lives.
namespace tkv_emu {

struct ParamInfo {
    char kind;  // 'p' pointer, 'i' signed integer, 'u' unsigned integer, 'f' floating, 'b' bool, 's' other
    unsigned size;
    const char* type;  // spelled by the compiler
};

template <typename T>
const char* type_name() {
    return __PRETTY_FUNCTION__;  // "... [with T = long long int]": runtime.cpp cuts out the type
}

template <typename T>
ParamInfo param_info() {
    char kind = 's';
    if (std::is_pointer<T>::value) kind = 'p';
    else if (std::is_same<T, bool>::value) kind = 'b';
    else if (std::is_integral<T>::value) kind = std::is_signed<T>::value ? 'i' : 'u';
    else if (std::is_floating_point<T>::value) kind = 'f';
    return ParamInfo{kind, (unsigned)sizeof(T), type_name<T>()};
}

using Invoker = void (*)(void* fn, void* const* args);
void register_kernel(const char* name, void* fn, Invoker invoke, const ParamInfo* params, int num_params);
void register_shared(void* base, std::size_t capacity);
std::size_t shared_capacity();

template <typename... A, std::size_t... I>
void invoke_with(void (*f)(A...), void* const* args, std::index_sequence<I...>) {
    f(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

template <typename... A>
struct KernelRegistration {
    KernelRegistration(const char* name, void (*f)(A...)) {
        static const ParamInfo params[sizeof...(A) + 1] = {param_info<A>()..., ParamInfo{'s', 0, ""}};
        register_kernel(
            name, reinterpret_cast<void*>(f),
            [](void* fn, void* const* args) {
                invoke_with(reinterpret_cast<void (*)(A...)>(fn), args, std::index_sequence_for<A...>{});
            },
            params, (int)sizeof...(A));
    }
};

struct SharedRegistration {
    SharedRegistration(void* base, std::size_t capacity) { register_shared(base, capacity); }
};

}  // namespace tkv_emu

#define TKV_EMU_KERNEL(name) static ::tkv_emu::KernelRegistration tkv_emu_kernel_##name(#name, &name);
// The array is as large as the largest dynamic shared memory a launch may ask for (sm_90's
// opt-in maximum); a launch's own size is enforced by the canary / ASan poison past it.
#define TKV_EMU_SHARED(type, name)                                                  \
    alignas(16) type name[232448 / sizeof(type)];                                    \
    static ::tkv_emu::SharedRegistration tkv_emu_shared_##name(name, sizeof(name));
