// 3x3x3 convolution steps (cross-correlation, zero padding 1, stride 1) as implicit GEMMs
// (conv_gemm.cuh): fused forward, state vjp and the kernel gradient's split-K partials (summed by
// conv.cu's conv_kernel_grad_sum; the bias gradient is dense.cu's bias_grad with inner = D H W).
// Launch contracts: kernels/README.md. States are (B, C, D, H, W) row-major, kernels
// K (Co, Ci, 3, 3, 3) (PyTorch's Conv3d layout).
#include "common.cuh"
#include "conv_gemm.cuh"

// y = [u +] h sigma(conv3d(u, K) + b), deriv = sigma'(...), both (B, Co, D, H, W), either may be
// null. GEMM launch: grid (ceil(B D H W / BN), ceil(Co / BM)).
template <typename T>
__global__ void conv3d_forward(const T *u, const T *K, const T *b, T *y, T *deriv, int B, int Ci,
                               int Co, int D, int H, int W, T h, int act, int residual) {
    conv_gemm_forward<T, 27>(u, K, b, B, Ci, Co, D, H, W, act, [&](long long e, T s, T ds) {
        if (y) y[e] = (residual ? u[e] : T(0)) + h * s;
        if (deriv) deriv[e] = ds;
    });
}

// gx (B, Ci, D, H, W) = [gy +] h conv3d^T(deriv * gy, K), gy and deriv (B, Co, D, H, W).
// GEMM launch: grid (ceil(B D H W / BN), ceil(Ci / BM)).
template <typename T>
__global__ void conv3d_vjp_input(const T *gy, const T *deriv, const T *K, T *gx, int B, int Ci,
                                 int Co, int D, int H, int W, T h, int residual) {
    conv_gemm_vjp<T, 27>(gy, deriv, K, B, Ci, Co, D, H, W, [&](long long e, T c) {
        gx[e] = (residual ? gy[e] : T(0)) + h * c;
    });
}

// Split-K partials part (nsplit, Co, Ci 27) of gK[o, c, t] = sum (deriv * gy)[n, o, .] u at tap t;
// grid (nsplit x ceil(27 Ci / BN), ceil(Co / BM)), GEMM threads; conv_kernel_grad_sum adds them.
template <typename T>
__global__ void conv3d_kernel_grad(const T *gy, const T *deriv, const T *u, T *part, int B, int Ci,
                                   int Co, int D, int H, int W, int ksplit) {
    conv_gemm_kgrad_part<T, 27>(gy, deriv, u, part, B, Ci, Co, D, H, W, ksplit);
}
