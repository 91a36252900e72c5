// Dense residual-block steps: fused forward, state vjp, parameter vjp, and their interval-batched
// forms. Launch contracts: kernels/README.md. Row-major arrays; B batch rows, I inputs, O outputs.
#include "common.cuh"

// ------------------------------------------------------------------------------------ forward
template <typename T>
struct RowLoad {  // A(m, k) = x[m, k] (row-major, K contiguous)
    const T *x;
    int ld;
    __device__ T operator()(int m, int k) const { return x[m * ld + k]; }
};

template <typename T>
struct WeightT {  // B(k, n) = W[n, k]: the transposed weight (K contiguous)
    const T *W;
    int ld;
    __device__ T operator()(int k, int n) const { return W[n * ld + k]; }
};

template <typename T>
struct ForwardStore {  // y = [x +] h sigma(z + b) [+ g]; deriv = sigma'(z + b); y, deriv, g may be null
    const T *x, *b;
    T *y, *deriv;
    int O;
    T h;
    int act, residual;
    const T *g;
    __device__ void operator()(int m, int n, T z) const {
        T s, ds;
        activate(z + b[n], act, s, ds);
        if (y) {
            T v = (residual ? x[m * O + n] : T(0)) + h * s;
            if (g) v += g[m * O + n];
            y[m * O + n] = v;
        }
        if (deriv) deriv[m * O + n] = ds;
    }
};

template <typename T>
__device__ __forceinline__ void dense_forward_body(const T *x, const T *W, const T *b, T *y,
                                                   T *deriv, int B, int I, int O, T h, int act,
                                                   int residual, const T *g) {
    gemm_tile<T, true, true>(B, O, I, RowLoad<T>{x, I}, WeightT<T>{W, I},
                             ForwardStore<T>{x, b, y, deriv, O, h, act, residual, g});
}

// y (B, O) = [x +] h sigma(x W^T + b); deriv (B, O) = sigma'(x W^T + b). y or deriv may be null.
template <typename T>
__global__ void dense_forward(const T *x, const T *W, const T *b, T *y, T *deriv, int B, int I,
                              int O, T h, int act, int residual) {
    dense_forward_body(x, W, b, y, deriv, B, I, O, h, act, residual, (const T *)nullptr);
}

// Interval-batched residual forward: problem p = blockIdx.z steps state xs[p] with layer
// layers[p] of W (L, w, w) and b (L, w): ys[p] = xs[p] + h sigma(xs[p] W_l^T + b_l), and
// derivs[p] = sigma'. Either pointer array may be null (not both): then nothing of that kind is
// written (ys null: the sigma' of many layers at once). gs (may be null): a right-hand side
// added to each ys[p] in the epilogue (MGRIT's FAS rhs: u_j = Phi(u_{j-1}) + g_j, one launch).
template <typename T>
__global__ void dense_forward_batched(const T *const *xs, const T *W, const T *b, T *const *ys,
                                      T *const *derivs, const T *const *gs, const int *layers,
                                      int B, int w, T h, int act) {
    const int p = blockIdx.z, l = layers[p];
    dense_forward_body(xs[p], W + (long long)l * w * w, b + (long long)l * w,
                       ys ? ys[p] : (T *)nullptr, derivs ? derivs[p] : (T *)nullptr, B, w, w, h,
                       act, 1, gs ? gs[p] : (const T *)nullptr);
}

// ---------------------------------------------------------------------------------- state vjp
template <typename T>
struct ScaledCotangent {  // A(m, k) = deriv[m, k] gy[m, k] (K contiguous)
    const T *gy, *deriv;
    int ld;
    __device__ T operator()(int m, int k) const { return deriv[m * ld + k] * gy[m * ld + k]; }
};

template <typename T>
struct WeightRows {  // B(k, n) = W[k, n] (N contiguous)
    const T *W;
    int ld;
    __device__ T operator()(int k, int n) const { return W[k * ld + n]; }
};

