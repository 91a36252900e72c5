// 3x3 convolution residual-block steps (cross-correlation, padding 1, stride 1): fused forward,
// state vjp, kernel gradient, and the interval-batched forward / state vjp. Launch contracts:
// kernels/README.md. States are (B, C, H, W) row-major, kernels K (Co, Ci, 3, 3).
#include "common.cuh"

// Pre-activation z[n, o, y, x] = b[o] + sum_{c, dy, dx} K[o, c, dy, dx] u[n, c, y+dy-1, x+dx-1].
template <typename T>
__device__ __forceinline__ T conv_z(const T *u, const T *K, const T *b, int n, int o, int y,
                                    int x, int Ci, int H, int W) {
    T z = b[o];
    for (int c = 0; c < Ci; ++c) {
        const T *uc = u + ((long long)n * Ci + c) * H * W;
        const T *kc = K + ((long long)o * Ci + c) * 9;
        for (int dy = 0; dy < 3; ++dy) {
            const int yy = y + dy - 1;
            if (yy < 0 || yy >= H) continue;
            for (int dx = 0; dx < 3; ++dx) {
                const int xx = x + dx - 1;
                if (xx >= 0 && xx < W) z += kc[dy * 3 + dx] * uc[yy * W + xx];
            }
        }
    }
    return z;
}

// Grid-stride over the B Co H W outputs: store(e, sigma(z), sigma'(z)) with z = conv(u, K) + b.
template <typename T, class Store>
__device__ __forceinline__ void conv_forward_loop(const T *u, const T *K, const T *b, int B,
                                                  int Ci, int Co, int H, int W, int act,
                                                  const Store &store) {
    const int total = B * Co * H * W;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
        const int xw = e % W, yh = (e / W) % H, o = (e / (W * H)) % Co, n = e / (W * H * Co);
        T s, ds;
        activate(conv_z(u, K, b, n, o, yh, xw, Ci, H, W), act, s, ds);
        store(e, s, ds);
    }
}

template <typename T>
__device__ __forceinline__ void conv_forward_body(const T *u, const T *K, const T *b, T *y,
                                                  T *deriv, int B, int Ci, int Co, int H, int W,
                                                  T h, int act, int residual, const T *g) {
    conv_forward_loop(u, K, b, B, Ci, Co, H, W, act, [&](int e, T s, T ds) {
        if (y) {
            T v = (residual ? u[e] : T(0)) + h * s;
            if (g) v += g[e];
            y[e] = v;
        }
        if (deriv) deriv[e] = ds;
    });
}

// y = [u +] h sigma(conv(u, K) + b), deriv = sigma'(...), both (B, Co, H, W), either may be null.
// 1-D grid-stride over the B Co H W outputs (one output per thread and pass).
template <typename T>
__global__ void conv_forward(const T *u, const T *K, const T *b, T *y, T *deriv, int B, int Ci,
                             int Co, int H, int W, T h, int act, int residual) {
    conv_forward_body(u, K, b, y, deriv, B, Ci, Co, H, W, h, act, residual, (const T *)nullptr);
}

// Interval-batched residual forward: problem p = blockIdx.y steps us[p] with layer layers[p] of
// K (L, C, C, 3, 3) and b (L, C); ys or derivs may be null (not both); gs (may be null) is
// added to each ys[p] (the FAS rhs).
template <typename T>
__global__ void conv_forward_batched(const T *const *us, const T *K, const T *b, T *const *ys,
                                     T *const *derivs, const T *const *gs, const int *layers,
                                     int B, int C, int H, int W, T h, int act) {
    const int p = blockIdx.y, l = layers[p];
    conv_forward_body(us[p], K + (long long)l * C * C * 9, b + (long long)l * C,
                      ys ? ys[p] : (T *)nullptr, derivs ? derivs[p] : (T *)nullptr, B, C, C, H,
                      W, h, act, 1, gs ? gs[p] : (const T *)nullptr);
}

// ---------------------------------------------------------------------------------- state vjp
// Grid-stride over the B Ci H W inputs: store(e, conv^T(deriv * gy, K)[e]).
template <typename T, class Store>
__device__ __forceinline__ void conv_vjp_loop(const T *gy, const T *deriv, const T *K, int B,
                                              int Ci, int Co, int H, int W,
                                              const Store &store) {
    const int total = B * Ci * H * W;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
        const int xw = e % W, yh = (e / W) % H, c = (e / (W * H)) % Ci, n = e / (W * H * Ci);
        T acc = T(0);
        for (int o = 0; o < Co; ++o) {
            const long long base = ((long long)n * Co + o) * H * W;
            const T *ko = K + ((long long)o * Ci + c) * 9;
            for (int dy = 0; dy < 3; ++dy) {
                const int yy = yh - dy + 1;  // the output row that read input row yh via dy
                if (yy < 0 || yy >= H) continue;
                for (int dx = 0; dx < 3; ++dx) {
                    const int xx = xw - dx + 1;
                    if (xx < 0 || xx >= W) continue;
                    const long long at = base + yy * W + xx;
                    acc += ko[dy * 3 + dx] * deriv[at] * gy[at];
                }
            }
        }
        store(e, acc);
    }
}

