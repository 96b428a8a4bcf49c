// The CUDA emulator's runtime: fibers, the block scheduler, barriers, warp collectives and
// the launch entry point that tests/cuda_emu/launcher.py calls through ctypes.
//
// One launch runs its blocks one after the other (in grid order, reversed or a seeded
// random permutation). A block's threads are fibers: each runs on a stack of its own until
// it reaches a synchronisation point (a barrier, a warp collective, an atomic in random
// mode) or ends; then the scheduler resumes another runnable thread, chosen by the order
// mode:
//
//   in order   lowest thread first (the queue refills in thread order)
//   reversed   highest thread first
//   random     any runnable thread, by a seeded xorshift generator
//
// When no thread is runnable and not all have ended, the block is deadlocked: the launch
// fails with who waits where (never a hang). Any failure (a __trap, a deadlock, a warp that
// disagrees, a write past the dynamic shared memory) stops the launch; tkv_emu_error()
// then says what happened, naming the block and thread.
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define TKV_ASAN 1
#else
#define TKV_ASAN 0
#endif

#include "cuda_emu.h"  // last: its qualifier macros (__noinline__, ...) must not reach the system headers

#define TKV_EXPORT extern "C" __attribute__((visibility("default")))

namespace tkv_emu {

uint3 thread_idx;
uint3 block_idx;
dim3 block_dim;
dim3 grid_dim;

namespace {

constexpr unsigned char kSharedPoison = 0xA5;  // dynamic shared memory at block start
constexpr unsigned char kCanary = 0x5C;        // bytes past the launch's dynamic shared size
constexpr std::size_t kStackBytes = 256 * 1024;
constexpr unsigned kMaxThreads = 1024;
constexpr unsigned long long kMaxSharedBytes = 232448;  // sm_90 opt-in maximum (227 KiB)

// ------------------------------------------------------------------ context switch
// x86-64: save the callee-saved registers, MXCSR and the x87 control word on the current
// stack, store the stack pointer, load the other one and pop its registers. A few
// nanoseconds (swapcontext makes a sigprocmask system call per switch).
#if defined(__x86_64__)
extern "C" void tkv_emu_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .p2align 4
    .type tkv_emu_switch,@function
tkv_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size tkv_emu_switch,.-tkv_emu_switch
)");
#define TKV_FAST_SWITCH 1
#else
#include <ucontext.h>
#define TKV_FAST_SWITCH 0
#endif

enum class St : unsigned char { Ready, Running, Barrier, Warp, Done, Dead };

struct Fiber {
    void* sp = nullptr;
    unsigned char* stack = nullptr;  // lowest usable byte (a guard page lies below it)
    uint3 tid{};
    unsigned linear = 0;
    St st = St::Ready;
    const char* wait_file = "";
    int wait_line = 0;
    void* fake_stack = nullptr;  // ASan's fake stack of this fiber while switched out
#if !TKV_FAST_SWITCH
    ucontext_t ctx;
#endif
};

struct WarpState {
    unsigned pending = 0;  // lanes arrived at the collective now forming
    WarpOp op = kSyncWarp;
    unsigned mask = 0;
    int arg = 0;
    int width = 32;
    const char* file = "";
    int line = 0;
    unsigned long long value[32] = {};
    int lane_arg[32] = {};
    unsigned long long result[32] = {};
};

struct Kernel {
    std::string name;
    void* fn;
    Invoker invoke;
    std::vector<ParamInfo> params;
};

struct SharedArray {
    unsigned char* base;
    std::size_t capacity;
};

std::vector<Kernel>& kernels() {
    static std::vector<Kernel> k;
    return k;
}
std::vector<SharedArray>& shared_arrays() {
    static std::vector<SharedArray> s;
    return s;
}

std::string g_error;

std::string format(const char* fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return buf;
}

const char* base_name(const char* path) {
    const char* slash = std::strrchr(path, '/');
    return slash ? slash + 1 : path;
}

// ------------------------------------------------------------------ the block scheduler
struct Block {
    const Kernel* kernel = nullptr;
    void* const* args = nullptr;
    int mode = 0;  // 0 in order, 1 reversed, 2 random
    unsigned long long rng = 0;
    unsigned n = 0;
    std::vector<Fiber> fibers;
    std::vector<unsigned> ready;  // runnable fibers (a FIFO from `head`, or a random pool)
    std::size_t head = 0;
    WarpState warps[kMaxThreads / 32];
    unsigned at_barrier = 0;
    const char* barrier_file = "";
    int barrier_line = 0;
    int barrier_op = -1;  // -1 plain, else the __syncthreads_count/and/or being formed
    int barrier_acc = 0;
    int barrier_result = 0;
    unsigned done = 0;
    bool failed = false;
    bool in_fiber = false;  // a fiber runs (not the scheduler): a fault there fails the launch
    Fiber* current = nullptr;
    void* sched_sp = nullptr;
    void* sched_fake_stack = nullptr;
    const void* sched_stack_bottom = nullptr;
    std::size_t sched_stack_size = 0;
#if !TKV_FAST_SWITCH
    ucontext_t sched_ctx;
#endif

