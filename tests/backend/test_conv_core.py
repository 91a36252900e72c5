"""The Numba conv core (SIMD tiles over a flat padded layout, mgnn.backend.numba_cpu and
conv_tiles): the tiles against NumPy, and the 2D and 3D kernels against the NumPy reference at
sizes that cross its blocking (odd sizes, Ci != Co, B = 1, 1x1 images, channel counts not a
multiple of the tile, runs with a ragged last tile, volumes whose runs cross planes), both
dtypes; and the same bits for 1 and 2 threads (Numba's and BLAS's)."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from mgnn.backend import get_backend
from mgnn.backend import numba_cpu as NB
from tests.conftest import assert_close

REF = get_backend("numpy")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: (B, Ci, Co, H, W): odd sizes, C not a multiple of any tile, fewer channels than a tile, B = 1,
#: a 1x1 image, a tall image of one column, long runs of many position tiles (the last ragged)
#: at 17-40 channels
SHAPES_2D = [(2, 3, 5, 7, 9), (1, 4, 4, 8, 8), (1, 1, 1, 1, 1), (3, 7, 7, 13, 1),
             (2, 5, 3, 40, 40), (1, 17, 17, 11, 12), (1, 32, 31, 20, 40), (2, 40, 40, 20, 20),
             (1, 40, 40, 9, 70)]
#: (B, Ci, Co, D, H, W): small volumes, a 1-voxel one, 33 -> 34 channels, and one whose position
#: tiles cross its 13-row planes (Ci != Co)
SHAPES_3D = [(2, 3, 5, 6, 7, 9), (1, 2, 2, 1, 1, 1), (1, 4, 3, 3, 2, 5), (1, 33, 34, 2, 3, 4),
             (1, 24, 20, 4, 13, 20)]


def _case(rng, dtype, B, Ci, Co, *spatial):
    dt = np.dtype(dtype)
    x = rng.standard_normal((B, Ci) + spatial).astype(dt)
    K = (rng.standard_normal((Co, Ci) + (3,) * len(spatial)) / np.sqrt(9 * Ci)).astype(dt)
    b = rng.standard_normal(Co).astype(dt)
    g = rng.standard_normal((B, Co) + spatial).astype(dt)
    return x, K, b, g, dt.type(0.37)


def _check_all(prefix, x, K, b, g, h, act, dtype):
    nb, ref = (lambda n: getattr(NB, prefix + n)), (lambda n: getattr(REF, prefix + n))
    residual = x.shape[1] == K.shape[0]
    y, d = nb("_forward_deriv")(x, K, b, h, act, residual)
    yr, dr = ref("_forward_deriv")(x, K, b, h, act, residual)
    assert_close(y, yr, dtype, "y")
    assert_close(d, dr, dtype, "sigma'")
    assert_close(nb("_forward")(x, K, b, h, act, residual), yr, dtype, "forward")
    assert_close(nb("_deriv")(x, K, b, act), dr, dtype, "deriv")
    assert_close(nb("_vjp_input")(g, dr, K, h, residual), ref("_vjp_input")(g, dr, K, h, residual),
                 dtype, "vjp_input")
    for a, r, n in zip(nb("_vjp")(g, dr, x, K, h, residual), ref("_vjp")(g, dr, x, K, h, residual),
                       ("gx", "gK", "gb")):
        assert_close(a, r, dtype, n)
    for a, r, n in zip(nb("_vjp_params")(g, dr, x, h), ref("_vjp_params")(g, dr, x, h),
                       ("gK", "gb")):
        assert_close(a, r, dtype, n)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", SHAPES_2D)
def test_conv2d_core_matches_the_reference(dtype, shape, rng):
    x, K, b, g, h = _case(rng, dtype, *shape)
    for act in (0, 1, 2):
        _check_all("conv", x, K, b, g, h, act, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", SHAPES_3D)
def test_conv3d_core_matches_the_reference(dtype, shape, rng):
    x, K, b, g, h = _case(rng, dtype, *shape)
    _check_all("conv3d", x, K, b, g, h, 1, dtype)


def test_the_shapes_cross_every_tile_seam():
    """The shapes above have ragged last tiles of both kinds (channels: Co and Ci not multiples
    of CONV_MR, more than one channel tile and fewer channels than one; positions: runs longer
    than a tile and not a multiple of it, in both dtypes' tile lengths), else the seams would go
    untested; the 3D runs cross plane borders."""
    MR, BLK = NB.CONV_MR, NB.CONV_BLK
    seen = set()
    for nd, shapes in ((2, SHAPES_2D), (3, SHAPES_3D)):
        for shape in shapes:
            Ci, Co, spatial = shape[1], shape[2], shape[3:]
            geo = NB._conv_geometry(nd, spatial)
            L, Lz = geo[5], geo[6]
            assert Lz % BLK == 0 and 0 <= Lz - L < BLK
            # a tile reads up to the last tap's offset plus Lz: within the slack
            assert NB._conv_offsets(nd, geo[1], geo[2])[-1] + Lz <= geo[4]
            for C in (Ci, Co):
                seen.add("ragged channel tile" if C % MR and C > MR else
                         "fewer channels than a tile" if C < MR else "whole channel tiles")
            for blk in (BLK, BLK // 2):  # float32, float64
                if L > blk and L % blk:
                    seen.add(f"ragged position tile {blk}")
    assert seen >= {"ragged channel tile", "fewer channels than a tile", "whole channel tiles",
                    f"ragged position tile {BLK}", f"ragged position tile {BLK // 2}"}, seen


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_simd_tiles_against_numpy(dtype, rng):
    """conv_tile and kgrad_tile (mgnn.backend.conv_tiles) at arbitrary offsets and strides,
    full and partial tiles (rows past nz / nr not stored, taps past nq not stored)."""
    from numba import njit
    from mgnn.backend import conv_tiles as CT

    @njit
    def conv(z, xp, w, offs, nz, nci):
        CT.conv_tile(z, 3, 100, nz, xp, 5, 60, w, 2, offs, offs.size, nci)

    @njit
    def kgrad(g, s, xp, offs, nr, nq, n):
        CT.kgrad_tile(g, 1, 7 * CT.NV, 2, nr, nq, s, 3, 50, xp, 4, offs, 1, n)

    dt = np.dtype(dtype)
    V, MR, NV = CT.vl(dt), CT.MR, CT.NV
    xp = rng.standard_normal(4000).astype(dt)
    w = rng.standard_normal(1000).astype(dt)
    offs = np.array([0, 1, 7, 13, 2], np.int64)
    for nz in (MR, 1, MR - 1):
        z = np.full(MR * 100 + 100, -1, dt)
        conv(z, xp, w, offs, nz, 3)
        ref = np.full(z.size, -1.0)
        for r in range(nz):
            for j in range(NV * V):
                ref[3 + r * 100 + j] = sum(np.float64(w[2 + (i * 5 + t) * MR + r])
                                           * xp[5 + i * 60 + offs[t] + j]
                                           for i in range(3) for t in range(5))
        assert_close(z, ref.astype(dt), dtype, f"conv_tile nz {nz}")
    n = 5 * V
    for nr, nq in ((MR, NV), (1, 1), (MR - 1, NV - 1)):
        g = np.full(1 + MR * 7 * NV + 2 * NV, -1, dt)
        kgrad(g, xp, xp, offs, nr, nq, n)
        ref = np.full(g.size, -1.0)
        for r in range(nr):
            for q in range(nq):
                ref[1 + r * 7 * NV + q * 2] = sum(np.float64(xp[3 + r * 50 + j])
                                                  * xp[4 + offs[1 + q] + j] for j in range(n))
        assert_close(g, ref.astype(dt), dtype, f"kgrad_tile {nr} {nq}")


def test_non_contiguous_inputs_are_accepted(rng):
    x, K, b, g, h = _case(rng, "float64", 2, 3, 3, 6, 5)
    xt = np.ascontiguousarray(x.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)  # F-ordered view
    Kt = np.ascontiguousarray(K.transpose(1, 0, 2, 3)).transpose(1, 0, 2, 3)
    assert not xt.flags.c_contiguous and not Kt.flags.c_contiguous
    assert_close(NB.conv_forward(xt, Kt, b, h, 1, True), REF.conv_forward(x, K, b, h, 1, True),
                 "float64", "forward of views")


_THREADS = textwrap.dedent("""
    import numba, numpy as np
    from threadpoolctl import threadpool_limits
    from mgnn.backend import numba_cpu as nb
    rng = np.random.default_rng(3)
    out = {}
    for threads in (1, 2):
        numba.set_num_threads(threads)
        with threadpool_limits(threads):
            res = []
            for dt in (np.float32, np.float64):
                for spatial, p in (((13, 40), "conv"), ((5, 6, 7), "conv3d")):
                    r = np.random.default_rng(3)
                    x = r.standard_normal((5, 6) + spatial).astype(dt)
                    K = (r.standard_normal((6, 6) + (3,) * len(spatial)) / 8).astype(dt)
                    b = r.standard_normal(6).astype(dt)
                    g = r.standard_normal(x.shape).astype(dt)
                    y, d = getattr(nb, p + "_forward_deriv")(x, K, b, dt(0.3), 0, True)
                    res += [y, d, *getattr(nb, p + "_vjp")(g, d, x, K, dt(0.3), True)]
            out[threads] = res
    assert all(np.array_equal(a, c) for a, c in zip(out[1], out[2]))
    print("OK")
""")


def test_one_and_two_threads_give_the_same_bits():
    """Samples on Numba's threads, one BLAS thread each, kernel gradients summed in sample
    order: the bits do not depend on the thread counts (Numba's or the process's BLAS)."""
    env = dict(os.environ, NUMBA_NUM_THREADS="2")
    res = subprocess.run([sys.executable, "-c", _THREADS], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout + res.stderr
