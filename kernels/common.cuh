// Shared device helpers of mgnn's RawKernels: activations, min/max, launch geometry.
//
// Every kernel is a template on the element type T (float or double). Sizes are int (element
// counts below 2^31). Activation codes (mgnn._config.ACTIVATIONS): 0 tanh, 1 relu, 2 identity.
// The geometry macros below are set by the loader (-D...); the defaults are the GPU geometry.
#pragma once

#ifndef MGNN_BM
#define MGNN_BM 64        // GEMM tile rows per block
#endif
#ifndef MGNN_BN
#define MGNN_BN 64        // GEMM tile columns per block
#endif
#ifndef MGNN_BK
#define MGNN_BK 16        // GEMM tile depth (shared-memory stage)
#endif
#ifndef MGNN_TM
#define MGNN_TM 4         // GEMM rows per thread
#endif
#ifndef MGNN_TN
#define MGNN_TN 4         // GEMM columns per thread
#endif
#ifndef MGNN_REDUCE
#define MGNN_REDUCE 256   // threads of a reduction block (a power of two)
#endif
#ifndef MGNN_ELEM
#define MGNN_ELEM 256     // threads of an elementwise block
#endif

#define MGNN_GEMM_THREADS ((MGNN_BM / MGNN_TM) * (MGNN_BN / MGNN_TN))

__device__ __forceinline__ float mg_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double mg_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float mg_exp(float x) { return expf(x); }
__device__ __forceinline__ double mg_exp(double x) { return exp(x); }
__device__ __forceinline__ float mg_log(float x) { return logf(x); }
__device__ __forceinline__ double mg_log(double x) { return log(x); }
__device__ __forceinline__ int mg_min(int a, int b) { return a < b ? a : b; }
template <typename T>
__device__ __forceinline__ T mg_max(T a, T b) { return a > b ? a : b; }

// sigma(z) and sigma'(z) of activation `act`.
template <typename T>
__device__ __forceinline__ void activate(T z, int act, T &s, T &ds) {
    if (act == 0) {
        s = mg_tanh(z);
        ds = T(1) - s * s;
    } else if (act == 1) {
        s = z > T(0) ? z : T(0);
        ds = z > T(0) ? T(1) : T(0);
    } else {
        s = z;
        ds = T(1);
    }
}

// The smallest power of two >= N (N >= 1), at compile time.
template <int N>
struct MgPow2 {
    static constexpr int value = 2 * MgPow2<(N + 1) / 2>::value;
};
template <>
struct MgPow2<1> {
    static constexpr int value = 1;
};

// Tree sum of `value` over the NT threads of a 1-D block (any NT >= 1; blockDim.x == NT); the
// result is valid in every thread. Every thread of the block must call it (it synchronises).
template <int NT, typename T>
__device__ __forceinline__ T block_sum_n(T value, T *scratch) {
    static_assert(NT >= 1, "block_sum_n: NT >= 1");
    constexpr int HALF = MgPow2<NT>::value / 2;
    const int t = threadIdx.x;
    scratch[t] = value;
    __syncthreads();
    for (int stride = HALF; stride > 0; stride /= 2) {
        if (t < stride && t + stride < NT) scratch[t] += scratch[t + stride];
        __syncthreads();
    }
    const T total = scratch[0];
    __syncthreads();  // scratch may be reused at once
    return total;
}

// block_sum_n over the MGNN_REDUCE threads of a reduction block.
template <typename T>
__device__ __forceinline__ T block_sum(T value, T *scratch) {
    return block_sum_n<MGNN_REDUCE>(value, scratch);
}

// Tree max (same contract as block_sum).
template <typename T>
__device__ __forceinline__ T block_max(T value, T *scratch) {
    const int t = threadIdx.x;
    scratch[t] = value;
    __syncthreads();
    for (int stride = MGNN_REDUCE / 2; stride > 0; stride /= 2) {
        if (t < stride) scratch[t] = mg_max(scratch[t], scratch[t + stride]);
        __syncthreads();
    }
    const T total = scratch[0];
    __syncthreads();  // scratch may be reused at once
    return total;
}