    unsigned long long next_random() {  // xorshift64*
        rng ^= rng >> 12;
        rng ^= rng << 25;
        rng ^= rng >> 27;
        return rng * 2685821657736338717ull;
    }

    void make_ready(unsigned f) {
        fibers[f].st = St::Ready;
        ready.push_back(f);
    }

    // Make fibers first .. first + count - 1, or the lanes of `mask` of the warp starting at
    // `first`, runnable in the mode's order.
    void make_ready_range(unsigned first, unsigned count) {
        if (mode == 1) {
            for (unsigned i = count; i-- > 0;) make_ready(first + i);
        } else {
            for (unsigned i = 0; i < count; ++i) make_ready(first + i);
        }
    }
    void make_ready_lanes(unsigned first, unsigned mask) {
        if (mode == 1) {
            for (int l = 31; l >= 0; --l) if (mask >> l & 1u) make_ready(first + (unsigned)l);
        } else {
            for (unsigned l = 0; l < 32; ++l) if (mask >> l & 1u) make_ready(first + l);
        }
    }

    bool pick(unsigned* f) {
        if (head >= ready.size()) {
            ready.clear();
            head = 0;
            return false;
        }
        if (mode == 2) {
            const std::size_t i = head + next_random() % (ready.size() - head);
            std::swap(ready[i], ready[head]);
        }
        *f = ready[head++];
        if (head > 4096 && head * 2 > ready.size()) {
            ready.erase(ready.begin(), ready.begin() + (long)head);
            head = 0;
        }
        return true;
    }

    std::string where() const {
        return format("block (%u,%u,%u) thread (%u,%u,%u)", block_idx.x, block_idx.y, block_idx.z,
                      current->tid.x, current->tid.y, current->tid.z);
    }
};

Block* g_block = nullptr;

struct StackPool {
    unsigned char* region = nullptr;
    std::size_t count = 0;
    std::size_t page = 4096;

    unsigned char* stack(std::size_t i) { return region + i * (kStackBytes + page) + page; }

    void reserve(std::size_t n) {
        if (n <= count) return;
        if (region) munmap(region, count * (kStackBytes + page));
        page = (std::size_t)sysconf(_SC_PAGESIZE);
        const std::size_t bytes = n * (kStackBytes + page);
        void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) {
            std::fprintf(stderr, "cuda_emu: cannot map %zu fiber stacks: %s\n", n, std::strerror(errno));
            std::abort();
        }
        region = static_cast<unsigned char*>(p);
        count = n;
        for (std::size_t i = 0; i < n; ++i) mprotect(stack(i) - page, page, PROT_NONE);  // overflow faults
    }
} g_stacks;

// ------------------------------------------------------------------ switching
void fiber_main();

void enter_fiber(Block& b, Fiber& f) {
    b.current = &f;
    thread_idx = f.tid;
    f.st = St::Running;
#if TKV_ASAN
    __sanitizer_start_switch_fiber(&b.sched_fake_stack, f.stack, kStackBytes);
#endif
    b.in_fiber = true;
#if TKV_FAST_SWITCH
    tkv_emu_switch(&b.sched_sp, f.sp);
#else
    swapcontext(&b.sched_ctx, &f.ctx);
#endif
    b.in_fiber = false;
#if TKV_ASAN
    __sanitizer_finish_switch_fiber(b.sched_fake_stack, nullptr, nullptr);
#endif
}

