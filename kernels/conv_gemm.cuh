// Implicit-GEMM convolutions, shared by conv.cu (TAPS = 9: 3x3) and conv3d.cu (TAPS = 27:
// 3x3x3): cross-correlation, zero padding 1, stride 1; states (B, C, D, H, W) row-major (D = 1
// in 2D), kernels K (Co, Ci, TAPS). Position n = ((b D + z) H + y) W + x of the B S outputs
// (S = D H W); tap k = c TAPS + t, t = (dz 3 + dy) 3 + dx (dz = 1 in 2D). Every convolution is
// one gemm_tile (common.cuh: 64 x 64 tiles, 4 x 4 per thread, 16-deep shared-memory stages) whose
// loaders read the im2col matrix in place (no copy) and whose store runs the fused epilogue.
// Needs common.cuh first (module_source inlines both; kernels/README.md).
#pragma once

// Address of tap t of position n in a (B, C, D, H, W) state, channel c; -1 in the zero border.
template <int TAPS>
__device__ __forceinline__ long long conv_tap_at(int n, int t, int c, int C, int D, int H,
                                                 int W) {
    const int dz = TAPS == 27 ? t / 9 : 1, dy = (t / 3) % 3, dx = t % 3;
    const int x = n % W, r = n / W, y = r % H, r2 = r / H, z = r2 % D, b = r2 / D;
    const int zz = z + dz - 1, yy = y + dy - 1, xx = x + dx - 1;
    if (zz < 0 || zz >= D || yy < 0 || yy >= H || xx < 0 || xx >= W) return -1;
    return ((((long long)b * C + c) * D + zz) * H + yy) * W + xx;
}

template <typename T, int TAPS>
struct ConvIm2col {  // B(k, n) = [d *] v at tap k of position n: im2col (C TAPS, B S), in place
    const T *v, *d;
    int C, D, H, W;
    __device__ __forceinline__ T operator()(int k, int n) const {
        const int c = k / TAPS;
        const long long at = conv_tap_at<TAPS>(n, k - c * TAPS, c, C, D, H, W);
        return at < 0 ? T(0) : (d ? d[at] * v[at] : v[at]);
    }
};

template <typename T, int TAPS>
struct ConvIm2colT {  // B(k, j) = im2col[j, k0 + k]: positions from k0 on as the GEMM's depth
    ConvIm2col<T, TAPS> im;
    int k0;
    __device__ __forceinline__ T operator()(int k, int j) const { return im(j, k0 + k); }
};

template <typename T>
struct ConvWeight {  // A(o, k) = K[o, k], K (Co, Ci TAPS)
    const T *K;
    int ld;
    __device__ __forceinline__ T operator()(int m, int k) const {
        return K[(long long)m * ld + k];
    }
};

template <typename T, int TAPS>
struct ConvWeightFlip {  // A(c, k) = K[o, c, TAPS-1-t], k = o TAPS + t: the transposed conv
    const T *K;
    int Ci;
    __device__ __forceinline__ T operator()(int m, int k) const {
        const int o = k / TAPS, t = k - o * TAPS;
        return K[((long long)o * Ci + m) * TAPS + TAPS - 1 - t];
    }
};

template <typename T>
struct ConvCotangentRows {  // A(o, k) = [d *] v[b, o, p] at position k0 + k = b S + p
    const T *v, *d;
    int C, S, k0;
    __device__ __forceinline__ T operator()(int m, int k) const {
        const int n = k0 + k, b = n / S;
        const long long at = ((long long)b * C + m) * S + (n - b * S);
        return d ? d[at] * v[at] : v[at];
    }
};

// out(e, sigma(z), sigma'(z)) for the output elements e of this block's tile, z = conv(u, K) + b
// (B, Co, S): a GEMM (Co) x (B S) x (Ci TAPS); grid (ceil(B S / BN), ceil(Co / BM)[, problems]).
template <typename T, int TAPS, class Out>
__device__ __forceinline__ void conv_gemm_forward(const T *u, const T *K, const T *b, int B,
                                                  int Ci, int Co, int D, int H, int W, int act,
                                                  const Out &out) {
    const int S = D * H * W;
    gemm_tile<T, true, false>(Co, B * S, Ci * TAPS, ConvWeight<T>{K, Ci * TAPS},
                              ConvIm2col<T, TAPS>{u, nullptr, Ci, D, H, W},
                              [&](int o, int n, T z) {
                                  const int bn = n / S;
                                  T s, ds;
                                  activate(z + b[o], act, s, ds);
                                  out(((long long)bn * Co + o) * S + (n - bn * S), s, ds);
                              });
}

// out(e, c) for the input elements e (B, Ci, S) of this block's tile, c = conv^T(deriv * gy, K):
// a GEMM (Ci) x (B S) x (Co TAPS) on the flipped kernel; grid (ceil(B S / BN), ceil(Ci / BM)).
template <typename T, int TAPS, class Out>
__device__ __forceinline__ void conv_gemm_vjp(const T *gy, const T *deriv, const T *K, int B,
                                              int Ci, int Co, int D, int H, int W,
                                              const Out &out) {
    const int S = D * H * W;
    gemm_tile<T, true, false>(Ci, B * S, Co * TAPS, ConvWeightFlip<T, TAPS>{K, Ci},
                              ConvIm2col<T, TAPS>{gy, deriv, Co, D, H, W},
                              [&](int c, int n, T v) {
                                  const int bn = n / S;
                                  out(((long long)bn * Ci + c) * S + (n - bn * S), v);
                              });
}

// Splits of the kernel gradient's depth: ceil(positions / ksplit), at least 1.
__device__ __forceinline__ int conv_kgrad_splits(int positions, int ksplit) {
    return positions > ksplit ? (positions + ksplit - 1) / ksplit : 1;
}

// Kernel-gradient partials (split K): part[s, o, k] = sum over the positions n of split s
// (ksplit consecutive positions) of (deriv * gy)[b, o, p] im2col(u)[k, n], part (nsplit, Co,
// Ci TAPS); blockIdx.x = split * tiles + tile (tiles of Ci TAPS columns), blockIdx.y the Co tile.
// conv_kgrad_sum adds the splits in order: the same bits for any launch.
template <typename T, int TAPS>
__device__ __forceinline__ void conv_gemm_kgrad_part(const T *gy, const T *deriv, const T *u,
                                                     T *part, int B, int Ci, int Co, int D,
                                                     int H, int W, int ksplit) {
    const int S = D * H * W, NK = Ci * TAPS, tiles = (NK + MGNN_BN - 1) / MGNN_BN;
    const int split = blockIdx.x / tiles, tile = blockIdx.x - split * tiles;
    const int k0 = split * ksplit, len = mg_min(ksplit, B * S - k0);
    T *ps = part + (long long)split * Co * NK;
    gemm_tile_at<T, true, true>(blockIdx.y * MGNN_BM, tile * MGNN_BN, Co, NK, len,
                                ConvCotangentRows<T>{gy, deriv, Co, S, k0},
                                ConvIm2colT<T, TAPS>{{u, nullptr, Ci, D, H, W}, k0},
                                [&](int o, int k, T v) { ps[(long long)o * NK + k] = v; });
}