// ------------------------------------------------------------------------------- GEMM tile
// C(m, n) = sum_k A(m, k) B(k, n) over one BM x BN tile of C per block, then store(m, n, c) for
// every (m, n) of the tile inside M x N. A and B come through loaders; A_K / B_K: the loader's k
// index is the contiguous one in memory (loads then run along k for coalescing), else m / n is.
// Thread (tx, ty) owns rows ty + i * TY and columns tx + j * TX of the tile (coalesced stores).
// gemm_tile_at: the tile at rows m0.., columns n0..; gemm_tile: the block's tile (blockIdx.y,
// blockIdx.x). The k order of every sum is 0, 1, .. K-1 whatever the tile: the same bits.
template <typename T, bool A_K, bool B_K, class LoadA, class LoadB, class Store>
__device__ __forceinline__ void gemm_tile_at(int m0, int n0, int M, int N, int K,
                                             const LoadA &load_a, const LoadB &load_b,
                                             const Store &store) {
    constexpr int TX = MGNN_BN / MGNN_TN, TY = MGNN_BM / MGNN_TM, NT = TX * TY;
    __shared__ T As[MGNN_BK][MGNN_BM + 1];
    __shared__ T Bs[MGNN_BK][MGNN_BN + 1];
    const int tid = threadIdx.x, tx = tid % TX, ty = tid / TX;
    T acc[MGNN_TM][MGNN_TN];
    for (int i = 0; i < MGNN_TM; ++i)
        for (int j = 0; j < MGNN_TN; ++j) acc[i][j] = T(0);
    for (int k0 = 0; k0 < K; k0 += MGNN_BK) {
        for (int e = tid; e < MGNN_BM * MGNN_BK; e += NT) {
            const int mm = A_K ? e / MGNN_BK : e % MGNN_BM;
            const int kk = A_K ? e % MGNN_BK : e / MGNN_BM;
            const int m = m0 + mm, k = k0 + kk;
            As[kk][mm] = (m < M && k < K) ? load_a(m, k) : T(0);
        }
        for (int e = tid; e < MGNN_BN * MGNN_BK; e += NT) {
            const int nn = B_K ? e / MGNN_BK : e % MGNN_BN;
            const int kk = B_K ? e % MGNN_BK : e / MGNN_BN;
            const int n = n0 + nn, k = k0 + kk;
            Bs[kk][nn] = (n < N && k < K) ? load_b(k, n) : T(0);
        }
        __syncthreads();
        for (int kk = 0; kk < MGNN_BK; ++kk) {
            T a[MGNN_TM], b[MGNN_TN];
            for (int i = 0; i < MGNN_TM; ++i) a[i] = As[kk][ty + i * TY];
            for (int j = 0; j < MGNN_TN; ++j) b[j] = Bs[kk][tx + j * TX];
            for (int i = 0; i < MGNN_TM; ++i)
                for (int j = 0; j < MGNN_TN; ++j) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
    for (int i = 0; i < MGNN_TM; ++i) {
        const int m = m0 + ty + i * TY;
        for (int j = 0; j < MGNN_TN; ++j) {
            const int n = n0 + tx + j * TX;
            if (m < M && n < N) store(m, n, acc[i][j]);
        }
    }
}

template <typename T, bool A_K, bool B_K, class LoadA, class LoadB, class Store>
__device__ __forceinline__ void gemm_tile(int M, int N, int K, const LoadA &load_a,
                                          const LoadB &load_b, const Store &store) {
    gemm_tile_at<T, A_K, B_K>(blockIdx.y * MGNN_BM, blockIdx.x * MGNN_BN, M, N, K, load_a, load_b,
                              store);
}

// ------------------------------------------------------------------------ stacked states
// A stacked launch (kernels/README.md, "Stacked states") runs `count` steps of one array of
// states U (m, *state): problem p is the step into slot i = slot0 + p * stride (it reads U[i-1])
// with the parameters of layer l = layer0 + i * layer_step, and writes output slot
// o = out0 + p * out_stride. No pointer arrays: every address is base + index * state size.
struct StackedIndex {
    int i, o, l;
};

__device__ __forceinline__ StackedIndex stacked_index(int p, int slot0, int stride, int out0,
                                                      int out_stride, int layer0,
                                                      int layer_step) {
    const int i = slot0 + p * stride;
    return StackedIndex{i, out0 + p * out_stride, layer0 + i * layer_step};
}

// What a stacked step does with its result phi at element e of the state:
//   mode 0 (residual): r = (phi - u) [+ g], and acc += r^2 (in double);
//   mode 1 (FAS):      r = (r + u) - phi;
//   mode 2 (plain):    r = phi [+ g]   (a chain step: r is U[i] itself).
// u = U[i], g = G[i] (null ok), r = R[o], acc = this thread's sum of squares.
template <typename T>
struct StackedOut {
    const T *u, *g;
    T *r;
    int mode;
    double *acc;
    __device__ __forceinline__ void operator()(long long e, T phi) const {
        if (mode == 1) {
            r[e] = (r[e] + u[e]) - phi;
            return;
        }
        T v = mode == 0 ? phi - u[e] : phi;
        if (g) v += g[e];
        r[e] = v;
        if (mode == 0) *acc += (double)v * (double)v;
    }
};

// The StackedOut of problem `s` of a launch over states of `size` elements.
template <typename T>
__device__ __forceinline__ StackedOut<T> stacked_out(const StackedIndex &s, long long size,
                                                     const T *U, const T *G, T *R, int mode,
                                                     double *acc) {
    return StackedOut<T>{U + s.i * size, G ? G + s.i * size : (const T *)nullptr,
                         R + s.o * size, mode, acc};
}

// Mode 0: the block's sum of `acc` (NT threads) into partial[part0 + the block's flat index
// (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x]. Nothing when partial is null
// (uniform over the block). Every thread of the block must call it.
template <int NT>
__device__ __forceinline__ void stacked_partial(double acc, double *partial, int part0,
                                                double *scratch) {
    if (!partial) return;
    const double total = block_sum_n<NT>(acc, scratch);
    if (threadIdx.x == 0)
        partial[part0 + ((long long)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x +
                blockIdx.x] = total;
}
