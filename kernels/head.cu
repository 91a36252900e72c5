// Pooling and the loss: average pooling to a p x p grid and its adjoint, softmax cross-entropy.
// Launch contracts: kernels/README.md.
#include "common.cuh"

// v (B, C, p, p) = mean of u (B, C, H, W) over each (H/p) x (W/p) window. 1-D grid-stride over v.
template <typename T>
__global__ void avgpool_forward(const T *u, T *v, int B, int C, int H, int W, int p) {
    const int total = B * C * p * p, wh = H / p, ww = W / p;
    const T scale = T(1) / T(wh * ww);
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
        const int px = e % p, py = (e / p) % p, nc = e / (p * p);
        const T *src = u + (long long)nc * H * W + (long long)py * wh * W + px * ww;
        T s = T(0);
        for (int y = 0; y < wh; ++y)
            for (int x = 0; x < ww; ++x) s += src[y * W + x];
        v[e] = s * scale;
    }
}

// gu (B, C, H, W) = g (B, C, p, p) spread evenly over each window. 1-D grid-stride over gu.
template <typename T>
__global__ void avgpool_vjp(const T *g, T *gu, int B, int C, int H, int W, int p) {
    const int total = B * C * H * W, wh = H / p, ww = W / p;
    const T scale = T(1) / T(wh * ww);
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
        const int x = e % W, y = (e / W) % H, nc = e / (H * W);
        gu[e] = g[((long long)nc * p + y / wh) * p + x / ww] * scale;
    }
}

// Softmax cross-entropy, one block of MGNN_REDUCE threads per sample r = blockIdx.x:
// row_loss[r] = -log softmax(logits[r])[y[r]] and g[r] = (softmax(logits[r]) - onehot(y[r])) / B.
template <typename T>
__global__ void softmax_xent(const T *logits, const long long *y, T *g, T *row_loss, int B,
                             int K) {
    __shared__ T scratch[MGNN_REDUCE];
    const int r = blockIdx.x;
    const T *z = logits + (long long)r * K;
    T m = z[0];
    for (int k = threadIdx.x; k < K; k += MGNN_REDUCE) m = mg_max(m, z[k]);
    m = block_max(m, scratch);
    T s = T(0);
    for (int k = threadIdx.x; k < K; k += MGNN_REDUCE) s += mg_exp(z[k] - m);
    s = block_sum(s, scratch);
    const int label = (int)y[r];
    const T inv_b = T(1) / T(B);
    for (int k = threadIdx.x; k < K; k += MGNN_REDUCE)
        g[(long long)r * K + k] = (mg_exp(z[k] - m) / s - (k == label ? T(1) : T(0))) * inv_b;
    if (threadIdx.x == 0) row_loss[r] = mg_log(s) - (z[label] - m);
}
