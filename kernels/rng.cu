// Counter-based random numbers: Philox4x32-10 (Salmon et al., SC'11; Random123's definition and
// known-answer vectors) and the dropout keep mask built on it, bit for bit the same as
// mgnn/backend/counter_rng.py (NumPy and Numba). Integer arithmetic only. Launch contract:
// kernels/README.md ("rng.cu").
#include "common.cuh"

// Four 32-bit words: a Philox counter or its output.
struct MgPhilox4 {
    unsigned int v[4];
};

// hi, lo 32-bit halves of the 64-bit product a * b.
__device__ __forceinline__ void mg_mulhilo32(unsigned int a, unsigned int b, unsigned int &hi,
                                             unsigned int &lo) {
    const unsigned long long p = (unsigned long long)a * b;
    hi = (unsigned int)(p >> 32);
    lo = (unsigned int)p;
}

// Philox4x32-10 of counter c under key (k0, k1): ten rounds, multipliers 0xD2511F53 (word 0)
// and 0xCD9E8D57 (word 2), the key bumped by 0x9E3779B9 / 0xBB67AE85 before every round but the
// first.
__device__ __forceinline__ MgPhilox4 philox4x32_10(MgPhilox4 c, unsigned int k0,
                                                   unsigned int k1) {
    for (int r = 0; r < 10; ++r) {
        if (r) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        unsigned int hi0, lo0, hi1, lo1;
        mg_mulhilo32(0xD2511F53u, c.v[0], hi0, lo0);
        mg_mulhilo32(0xCD9E8D57u, c.v[2], hi1, lo1);
        c = MgPhilox4{{hi1 ^ c.v[1] ^ k0, lo1, hi0 ^ c.v[3] ^ k1, lo0}};
    }
    return c;
}

// mask (batch, n) unsigned char: mask[i, e] = 1 iff (r >> 8) >= threshold, r = word 0 of
// philox4x32_10(counter (e, sample0 + i, layer, step), key (seed_lo, seed_hi)). The int
// arguments sample0, layer, step, seed_lo, seed_hi carry 32-bit patterns (read as unsigned; the
// sample index wraps mod 2**32); threshold in [0, 2**24]. Grid-stride over elements (x, one
// thread per element when the grid is not capped) and over samples (y). T is unused (every
// kernel is instantiated for float and double).
template <typename T>
__global__ void dropout_mask(unsigned char *mask, int batch, int n, int sample0, int layer,
                             int step, int seed_lo, int seed_hi, int threshold) {
    const unsigned int k0 = (unsigned int)seed_lo, k1 = (unsigned int)seed_hi;
    for (int i = blockIdx.y; i < batch; i += gridDim.y) {
        const unsigned int s = (unsigned int)sample0 + (unsigned int)i;
        unsigned char *row = mask + (long long)i * n;
        for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x) {
            const MgPhilox4 r = philox4x32_10(
                MgPhilox4{{(unsigned int)e, s, (unsigned int)layer, (unsigned int)step}}, k0, k1);
            row[e] = (r.v[0] >> 8) >= (unsigned int)threshold ? 1 : 0;
        }
    }
}