// The running fiber stops here (it waits, or it ended when `ending`: its stack is reused by
// the next block) and the next runnable one resumes: a direct switch, without a detour
// through the scheduler, which gets control back only when nothing is runnable or the
// launch failed. Returns when another fiber (or the scheduler) resumes this one.
void leave_fiber(bool ending) {
    Block& b = *g_block;
    Fiber& me = *b.current;
    unsigned next;
    void* to_sp = b.sched_sp;
#if TKV_ASAN
    const void* to_bottom = b.sched_stack_bottom;
    std::size_t to_size = b.sched_stack_size;
#endif
#if !TKV_FAST_SWITCH
    ucontext_t* to_ctx = &b.sched_ctx;
#endif
    if (!b.failed && b.pick(&next)) {
        Fiber& f = b.fibers[next];
        if (&f == &me) {  // it made itself runnable again (an atomic in random order) and won
            me.st = St::Running;
            return;
        }
        b.current = &f;
        thread_idx = f.tid;
        f.st = St::Running;
        to_sp = f.sp;
#if TKV_ASAN
        to_bottom = f.stack;
        to_size = kStackBytes;
#endif
#if !TKV_FAST_SWITCH
        to_ctx = &f.ctx;
#endif
    }
#if TKV_ASAN
    __sanitizer_start_switch_fiber(ending ? nullptr : &me.fake_stack, to_bottom, to_size);
#else
    (void)ending;
#endif
#if TKV_FAST_SWITCH
    tkv_emu_switch(&me.sp, to_sp);
#else
    (void)to_sp;
    swapcontext(&me.ctx, to_ctx);
#endif
#if TKV_ASAN
    __sanitizer_finish_switch_fiber(me.fake_stack, nullptr, nullptr);
#endif
}

[[noreturn]] void fail(const std::string& message) {
    Block& b = *g_block;
    if (!b.failed) {
        b.failed = true;
        g_error = message;
    }
    b.current->st = St::Dead;
    leave_fiber(true);
    std::abort();  // never resumed
}

// SIGSEGV / SIGBUS inside a kernel thread (an invalid address, a vector access misaligned
// for its type, a fiber's stack overflowing into its guard page): the launch fails naming
// the thread, as a GPU reports an illegal or misaligned address. Runs on an alternate
// signal stack, with SA_NODEFER (the handler never returns: it switches to the scheduler).
// Not installed in the sanitizer build, whose own handler reports more.
#if !TKV_ASAN
void on_fault(int sig, siginfo_t* info, void*) {
    Block* b = g_block;
    if (!b || !b->in_fiber || !b->current) {  // not in a kernel thread: the emulator's own bug
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    if (!b->failed) {
        b->failed = true;
        g_error = format("memory fault (%s at address %p) in %s: an invalid address, or an access misaligned for "
                         "its type (a GPU reports an illegal / misaligned address)",
                         sig == SIGBUS ? "SIGBUS" : "SIGSEGV", info->si_addr, b->where().c_str());
    }
    b->current->st = St::Dead;
#if TKV_FAST_SWITCH
    void* abandoned;
    tkv_emu_switch(&abandoned, b->sched_sp);
#else
    ucontext_t abandoned;
    swapcontext(&abandoned, &b->sched_ctx);
#endif
}
#endif

struct FaultGuard {  // installs on_fault for one launch, restores the previous handlers
    struct sigaction old_segv, old_bus;
    stack_t old_stack;
    FaultGuard() {
#if !TKV_ASAN
        static std::vector<unsigned char> alt(256 * 1024);
        stack_t ss{};
        ss.ss_sp = alt.data();
        ss.ss_size = alt.size();
        sigaltstack(&ss, &old_stack);
        struct sigaction sa{};
        sa.sa_sigaction = on_fault;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGSEGV, &sa, &old_segv);
        sigaction(SIGBUS, &sa, &old_bus);
#endif
    }
    ~FaultGuard() {
#if !TKV_ASAN
        sigaction(SIGSEGV, &old_segv, nullptr);
        sigaction(SIGBUS, &old_bus, nullptr);
        sigaltstack(&old_stack, nullptr);
#endif
    }
};

