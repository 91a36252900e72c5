// 3x3x3 convolution steps (cross-correlation, zero padding 1, stride 1): fused forward, state
// vjp and kernel gradient (the bias gradient is dense.cu's bias_grad with inner = D H W). Launch
// contracts: kernels/README.md. States are (B, C, D, H, W) row-major, kernels K (Co, Ci, 3, 3, 3)
// (PyTorch's Conv3d layout).
#include "common.cuh"

// Pre-activation z[n, o, z, y, x] = b[o] + sum_{c, dz, dy, dx} K[o, c, dz, dy, dx]
// u[n, c, z+dz-1, y+dy-1, x+dx-1] (out-of-range u = 0).
template <typename T>
__device__ __forceinline__ T conv3d_z(const T *u, const T *K, const T *b, int n, int o, int zd,
                                      int y, int x, int Ci, int D, int H, int W) {
    T z = b[o];
    for (int c = 0; c < Ci; ++c) {
        const T *uc = u + ((long long)n * Ci + c) * D * H * W;
        const T *kc = K + ((long long)o * Ci + c) * 27;
        for (int dz = 0; dz < 3; ++dz) {
            const int zz = zd + dz - 1;
            if (zz < 0 || zz >= D) continue;
            for (int dy = 0; dy < 3; ++dy) {
                const int yy = y + dy - 1;
                if (yy < 0 || yy >= H) continue;
                const T *row = uc + ((long long)zz * H + yy) * W;
                const T *kr = kc + dz * 9 + dy * 3;
                for (int dx = 0; dx < 3; ++dx) {
                    const int xx = x + dx - 1;
                    if (xx >= 0 && xx < W) z += kr[dx] * row[xx];
                }
            }
        }
    }
    return z;
}

// y = [u +] h sigma(conv3d(u, K) + b), deriv = sigma'(...), both (B, Co, D, H, W), either may be
// null. 1-D grid-stride over the B Co D H W outputs (one output per thread and pass).
template <typename T>
__global__ void conv3d_forward(const T *u, const T *K, const T *b, T *y, T *deriv, int B, int Ci,
                               int Co, int D, int H, int W, T h, int act, int residual) {
    const int total = B * Co * D * H * W;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
        const int xw = e % W, yh = (e / W) % H, zd = (e / (W * H)) % D,
                  o = (e / (W * H * D)) % Co, n = e / (W * H * D * Co);
        T s, ds;
        activate(conv3d_z(u, K, b, n, o, zd, yh, xw, Ci, D, H, W), act, s, ds);
        if (y) y[e] = (residual ? u[e] : T(0)) + h * s;
        if (deriv) deriv[e] = ds;
    }
}

// gx (B, Ci, D, H, W) = [gy +] h conv3d^T(deriv * gy, K), gy and deriv (B, Co, D, H, W).
// 1-D grid-stride over the B Ci D H W inputs.
template <typename T>
__global__ void conv3d_vjp_input(const T *gy, const T *deriv, const T *K, T *gx, int B, int Ci,
                                 int Co, int D, int H, int W, T h, int residual) {
    const int total = B * Ci * D * H * W;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
        const int xw = e % W, yh = (e / W) % H, zd = (e / (W * H)) % D,
                  c = (e / (W * H * D)) % Ci, n = e / (W * H * D * Ci);
        T acc = T(0);
        for (int o = 0; o < Co; ++o) {
            const long long base = ((long long)n * Co + o) * D * H * W;
            const T *ko = K + ((long long)o * Ci + c) * 27;
            for (int dz = 0; dz < 3; ++dz) {
                const int zz = zd - dz + 1;  // the output plane that read input plane zd via dz
                if (zz < 0 || zz >= D) continue;
                for (int dy = 0; dy < 3; ++dy) {
                    const int yy = yh - dy + 1;
                    if (yy < 0 || yy >= H) continue;
                    for (int dx = 0; dx < 3; ++dx) {
                        const int xx = xw - dx + 1;
                        if (xx < 0 || xx >= W) continue;
                        const long long at = base + ((long long)zz * H + yy) * W + xx;
                        acc += ko[dz * 9 + dy * 3 + dx] * deriv[at] * gy[at];
                    }
                }
            }
        }
        gx[e] = (residual ? gy[e] : T(0)) + h * acc;
    }
}

// gK[o, c, dz, dy, dx] = h sum_{n, z, y, x} (deriv * gy)[n, o, z, y, x]
// u[n, c, z+dz-1, y+dy-1, x+dx-1]: one block of MGNN_REDUCE threads per entry of gK
// (blockIdx.x = (o Ci + c) 27 + (dz 3 + dy) 3 + dx), in-range terms only.
template <typename T>
__global__ void conv3d_kernel_grad(const T *gy, const T *deriv, const T *u, T *gK, int B, int Ci,
                                   int Co, int D, int H, int W, T h) {
    __shared__ T scratch[MGNN_REDUCE];
    const int entry = blockIdx.x, tap = entry % 27, dx = tap % 3, dy = (tap / 3) % 3,
              dz = tap / 9, c = (entry / 27) % Ci, o = entry / (27 * Ci);
    const int count = B * D * H * W;
    T s = T(0);
    for (int e = threadIdx.x; e < count; e += MGNN_REDUCE) {
        const int xw = e % W, yh = (e / W) % H, zd = (e / (W * H)) % D, n = e / (W * H * D);
        const int zz = zd + dz - 1, yy = yh + dy - 1, xx = xw + dx - 1;
        if (zz < 0 || zz >= D || yy < 0 || yy >= H || xx < 0 || xx >= W) continue;
        const long long at = (((long long)n * Co + o) * D + zd) * H * W + (long long)yh * W + xw;
        s += deriv[at] * gy[at] *
             u[(((long long)n * Ci + c) * D + zz) * H * W + (long long)yy * W + xx];
    }
    const T total = block_sum(s, scratch);
    if (threadIdx.x == 0) gK[entry] = h * total;
}