template <typename T>
struct VjpInputStore {  // gx = [gy +] h c [+ g]; g may be null
    const T *gy;
    T *gx;
    int I;
    T h;
    int residual;
    const T *g;
    __device__ void operator()(int m, int n, T c) const {
        T v = (residual ? gy[m * I + n] : T(0)) + h * c;
        if (g) v += g[m * I + n];
        gx[m * I + n] = v;
    }
};

template <typename T>
__device__ __forceinline__ void dense_vjp_input_body(const T *gy, const T *deriv, const T *W,
                                                     T *gx, int B, int I, int O, T h,
                                                     int residual, const T *g) {
    gemm_tile<T, true, false>(B, I, O, ScaledCotangent<T>{gy, deriv, O}, WeightRows<T>{W, I},
                              VjpInputStore<T>{gy, gx, I, h, residual, g});
}

// gx (B, I) = [gy +] h (deriv * gy) W, with gy and deriv (B, O), W (O, I).
template <typename T>
__global__ void dense_vjp_input(const T *gy, const T *deriv, const T *W, T *gx, int B, int I,
                                int O, T h, int residual) {
    dense_vjp_input_body(gy, deriv, W, gx, B, I, O, h, residual, (const T *)nullptr);
}

// Interval-batched state vjp: gxs[p] = gys[p] + h (derivs[p] * gys[p]) W_l [+ gs[p]],
// l = layers[p]; gs may be null.
template <typename T>
__global__ void dense_vjp_input_batched(const T *const *gys, const T *const *derivs,
                                        const T *W, T *const *gxs, const T *const *gs,
                                        const int *layers, int B, int w, T h) {
    const int p = blockIdx.z;
    dense_vjp_input_body(gys[p], derivs[p], W + (long long)layers[p] * w * w, gxs[p], B, w, w,
                         h, 1, gs ? gs[p] : (const T *)nullptr);
}

// ------------------------------------------------------------------------------ parameter vjp
template <typename T>
struct ScaledCotangentT {  // A(m, k) = deriv[k, m] gy[k, m]: m = output o, k = batch row (M contiguous)
    const T *gy, *deriv;
    int ld;
    __device__ T operator()(int m, int k) const { return deriv[k * ld + m] * gy[k * ld + m]; }
};

template <typename T>
struct ScaledStore {  // out = h c
    T *out;
    int ld;
    T h;
    __device__ void operator()(int m, int n, T c) const { out[m * ld + n] = h * c; }
};

// gW (O, I) = h (deriv * gy)^T x, with gy and deriv (B, O), x (B, I).
template <typename T>
__global__ void dense_weight_grad(const T *gy, const T *deriv, const T *x, T *gW, int B, int I,
                                  int O, T h) {
    gemm_tile<T, false, false>(O, I, B, ScaledCotangentT<T>{gy, deriv, O}, WeightRows<T>{x, I},
                               ScaledStore<T>{gW, I, h});
}

// Batched weight gradients: gW[l] (w, w) = h (derivs[p] * gys[p])^T xs[p], l = layers[p],
// p = blockIdx.z, into the stacked gW (L, w, w); every layer at most once per launch.
template <typename T>
__global__ void dense_weight_grad_batched(const T *const *gys, const T *const *derivs,
                                          const T *const *xs, T *gW, const int *layers, int B,
                                          int w, T h) {
    const int p = blockIdx.z;
    gemm_tile<T, false, false>(w, w, B, ScaledCotangentT<T>{gys[p], derivs[p], w},
                               WeightRows<T>{xs[p], w},
                               ScaledStore<T>{gW + (long long)layers[p] * w * w, w, h});
}

template <typename T>
__device__ __forceinline__ void bias_grad_body(const T *gy, const T *deriv, T *gb, int outer,
                                               int C, int inner, T h, T *scratch) {
    const int c = blockIdx.x, count = outer * inner;
    T s = T(0);
    for (int e = threadIdx.x; e < count; e += MGNN_REDUCE) {
        const int n = e / inner, i = e % inner;
        const long long at = ((long long)n * C + c) * inner + i;
        s += deriv[at] * gy[at];
    }
    const T total = block_sum(s, scratch);
    if (threadIdx.x == 0) gb[c] = h * total;
}

