// Host emulation of the CUDA subset mgnn's kernels use, for checking the kernels on machines
// without a GPU: the same *.cu files compile with the system C++20 compiler after this header.
// Never given to nvcc or NVRTC.
//
// Model: the blocks of a launch run one after another; the threads of a block run as fibers
// (ucontext) on the calling OS thread, one at a time (in thread order or in reverse, the order
// flipping at each barrier and between neighbouring blocks): each runs until it reaches
// __syncthreads() or returns; when every thread still running waits at the barrier, all go on.
// A thread that returns leaves the barrier, so later barriers wait only for the threads still
// running. __shared__ variables are function statics: one copy, shared by the threads of the
// running block. (One OS thread per CUDA thread, the earlier model, spent most of a test run in
// thread creation and context switches: 34 s of system time against 10 s of user time.)
// Supported: threadIdx, blockIdx, blockDim, gridDim (dim3), __global__, __device__,
// __forceinline__, __shared__ (static arrays, no initialisers), __syncthreads, the libm
// functions of <cmath> (tanhf, tanh, expf, exp, logf, log). Not supported: atomics, warp
// intrinsics, dynamic shared memory, streams.
#pragma once
#include <cmath>
#include <cstddef>
#include <exception>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

namespace mgnn_emu {
inline thread_local dim3 thread_idx, block_idx, block_dim, grid_dim;

// One CUDA thread of the running block: its context and where it stands.
struct Fiber {
    ucontext_t ctx;
    enum State { ready, waiting, done } state = ready;
};
inline thread_local ucontext_t *scheduler = nullptr;  // the launch loop's context
inline thread_local Fiber *running = nullptr;          // the fiber being run

// __syncthreads(): back to the launch loop until every running thread has arrived.
inline void sync_threads() {
    Fiber *self = running;
    self->state = Fiber::waiting;
    swapcontext(&self->ctx, scheduler);
}
}  // namespace mgnn_emu

#define threadIdx (mgnn_emu::thread_idx)
#define blockIdx (mgnn_emu::block_idx)
#define blockDim (mgnn_emu::block_dim)
#define gridDim (mgnn_emu::grid_dim)
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __syncthreads() (mgnn_emu::sync_threads())

namespace mgnn_emu {

template <typename... A, std::size_t... I>
void call(void (*kernel)(A...), void **args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<A>> *>(args[I])...);
}

// The body every fiber of a launch runs (the kernel call) and whether one of them threw.
inline thread_local void (*fiber_body)(void *) = nullptr;
inline thread_local void *fiber_arg = nullptr;
inline thread_local int fiber_failed = 0;

inline void fiber_entry() {
    try {
        fiber_body(fiber_arg);
    } catch (...) {
        fiber_failed = 1;
    }
    running->state = Fiber::done;  // returning resumes uc_link: the launch loop
}

template <typename... A>
struct Call {
    void (*kernel)(A...);
    void **args;
    static void run(void *self) {
        auto *c = static_cast<Call *>(self);
        call(c->kernel, c->args, std::index_sequence_for<A...>{});
    }
};

// Bytes of stack per fiber (the kernels keep small register tiles; untouched pages cost nothing)
inline constexpr std::size_t fiber_stack = 256 * 1024;

// The fibers' stacks of one launch: one mapping, each stack above a PROT_NONE guard page, so a
// fiber that overflows its stack faults instead of overwriting the one below.
struct Stacks {
    char *base = nullptr;
    std::size_t guard = 0, slot = 0, size = 0;
    explicit Stacks(unsigned n) {
        guard = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
        slot = guard + fiber_stack;
        size = slot * n;
        void *p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return;
        base = static_cast<char *>(p);
        for (unsigned t = 0; t < n; ++t)
            if (mprotect(base + t * slot, guard, PROT_NONE) != 0) {
                munmap(base, size);
                base = nullptr;
                return;
            }
    }
    ~Stacks() {
        if (base) munmap(base, size);
    }
    Stacks(const Stacks &) = delete;
    Stacks &operator=(const Stacks &) = delete;
    char *stack(unsigned t) const { return base + t * slot + guard; }
};

