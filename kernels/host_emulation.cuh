// Host emulation of the CUDA subset mgnn's kernels use, for checking the kernels on machines
// without a GPU: the same *.cu files compile with the system C++20 compiler after this header.
// Never given to nvcc or NVRTC.
//
// Model: the blocks of a launch run one after another; the threads of a block run as OS threads
// that meet at a std::barrier for __syncthreads(); a thread that returns leaves the barrier
// (arrive_and_drop), so later barriers wait only for the threads still running. __shared__
// variables are function statics: one copy, shared by the threads of the running block.
// Supported: threadIdx, blockIdx, blockDim, gridDim (dim3), __global__, __device__,
// __forceinline__, __shared__ (static arrays, no initialisers), __syncthreads, the libm
// functions of <cmath> (tanhf, tanh, expf, exp, logf, log). Not supported: atomics, warp
// intrinsics, dynamic shared memory, streams.
#pragma once
#include <barrier>
#include <cmath>
#include <cstddef>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

namespace mgnn_emu {
inline thread_local dim3 thread_idx, block_idx, block_dim, grid_dim;
inline thread_local std::barrier<> *barrier = nullptr;
}  // namespace mgnn_emu

#define threadIdx (mgnn_emu::thread_idx)
#define blockIdx (mgnn_emu::block_idx)
#define blockDim (mgnn_emu::block_dim)
#define gridDim (mgnn_emu::grid_dim)
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __syncthreads() (mgnn_emu::barrier->arrive_and_wait())

namespace mgnn_emu {

template <typename... A, std::size_t... I>
void call(void (*kernel)(A...), void **args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<A>> *>(args[I])...);
}

// Run kernel<<<grid, block>>>(args...) to completion; args[i] points to the i-th argument, as
// for cuLaunchKernel. Returns 0, or 1 if a thread threw (the launch is then incomplete).
template <typename... A>
int launch(void (*kernel)(A...), const unsigned *grid, const unsigned *block, void **args) {
    const dim3 g{grid[0], grid[1], grid[2]}, b{block[0], block[1], block[2]};
    const unsigned n = b.x * b.y * b.z;
    int failed = 0;
    std::mutex lock;
    for (unsigned bz = 0; bz < g.z; ++bz)
        for (unsigned by = 0; by < g.y; ++by)
            for (unsigned bx = 0; bx < g.x; ++bx) {
                std::barrier<> bar(static_cast<std::ptrdiff_t>(n));
                std::vector<std::thread> threads;
                threads.reserve(n);
                for (unsigned t = 0; t < n; ++t)
                    threads.emplace_back([&, t] {
                        thread_idx = dim3{t % b.x, (t / b.x) % b.y, t / (b.x * b.y)};
                        block_idx = dim3{bx, by, bz};
                        block_dim = b;
                        grid_dim = g;
                        barrier = &bar;
                        try {
                            call(kernel, args, std::index_sequence_for<A...>{});
                        } catch (...) {
                            std::lock_guard<std::mutex> guard(lock);
                            failed = 1;
                        }
                        bar.arrive_and_drop();
                    });
                for (auto &th : threads) th.join();
                if (failed) return failed;
            }
    return 0;
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
