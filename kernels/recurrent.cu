// Gate epilogues of the GRU and tanh-RNN cells (mgnn.backend.RECURRENT_KERNELS; reference and
// formulas: mgnn/backend/numpy_ref.py). Launch contracts: kernels/README.md ("recurrent.cu").
// All four are grid-stride elementwise kernels over total = B*H elements e = b*H + j of the
// hidden state; gate-stacked arrays gi, gh, dgi, dgh are (B, 3H) with (r, z, n) in columns
// [0:H], [H:2H], [2H:3H]; the GRU cache is (B, 4, H) = (r, z, n, gh_n). Row offsets are 64-bit.
#include "common.cuh"

// 1 / (1 + exp(-x)) without overflow (exp of -|x| only); NaN propagates.
template <typename T>
__device__ __forceinline__ T rec_sigmoid(T x) {
    const T e = mg_exp(x >= T(0) ? -x : x);
    const T s = T(1) / (T(1) + e);
    return x >= T(0) ? s : e * s;
}

// r = sigmoid(gi_r + gh_r), z = sigmoid(gi_z + gh_z), n = tanh(gi_n + r gh_n);
// mode 1: h' = (h + dt (1-z) n) / (1 + dt (1-z)); mode 0: h' = (1-z) n + z h if dt == 1, else
// h + dt (1-z)(n-h). Writes h_next (B, H) and cache (B, 4, H).
template <typename T>
__global__ void gru_gates_forward(const T *gi, const T *gh, const T *h, T *h_next, T *cache,
                                  int total, int H, T dt, int mode) {
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
        const long long b = e / H, j = e - b * H, g3 = 3 * H * b + j, c4 = 4 * H * b + j;
        const T r = rec_sigmoid(gi[g3] + gh[g3]);
        const T z = rec_sigmoid(gi[g3 + H] + gh[g3 + H]);
        const T ghn = gh[g3 + 2 * H];
        const T n = mg_tanh(gi[g3 + 2 * H] + r * ghn);
        const T hb = h[e];
        if (mode == 1) {
            const T a = dt * (T(1) - z);
            h_next[e] = (hb + a * n) / (T(1) + a);
        } else if (dt == T(1)) {
            h_next[e] = (T(1) - z) * n + z * hb;
        } else {
            h_next[e] = hb + dt * (T(1) - z) * (n - hb);
        }
        cache[c4] = r;
        cache[c4 + H] = z;
        cache[c4 + 2 * H] = n;
        cache[c4 + 3 * H] = ghn;
    }
}

// vjp of gru_gates_forward with cotangent g (B, H): dh (B, H) (the direct path), dgi, dgh (B, 3H).
// With h' = c(h, z, n): dpn = g c_n (1 - n^2), dpr = dpn gh_n r (1 - r), dpz = g c_z z (1 - z);
// dgi = (dpr, dpz, dpn), dgh = (dpr, dpz, dpn r), dh = g c_h.
template <typename T>
__global__ void gru_gates_vjp(const T *g, const T *h, const T *cache, T *dh, T *dgi, T *dgh,
                              int total, int H, T dt, int mode) {
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
        const long long b = e / H, j = e - b * H, g3 = 3 * H * b + j, c4 = 4 * H * b + j;
        const T r = cache[c4], z = cache[c4 + H], n = cache[c4 + 2 * H], ghn = cache[c4 + 3 * H];
        const T gb = g[e], hb = h[e];
        T c_h, c_n, c_z;
        if (mode == 1) {
            const T a = dt * (T(1) - z), inv = T(1) / (T(1) + a);
            c_h = inv;
            c_n = a * inv;
            c_z = -dt * (n - hb) * inv * inv;
        } else if (dt == T(1)) {
            c_h = z;
            c_n = T(1) - z;
            c_z = hb - n;
        } else {
            c_n = dt * (T(1) - z);
            c_h = T(1) - c_n;
            c_z = -dt * (n - hb);
        }
        const T dpn = gb * c_n * (T(1) - n * n);
        const T dpr = dpn * ghn * r * (T(1) - r);
        const T dpz = gb * c_z * z * (T(1) - z);
        dh[e] = gb * c_h;
        dgi[g3] = dpr;
        dgi[g3 + H] = dpz;
        dgi[g3 + 2 * H] = dpn;
        dgh[g3] = dpr;
        dgh[g3 + H] = dpz;
        dgh[g3 + 2 * H] = dpn * r;
    }
}

// t = tanh(gi + gh): h_next = t if dt == 1, else h + dt (t - h); deriv = 1 - t^2 (all (B, H)).
template <typename T>
__global__ void rnn_gates_forward(const T *gi, const T *gh, const T *h, T *h_next, T *deriv,
                                  int total, T dt) {
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
        const T t = mg_tanh(gi[e] + gh[e]);
        h_next[e] = dt == T(1) ? t : h[e] + dt * (t - h[e]);
        deriv[e] = T(1) - t * t;
    }
}

// vjp of rnn_gates_forward: dh = g (1 - dt), da = g dt deriv (all (B, H)).
template <typename T>
__global__ void rnn_gates_vjp(const T *g, const T *deriv, T *dh, T *da, int total, T dt) {
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
        dh[e] = g[e] * (T(1) - dt);
        da[e] = g[e] * dt * deriv[e];
    }
}