template <typename T>
__device__ __forceinline__ void conv_vjp_input_body(const T *gy, const T *deriv, const T *K,
                                                    T *gx, int B, int Ci, int Co, int H, int W,
                                                    T h, int residual, const T *g) {
    conv_vjp_loop(gy, deriv, K, B, Ci, Co, H, W, [&](int e, T c) {
        T v = (residual ? gy[e] : T(0)) + h * c;
        if (g) v += g[e];
        gx[e] = v;
    });
}

// gx (B, Ci, H, W) = [gy +] h conv^T(deriv * gy, K), gy and deriv (B, Co, H, W). 1-D grid-stride.
template <typename T>
__global__ void conv_vjp_input(const T *gy, const T *deriv, const T *K, T *gx, int B, int Ci,
                               int Co, int H, int W, T h, int residual) {
    conv_vjp_input_body(gy, deriv, K, gx, B, Ci, Co, H, W, h, residual, (const T *)nullptr);
}

// Interval-batched state vjp: gxs[p] = gys[p] + h conv^T(derivs[p] * gys[p], K_l) [+ gs[p]],
// l = layers[p]; gs may be null.
template <typename T>
__global__ void conv_vjp_input_batched(const T *const *gys, const T *const *derivs, const T *K,
                                       T *const *gxs, const T *const *gs, const int *layers,
                                       int B, int C, int H, int W, T h) {
    const int p = blockIdx.y;
    conv_vjp_input_body(gys[p], derivs[p], K + (long long)layers[p] * C * C * 9, gxs[p], B, C, C,
                        H, W, h, 1, gs ? gs[p] : (const T *)nullptr);
}

// ---------------------------------------------------------------------------- stacked states
// One launch = `count` steps of one stacked array (stacked_index in common.cuh), problem
// p = blockIdx.y, elementwise (grid-stride over the state, MGNN_ELEM threads per block exactly:
// mode 0 sums each block's r^2 into partial). Same loops as the single-step kernels above.

// phi = U[i-1] + h sigma(conv(U[i-1], K_l) + b_l), U (m, B, C, H, W), K (L, C, C, 3, 3),
// b (L, C); then StackedOut into R (n_out, B, C, H, W) (R == U for a chain, mode 2).
template <typename T>
__global__ void conv_stacked_forward(const T *U, const T *G, T *R, const T *K, const T *b,
                                     int slot0, int stride, int out0, int out_stride, int layer0,
                                     int layer_step, int B, int C, int H, int W, T h, int act,
                                     int mode, double *partial, int part0) {
    __shared__ double scratch[MGNN_ELEM];
    const StackedIndex s =
        stacked_index(blockIdx.y, slot0, stride, out0, out_stride, layer0, layer_step);
    const long long size = (long long)B * C * H * W;
    const T *x = U + (s.i - 1) * size;
    double acc = 0.0;
    const StackedOut<T> out = stacked_out(s, size, U, G, R, mode, &acc);
    conv_forward_loop(x, K + (long long)s.l * C * C * 9, b + (long long)s.l * C, B, C, C, H, W,
                      act, [&](int e, T sig, T) { out(e, x[e] + h * sig); });
    stacked_partial<MGNN_ELEM>(acc, partial, part0, scratch);
}

// phi = L[i-1] + h conv^T(D_l * L[i-1], K_l), D_l = D[l - d0] (D (n_d, B, C, H, W): sigma' of
// layers d0 .. d0 + n_d - 1); then StackedOut as above.
template <typename T>
__global__ void conv_stacked_adjoint(const T *L, const T *G, T *R, const T *K, const T *D, int d0,
                                     int slot0, int stride, int out0, int out_stride, int layer0,
                                     int layer_step, int B, int C, int H, int W, T h, int mode,
                                     double *partial, int part0) {
    __shared__ double scratch[MGNN_ELEM];
    const StackedIndex s =
        stacked_index(blockIdx.y, slot0, stride, out0, out_stride, layer0, layer_step);
    const long long size = (long long)B * C * H * W;
    const T *gy = L + (s.i - 1) * size;
    double acc = 0.0;
    const StackedOut<T> out = stacked_out(s, size, L, G, R, mode, &acc);
    conv_vjp_loop(gy, D + (s.l - d0) * size, K + (long long)s.l * C * C * 9, B, C, C, H, W,
                  [&](int e, T c) { out(e, gy[e] + h * c); });
    stacked_partial<MGNN_ELEM>(acc, partial, part0, scratch);
}