// gb[c] = h sum over n < outer, i < inner of (deriv * gy)[n, c, i], for gy and deriv of shape
// (outer, C, inner): dense (B, O) has inner 1, conv (B, C, H, W) has inner H W. One block of
// MGNN_REDUCE threads per channel c = blockIdx.x.
template <typename T>
__global__ void bias_grad(const T *gy, const T *deriv, T *gb, int outer, int C, int inner, T h) {
    __shared__ T scratch[MGNN_REDUCE];
    bias_grad_body(gy, deriv, gb, outer, C, inner, h, scratch);
}

// Batched bias gradients: gb[l] (C,) of problem p = blockIdx.y, l = layers[p], into the stacked
// gb (L, C); one block of MGNN_REDUCE threads per (channel, problem).
template <typename T>
__global__ void bias_grad_batched(const T *const *gys, const T *const *derivs, T *gb,
                                  const int *layers, int outer, int C, int inner, T h) {
    __shared__ T scratch[MGNN_REDUCE];
    const int p = blockIdx.y;
    bias_grad_body(gys[p], derivs[p], gb + (long long)layers[p] * C, outer, C, inner, h, scratch);
}

// ---------------------------------------------------------------------------- stacked states
// One launch = `count` steps of one stacked array (see stacked_index in common.cuh): the GEMM tile
// code and loaders above, with an epilogue that hands phi to StackedOut (mode 0/1/2). Mode 0
// also writes each block's sum of r^2 to partial (null in modes 1 and 2).
template <typename T>
struct StackedForwardStore {  // phi = x + h sigma(z + b)  (= ForwardStore's y, residual)
    const T *x, *b;
    int O;
    T h;
    int act;
    StackedOut<T> out;
    __device__ void operator()(int m, int n, T z) const {
        T s, ds;
        activate(z + b[n], act, s, ds);
        out((long long)m * O + n, x[m * O + n] + h * s);
    }
};

template <typename T>
struct StackedVjpStore {  // phi = gy + h c  (= VjpInputStore's gx, residual)
    const T *gy;
    int I;
    T h;
    StackedOut<T> out;
    __device__ void operator()(int m, int n, T c) const {
        out((long long)m * I + n, gy[m * I + n] + h * c);
    }
};

// Problem p = blockIdx.z: phi = U[i-1] + h sigma(U[i-1] W_l^T + b_l), U (m, B, w), W (L, w, w),
// b (L, w); then StackedOut into R (n_out, B, w) (R == U for a chain, mode 2).
template <typename T>
__global__ void dense_stacked_forward(const T *U, const T *G, T *R, const T *W, const T *b,
                                      int slot0, int stride, int out0, int out_stride,
                                      int layer0, int layer_step, int B, int w, T h, int act,
                                      int mode, double *partial, int part0) {
    __shared__ double scratch[MGNN_GEMM_THREADS];
    const StackedIndex s =
        stacked_index(blockIdx.z, slot0, stride, out0, out_stride, layer0, layer_step);
    const long long size = (long long)B * w;
    const T *x = U + (s.i - 1) * size;
    double acc = 0.0;
    gemm_tile<T, true, true>(
        B, w, w, RowLoad<T>{x, w}, WeightT<T>{W + (long long)s.l * w * w, w},
        StackedForwardStore<T>{x, b + (long long)s.l * w, w, h, act,
                               stacked_out(s, size, U, G, R, mode, &acc)});
    stacked_partial<MGNN_GEMM_THREADS>(acc, partial, part0, scratch);
}

// Problem p = blockIdx.z: phi = L[i-1] + h (D_l * L[i-1]) W_l with D_l = D[l - d0], D (n_d, B, w)
// the stored sigma' of layers d0 .. d0 + n_d - 1; then StackedOut as above.
template <typename T>
__global__ void dense_stacked_adjoint(const T *L, const T *G, T *R, const T *W, const T *D,
                                      int d0, int slot0, int stride, int out0, int out_stride,
                                      int layer0, int layer_step, int B, int w, T h, int mode,
                                      double *partial, int part0) {
    __shared__ double scratch[MGNN_GEMM_THREADS];
    const StackedIndex s =
        stacked_index(blockIdx.z, slot0, stride, out0, out_stride, layer0, layer_step);
    const long long size = (long long)B * w;
    const T *gy = L + (s.i - 1) * size;
    double acc = 0.0;
    gemm_tile<T, true, false>(
        B, w, w, ScaledCotangent<T>{gy, D + (s.l - d0) * size, w},
        WeightRows<T>{W + (long long)s.l * w * w, w},
        StackedVjpStore<T>{gy, w, h, stacked_out(s, size, L, G, R, mode, &acc)});
    stacked_partial<MGNN_GEMM_THREADS>(acc, partial, part0, scratch);
}