void fiber_main() {
    Block& b = *g_block;
#if TKV_ASAN
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
    b.kernel->invoke(b.kernel->fn, b.args);
    Fiber& f = *b.current;
    f.st = St::Done;
    ++b.done;
    leave_fiber(true);
    std::abort();  // never resumed
}

void init_fiber(Fiber& f, unsigned char* stack) {
    f.stack = stack;
    f.fake_stack = nullptr;
#if TKV_FAST_SWITCH
    // [top-8] 0 (the entry's return address), [top-16] fiber_main (popped by `ret`, leaving
    // rsp = 8 mod 16 as at any function entry), six zeroed registers, MXCSR and x87 CW.
    // Tops are staggered across a page: page-aligned tops of 1024 fibers would all fall in
    // the same cache sets and evict each other at every switch.
    const std::size_t color = (f.linear * 17u % 64u) * 64u;
    auto* top = reinterpret_cast<std::uintptr_t*>(stack + kStackBytes - color);
    top[-1] = 0;
    top[-2] = reinterpret_cast<std::uintptr_t>(&fiber_main);
    for (int r = 3; r <= 8; ++r) top[-r] = 0;
    std::uint32_t* csr = reinterpret_cast<std::uint32_t*>(&top[-9]);
    csr[0] = 0x1F80;  // MXCSR: all exceptions masked, round to nearest
    csr[1] = 0x037F;  // x87 control word: default
    f.sp = &top[-9];
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stack;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
#endif
}

std::string tid_list(const Block& b, St st) {
    std::string out;
    int shown = 0, total = 0;
    for (const Fiber& f : b.fibers) {
        if (f.st != st) continue;
        ++total;
        if (shown < 8) {
            out += format("%s%u", shown ? "," : "", f.linear);
            ++shown;
        }
    }
    if (total > shown) out += format(",... (%d threads)", total);
    return out;
}

// Nothing runnable, not everything ended: say who waits where.
std::string deadlock_report(const Block& b) {
    std::string msg = format("deadlock in block (%u,%u,%u) of %s: ", block_idx.x, block_idx.y, block_idx.z,
                             b.kernel->name.c_str());
    const char* sep = "";
    if (b.at_barrier) {
        msg += format("%u of %u threads wait at __syncthreads (%s:%d) [threads %s]", b.at_barrier, b.n,
                      base_name(b.barrier_file), b.barrier_line, tid_list(b, St::Barrier).c_str());
        if (b.done) msg += format("; %u threads ended without reaching it [threads %s]", b.done,
                                  tid_list(b, St::Done).c_str());
        sep = "; ";
    }
    for (unsigned w = 0; w < (b.n + 31) / 32; ++w) {
        const WarpState& ws = b.warps[w];
        if (!ws.pending) continue;
        const unsigned missing = ws.mask & ~ws.pending;
        msg += format("%swarp %u: lanes 0x%08x wait in a warp collective (%s:%d, mask 0x%08x) for lanes 0x%08x", sep,
                      w, ws.pending, base_name(ws.file), ws.line, ws.mask, missing);
        sep = "; ";
        for (unsigned lane = 0; lane < 32; ++lane) {
            if (!(missing >> lane & 1u)) continue;
            const Fiber& f = b.fibers[w * 32 + lane];
            const char* state = f.st == St::Done ? "ended" : f.st == St::Barrier ? "waits at __syncthreads" : "waits";
            msg += format(" [lane %u %s]", lane, state);
            break;
        }
    }
    return msg;
}

const Kernel* find_kernel(const char* name) {
    for (const Kernel& k : kernels()) {
        if (k.name == name) return &k;
    }
    return nullptr;
}

std::string spelled(const ParamInfo& p) {
    // "const char* tkv_emu::type_name() [with T = long long int]" -> "long long int"
    const char* with = std::strstr(p.type, "T = ");
    if (!with) return p.type;
    std::string s = with + 4;
    const std::size_t end = s.find_first_of(";]");
    return end == std::string::npos ? s : s.substr(0, end);
}