// ------------------------------------------------------------------------------ kernel grad
// gK[o, c, dy, dx] = h sum_{n, y, x} (deriv * gy)[n, o, y, x] u[n, c, y+dy-1, x+dx-1]: one block
// of MGNN_REDUCE threads per entry of gK (blockIdx.x = ((o Ci + c) 3 + dy) 3 + dx).
template <typename T>
__device__ __forceinline__ void conv_kernel_grad_body(const T *gy, const T *deriv, const T *u,
                                                      T *gK, int B, int Ci, int Co, int H, int W,
                                                      T h, T *scratch) {
    const int entry = blockIdx.x, dx = entry % 3, dy = (entry / 3) % 3, c = (entry / 9) % Ci,
              o = entry / (9 * Ci);
    const int count = B * H * W;
    T s = T(0);
    for (int e = threadIdx.x; e < count; e += MGNN_REDUCE) {
        const int xw = e % W, yh = (e / W) % H, n = e / (W * H);
        const int yy = yh + dy - 1, xx = xw + dx - 1;
        if (yy < 0 || yy >= H || xx < 0 || xx >= W) continue;
        const long long at = (((long long)n * Co + o) * H + yh) * W + xw;
        s += deriv[at] * gy[at] * u[(((long long)n * Ci + c) * H + yy) * W + xx];
    }
    const T total = block_sum(s, scratch);
    if (threadIdx.x == 0) gK[entry] = h * total;
}

template <typename T>
__global__ void conv_kernel_grad(const T *gy, const T *deriv, const T *u, T *gK, int B, int Ci,
                                 int Co, int H, int W, T h) {
    __shared__ T scratch[MGNN_REDUCE];
    conv_kernel_grad_body(gy, deriv, u, gK, B, Ci, Co, H, W, h, scratch);
}

// Batched kernel gradients: gK[l] (C, C, 3, 3) of problem p = blockIdx.y, l = layers[p], into the
// stacked gK (L, C, C, 3, 3); grid (9 C^2, count).
template <typename T>
__global__ void conv_kernel_grad_batched(const T *const *gys, const T *const *derivs,
                                         const T *const *us, T *gK, const int *layers, int B,
                                         int C, int H, int W, T h) {
    __shared__ T scratch[MGNN_REDUCE];
    const int p = blockIdx.y;
    conv_kernel_grad_body(gys[p], derivs[p], us[p], gK + (long long)layers[p] * C * C * 9, B, C,
                          C, H, W, h, scratch);
}

// ------------------------------------------------------------------------ stacked gradients
// As dense_deriv_stacked / dense_weight_grad_stacked (dense.cu) for conv states, problem
// p = blockIdx.y, l = layer0 + p; the bias gradient is bias_grad_stacked with inner H W.

// D[p] = sigma'(conv(U[first + p], K_l) + b_l); U (m, B, C, H, W), K (L, C, C, 3, 3), b (L, C),
// D (count, B, C, H, W). 1-D grid-stride over the state in blockIdx.x.
template <typename T>
__global__ void conv_deriv_stacked(const T *U, int first, const T *K, const T *b, int layer0,
                                   T *D, int B, int C, int H, int W, int act) {
    const int p = blockIdx.y, l = layer0 + p;
    const long long size = (long long)B * C * H * W;
    conv_forward_body(U + (first + p) * size, K + (long long)l * C * C * 9, b + (long long)l * C,
                      (T *)nullptr, D + p * size, B, C, C, H, W, T(1), act, 0,
                      (const T *)nullptr);
}

// gK[l] (C, C, 3, 3) = conv_kernel_grad of Lam_p = L[l_first + p l_stride], D[p] and
// U[u_first + p]; grid (9 C^2, count).
template <typename T>
__global__ void conv_kernel_grad_stacked(const T *L, int l_first, int l_stride, const T *D,
                                         const T *U, int u_first, int layer0, T *gK, int B,
                                         int C, int H, int W, T h) {
    __shared__ T scratch[MGNN_REDUCE];
    const int p = blockIdx.y;
    const long long size = (long long)B * C * H * W;
    conv_kernel_grad_body(L + (l_first + (long long)p * l_stride) * size, D + p * size,
                          U + (u_first + p) * size, gK + (long long)(layer0 + p) * C * C * 9, B,
                          C, C, H, W, h, scratch);
}
