// Batch normalisation fused with the activation (mgnn.backend.BN_KERNELS, PyTorch semantics).
// Launch contracts: kernels/README.md ("bn.cu"). z and every array shaped like it are
// (outer, C, inner): dense (B, C) has inner 1, conv (B, C, H, W) has inner H W; statistics are per
// channel c over the M = outer * inner elements (n, c, i). The per-channel reductions run one
// block of MGNN_REDUCE threads per channel (blockIdx.x = c), accumulate in double and end in a
// block_sum tree: deterministic, no atomics.
#include "common.cuh"

// Flat index of element e = n * inner + i (e < M) of channel c.
__device__ __forceinline__ long long bn_at(int e, int c, int C, int inner) {
    return ((long long)(e / inner) * C + c) * inner + e % inner;
}

// mean[c] = (1/M) sum z[n, c, i], m2[c] = sum (z[n, c, i] - mean)^2 (two passes over the
// channel, both in double; mean and m2 rounded to T at the end).
template <typename T>
__global__ void bn_stats(const T *z, T *mean, T *m2, int outer, int C, int inner) {
    __shared__ double scratch[MGNN_REDUCE];
    const int c = blockIdx.x, M = outer * inner;
    double s = 0.0;
    for (int e = threadIdx.x; e < M; e += MGNN_REDUCE) s += (double)z[bn_at(e, c, C, inner)];
    const double mu = block_sum(s, scratch) / M;
    double q = 0.0;
    for (int e = threadIdx.x; e < M; e += MGNN_REDUCE) {
        const double d = (double)z[bn_at(e, c, C, inner)] - mu;
        q += d * d;
    }
    const double total = block_sum(q, scratch);
    if (threadIdx.x == 0) {
        mean[c] = (T)mu;
        m2[c] = (T)total;
    }
}

// Elementwise over total = outer * C * inner (channel c = (e / inner) % C):
// xhat = (z - mean[c]) invstd[c], y = gamma[c] xhat + beta[c], a = sigma(y), deriv = sigma'(y).
template <typename T>
__global__ void bn_act_forward(const T *z, const T *mean, const T *invstd, const T *gamma,
                               const T *beta, T *a, T *xhat, T *deriv, int total, int C,
                               int inner, int act) {
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
        const int c = (e / inner) % C;
        const T x = (z[e] - mean[c]) * invstd[c];
        T s, ds;
        activate(gamma[c] * x + beta[c], act, s, ds);
        xhat[e] = x;
        a[e] = s;
        deriv[e] = ds;
    }
}

// s1[c] = sum gy, s2[c] = sum gy xhat over channel c, gy = ga * deriv (in T; sums in double).
template <typename T>
__global__ void bn_act_vjp_sums(const T *ga, const T *deriv, const T *xhat, T *s1, T *s2,
                                int outer, int C, int inner) {
    __shared__ double scratch[MGNN_REDUCE];
    const int c = blockIdx.x, M = outer * inner;
    double p = 0.0, q = 0.0;
    for (int e = threadIdx.x; e < M; e += MGNN_REDUCE) {
        const long long at = bn_at(e, c, C, inner);
        const T gy = ga[at] * deriv[at];
        p += (double)gy;
        q += (double)(gy * xhat[at]);
    }
    const double tp = block_sum(p, scratch);
    const double tq = block_sum(q, scratch);
    if (threadIdx.x == 0) {
        s1[c] = (T)tp;
        s2[c] = (T)tq;
    }
}

// Elementwise over total = outer * C * inner:
// gz = gamma[c] invstd[c] ((ga deriv - s1[c] / count) - xhat s2[c] / count).
template <typename T>
__global__ void bn_act_vjp_input(const T *ga, const T *deriv, const T *xhat, const T *invstd,
                                 const T *gamma, const T *s1, const T *s2, T *gz, int total,
                                 int C, int inner, T count) {
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
        const int c = (e / inner) % C;
        const T m1 = s1[c] / count, m2 = s2[c] / count;
        gz[e] = gamma[c] * invstd[c] * ((ga[e] * deriv[e] - m1) - xhat[e] * m2);
    }
}