bool accepts(const ParamInfo& p, char kind, unsigned size) {
    if (p.size != size) return false;
    switch (p.kind) {
        case 'p': return kind == 'u';  // CuPy convention: a device address as numpy uint64
        case 'i': return kind == 'i';
        case 'u': return kind == 'u';
        case 'f': return kind == 'f';
        case 'b': return kind == 'b';
        default: return true;  // a struct by value: its size must match
    }
}

const char* kind_name(char kind) {
    switch (kind) {
        case 'i': return "a signed integer";
        case 'u': return "an unsigned integer";
        case 'f': return "a float";
        case 'b': return "a bool";
        default: return "bytes";
    }
}

void fill_shared(std::size_t size) {
    for (const SharedArray& s : shared_arrays()) {
        std::memset(s.base, kSharedPoison, size);
        std::memset(s.base + size, kCanary, s.capacity - size);
    }
}

// A write past the launch's dynamic shared memory changed the canary: name the first byte.
bool shared_overrun(std::size_t size, std::string* msg) {
    static unsigned char canary_page[4096];
    if (canary_page[0] != kCanary) std::memset(canary_page, kCanary, sizeof canary_page);
    for (const SharedArray& s : shared_arrays()) {
        for (std::size_t i = size; i < s.capacity;) {  // a page at a time; a closer look at one that differs
            const std::size_t n = std::min(sizeof canary_page, s.capacity - i);
            if (std::memcmp(s.base + i, canary_page, n) != 0) {
                while (s.base[i] == kCanary) ++i;
                *msg = format("block (%u,%u,%u) wrote byte %zu of dynamic shared memory, past the %zu bytes the "
                              "launch asked for",
                              block_idx.x, block_idx.y, block_idx.z, i, size);
                return true;
            }
            i += n;
        }
    }
    return false;
}

// A kernel thread that loops without ever reaching a synchronisation point cannot be
// preempted: after TKV_EMU_TIMEOUT_S seconds (default 600) of one launch the process
// aborts with a message, so CI fails instead of hanging.
class Watchdog {
  public:
    explicit Watchdog(const char* kernel) : kernel_(kernel), thread_([this] { watch(); }) {}
    ~Watchdog() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            done_ = true;
        }
        cv_.notify_one();
        thread_.join();
    }

  private:
    void watch() {
        const char* env = std::getenv("TKV_EMU_TIMEOUT_S");
        const long limit = env && std::atol(env) > 0 ? std::atol(env) : 600;
        std::unique_lock<std::mutex> lock(mu_);
        if (!cv_.wait_for(lock, std::chrono::seconds(limit), [this] { return done_; })) {
            std::fprintf(stderr, "cuda_emu: the launch of %s ran over %ld s: a kernel thread loops without reaching a "
                         "synchronisation point (an endless loop?); aborting\n", kernel_, limit);
            std::abort();
        }
    }
    const char* kernel_;
    std::mutex mu_;
    std::condition_variable cv_;
    bool done_ = false;
    std::thread thread_;
};

bool run_block(Block& b) {
    b.ready.clear();
    b.head = 0;
    b.at_barrier = 0;
    b.barrier_op = -1;
    b.done = 0;
    for (WarpState& w : b.warps) w.pending = 0;
    unsigned i = 0;
    for (unsigned z = 0; z < block_dim.z; ++z) {
        for (unsigned y = 0; y < block_dim.y; ++y) {
            for (unsigned x = 0; x < block_dim.x; ++x, ++i) {
                Fiber& f = b.fibers[i];
                f.tid = uint3{x, y, z};
                f.linear = i;
                init_fiber(f, g_stacks.stack(i));
            }
        }
    }
    b.make_ready_range(0, b.n);
    unsigned f;
    // Each entry runs fibers, switching among them directly, until none is runnable.
    while (!b.failed && b.pick(&f)) enter_fiber(b, b.fibers[f]);
    if (b.failed) return false;
    if (b.done != b.n) {
        g_error = deadlock_report(b);
        return false;
    }
    return true;
}

}  // namespace

// ------------------------------------------------------------------ kernel-side calls
void register_kernel(const char* name, void* fn, Invoker invoke, const ParamInfo* params, int num_params) {
    kernels().push_back(Kernel{name, fn, invoke, std::vector<ParamInfo>(params, params + num_params)});
}