// ------------------------------------------------------------------------ stacked gradients
// The sigma' and parameter gradients of `count` consecutive layers l = layer0 + p, p < count,
// read from stacked arrays by slot arithmetic (no pointer arrays, no per-layer host work).

// Problem p = blockIdx.z: D[p] = sigma'(U[first + p] W_l^T + b_l); U (m, B, w), W (L, w, w),
// b (L, w), D (count, B, w).
template <typename T>
__global__ void dense_deriv_stacked(const T *U, int first, const T *W, const T *b, int layer0,
                                    T *D, int B, int w, int act) {
    const int p = blockIdx.z, l = layer0 + p;
    const long long size = (long long)B * w;
    dense_forward_body(U + (first + p) * size, W + (long long)l * w * w, b + (long long)l * w,
                       (T *)nullptr, D + p * size, B, w, w, T(1), act, 0, (const T *)nullptr);
}

// Problem p = blockIdx.z, l = layer0 + p: gW[l] (w, w) = h (D[p] * Lam_p)^T U[u_first + p] with
// Lam_p = L[l_first + p l_stride] (l_stride may be negative); L (m_l, B, w), D (count, B, w),
// U (m_u, B, w), gW (L, w, w).
template <typename T>
__global__ void dense_weight_grad_stacked(const T *L, int l_first, int l_stride, const T *D,
                                          const T *U, int u_first, int layer0, T *gW, int B,
                                          int w, T h) {
    const int p = blockIdx.z;
    const long long size = (long long)B * w;
    const T *lam = L + (l_first + (long long)p * l_stride) * size;
    gemm_tile<T, false, false>(
        w, w, B, ScaledCotangentT<T>{lam, D + p * size, w},
        WeightRows<T>{U + (u_first + p) * size, w},
        ScaledStore<T>{gW + (long long)(layer0 + p) * w * w, w, h});
}

// Problem p = blockIdx.y: gb[layer0 + p] (C,) = bias_grad of Lam_p = L[l_first + p l_stride] and
// D[p], states (outer, C, inner) (dense: inner 1; conv: inner H W); gb (L, C). One block of
// MGNN_REDUCE threads per (channel, problem).
template <typename T>
__global__ void bias_grad_stacked(const T *L, int l_first, int l_stride, const T *D, int layer0,
                                  T *gb, int outer, int C, int inner, T h) {
    __shared__ T scratch[MGNN_REDUCE];
    const int p = blockIdx.y;
    const long long size = (long long)outer * C * inner;
    bias_grad_body(L + (l_first + (long long)p * l_stride) * size, D + p * size,
                   gb + (long long)(layer0 + p) * C, outer, C, inner, h, scratch);
}

// ---------------------------------------------------------------------- wide layers (cuBLAS)
// For wide layers the GEMMs go to cuBLAS (RawBackend.gemm_min_width; strided-batched, straight
// on the stacked arrays) and these kernels do the rest: a prologue forming the GEMM's scaled
// cotangent operand and epilogues applying bias, activation, residual and StackedOut. Problem
// p = blockIdx.y; MGNN_ELEM threads, a grid-stride loop over one state of size B w.

