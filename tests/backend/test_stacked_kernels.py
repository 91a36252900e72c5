"""Stacked-state kernels (mgnn.backend.STACKED_KERNELS) of the numpy and numba backends.

Oracles: ``numpy_ref.stacked_loops(bk)``, a loop of backend ``bk``'s single-step kernels plus NumPy
arithmetic in the stated order. The numba kernels equal the loop of numba single steps to the last
bit where the single step takes the fused njit path (every case here except ``test_wide_dense``:
from WIDE / WIDE_TANH_F32 output elements a numba single step goes through NumPy's matmul and
ufuncs, the stacked kernels never do) and the numpy reference to round-off.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from mgnn.backend import STACKED_KERNELS, get_backend
from mgnn.backend.numpy_ref import stacked_loops

REF, NB = get_backend("numpy"), get_backend("numba")
NB_LOOP = stacked_loops(NB)
RTOL = {"float32": 1e-6, "float64": 1e-13}
M, N_LAYERS, D0, N_D = 12, 16, 3, 11  # slots 1..11 use layers 3..13 for either layer_step
CHAINS = np.array([[9, 3], [1, 3], [5, 0], [6, 2]])  # irregular, unsorted, one of length 0
SLOTS, OUTS, N_OUT = np.array([7, 2, 11, 4]), np.array([1, 3, 0, 2]), 5
STATE = {"dense": (4, 6), "conv": (2, 3, 5, 6)}


def _case(kind, dtype, with_g, seed=7):
    rng = np.random.default_rng(seed)
    state = STATE[kind]
    c = state[1]
    r = lambda *s: rng.standard_normal(s).astype(dtype)  # noqa: E731
    W = r(N_LAYERS, c, c) * 0.5 if kind == "dense" else r(N_LAYERS, c, c, 3, 3) * 0.3
    return dict(U=r(M, *state), G=r(M, *state) if with_g else None, W=W, b=r(N_LAYERS, c),
                D=r(N_D, *state), R=r(N_OUT, *state), h=np.dtype(dtype).type(0.3))


def _call(fns, kind, op, a, layer_step, act, mode):
    """Run kernel ``kind_op`` of ``fns`` on copies of the case; (U after, R after, returned)."""
    U, R = a["U"].copy(), None if a["R"] is None else a["R"].copy()
    layer0 = 2 if layer_step == 1 else 14
    f = fns[f"{kind}_{op}"] if isinstance(fns, dict) else getattr(fns, f"{kind}_{op}")
    if op == "chains_forward":
        out = f(U, a["G"], a["W"], a["b"], CHAINS, layer0, layer_step, a["h"], act)
    elif op == "points_forward":
        out = f(U, a["G"], R, a["W"], a["b"], SLOTS, OUTS, layer0, layer_step, a["h"], act, mode)
    elif op == "chains_adjoint":
        out = f(U, a["G"], a["W"], a["D"], D0, CHAINS, layer0, layer_step, a["h"])
    else:
        out = f(U, a["G"], R, a["W"], a["D"], D0, SLOTS, OUTS, layer0, layer_step, a["h"], mode)
    return U, R, out


CASES = ([(op, act, None) for op in ("chains_forward",) for act in (0, 1)]
         + [("points_forward", act, mode) for act in (0, 1) for mode in (0, 1, 2)]
         + [("chains_adjoint", None, None)]
         + [("points_adjoint", None, mode) for mode in (0, 1, 2)])


def test_backends_advertise_the_stacked_kernels():
    for bk in (REF, NB):
        assert bk.stacked_states is True
        assert [k for k in STACKED_KERNELS if not callable(getattr(bk, k, None))] == []
    assert len(STACKED_KERNELS) == 8 and set(STACKED_KERNELS) == set(NB_LOOP)


@pytest.mark.parametrize("kind", ["dense", "conv"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op,act,mode", CASES)
@pytest.mark.parametrize("with_g", [False, True])
@pytest.mark.parametrize("layer_step", [1, -1])
def test_stacked_matches_single_step_loops(kind, dtype, op, act, mode, with_g, layer_step):
    a = _case(kind, dtype, with_g)
    got = _call(NB, kind, op, a, layer_step, act, mode)
    loop = _call(NB_LOOP, kind, op, a, layer_step, act, mode)
    ref = _call(REF, kind, op, a, layer_step, act, mode)
    # same njit code path as the numba single steps: bit-identical states and outputs
    np.testing.assert_array_equal(got[0], loop[0])
    np.testing.assert_array_equal(got[1], loop[1])
    rtol = RTOL[dtype]
    for g, r in zip(got[:2], ref[:2]):
        np.testing.assert_allclose(g, r, rtol=rtol, atol=rtol * float(np.abs(r).max()))
    if op.startswith("chains"):
        assert got[2] is None and ref[2] is None
        touched = np.zeros(M, bool)
        for first, n in CHAINS:
            touched[first:first + n] = True
        np.testing.assert_array_equal(got[0][~touched], a["U"][~touched])  # nothing else written
        assert not np.array_equal(got[0][touched], a["U"][touched])
    else:
        np.testing.assert_array_equal(got[0], a["U"])  # U is only read
        np.testing.assert_array_equal(got[1][4], a["R"][4])  # R slots not in out_slots untouched
        assert isinstance(got[2], float)
        if mode == 0:
            want = float(np.sum(got[1][OUTS].astype(np.float64) ** 2))
            assert got[2] == pytest.approx(want, rel=1e-12) and got[2] > 0
            assert got[2] == pytest.approx(ref[2], rel=10 * rtol)
        else:
            assert got[2] == 0.0 and ref[2] == 0.0


@pytest.mark.parametrize("act", [0, 1])
@pytest.mark.parametrize("op", ["chains_forward", "chains_adjoint"])
def test_wide_dense(act, op):
    """64 x 64 states: a numba single step goes through NumPy (not the same code path): equal to
    round-off only."""
    rng = np.random.default_rng(3)
    f32 = np.float32
    a = dict(U=rng.standard_normal((M, 64, 64)).astype(f32), G=None,
             W=(rng.standard_normal((N_LAYERS, 64, 64)) / 8).astype(f32),
             b=rng.standard_normal((N_LAYERS, 64)).astype(f32),
             D=rng.standard_normal((N_D, 64, 64)).astype(f32), R=None, h=f32(0.1))
    got, loop = (_call(fns, "dense", op, a, 1, act, None)[0] for fns in (NB, NB_LOOP))
    np.testing.assert_allclose(got, loop, rtol=1e-6, atol=1e-6 * float(np.abs(loop).max()))


def test_empty_and_zero_length():
    a = _case("dense", "float64", True)
    for fns in (NB, REF):
        U = a["U"].copy()
        fns.dense_chains_forward(U, None, a["W"], a["b"], np.zeros((0, 2), np.int64), 2, 1, 0.3, 1)
        fns.dense_chains_forward(U, None, a["W"], a["b"], np.array([[0, 0], [99, 0]]), 2, 1, 0.3, 1)
        np.testing.assert_array_equal(U, a["U"])
        out = fns.dense_points_forward(U, None, a["R"].copy(), a["W"], a["b"], np.zeros(0, int),
                                       np.zeros(0, int), 2, 1, 0.3, 1, 0)
        assert isinstance(out, float) and out == 0.0


def _bad_cases():
    a = _case("dense", "float64", True)
    U, G, W, b, R = a["U"], a["G"], a["W"], a["b"], a["R"]
    fwd, pts = "dense_chains_forward", "dense_points_forward"
    adj = "dense_chains_adjoint"
    ch = np.array([[1, 3]])
    return [
        (fwd, (U.astype(np.float32), None, W, b, ch, 2, 1, 0.3, 1), TypeError, "float32"),
        (fwd, (U[:, :, :5].copy(), None, W, b, ch, 2, 1, 0.3, 1), ValueError, r"W has shape"),
        (fwd, (U[..., None], None, W, b, ch, 2, 1, 0.3, 1), ValueError, r"U has shape"),
        (fwd, (U, G[:5], W, b, ch, 2, 1, 0.3, 1), ValueError, r"G has shape \(5, 4, 6\)"),
        (fwd, (U, None, W, b[:3], ch, 2, 1, 0.3, 1), ValueError, r"b has shape \(3, 6\)"),
        (fwd, (U, None, W, b, ch, 2, 1, 0.3, 7), ValueError, "act=7"),
        (fwd, (list(U), None, W, b, ch, 2, 1, 0.3, 1), TypeError, "U must be a NumPy array"),
        (fwd, (U, None, W, b, [[0, 2]], 2, 1, 0.3, 1), ValueError, r"chains\[0\] = \[0, 2\]"),
        (fwd, (U, None, W, b, [[1, 2], [10, 3]], 2, 1, 0.3, 1), ValueError,
         r"chains\[1\] = \[10, 3\]"),
        (fwd, (U, None, W, b, [[1, -1]], 2, 1, 0.3, 1), ValueError, "negative length"),
        (fwd, (U, None, W, b, [[1, 2], [3, 2]], 2, 1, 0.3, 1), ValueError, r"\[3, 2\] overlaps"),
        (fwd, (U, None, W, b, [[1.0, 2.0]], 2, 1, 0.3, 1), TypeError, "chains must be an integer"),
        (fwd, (U, None, W, b, [1, 2], 2, 1, 0.3, 1), ValueError, r"chains has shape \(2,\)"),
        (fwd, (U, None, W, b, ch, 14, 1, 0.3, 1), ValueError, "slot 3 uses layer 17"),
        (fwd, (U, None, W, b, ch, 2, -1, 0.3, 1), ValueError, "slot 3 uses layer -1"),
        (fwd, (U, None, W, b, ch, 2.0, 1, 0.3, 1), TypeError, "layer0 must be an integer"),
        (fwd, (U, None, W, b, ch, 2, 1, np.ones(2), 1), TypeError, "h must be a real scalar"),
        (fwd, (U[:, ::2], None, W, b, ch, 2, 1, 0.3, 1), ValueError, "U must be C-contiguous"),
        (adj, (U, None, W, a["D"], D0, ch, 1, 1, 0.3), ValueError,
         r"slot 1 uses layer 2 .*d0=3\.\.13"),
        (adj, (U, None, W, a["D"], D0, [[9, 3]], 3, 1, 0.3), ValueError,
         r"slot 11 uses layer 14 .*d0=3\.\.13"),
        (adj, (U, None, W, a["D"][:, :2], D0, ch, 2, 1, 0.3), ValueError, r"D has shape"),
        (pts, (U, None, U[:2], W, b, [1, 2], [0, 1], 2, 1, 0.3, 1, 0), ValueError,
         "R shares memory with U"),
        (pts, (U, None, R, W, b, [1, 12], [0, 1], 2, 1, 0.3, 1, 0), ValueError,
         r"slots\[1\] = 12"),
        (pts, (U, None, R, W, b, [1, 2], [0, 5], 2, 1, 0.3, 1, 0), ValueError,
         r"out_slots\[1\] = 5"),
        (pts, (U, None, R, W, b, [1, 2], [3, 3], 2, 1, 0.3, 1, 0), ValueError, "repeats"),
        (pts, (U, None, R, W, b, [1, 2], [0], 2, 1, 0.3, 1, 0), ValueError, "out_slots has shape"),
        (pts, (U, None, R, W, b, [1, 2], [0, 1], 2, 1, 0.3, 1, 3), ValueError, "mode 3"),
    ]


@pytest.mark.parametrize("bk", [NB, REF], ids=["numba", "numpy"])
def test_bad_arguments_name_the_value(bk):
    for name, args, exc, match in _bad_cases():
        with pytest.raises(exc, match=match):
            getattr(bk, name)(*args)


def test_conv_shapes_checked():
    a = _case("conv", "float32", False)
    with pytest.raises(ValueError, match=r"W has shape \(16, 3, 3\)"):
        NB.conv_chains_forward(a["U"], None, a["W"][..., 0, 0], a["b"], CHAINS, 2, 1, 0.3, 1)


_THREADED = textwrap.dedent("""
    import numba, numpy as np
    from mgnn.backend import numba_cpu as nb
    from tests.backend.test_stacked_kernels import CASES, _call, _case
    assert numba.get_num_threads() == 2
    for kind in ("dense", "conv"):
        for dtype in ("float32", "float64"):
            a = _case(kind, dtype, True)
            for op, act, mode in CASES:
                serial = {k: (lambda f: lambda *x: f(*x, parallel=False))(getattr(nb, k))
                          for k in dir(nb) if "_chains_" in k or "_points_" in k}
                par, ser = _call(nb, kind, op, a, -1, act, mode), _call(serial, kind, op, a, -1,
                                                                        act, mode)
                for p, s in zip(par, ser):
                    assert (p is None and s is None) or np.array_equal(p, s), (kind, dtype, op)
    used = [d for d in ("_dense_fwd_par", "_dense_adj_par", "_conv_fwd_par", "_conv_adj_par")
            if len(getattr(nb, d).signatures) == 2]  # float32, float64: one specialisation each
    assert len(used) == 4, used
    print("OK")