void register_shared(void* base, std::size_t capacity) {
    shared_arrays().push_back(SharedArray{static_cast<unsigned char*>(base), capacity});
}

void syncthreads(const char* file, int line) { syncthreads_reduce(-1, 0, file, line); }

int syncthreads_reduce(int op, int predicate, const char* file, int line) {
    Block& b = *g_block;
    Fiber& me = *b.current;
    if (b.at_barrier == 0) {
        b.barrier_file = file;
        b.barrier_line = line;
        b.barrier_op = op;
        b.barrier_acc = op == 1 ? 1 : 0;
    } else if (b.barrier_line != line || std::strcmp(b.barrier_file, file) != 0 || b.barrier_op != op) {
        fail(format("%s reaches __syncthreads at %s:%d while %u threads wait at the one at %s:%d "
                    "(a barrier in divergent code)",
                    b.where().c_str(), base_name(file), line, b.at_barrier, base_name(b.barrier_file),
                    b.barrier_line));
    }
    if (op == 0) b.barrier_acc += predicate != 0;
    if (op == 1) b.barrier_acc &= predicate != 0;
    if (op == 2) b.barrier_acc |= predicate != 0;
    me.st = St::Barrier;
    me.wait_file = file;
    me.wait_line = line;
    if (++b.at_barrier == b.n) {  // the last thread of the block: everyone goes on
        b.at_barrier = 0;
        b.barrier_result = b.barrier_acc;
        b.make_ready_range(0, b.n);
    }
    leave_fiber(false);
    return b.barrier_result;
}

[[noreturn]] void trap(const char* file, int line) {
    fail(format("__trap() in %s (%s:%d)", g_block->where().c_str(), base_name(file), line));
}

void atomic_point() {
    Block& b = *g_block;
    if (b.mode != 2 || (b.next_random() & 1)) return;
    b.make_ready(b.current->linear);
    leave_fiber(false);
}

unsigned long long warp_collective(WarpOp op, unsigned mask, unsigned long long value, int arg, int width,
                                   const char* file, int line) {
    static const char* const names[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync",
                                        "__syncwarp", "__ballot_sync", "__any_sync", "__all_sync"};
    Block& b = *g_block;
    Fiber& me = *b.current;
    const unsigned warp = me.linear / 32, lane = me.linear % 32;
    const unsigned first = warp * 32, lanes = std::min(32u, b.n - first);
    const unsigned exists = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
    if (!(mask >> lane & 1u)) {
        fail(format("%s (lane %u of warp %u) calls %s with mask 0x%08x, which leaves it out (%s:%d)",
                    b.where().c_str(), lane, warp, names[op], mask, base_name(file), line));
    }
    if (mask & ~exists) {
        fail(format("%s calls %s with mask 0x%08x naming lanes 0x%08x that this block (%u threads) lacks (%s:%d)",
                    b.where().c_str(), names[op], mask, mask & ~exists, b.n, base_name(file), line));
    }
    if (width < 1 || width > 32 || (width & (width - 1))) {
        fail(format("%s calls %s with width %d: expected a power of two <= 32 (%s:%d)", b.where().c_str(),
                    names[op], width, base_name(file), line));
    }
    WarpState& w = b.warps[warp];
    if (w.pending == 0) {
        w.op = op;
        w.mask = mask;
        w.arg = arg;
        w.width = width;
        w.file = file;
        w.line = line;
    } else if (w.op != op || w.mask != mask || w.width != width || (op != kShflIdx && w.arg != arg)) {
        fail(format("warp %u disagrees: %s calls %s(mask 0x%08x, %d, width %d) at %s:%d while lanes 0x%08x "
                    "wait in %s(mask 0x%08x, %d, width %d) at %s:%d",
                    warp, b.where().c_str(), names[op], mask, arg, width, base_name(file), line, w.pending,
                    names[w.op], w.mask, w.arg, w.width, base_name(w.file), w.line));
    }
    w.value[lane] = value;
    w.lane_arg[lane] = arg;
    w.pending |= 1u << lane;
    me.st = St::Warp;
    me.wait_file = file;
    me.wait_line = line;
    if (w.pending == w.mask) {  // the last lane: compute every lane's result, release them
        unsigned long long ballot = 0;
        for (unsigned l = 0; l < 32; ++l) {
            if (w.mask >> l & 1u) ballot |= (unsigned long long)(w.value[l] != 0) << l;
        }
        for (unsigned l = 0; l < 32; ++l) {
            if (!(w.mask >> l & 1u)) continue;
            const int seg = (int)l & ~(w.width - 1);
            int src = (int)l;
            switch (w.op) {
                case kShflIdx: src = seg + (w.lane_arg[l] & (w.width - 1)); break;
                case kShflUp: src = (int)l - w.arg >= seg ? (int)l - w.arg : (int)l; break;
                case kShflDown: src = (int)l + w.arg < seg + w.width ? (int)l + w.arg : (int)l; break;
                case kShflXor: src = ((int)l ^ w.arg) < seg + w.width ? ((int)l ^ w.arg) : (int)l; break;
                default: break;
            }
            if (w.op <= kShflXor && (src < 0 || src > 31 || !(w.mask >> src & 1u))) {
                const uint3 t = b.fibers[first + l].tid;
                fail(format("block (%u,%u,%u) thread (%u,%u,%u) (lane %u of warp %u) reads lane %d in %s, outside "
                            "the mask 0x%08x (undefined on a GPU) (%s:%d)",
                            block_idx.x, block_idx.y, block_idx.z, t.x, t.y, t.z, l, warp, src, names[w.op], w.mask,
                            base_name(w.file), w.line));
            }
            switch (w.op) {
                case kBallot: w.result[l] = ballot; break;
                case kAny: w.result[l] = ballot != 0; break;
                case kAll: w.result[l] = ballot == (unsigned long long)w.mask; break;
                case kSyncWarp: w.result[l] = 0; break;
                default: w.result[l] = w.value[src]; break;
            }
        }
        w.pending = 0;
        b.make_ready_lanes(first, w.mask);
    }
    leave_fiber(false);
    return w.result[lane];
}

