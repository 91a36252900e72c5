"""Spatial grid transfer (mgnn.backend.grid_transfer): every operator against a dense matrix built
independently from the 1D formulas, the exact transposes, constants, R P = I, size chains,
dtypes, the CuPy path (fake cupy) and bad input."""
import itertools
import os
import subprocess
import sys
from functools import reduce

import numpy as np
import pytest

from mgnn.backend import grid_transfer as gt
from mgnn.backend.grid_transfer import (coarse_shape, coarse_size, interpolate,
                                        interpolate_transpose, restrict, restrict_transpose)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPS = list(itertools.product(gt.INTERPS, gt.RESTRICTS))
# 2D and 3D; all odd (vertex-centred), all even (cell-centred), mixed; m = 1 on some axes
TINY = [(5, 5), (4, 6), (5, 4), (3, 2), (7, 3), (5, 4, 3), (4, 4, 2), (3, 5, 7), (6, 3, 2),
        (2, 2, 2)]


# --- the 1D operators written out from their definitions (loops, no slicing tricks) ----------

def p_1d(n, interp):
    """Dense 1D interpolation (n x m)."""
    m = n // 2
    P = np.zeros((n, m))
    if n % 2 and interp == "linear":
        for i in range(m):
            P[2 * i + 1, i] = 1.0
            P[2 * i, i] += 0.5       # f[2i]   = (c[i-1] + c[i]) / 2, zero outside
            P[2 * i + 2, i] += 0.5
    elif n % 2:
        for j in range(n):
            P[j, min(j // 2, m - 1)] = 1.0
    elif interp == "nearest":
        for j in range(n):
            P[j, j // 2] = 1.0
    else:
        for i in range(m):
            P[2 * i, i] += 0.75
            P[2 * i, max(i - 1, 0)] += 0.25
            P[2 * i + 1, i] += 0.75
            P[2 * i + 1, min(i + 1, m - 1)] += 0.25
    return P


def r_1d(n, interp, restrict_name):
    """Dense 1D restriction (m x n): D^-1 P^T (rows of P^T normalised) or injection."""
    m = n // 2
    if restrict_name == "full":
        P = p_1d(n, interp)
        return P.T / P.sum(axis=0)[:, None]
    R = np.zeros((m, n))
    for i in range(m):
        R[i, 2 * i + 1 if n % 2 else 2 * i] = 1.0
    return R


def kron(mats):
    return reduce(np.kron, mats)


def dense(op, in_shape):
    """The matrix of the linear map ``op`` on (1, 1, *in_shape) arrays, column by column."""
    cols = []
    for k in range(int(np.prod(in_shape))):
        e = np.zeros(in_shape)
        e.flat[k] = 1.0
        cols.append(op(e[None, None])[0, 0].ravel())
    return np.stack(cols, axis=1)


def test_1d_definitions_give_the_textbook_stencils():
    """The references above are full weighting, average pooling and P^T / 2 (cell linear)."""
    np.testing.assert_array_equal(r_1d(7, "linear", "full")[1], [0, 0, .25, .5, .25, 0, 0])
    np.testing.assert_array_equal(r_1d(6, "nearest", "full")[1], [0, 0, .5, .5, 0, 0])
    np.testing.assert_array_equal(r_1d(8, "linear", "full")[1],
                                  [0, .125, .375, .375, .125, 0, 0, 0])
    np.testing.assert_array_equal(r_1d(8, "linear", "full")[0], [.5, .375, .125, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(r_1d(7, "nearest", "full")[2], [0, 0, 0, 0, 1 / 3, 1 / 3, 1 / 3])
    np.testing.assert_array_equal(r_1d(8, "linear", "full"), p_1d(8, "linear").T / 2)


# --- coarse sizes ------------------------------------------------------------------------------

def test_coarse_sizes_and_chains():
    assert [coarse_size(n) for n in (31, 15, 7, 3)] == [15, 7, 3, 1]
    assert [coarse_size(n) for n in (32, 16, 8, 2)] == [16, 8, 4, 1]
    assert coarse_shape((31, 32, 5)) == (15, 16, 2)
    assert coarse_size(np.int64(9)) == 4
    for n in (1, 0, -3):
        with pytest.raises(ValueError, match=f"grid size {n} cannot be coarsened"):
            coarse_size(n)
    for bad in (4.0, True, "4"):
        with pytest.raises(TypeError, match=repr(bad).replace(".", r"\.")):
            coarse_size(bad)


@pytest.mark.parametrize("fine", [(31, 31, 31), (32, 32, 32), (31, 31), (32, 32), (31, 32, 16)])
@pytest.mark.parametrize("interp", gt.INTERPS)
def test_size_chains_keep_constants(fine, interp):
    """31 -> 15 -> 7 -> 3 and 32 -> 16 -> 8: shapes, constants kept by full restriction, and
    interpolation back up to the fine shape."""
    u = np.ones((1, 2) + fine)
    shapes = [fine]
    for _ in range(3 if fine[0] % 2 else 2):
        u = restrict(u, interp, "full")
        shapes.append(u.shape[2:])
        np.testing.assert_allclose(u, 1.0, rtol=1e-14, atol=0)
    want = {31: [31, 15, 7, 3], 32: [32, 16, 8]}[fine[0]]
    assert [s[0] for s in shapes] == want
    for s in reversed(shapes[:-1]):
        u = interpolate(u, s, interp)
    assert u.shape == (1, 2) + fine


# --- dense matrices and transposes -----------------------------------------------------------

@pytest.mark.parametrize("fine", TINY)
@pytest.mark.parametrize("interp, restrict_name", OPS)
def test_operators_equal_the_dense_tensor_products(fine, interp, restrict_name, rng):
    coarse = coarse_shape(fine)
    P_ref = kron([p_1d(n, interp) for n in fine])
    R_ref = kron([r_1d(n, interp, restrict_name) for n in fine])
    P = dense(lambda e: interpolate(e, fine, interp), coarse)
    PT = dense(lambda g: interpolate_transpose(g, interp), fine)
    R = dense(lambda u: restrict(u, interp, restrict_name), fine)
    RT = dense(lambda v: restrict_transpose(v, fine, interp, restrict_name), coarse)
    np.testing.assert_allclose(P, P_ref, rtol=0, atol=1e-15)
    np.testing.assert_allclose(R, R_ref, rtol=0, atol=1e-15)
    np.testing.assert_allclose(PT, P.T, rtol=0, atol=1e-15)
    np.testing.assert_allclose(RT, R.T, rtol=0, atol=1e-15)
    # batch and channel axes are independent copies of the same map
    x = rng.standard_normal((2, 3) + fine)
    got = restrict(x, interp, restrict_name)
    want = np.einsum("ij,bcj->bci", R_ref, x.reshape(2, 3, -1)).reshape((2, 3) + coarse)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("fine", [(9, 7), (8, 10), (9, 8), (7, 6, 5), (8, 8, 6), (9, 7, 5),
                                  (15, 16), (31, 15, 7)])
@pytest.mark.parametrize("interp, restrict_name", OPS)
def test_dot_product_identities(fine, interp, restrict_name, rng):
    """<R u, v> = <u, R^T v> and <P e, g> = <e, P^T g> (float64, relative 1e-12)."""
    coarse = coarse_shape(fine)
    u = rng.standard_normal((2, 3) + fine)
    g = rng.standard_normal((2, 3) + fine)
    v = rng.standard_normal((2, 3) + coarse)
    e = rng.standard_normal((2, 3) + coarse)
    Ru, RTv = restrict(u, interp, restrict_name), restrict_transpose(v, fine, interp, restrict_name)
    lhs, rhs = np.vdot(Ru, v), np.vdot(u, RTv)
    assert abs(lhs - rhs) <= 1e-12 * np.linalg.norm(Ru) * np.linalg.norm(v)
    Pe, PTg = interpolate(e, fine, interp), interpolate_transpose(g, interp)
    lhs, rhs = np.vdot(Pe, g), np.vdot(e, PTg)
    assert abs(lhs - rhs) <= 1e-12 * np.linalg.norm(Pe) * np.linalg.norm(g)


# --- constants and R P = I ---------------------------------------------------------------------

def _profile(n, interp):
    """P 1 along one axis: 1, except 1/2 at both ends of a vertex-centred linear axis."""
    p = np.ones(n)
    if n % 2 and interp == "linear":
        p[0] = p[-1] = 0.5
    return p


@pytest.mark.parametrize("fine", [(7, 7), (8, 6), (7, 8), (7, 5, 3), (8, 4, 6), (5, 6, 7)])
@pytest.mark.parametrize("interp, restrict_name", OPS)
def test_constants(fine, interp, restrict_name):
    """Full restriction and injection map 1 to 1 everywhere. Interpolation maps 1 to 1 except
    vertex-centred linear: (1/2)^k at points on the first or last index of k vertex axes."""
    ones_c = np.ones((2, 1) + coarse_shape(fine))
    np.testing.assert_allclose(restrict(np.ones((2, 1) + fine), interp, restrict_name), ones_c,
                               rtol=1e-15, atol=0)
    want = reduce(np.multiply.outer, [_profile(n, interp) for n in fine])
    got = interpolate(ones_c, fine, interp)
    np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))
    if interp == "linear" and any(n % 2 for n in fine):
        assert got.min() < 1  # the zero boundary is really there


RP_IDENTITY = {("nearest", "full"), ("nearest", "injection"), ("linear", "injection")}


@pytest.mark.parametrize("fine", [(7, 7), (8, 6), (7, 6), (7, 5, 3), (8, 4, 6), (5, 6, 7)])
@pytest.mark.parametrize("interp, restrict_name", OPS)
def test_restriction_undoes_interpolation_where_theory_says(fine, interp, restrict_name, rng):
    """R P = I for nearest (vertex and cell, full or injection) and for injection after vertex
    linear; not for linear + full weighting, nor for cell linear + injection."""
    e = rng.standard_normal((2, 2) + coarse_shape(fine))
    err = np.abs(restrict(interpolate(e, fine, interp), interp, restrict_name) - e).max()
    cell_linear_injection = (interp, restrict_name) == ("linear", "injection") and \
        any(n % 2 == 0 for n in fine)
    if (interp, restrict_name) in RP_IDENTITY and not cell_linear_injection:
        assert err <= 1e-14 * np.abs(e).max()
    else:
        assert err > 0.01


# --- dtypes, layout, inputs left alone -------------------------------------------------------

@pytest.mark.parametrize("fine", [(7, 8), (5, 6, 7)])
@pytest.mark.parametrize("interp, restrict_name", OPS)
def test_float32_preserved_and_inputs_untouched(fine, interp, restrict_name, rng):
    coarse = coarse_shape(fine)
    u64, v64 = rng.standard_normal((2, 3) + fine), rng.standard_normal((2, 3) + coarse)
    u32, v32 = u64.astype(np.float32), v64.astype(np.float32)
    keep_u, keep_v = u32.copy(), v32.copy()
    calls = [(lambda u, v: restrict(u, interp, restrict_name)),
             (lambda u, v: restrict_transpose(v, fine, interp, restrict_name)),
             (lambda u, v: interpolate(v, fine, interp)),
             (lambda u, v: interpolate_transpose(u, interp))]
    for call in calls:
        got, want = call(u32, v32), call(u64, v64)
        assert got.dtype == np.float32 and got.flags.c_contiguous
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(u32, keep_u)
    np.testing.assert_array_equal(v32, keep_v)


def test_non_contiguous_input(rng):
    base = rng.standard_normal((3, 2, 9, 8, 7))
    view = base.transpose(1, 0, 2, 3, 4)[:, :, :, :, :]
    np.testing.assert_allclose(restrict(view), restrict(np.ascontiguousarray(view)), rtol=0,
                               atol=0)


def test_cupy_arrays_stay_on_the_device():
    """On the fake cupy (NumPy-backed arrays that refuse to mix with host arrays): every function
    returns a cupy array equal to the NumPy result to round-off."""
    script = (
        "import numpy as np, cupy\n"
        "from mgnn.backend import grid_transfer as gt\n"
        "rng = np.random.default_rng(0)\n"
        "for fine in [(7, 6), (5, 6, 4)]:\n"
        "    c = gt.coarse_shape(fine)\n"
        "    u, v = rng.standard_normal((2, 2) + fine), rng.standard_normal((2, 2) + c)\n"
        "    du, dv = cupy.asarray(u), cupy.asarray(v)\n"
        "    for i in gt.INTERPS:\n"
        "        for r in gt.RESTRICTS:\n"
        "            for f in (lambda a, b: gt.restrict(a, i, r),\n"
        "                      lambda a, b: gt.restrict_transpose(b, fine, i, r),\n"
        "                      lambda a, b: gt.interpolate(b, fine, i),\n"
        "                      lambda a, b: gt.interpolate_transpose(a, i)):\n"
        "                got = f(du, dv)\n"
        "                assert type(got) is cupy.ndarray, type(got)\n"
        "                want = f(u, v)  # the CPU path: the same terms, other order\n"
        "                assert np.allclose(cupy.asnumpy(got), want, rtol=1e-14, atol=1e-15)\n"
        "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "tests", "fakegpu"),
                                                       REPO]))
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# --- bad input -----------------------------------------------------------------------------

def test_bad_names():
    u = np.zeros((1, 1, 5, 5))
    with pytest.raises(ValueError, match="interp must be 'linear' or 'nearest', got 'cubic'"):
        restrict(u, "cubic")
    with pytest.raises(ValueError, match="interp must be 'linear' or 'nearest', got 'cubic'"):
        interpolate(np.zeros((1, 1, 2, 2)), (5, 5), "cubic")
    with pytest.raises(ValueError, match="restrict must be 'full' or 'injection', got 'average'"):
        restrict(u, "linear", "average")
    with pytest.raises(ValueError, match="restrict must be 'full' or 'injection', got 'mean'"):
        restrict_transpose(np.zeros((1, 1, 2, 2)), (5, 5), "linear", "mean")
    with pytest.raises(TypeError, match="interp must be .* got None"):
        interpolate_transpose(u, None)


def test_bad_shapes_and_types():
    with pytest.raises(ValueError, match=r"2 or 3 spatial axes, got shape \(1, 1, 5\)"):
        restrict(np.zeros((1, 1, 5)))
    with pytest.raises(ValueError, match=r"got shape \(1, 1, 3, 3, 3, 3\)"):
        interpolate_transpose(np.zeros((1, 1, 3, 3, 3, 3)))
    with pytest.raises(ValueError, match=r"e must be \(B, C, \*spatial\) with 3 spatial axes"):
        interpolate(np.zeros((1, 1, 2, 2)), (5, 5, 5))
    with pytest.raises(ValueError, match=r"spatial shape \(3, 2\), but the fine shape \(5, 5\) "
                                         r"coarsens to \(2, 2\)"):
        interpolate(np.zeros((1, 1, 3, 2)), (5, 5))
    with pytest.raises(ValueError, match=r"\(4, 2\), but the fine shape \(8, 8\) coarsens"):
        restrict_transpose(np.zeros((1, 1, 4, 2)), (8, 8))
    with pytest.raises(ValueError, match="grid size 1 cannot be coarsened"):
        restrict(np.zeros((1, 1, 5, 1)))
    with pytest.raises(ValueError, match="grid size 1 cannot be coarsened"):
        interpolate(np.zeros((1, 1, 2, 2)), (5, 1))
    with pytest.raises(ValueError, match=r"2 or 3 axes, got \(5,\)"):
        coarse_shape((5,))
    with pytest.raises(TypeError, match=r"tuple of ints, got \(5, 4\.0\)"):
        interpolate(np.zeros((1, 1, 2, 2)), (5, 4.0))
    with pytest.raises(TypeError, match="floating-point dtype, got int64"):
        restrict(np.zeros((1, 1, 4, 4), dtype=np.int64))
    with pytest.raises(TypeError, match="NumPy or CuPy arrays, got list"):
        restrict([[[[0.0]]]])


@pytest.mark.parametrize("fine", [(7, 7), (8, 6), (7, 8), (2, 3), (7, 5, 3), (8, 4, 6),
                                  (5, 6, 7)])
@pytest.mark.parametrize("interp, restrict_name", OPS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_matrix_path_equals_the_slice_reference(fine, interp, restrict_name, dtype, rng):
    """The fast paths (Numba sparse rows on NumPy arrays; the per-axis GEMMs CuPy takes, run
    here on NumPy) equal the slice-by-slice application of the same terms (``_apply`` of
    ``_plan``) to round-off, in both directions, for P and R."""
    from mgnn.backend.grid_transfer import _apply, _plan, _transfer_dense
    coarse = coarse_shape(fine)
    u = rng.standard_normal((3, 2) + fine).astype(dtype)
    v = rng.standard_normal((3, 2) + coarse).astype(dtype)
    tol = 1e-14 if dtype == np.float64 else 1e-6
    pairs = [(restrict(u, interp, restrict_name), _apply(u, u.shape[:2] + coarse,
                                                         _plan(fine, interp, restrict_name, False))),
             (restrict_transpose(v, fine, interp, restrict_name),
              _apply(v, v.shape[:2] + fine, _plan(fine, interp, restrict_name, True))),
             (interpolate(v, fine, interp), _apply(v, v.shape[:2] + fine,
                                                   _plan(fine, interp, None, True))),
             (interpolate_transpose(u, interp), _apply(u, u.shape[:2] + coarse,
                                                       _plan(fine, interp, None, False)))]
    dense = [_transfer_dense(u, fine, interp, restrict_name, False, np),
             _transfer_dense(v, fine, interp, restrict_name, True, np),
             _transfer_dense(v, fine, interp, None, True, np),
             _transfer_dense(u, fine, interp, None, False, np)]
    for (got, want), other in zip(pairs, dense):
        assert got.dtype == dtype and got.shape == want.shape and got.flags.c_contiguous
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
        assert other.dtype == dtype and other.flags.c_contiguous
        np.testing.assert_allclose(other, want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("shape", [(9, 8, 16, 16), (2, 3, 12, 10), (3, 2, 8, 6, 4),
                                   (4, 2, 16, 5), (40, 1, 4, 2)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64])
def test_fixed_windows_equal_the_slice_reference(shape, dtype, rng):
    """The CPU's fixed-window passes (even axes: windows over whole arrays, edge rows from the
    sparse rows, blocks of lines and of planes; odd axes mixed in take the sparse rows or the
    GEMM) equal the slice reference for every operator in both directions; several blocks of
    planes ((9, 8, 16, 16): 72 planes, 32 a block) and tiny axes (2: one row, all edge or all
    window). The two-axis pass equals two single-axis passes bit for bit."""
    from mgnn.backend.grid_transfer import _apply, _axis_csr, _plan, _structure, _transfer_sparse
    from mgnn.backend.numba_cpu import apply_structured_axis, apply_structured_planes
    fine = shape[2:]
    coarse = coarse_shape(fine)
    u = rng.standard_normal(shape).astype(dtype)
    v = rng.standard_normal(shape[:2] + coarse).astype(dtype)
    if np.iscomplexobj(u):  # both directions with imaginary parts
        u = u + 1j * rng.standard_normal(u.shape).astype(u.real.dtype)
        v = v + 1j * rng.standard_normal(v.shape).astype(v.real.dtype)
    tol = 1e-14 if dtype == np.float64 else 1e-6
    for interp, rname in OPS:
        for rs in (None, rname):
            for to_fine, x, out in ((False, u, coarse), (True, v, fine)):
                got = _transfer_sparse(x, fine, interp, rs, to_fine)
                want = _apply(x, x.shape[:2] + out, _plan(fine, interp, rs, to_fine))
                assert got.dtype == x.dtype and got.shape == want.shape
                np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
                forms = [_structure(n, interp, rs, to_fine, x.dtype) for n in fine]
                if len(fine) == 2 and None not in forms:
                    csrs = [_axis_csr(n, interp, rs, to_fine, x.dtype) for n in fine]
                    m = out
                    planes = x.reshape((-1,) + x.shape[2:])
                    one = apply_structured_planes(planes, m[0], m[1], forms, csrs)
                    order = (0, 1) if not to_fine else (1, 0)
                    y = planes
                    for k in order:
                        pre = int(np.prod(y.shape[:1 + k]))
                        y3 = y.reshape(pre, y.shape[1 + k], -1)
                        z = apply_structured_axis(y3, m[k], forms[k], *csrs[k])
                        y = z.reshape(y.shape[:1 + k] + (m[k],) + y.shape[2 + k:])
                    np.testing.assert_array_equal(one, y)
                    np.testing.assert_array_equal(got.reshape(one.shape), one)


def test_fixed_windows_where_the_axes_have_them():
    """Even axes get a window form in both directions (cell injection's transpose, with an
    empty row per pair, does not), odd axes none; the interior of the default 16-point axis is
    the rows 1..6 (out of 8) and the pairs 1..6 (out of 8)."""
    from mgnn.backend.grid_transfer import _structure
    for interp in gt.INTERPS:
        for rs in (None, "full", "injection"):
            for to_fine in (False, True):
                form = _structure(16, interp, rs, to_fine, np.float32)
                assert (form is None) == (rs == "injection" and to_fine)
                assert _structure(15, interp, rs, to_fine, np.float32) is None
    down = _structure(16, "linear", "full", False, np.float32)
    assert down[:4] == ("down", 1, 7, -1)
    np.testing.assert_array_equal(down[4], np.float32([1, 3, 3, 1]) / 8)
    up = _structure(16, "linear", None, True, np.float32)
    assert up[:4] == ("up", 1, 7, -1) and up[5] == 0
    np.testing.assert_array_equal(up[4], np.float32([0.25, 0.75]))
    np.testing.assert_array_equal(up[6], np.float32([0.75, 0.25]))


def test_fixed_windows_on_threads_give_the_same_bits(rng):
    """The two-axis pass with its blocks of planes on Numba's threads equals the serial pass
    bit for bit, in both directions (72 planes: 3 blocks)."""
    from mgnn.backend.grid_transfer import _axis_csr, _structure
    from mgnn.backend.numba_cpu import apply_structured_planes
    for to_fine, shape, out in ((False, (72, 16, 16), (8, 8)), (True, (72, 8, 8), (16, 16))):
        x = rng.standard_normal(shape).astype(np.float32)
        rs = None if to_fine else "full"
        forms = [_structure(16, "linear", rs, to_fine, x.dtype)] * 2
        csrs = [_axis_csr(16, "linear", rs, to_fine, x.dtype)] * 2
        a = apply_structured_planes(x, *out, forms, csrs, parallel=True)
        b = apply_structured_planes(x, *out, forms, csrs, parallel=False)
        np.testing.assert_array_equal(a, b)
