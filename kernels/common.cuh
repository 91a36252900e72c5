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

// Tree sum of `value` over the MGNN_REDUCE threads of a 1-D block; the result is valid in
// every thread. Every thread of the block must call it (it synchronises).
template <typename T>
__device__ __forceinline__ T block_sum(T value, T *scratch) {
    const int t = threadIdx.x;
    scratch[t] = value;
    __syncthreads();
    for (int stride = MGNN_REDUCE / 2; stride > 0; stride /= 2) {
        if (t < stride) scratch[t] += scratch[t + stride];
        __syncthreads();
    }
    const T total = scratch[0];
    __syncthreads();  // scratch may be reused at once
    return total;
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
