"""The host-emulation shim (kernels/host_emulation.cuh) on kernels written for it: threads of a
block meet at __syncthreads (a thread reads what a higher- or a lower-numbered one wrote before
the barrier), threads that return early leave the barrier, each block refills the shared
memory, the coordinates hold after every barrier, blockIdx/gridDim/blockDim/threadIdx in 3D, a
throwing thread (before or after a barrier) makes the launch report failure and the next launch
runs normally, and launches from several OS threads at once do not disturb each other."""
import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest

from mgnn.backend import kernel_dir

SOURCE = r"""
#include "host_emulation.cuh"

// out[i] = in[block start + (t + 1) % active] * 2 + the block's sum, for the first `active`
// threads of each block; the others return before the first barrier.
template <typename T>
__global__ void rotate_sum(T *out, const T *in, int active) {
    __shared__ T buf[64];
    __shared__ T total[1];
    const unsigned t = threadIdx.x;
    const unsigned base = blockIdx.x * blockDim.x;
    if (t >= static_cast<unsigned>(active)) return;
    buf[t] = in[base + t];
    __syncthreads();
    const T mine = buf[(t + 1) % active];
    __syncthreads();  // every read of the first phase before the second phase writes
    buf[threadIdx.x] = mine;  // the coordinates read again after each barrier
    if (threadIdx.x == 0) total[0] = 0;
    __syncthreads();
    if (threadIdx.x == 0)
        for (int k = 0; k < active; ++k) total[0] += in[blockIdx.x * blockDim.x + k];
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = 2 * buf[threadIdx.x] + total[0];
}

// Thread t (t > 0) reads what thread t - 1 wrote before the barrier, thread 0 the last one's;
// throws after the barrier where the value read is negative.
template <typename T>
__global__ void shift_or_throw(T *out, const T *in, int unused) {
    (void)unused;
    __shared__ T buf[64];
    const unsigned t = threadIdx.x, n = blockDim.x, base = blockIdx.x * n;
    buf[t] = in[base + t];
    __syncthreads();
    const T v = buf[(t + n - 1) % n];
    if (v < 0) throw 2;
    out[base + threadIdx.x] = v;
}

// out[linear thread id] = its coordinates packed as one number; throws where in < 0.
template <typename T>
__global__ void coordinates(T *out, const T *in, int unused) {
    (void)unused;
    const unsigned bl = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    const unsigned tl = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    const unsigned i = bl * blockDim.x * blockDim.y * blockDim.z + tl;
    if (in[i] < 0) throw 1;
    out[i] = threadIdx.x + 10 * threadIdx.y + 100 * threadIdx.z + 1000 * blockIdx.x
             + 10000 * blockIdx.y + 100000 * blockIdx.z;
}

MGNN_EMU_EXPORT(rotate_sum)
MGNN_EMU_EXPORT(coordinates)
MGNN_EMU_EXPORT(shift_or_throw)

// A race: thread t reads what thread t - 1 (or t + 1) writes, with no barrier between.
template <typename T>
__global__ void racy_neighbour(T *out, const T *in, int up) {
    __shared__ T buf[64];
    const unsigned t = threadIdx.x, n = blockDim.x, base = blockIdx.x * n;
    buf[t] = in[base + t];
    out[base + t] = buf[up ? (t + 1) % n : (t + n - 1) % n];
}
MGNN_EMU_EXPORT(racy_neighbour)
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        pytest.skip("no C++ compiler")
    tmp = tmp_path_factory.mktemp("shim")
    src, so = tmp / "shim.cpp", tmp / "shim.so"
    src.write_text(SOURCE)
    proc = subprocess.run([cxx, "-std=c++20", "-O1", "-fPIC", "-shared", "-fvisibility=hidden",
                           "-fno-gnu-unique", "-Wall", "-Wextra", "-Werror",
                           f"-I{kernel_dir()}", str(src), "-o", str(so)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ctypes.CDLL(str(so))


def _launch(lib, name, grid, block, out, inp, n):
    dims = [(ctypes.c_uint * 3)(*d) for d in (grid, block)]
    holders = [ctypes.c_void_p(out.ctypes.data), ctypes.c_void_p(inp.ctypes.data), ctypes.c_int(n)]
    args = (ctypes.c_void_p * 3)(*[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p)
                                   for h in holders])
    return getattr(lib, f"mgnn_emu_{name}_f64")(dims[0], dims[1], args)


@pytest.mark.parametrize("active", [16, 11, 1])
def test_threads_meet_at_the_barrier_and_early_returns_leave_it(lib, active):
    blocks, threads = 3, 16
    x = np.arange(blocks * threads, dtype=np.float64) ** 1.5
    out = np.full_like(x, np.nan)
    assert _launch(lib, "rotate_sum", (blocks, 1, 1), (threads, 1, 1), out, x, active) == 0
    for b in range(blocks):
        seg = x[b * threads:(b + 1) * threads]
        want = 2 * np.roll(seg[:active], -1) + seg[:active].sum()
        np.testing.assert_allclose(out[b * threads:b * threads + active], want, rtol=1e-15)
        assert np.isnan(out[b * threads + active:(b + 1) * threads]).all()


def test_coordinates_in_three_dimensions_and_a_throwing_thread(lib):
    grid, block = (2, 3, 2), (4, 2, 3)
    n = int(np.prod(grid) * np.prod(block))
    out = np.zeros(n)
    assert _launch(lib, "coordinates", grid, block, out, np.zeros(n), 0) == 0
    want = [tx + 10 * ty + 100 * tz + 1000 * bx + 10000 * by + 100000 * bz
            for bz in range(2) for by in range(3) for bx in range(2)
            for tz in range(3) for ty in range(2) for tx in range(4)]
    np.testing.assert_array_equal(out, want)
    bad = np.zeros(n)
    bad[5] = -1
    assert _launch(lib, "coordinates", grid, block, np.zeros(n), bad, 0) == 1


def test_lower_numbered_writes_a_throw_after_a_barrier_and_the_next_launch(lib):
    blocks, threads = 4, 8
    x = np.arange(1.0, blocks * threads + 1)
    out = np.zeros_like(x)
    assert _launch(lib, "shift_or_throw", (blocks, 1, 1), (threads, 1, 1), out, x, 0) == 0
    np.testing.assert_array_equal(out, np.roll(x.reshape(blocks, threads), 1, axis=1).ravel())
    bad = x.copy()
    bad[threads + 3] = -1  # block 1: thread 4 throws after the barrier
    assert _launch(lib, "shift_or_throw", (blocks, 1, 1), (threads, 1, 1), np.zeros_like(x),
                   bad, 0) == 1
    out[:] = 0
    assert _launch(lib, "shift_or_throw", (blocks, 1, 1), (threads, 1, 1), out, x, 0) == 0
    np.testing.assert_array_equal(out, np.roll(x.reshape(blocks, threads), 1, axis=1).ravel())


def test_launches_from_several_threads_at_once(lib):
    """ctypes releases the GIL: four OS threads launch at once, each with its own arrays (the
    scheduler's state is per OS thread; distinct kernels, since __shared__ arrays are one copy
    per library)."""
    import threading
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(20):
            blocks, threads = int(rng.integers(1, 5)), int(rng.integers(1, 33))
            n = blocks * threads
            out = np.zeros(n)
            if _launch(lib, "coordinates", (blocks, 1, 1), (threads, 1, 1), out, np.zeros(n),
                       0) != 0:
                errors.append("launch failed")
            want = np.arange(threads)[None, :] + 1000 * np.arange(blocks)[:, None]
            if not np.array_equal(out, want.ravel()):
                errors.append(f"wrong coordinates at {blocks}x{threads}")
    workers = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors[:3]


@pytest.mark.parametrize("up", [0, 1])
def test_a_missing_barrier_shows_up_in_either_direction(lib, up):
    """The threads of a block run in thread order in some blocks and in reverse in others, so a
    read of another thread's write with no __syncthreads() between gives a stale value in some
    block whichever neighbour it reads."""
    blocks, threads = 2, 8
    x = np.arange(1.0, blocks * threads + 1)
    out = np.full_like(x, np.nan)
    assert _launch(lib, "racy_neighbour", (blocks, 1, 1), (threads, 1, 1), out, x, up) == 0
    synced = np.roll(x.reshape(blocks, threads), -1 if up else 1, axis=1)
    inner = slice(0, threads - 1) if up else slice(1, threads)  # not the wrap-around reader
    stale = out.reshape(blocks, threads)[:, inner] != synced[:, inner]
    assert stale.all(axis=1).any() and not stale.all()  # one block in each order
