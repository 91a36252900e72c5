"""The Numba conv core (implicit GEMM over a flat padded layout, mgnn.backend.numba_cpu): the 2D
and 3D kernels against the NumPy reference at sizes that cross its blocking (odd sizes, Ci != Co,
B = 1, 1x1 images, images spanning several chunks, volumes whose chunks cross planes), both
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

#: (B, Ci, Co, H, W): odd sizes, C not a multiple of any block, B = 1, a 1x1 image, a tall
#: image of one column, images of several chunks: unfolded taps (32 channels, 40 wide: 7 rows
#: a chunk) and one GEMM a tap (40 channels, 20 wide: 9 rows a chunk; 70 wide: 2 rows a chunk,
#: the last one short)
SHAPES_2D = [(2, 3, 5, 7, 9), (1, 4, 4, 8, 8), (1, 1, 1, 1, 1), (3, 7, 7, 13, 1),
             (2, 5, 3, 40, 40), (1, 17, 17, 11, 12), (1, 32, 31, 20, 40), (2, 40, 40, 20, 20),
             (1, 40, 40, 9, 70)]
#: (B, Ci, Co, D, H, W): volumes of one chunk, a 1-voxel one, one of more channels than are
#: unfolded (one GEMM a tap), and one whose 8-row chunks cross its 13-row planes (Ci != Co)
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


def _plan(nd, Ci, Co, spatial):
    geo = NB._conv_geometry(nd, spatial)
    go, oo, tmap = NB._tap_groups(nd, geo[1], geo[2], max(Ci, Co))
    nrows = int(np.prod(spatial[:-1]))
    rpc, width = NB._chunk_plan(Co, Ci, go, oo, nrows, spatial[-1], geo[0], geo[1], geo[2])
    return geo, go, oo, tmap, nrows, rpc, width


def test_chunking_crosses_rows_and_planes():
    """The shapes above span several chunks of both tap plans (unfolded rows of taps, one GEMM
    a tap), a short last one among them, and 3D chunks that cross planes (else the chunk seams
    would go untested); unfolded chunks keep their GEMMs within OpenBLAS's small-matrix
    size."""
    spans = {1: [], 3: []}
    for (B, Ci, Co, H, W) in SHAPES_2D:
        geo, go, oo, tmap, nrows, rpc, width = _plan(2, Ci, Co, (H, W))
        assert tmap.shape == (9 // go.size, go.size) and go.size == (1 if max(Ci, Co) > 32 else 3)
        if go.size == 3:
            assert width == NB._max_chunk(rpc, nrows, W, *geo[:3]) + 2 * geo[1]
            assert Co * Ci * 3 * (width - 2 * geo[1]) <= NB.CONV_SMALL_MNK
        if rpc < H:
            spans[go.size].append(H % rpc)
    assert all(spans.values()) and any(spans[1]) and any(spans[3] + spans[1]), spans
    # the kernel gradient's chunks (as long as the small GEMM kernels take) have seams too
    assert any(NB._small_rows(Ci * Co, H, W, H, W + 1, 0) < H for (B, Ci, Co, H, W) in SHAPES_2D)
    B, Ci, Co, D, H, W = SHAPES_3D[-1]
    geo, go, oo, tmap, nrows, rpc, width = _plan(3, Ci, Co, (D, H, W))
    assert rpc < nrows and rpc % H and sorted(tmap.ravel()) == list(range(27)), (rpc, nrows)
    longest = NB._max_chunk(rpc, nrows, W, geo[0], geo[1], geo[2])
    assert longest > (rpc - 1) * geo[1] + W  # a chunk spans a plane's border rows
    assert Co * Ci * go.size * longest <= NB.CONV_SMALL_MNK and width == longest + 2 * geo[1]
    offs = NB._conv_offsets(3, geo[1], geo[2])
    assert all(offs[tmap[o, g]] == oo[o] + go[g] for o in range(3) for g in range(9))


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