// Run the threads of one block (block_idx set) to completion as fibers. Kept out of line so that
// the launch loop's variables never live across getcontext / swapcontext (returns-twice calls).
__attribute__((noinline)) inline void run_block(std::vector<Fiber> &fibers, const Stacks &stacks,
                                                ucontext_t *loop, dim3 b, unsigned flip) {
    const unsigned n = static_cast<unsigned>(fibers.size());
    for (unsigned t = 0; t < n; ++t) {
        Fiber &f = fibers[t];
        f.state = Fiber::ready;
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = stacks.stack(t);
        f.ctx.uc_stack.ss_size = fiber_stack;
        f.ctx.uc_link = loop;
        makecontext(&f.ctx, fiber_entry, 0);
    }
    for (unsigned left = n, pass = 0; left > 0; ++pass) {
        for (unsigned k = 0; k < n; ++k) {  // every thread to its next barrier
            const unsigned t = (pass + flip) % 2 ? n - 1 - k : k;
            Fiber &f = fibers[t];
            if (f.state != Fiber::ready) continue;
            thread_idx = dim3{t % b.x, (t / b.x) % b.y, t / (b.x * b.y)};
            running = &f;
            swapcontext(loop, &f.ctx);
            if (f.state == Fiber::done) --left;
        }
        for (Fiber &f : fibers)  // all still running have arrived: release them
            if (f.state == Fiber::waiting) f.state = Fiber::ready;
    }
}

// Run kernel<<<grid, block>>>(args...) to completion; args[i] points to the i-th argument, as
// for cuLaunchKernel. Returns 0, or 1 if a thread threw or the fibers' stacks could not be
// mapped (the launch is then incomplete: a failed block ends the grid). Between barriers the
// threads run in thread order and in reverse order alternately (starting in reverse in every
// other block), so a missing __syncthreads() between a write and another thread's read shows up
// whichever of the two comes first in thread order.
template <typename... A>
int launch(void (*kernel)(A...), const unsigned *grid, const unsigned *block, void **args) {
    const dim3 g{grid[0], grid[1], grid[2]}, b{block[0], block[1], block[2]};
    Call<A...> c{kernel, args};
    Stacks stacks(b.x * b.y * b.z);
    if (!stacks.base) return 1;
    std::vector<Fiber> fibers(b.x * b.y * b.z);
    ucontext_t loop;
    scheduler = &loop;
    fiber_body = &Call<A...>::run;
    fiber_arg = &c;
    fiber_failed = 0;
    block_dim = b;
    grid_dim = g;
    for (unsigned bz = 0; bz < g.z && !fiber_failed; ++bz)
        for (unsigned by = 0; by < g.y && !fiber_failed; ++by)
            for (unsigned bx = 0; bx < g.x && !fiber_failed; ++bx) {
                block_idx = dim3{bx, by, bz};
                run_block(fibers, stacks, &loop, b, bx + by + bz);
            }
    scheduler = nullptr;
    running = nullptr;
    return fiber_failed;
}
}  // namespace mgnn_emu

// extern "C" int mgnn_emu_<kernel>_f32 / _f64(grid[3], block[3], args): the float and double
// instantiations of a kernel template, for ctypes.
// Only these are exported: the build uses -fvisibility=hidden -fno-gnu-unique, so that two
// emulation libraries (e.g. two launch geometries) in one process never share a __shared__ array.
#define MGNN_EMU_VISIBLE extern "C" __attribute__((visibility("default"))) int
#define MGNN_EMU_EXPORT(kernel)                                                              \
    MGNN_EMU_VISIBLE mgnn_emu_##kernel##_f32(const unsigned *g, const unsigned *b, void **a) { \
        return mgnn_emu::launch(&kernel<float>, g, b, a);                                   \
    }                                                                                        \
    MGNN_EMU_VISIBLE mgnn_emu_##kernel##_f64(const unsigned *g, const unsigned *b, void **a) { \
        return mgnn_emu::launch(&kernel<double>, g, b, a);                                  \
    }