std::size_t shared_capacity() {
    std::size_t cap = 0;
    for (const SharedArray& s : shared_arrays()) cap = std::max(cap, s.capacity);
    return cap;
}

}  // namespace tkv_emu

using namespace tkv_emu;

// ------------------------------------------------------------------ the C API (ctypes)
TKV_EXPORT const char* tkv_emu_error() { return g_error.c_str(); }

// "name:kind size type;..." for each kernel and parameter (the launcher's view of signatures).
TKV_EXPORT const char* tkv_emu_signatures() {
    static std::string out;
    out.clear();
    for (const Kernel& k : kernels()) {
        out += k.name + "(";
        for (std::size_t i = 0; i < k.params.size(); ++i) {
            out += format("%s%c%u %s", i ? ", " : "", k.params[i].kind, k.params[i].size, spelled(k.params[i]).c_str());
        }
        out += ")\n";
    }
    return out.c_str();
}

// One launch: returns 0, or 1 with tkv_emu_error() saying why. `kinds[i]`/`sizes[i]`
// describe args[i] as the launcher built it (numpy dtype kind and item size).
TKV_EXPORT int tkv_emu_launch(const char* name, const unsigned* grid, const unsigned* block,
                              unsigned long long shared_bytes, int num_args, void* const* args,
                              const unsigned* sizes, const char* kinds, int mode, unsigned long long seed) {
    g_error.clear();
    const Kernel* k = find_kernel(name);
    if (!k) {
        g_error = format("no kernel named %s in this module", name);
        return 1;
    }
    if ((std::size_t)num_args != k->params.size()) {
        g_error = format("%s takes %zu arguments, the launch passed %d", name, k->params.size(), num_args);
        return 1;
    }
    for (int i = 0; i < num_args; ++i) {
        const ParamInfo& p = k->params[(std::size_t)i];
        if (!accepts(p, kinds[i], sizes[i])) {
            g_error = format("argument %d of %s: the kernel takes %s (%u B), the launch passed %s of %u B", i, name,
                             spelled(p).c_str(), p.size, kind_name(kinds[i]), sizes[i]);
            return 1;
        }
    }
    const unsigned long long threads = (unsigned long long)block[0] * block[1] * block[2];
    if (threads == 0 || threads > kMaxThreads || block[0] > 1024 || block[1] > 1024 || block[2] > 64) {
        g_error = format("block (%u,%u,%u): expected 1..1024 threads, x, y <= 1024, z <= 64", block[0], block[1],
                         block[2]);
        return 1;
    }
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0 || grid[0] > 2147483647u || grid[1] > 65535 || grid[2] > 65535) {
        g_error = format("grid (%u,%u,%u): expected x in 1..2^31-1, y and z in 1..65535", grid[0], grid[1], grid[2]);
        return 1;
    }
    if (shared_bytes > kMaxSharedBytes) {
        g_error = format("%llu B of dynamic shared memory: more than a block may have (%llu B on sm_90)",
                         shared_bytes, kMaxSharedBytes);
        return 1;
    }
    const std::size_t shared = (std::size_t)shared_bytes;
    if (shared > shared_capacity() && !shared_arrays().empty()) {
        g_error = format("%zu B of dynamic shared memory: more than the emulator's array (%zu B)", shared,
                         shared_capacity());
        return 1;
    }

    FaultGuard guard;
    Watchdog watchdog(name);
    Block b;
    b.kernel = k;
    b.args = args;
    b.mode = mode;
    b.rng = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
    if (!b.rng) b.rng = 1;
    b.n = (unsigned)threads;
    b.fibers.resize(b.n);
    g_stacks.reserve(b.n);