""")


def test_threads_bit_equal_to_serial():
    """With 2 Numba threads and several chains / points the prange variant runs; it equals the
    serial variant bit for bit (the chain bodies are the same code; norms summed in order)."""
    env = dict(os.environ, NUMBA_NUM_THREADS="2", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", _THREADED], env=env, cwd=root, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout + res.stderr


def test_index_check_twins_agree():
    """The numba wrapper's compiled bounds check gives the numpy one's verdicts."""
    from mgnn.backend.numba_cpu import _index_check
    from mgnn.backend.numpy_ref import index_check
    rng = np.random.default_rng(5)
    codes = set()
    for _ in range(400):
        n = int(rng.integers(0, 5))
        if rng.random() < 0.5:
            idx, outs = np.stack([rng.integers(-1, 12, n), rng.integers(-1, 4, n)], 1), \
                np.zeros(0, np.int64)
        else:
            idx, outs = rng.integers(-1, 13, (n, 1)), rng.integers(-1, 6, n)
        got, want = _index_check(idx, outs, 12, 5), index_check(idx, outs, 12, 5)
        assert got[:2] == want[:2], (idx, outs, got, want)
        assert got[0] or (got[2] > got[3]) == (want[2] > want[3])
        assert got[0] or got[2] > got[3] or got[2:] == want[2:]
        codes.add(want[0])
    assert codes == {0, 1, 2, 3, 4, 5, 6}
