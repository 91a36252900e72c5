// 3x3 convolution residual-block steps (cross-correlation, padding 1, stride 1) as implicit GEMMs
// (conv_gemm.cuh): fused forward, state vjp, kernel gradient (split-K partials + an ordered sum),
// and the interval-batched and stacked forms. Launch contracts: kernels/README.md. States are
// (B, C, H, W) row-major, kernels K (Co, Ci, 3, 3). Forward and vjp launches are GEMM launches:
// grid (ceil(B H W / BN), ceil(C_out / BM), problems), MGNN_GEMM_THREADS threads.
#include "common.cuh"
#include "conv_gemm.cuh"

template <typename T>
__device__ __forceinline__ void conv_forward_body(const T *u, const T *K, const T *b, T *y,
                                                  T *deriv, int B, int Ci, int Co, int H, int W,
                                                  T h, int act, int residual, const T *g) {
    conv_gemm_forward<T, 9>(u, K, b, B, Ci, Co, 1, H, W, act, [&](long long e, T s, T ds) {
        if (y) {
            T v = (residual ? u[e] : T(0)) + h * s;
            if (g) v += g[e];
            y[e] = v;
        }
        if (deriv) deriv[e] = ds;
    });
}

// y = [u +] h sigma(conv(u, K) + b), deriv = sigma'(...), both (B, Co, H, W), either may be null.
template <typename T>
__global__ void conv_forward(const T *u, const T *K, const T *b, T *y, T *deriv, int B, int Ci,
                             int Co, int H, int W, T h, int act, int residual) {
    conv_forward_body(u, K, b, y, deriv, B, Ci, Co, H, W, h, act, residual, (const T *)nullptr);
}

// Interval-batched residual forward: problem p = blockIdx.z steps us[p] with layer layers[p] of
// K (L, C, C, 3, 3) and b (L, C); ys or derivs may be null (not both); gs (may be null) is
// added to each ys[p] (the FAS rhs).
template <typename T>
__global__ void conv_forward_batched(const T *const *us, const T *K, const T *b, T *const *ys,
                                     T *const *derivs, const T *const *gs, const int *layers,
                                     int B, int C, int H, int W, T h, int act) {
    const int p = blockIdx.z, l = layers[p];
    conv_forward_body(us[p], K + (long long)l * C * C * 9, b + (long long)l * C,
                      ys ? ys[p] : (T *)nullptr, derivs ? derivs[p] : (T *)nullptr, B, C, C, H,
                      W, h, act, 1, gs ? gs[p] : (const T *)nullptr);
}

// ---------------------------------------------------------------------------------- state vjp
template <typename T>
__device__ __forceinline__ void conv_vjp_input_body(const T *gy, const T *deriv, const T *K,
                                                    T *gx, int B, int Ci, int Co, int H, int W,
                                                    T h, int residual, const T *g) {
    conv_gemm_vjp<T, 9>(gy, deriv, K, B, Ci, Co, 1, H, W, [&](long long e, T c) {
        T v = (residual ? gy[e] : T(0)) + h * c;
        if (g) v += g[e];
        gx[e] = v;
    });
}

// gx (B, Ci, H, W) = [gy +] h conv^T(deriv * gy, K), gy and deriv (B, Co, H, W).
template <typename T>
__global__ void conv_vjp_input(const T *gy, const T *deriv, const T *K, T *gx, int B, int Ci,
                               int Co, int H, int W, T h, int residual) {
    conv_vjp_input_body(gy, deriv, K, gx, B, Ci, Co, H, W, h, residual, (const T *)nullptr);
}

// Interval-batched state vjp: gxs[p] = gys[p] + h conv^T(derivs[p] * gys[p], K_l) [+ gs[p]],
// l = layers[p], p = blockIdx.z; gs may be null.
template <typename T>
__global__ void conv_vjp_input_batched(const T *const *gys, const T *const *derivs, const T *K,
                                       T *const *gxs, const T *const *gs, const int *layers,
                                       int B, int C, int H, int W, T h) {
    const int p = blockIdx.z;
    conv_vjp_input_body(gys[p], derivs[p], K + (long long)layers[p] * C * C * 9, gxs[p], B, C, C,
                        H, W, h, 1, gs ? gs[p] : (const T *)nullptr);
}

// ---------------------------------------------------------------------------- stacked states
// One launch = `count` steps of one stacked array (stacked_index in common.cuh), problem
// p = blockIdx.z, GEMM blocks (mode 0 sums each block's r^2 into partial). Same GEMMs as the
// single-step kernels above: the same bits.

// phi = U[i-1] + h sigma(conv(U[i-1], K_l) + b_l), U (m, B, C, H, W), K (L, C, C, 3, 3),
// b (L, C); then StackedOut into R (n_out, B, C, H, W) (R == U for a chain, mode 2).
template <typename T>
__global__ void conv_stacked_forward(const T *U, const T *G, T *R, const T *K, const T *b,
                                     int slot0, int stride, int out0, int out_stride, int layer0,
                                     int layer_step, int B, int C, int H, int W, T h, int act,
                                     int mode, double *partial, int part0) {
    __shared__ double scratch[MGNN_GEMM_THREADS];
    const StackedIndex s =
        stacked_index(blockIdx.z, slot0, stride, out0, out_stride, layer0, layer_step);
    const long long size = (long long)B * C * H * W;
    const T *x = U + (s.i - 1) * size;
    double acc = 0.0;
    const StackedOut<T> out = stacked_out(s, size, U, G, R, mode, &acc);
    conv_gemm_forward<T, 9>(x, K + (long long)s.l * C * C * 9, b + (long long)s.l * C, B, C, C, 1,
                            H, W, act, [&](long long e, T sig, T) { out(e, x[e] + h * sig); });
    stacked_partial<MGNN_GEMM_THREADS>(acc, partial, part0, scratch);
}