#if TKV_ASAN
    {  // the bounds of this (the scheduler's) stack, for switches back to it
        pthread_attr_t attr;
        pthread_getattr_np(pthread_self(), &attr);
        void* addr;
        pthread_attr_getstack(&attr, &addr, &b.sched_stack_size);
        b.sched_stack_bottom = addr;
        pthread_attr_destroy(&attr);
    }
#endif
    g_block = &b;
    grid_dim = dim3{grid[0], grid[1], grid[2]};
    block_dim = dim3{block[0], block[1], block[2]};

    // Block order: grid order, reversed, or a seeded permutation (Fisher-Yates).
    const unsigned long long num_blocks = (unsigned long long)grid[0] * grid[1] * grid[2];
    std::vector<unsigned long long> order(num_blocks);
    for (unsigned long long i = 0; i < num_blocks; ++i) order[i] = i;
    if (mode == 1) std::reverse(order.begin(), order.end());
    if (mode == 2) {
        for (unsigned long long i = num_blocks; i > 1; --i) std::swap(order[i - 1], order[b.next_random() % i]);
    }
#if TKV_ASAN
    for (const SharedArray& s : shared_arrays()) ASAN_POISON_MEMORY_REGION(s.base + shared, s.capacity - shared);
#endif
    bool ok = true;
    for (unsigned long long lin : order) {
        block_idx = uint3{(unsigned)(lin % grid[0]), (unsigned)(lin / grid[0] % grid[1]),
                          (unsigned)(lin / grid[0] / grid[1])};
#if TKV_ASAN
        for (const SharedArray& s : shared_arrays()) ASAN_UNPOISON_MEMORY_REGION(s.base, s.capacity);
#endif
        fill_shared(shared);
#if TKV_ASAN
        for (const SharedArray& s : shared_arrays()) ASAN_POISON_MEMORY_REGION(s.base + shared, s.capacity - shared);
#endif
        if (!run_block(b)) {
            ok = false;
            // Abandoned fibers leave ASan's stack poisoning behind on their stacks.
#if TKV_ASAN
            for (unsigned i = 0; i < b.n; ++i) ASAN_UNPOISON_MEMORY_REGION(g_stacks.stack(i), kStackBytes);
#endif
            break;
        }
#if TKV_ASAN
        for (const SharedArray& s : shared_arrays()) ASAN_UNPOISON_MEMORY_REGION(s.base, s.capacity);
#endif
        std::string overrun;
        if (shared_overrun(shared, &overrun)) {
            g_error = overrun;
            ok = false;
            break;
        }
    }
#if TKV_ASAN
    for (const SharedArray& s : shared_arrays()) ASAN_UNPOISON_MEMORY_REGION(s.base, s.capacity);
#endif
    g_block = nullptr;
    return ok ? 0 : 1;
}
