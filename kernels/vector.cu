// MGRIT FAS vector operations batched over many states (one launch for all C-points of a level):
// residuals with their squared norms, and the three-operand updates of the FAS right-hand side,
// the coarse-grid correction and the relaxation's rhs addition. Launch contracts:
// kernels/README.md. Every state has n elements; p = blockIdx.y selects the state.
#include "common.cuh"

// rs[p] = (phis[p] - us[p]) [+ gs[p]] and partial[p * gridDim.x + blockIdx.x] = the block's
// share of ||rs[p]||^2, accumulated in double. gs may be null. Block: MGNN_REDUCE threads.
template <typename T>
__global__ void residual_batched(const T *const *phis, const T *const *us, const T *const *gs,
                                 T *const *rs, double *partial, int n) {
    __shared__ double scratch[MGNN_REDUCE];
    const int p = blockIdx.y;
    const T *phi = phis[p], *u = us[p];
    const T *g = gs ? gs[p] : (const T *)nullptr;
    T *r = rs[p];
    double acc = 0.0;
    for (int e = blockIdx.x * MGNN_REDUCE + threadIdx.x; e < n; e += gridDim.x * MGNN_REDUCE) {
        T v = phi[e] - u[e];
        if (g) v += g[e];
        r[e] = v;
        acc += (double)v * (double)v;
    }
    const double total = block_sum(acc, scratch);
    if (threadIdx.x == 0) partial[(long long)p * gridDim.x + blockIdx.x] = total;
}

// outs[p] = (xs[p] + ys[p]) - zs[p] (mode 0: the FAS rhs, in place when outs == xs),
//           xs[p] + (ys[p] - zs[p]) (mode 1: the coarse-grid correction), or
//           xs[p] + ys[p]           (mode 2: zs unused, may be null).
// Block: MGNN_ELEM threads, 1-D grid-stride over n.
template <typename T>
__global__ void combine_batched(T *const *outs, const T *const *xs, const T *const *ys,
                                const T *const *zs, int n, int mode) {
    const int p = blockIdx.y;
    T *out = outs[p];
    const T *x = xs[p], *y = ys[p];
    const T *z = zs ? zs[p] : (const T *)nullptr;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x) {
        if (mode == 0)
            out[e] = (x[e] + y[e]) - z[e];
        else if (mode == 1)
            out[e] = x[e] + (y[e] - z[e]);
        else
            out[e] = x[e] + y[e];
    }
}

// out[0] = sum of partial[0 .. n) in double, in a fixed order (deterministic, no atomics): the
// second launch of a stacked mode-0 call, which reduces the per-block partials of its step
// launches to the residual norm on the device. One block of MGNN_REDUCE threads; n = 0 writes 0.
// (T is unused: every kernel is instantiated for float and double.)
template <typename T>
__global__ void sum_partials(const double *partial, double *out, int n) {
    __shared__ double scratch[MGNN_REDUCE];
    double s = 0.0;
    for (int k = threadIdx.x; k < n; k += MGNN_REDUCE) s += partial[k];
    const double total = block_sum(s, scratch);
    if (threadIdx.x == 0) out[0] = total;
}