// S[p] = h * A[a_first + p a_stride] * Bm[b_first + p b_stride] (elementwise; strides in states,
// either may be negative): D_l * L[i-1] of the stacked adjoint, h D[p] Lam_p of the weight grad.
template <typename T>
__global__ void stacked_product(const T *A, int a_first, int a_stride, const T *Bm, int b_first,
                                int b_stride, T *S, int size, T h) {
    const long long p = blockIdx.y;
    const T *a = A + (a_first + p * a_stride) * size, *bm = Bm + (b_first + p * b_stride) * size;
    T *s = S + p * size;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < size; e += gridDim.x * blockDim.x)
        s[e] = h * (a[e] * bm[e]);
}

// Z (count, B, w) = the GEMM z_p = x_p W_l^T (cuBLAS) of the stacked forward step into slot
// i = slot0 + p stride (x_p = U[i-1], l = layer0 + i layer_step); phi = x + h sigma(z + b_l),
// then StackedOut (mode 0/1/2, partial as dense_stacked_forward's, one per block).
template <typename T>
__global__ void dense_stacked_forward_epilogue(const T *Z, const T *U, const T *G, T *R,
                                               const T *b, int slot0, int stride, int out0,
                                               int out_stride, int layer0, int layer_step, int B,
                                               int w, T h, int act, int mode, double *partial,
                                               int part0) {
    __shared__ double scratch[MGNN_ELEM];
    const StackedIndex s =
        stacked_index(blockIdx.y, slot0, stride, out0, out_stride, layer0, layer_step);
    const long long size = (long long)B * w;
    const T *x = U + (s.i - 1) * size, *z = Z + blockIdx.y * size, *bl = b + (long long)s.l * w;
    double acc = 0.0;
    const StackedOut<T> out = stacked_out(s, size, U, G, R, mode, &acc);
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < size; e += gridDim.x * blockDim.x) {
        T sig, ds;
        activate(z[e] + bl[e % w], act, sig, ds);
        out(e, x[e] + h * sig);
    }
    stacked_partial<MGNN_ELEM>(acc, partial, part0, scratch);
}

// Z (count, B, w) = the GEMM c_p = S_p W_l (cuBLAS; S_p = D_l * L[i-1] from stacked_product) of
// the stacked adjoint step into slot i: phi = L[i-1] + h c, then StackedOut as above.
template <typename T>
__global__ void dense_stacked_adjoint_epilogue(const T *Z, const T *L, const T *G, T *R,
                                               int slot0, int stride, int out0, int out_stride,
                                               int B, int w, T h, int mode, double *partial,
                                               int part0) {
    __shared__ double scratch[MGNN_ELEM];
    const StackedIndex s = stacked_index(blockIdx.y, slot0, stride, out0, out_stride, 0, 0);
    const long long size = (long long)B * w;
    const T *gy = L + (s.i - 1) * size, *c = Z + blockIdx.y * size;
    double acc = 0.0;
    const StackedOut<T> out = stacked_out(s, size, L, G, R, mode, &acc);
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < size; e += gridDim.x * blockDim.x)
        out(e, gy[e] + h * c[e]);
    stacked_partial<MGNN_ELEM>(acc, partial, part0, scratch);
}

// Z (count, B, w) = z_p = x_p W_l^T (cuBLAS), l = layer0 + p: Y[y_first + p] = [X[x_first + p] +]
// h sigma(z + b_l) and D[d_first + p] = sigma'(z + b_l); Y or D may be null (X unread without
// residual). The serial sweep's step (count 1) and dense_deriv_stacked's sigma'.
template <typename T>
__global__ void dense_bias_act(const T *Z, const T *X, int x_first, const T *b, int layer0, T *Y,
                               int y_first, T *D, int d_first, int B, int w, T h, int act,
                               int residual) {
    const long long p = blockIdx.y, size = (long long)B * w;
    const T *z = Z + p * size, *bl = b + (layer0 + p) * w;
    const T *x = residual ? X + (x_first + p) * size : (const T *)nullptr;
    T *y = Y ? Y + (y_first + p) * size : (T *)nullptr;
    T *d = D ? D + (d_first + p) * size : (T *)nullptr;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < size; e += gridDim.x * blockDim.x) {
        T sig, ds;
        activate(z[e] + bl[e % w], act, sig, ds);
        if (y) y[e] = (x ? x[e] : T(0)) + h * sig;
        if (d) d[e] = ds;
    }
}