// phi = L[i-1] + h conv^T(D_l * L[i-1], K_l), D_l = D[l - d0] (D (n_d, B, C, H, W): sigma' of
// layers d0 .. d0 + n_d - 1); then StackedOut as above.
template <typename T>
__global__ void conv_stacked_adjoint(const T *L, const T *G, T *R, const T *K, const T *D, int d0,
                                     int slot0, int stride, int out0, int out_stride, int layer0,
                                     int layer_step, int B, int C, int H, int W, T h, int mode,
                                     double *partial, int part0) {
    __shared__ double scratch[MGNN_GEMM_THREADS];
    const StackedIndex s =
        stacked_index(blockIdx.z, slot0, stride, out0, out_stride, layer0, layer_step);
    const long long size = (long long)B * C * H * W;
    const T *gy = L + (s.i - 1) * size;
    double acc = 0.0;
    const StackedOut<T> out = stacked_out(s, size, L, G, R, mode, &acc);
    conv_gemm_vjp<T, 9>(gy, D + (s.l - d0) * size, K + (long long)s.l * C * C * 9, B, C, C, 1, H,
                        W, [&](long long e, T c) { out(e, gy[e] + h * c); });
    stacked_partial<MGNN_GEMM_THREADS>(acc, partial, part0, scratch);
}

// D[p] = sigma'(conv(U[first + p], K_l) + b_l), l = layer0 + p, p = blockIdx.z; U (m, B, C, H, W),
// K (L, C, C, 3, 3), b (L, C), D (count, B, C, H, W).
template <typename T>
__global__ void conv_deriv_stacked(const T *U, int first, const T *K, const T *b, int layer0,
                                   T *D, int B, int C, int H, int W, int act) {
    const int p = blockIdx.z, l = layer0 + p;
    const long long size = (long long)B * C * H * W;
    conv_forward_body(U + (first + p) * size, K + (long long)l * C * C * 9, b + (long long)l * C,
                      (T *)nullptr, D + p * size, B, C, C, H, W, T(1), act, 0,
                      (const T *)nullptr);
}

// ------------------------------------------------------------------------------ kernel grad
// Two launches: the split-K partials of gK (conv_gemm_kgrad_part; grid (splits x tiles of 9 Ci,
// ceil(Co / BM), problems), GEMM threads) into part (problems, nsplit, Co, Ci 9), then
// conv_kernel_grad_sum. nsplit = ceil(B H W / ksplit).

// Partials of gK = conv_kernel_grad(gy, deriv, u) (one problem).
template <typename T>
__global__ void conv_kernel_grad(const T *gy, const T *deriv, const T *u, T *part, int B, int Ci,
                                 int Co, int H, int W, int ksplit) {
    conv_gemm_kgrad_part<T, 9>(gy, deriv, u, part, B, Ci, Co, 1, H, W, ksplit);
}

// Partials of problem p = blockIdx.z: gys[p], derivs[p], us[p] at part + p nsplit C 9 C.
template <typename T>
__global__ void conv_kernel_grad_batched(const T *const *gys, const T *const *derivs,
                                         const T *const *us, T *part, int B, int C, int H, int W,
                                         int ksplit) {
    const int p = blockIdx.z, nsplit = conv_kgrad_splits(B * H * W, ksplit);
    conv_gemm_kgrad_part<T, 9>(gys[p], derivs[p], us[p], part + (long long)p * nsplit * C * C * 9,
                               B, C, C, 1, H, W, ksplit);
}

// Partials of problem p = blockIdx.z: Lam_p = L[l_first + p l_stride], D[p], U[u_first + p].
template <typename T>
__global__ void conv_kernel_grad_stacked(const T *L, int l_first, int l_stride, const T *D,
                                         const T *U, int u_first, T *part, int B, int C, int H,
                                         int W, int ksplit) {
    const int p = blockIdx.z, nsplit = conv_kgrad_splits(B * H * W, ksplit);
    const long long size = (long long)B * C * H * W;
    conv_gemm_kgrad_part<T, 9>(L + (l_first + (long long)p * l_stride) * size, D + p * size,
                               U + (u_first + p) * size, part + (long long)p * nsplit * C * C * 9,
                               B, C, C, 1, H, W, ksplit);
}

// gK[l] (entries,) = h sum_s part[p, s] (the splits in order), l = layers[p] (layers non-null)
// or layer0 + p, problem p = blockIdx.y; 1-D grid-stride over the entries (2D and 3D kernels).
template <typename T>
__global__ void conv_kernel_grad_sum(const T *part, int nsplit, int entries, const int *layers,
                                     int layer0, T *gK, T h) {
    const int p = blockIdx.y, l = layers ? layers[p] : layer0 + p;
    const T *pp = part + (long long)p * nsplit * entries;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < entries; e += gridDim.x * blockDim.x) {
        T s = T(0);
        for (int k = 0; k < nsplit; ++k) s += pp[(long long)k * entries + e];
        gK[(long long)l * entries + e] = h * s;
    }
}
