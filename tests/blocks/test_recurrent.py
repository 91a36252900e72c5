"""Recurrent sequence models (GRU, implicit GRU, tanh RNN) as time steppers: PyTorch's
reference, backpropagation through time, MGRIT over sequence time, gradchecks, bad input."""
import os

import numpy as np
import pytest

import mgnn
from mgnn import MGRITOptions, gradcheck
from mgnn.backend import available_backends
from tests.conftest import SHARED

TORCH = os.path.join(SHARED, "reference", "torch")
BACKENDS = [b for b in ("numpy", "numba", "cuda-emulated") if b in available_backends()]
CONVERGED = MGRITOptions(cf=2, max_levels=3, tol=1e-13, max_iter=40)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case, make", [("gru_2layer", mgnn.gru_classifier),
                                        ("rnn_2layer", mgnn.rnn_classifier)])
@pytest.mark.parametrize("mgrit", [False, True])
def test_pytorch_reference_reproduced(backend, case, make, mgrit):
    path = os.path.join(TORCH, case + ".npz")
    if not os.path.exists(path):
        pytest.skip("../shared/reference/torch not present")
    ref = np.load(path)
    model = make(3, 5, 3, 10, n_layers=2)
    assert sorted(model.params) == sorted(k[6:] for k in ref.files if k.startswith("param/"))
    for k in model.params:
        model.params[k][...] = ref["param/" + k]
    opts = CONVERGED if mgrit else None
    lp = mgnn.LayerParallel(model, fwd=opts, bwd=opts, backend=backend)
    loss, grads = lp.loss_and_grad(ref["x"], ref["y"])
    assert abs(loss - float(ref["loss"])) <= 1e-10 * float(ref["loss"])
    for k in grads:
        np.testing.assert_allclose(grads[k], ref["grad/" + k], rtol=1e-10,
                                   atol=1e-13 * np.abs(ref["grad/" + k]).max(), err_msg=k)
    if mgrit:
        assert lp.stats["forward"]["converged"] and lp.stats["adjoint"]["converged"]


def _models():
    return [mgnn.gru_classifier(3, 4, 3, 9, n_layers=2, seed=2, coarse="rediscretise"),
            mgnn.gru_classifier(3, 4, 3, 9, cell="implicit_gru", coarse="implicit", seed=2),
            mgnn.gru_classifier(3, 4, 3, 9, n_layers=2, coarse="implicit", seed=2),
            mgnn.rnn_classifier(3, 4, 3, 9, n_layers=2, seed=2)]


@pytest.mark.parametrize("index", range(4))
def test_numba_serial_equals_numpy_bptt_and_converged_mgrit_equals_it(index):
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((5, 9, 3)), rng.integers(0, 3, 5)
    model = _models()[index]
    l0, g0 = mgnn.LayerParallel(model, backend="numpy").loss_and_grad(x, y)
    g0 = g0.copy()
    l1, g1 = mgnn.LayerParallel(model, backend="numba").loss_and_grad(x, y)
    assert abs(l1 - l0) <= 1e-12 * l0
    np.testing.assert_allclose(g1.flat, g0.flat, rtol=1e-12, atol=1e-14)
    lp = mgnn.LayerParallel(model, fwd=CONVERGED, bwd=CONVERGED, backend="numba")
    l2, g2 = lp.loss_and_grad(x, y)
    assert lp.stats["forward"]["iterations"] >= 2
    assert abs(l2 - l0) <= 1e-10 * l0
    np.testing.assert_allclose(g2.flat, g0.flat, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("index", range(4))
def test_whole_sequence_model_gradcheck(index):
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((3, 9, 3)), rng.integers(0, 3, 3)
    model = _models()[index]
    lp = mgnn.LayerParallel(model, backend="numpy")

    def loss_at(a):
        for k in model.params:
            model.params[k][...] = a[k]
        return lp.loss_and_grad(x, y)

    res = gradcheck(lambda a: np.array(loss_at(a)[0]),
                    lambda a, g: {k: g * v.copy() for k, v in loss_at(a)[1].items()},
                    {k: v.copy() for k, v in model.params.items()}, max_entries=16)
    assert res.ok


def test_coarse_propagators_differ_only_on_coarse_levels():
    """The fine level is the same network whatever the coarse propagator: serial results are
    identical; a one-cycle MGRIT solve is not (the coarse operators differ)."""
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((4, 16, 3)), rng.integers(0, 3, 4)
    a = mgnn.gru_classifier(3, 4, 3, 16, seed=6, coarse="rediscretise")
    b = mgnn.gru_classifier(3, 4, 3, 16, seed=6, coarse="implicit")
    assert mgnn.LayerParallel(a).loss_and_grad(x, y)[0] == \
        mgnn.LayerParallel(b).loss_and_grad(x, y)[0]
    two = MGRITOptions(cf=2, max_levels=3, nrelax=0, tol=0.0, max_iter=1)
    ra = mgnn.LayerParallel(a, fwd=two, bwd=two).loss_and_grad(x, y)[0]
    rb = mgnn.LayerParallel(b, fwd=two, bwd=two).loss_and_grad(x, y)[0]
    assert ra != rb


def test_parameter_names_and_shapes_follow_pytorch():
    m = mgnn.gru_classifier(6, 8, 4, 12, n_layers=2)
    assert list(m.params) == [
        "gru.weight_ih_l0", "gru.weight_hh_l0", "gru.bias_ih_l0", "gru.bias_hh_l0",
        "gru.weight_ih_l1", "gru.weight_hh_l1", "gru.bias_ih_l1", "gru.bias_hh_l1",
        "closing.weight", "closing.bias"]
    assert m.params["gru.weight_ih_l0"].shape == (24, 6)
    assert m.params["gru.weight_ih_l1"].shape == (24, 8)
    assert np.abs(m.params["gru.weight_hh_l1"]).max() <= 1 / np.sqrt(8)
    assert m.n_layers == 12 and m.input_shape() == (12, 6)
    r = mgnn.rnn_classifier(6, 8, 4, 12)
    assert r.params["rnn.weight_hh_l0"].shape == (8, 8)


def test_bad_input():
    with pytest.raises(ValueError, match="seq_len must be >= 2"):
        mgnn.gru_classifier(3, 4, 3, 1)
    with pytest.raises(ValueError, match="hidden must be >= 1"):
        mgnn.gru_classifier(3, 0, 3, 8)
    with pytest.raises(ValueError, match="cell must be"):
        mgnn.gru_classifier(3, 4, 3, 8, cell="lstm")
    with pytest.raises(ValueError, match="coarse must be"):
        mgnn.gru_classifier(3, 4, 3, 8, coarse="spectral")
    lp = mgnn.LayerParallel(mgnn.gru_classifier(3, 4, 3, 8))
    y = np.zeros(2, dtype=np.int64)
    with pytest.raises(ValueError, match=r"x has shape \(2, 8\), expected \(B,\) \+ \(8, 3\)"):
        lp.loss_and_grad(np.zeros((2, 8)), y)
    with pytest.raises(ValueError, match=r"expected \(B,\) \+ \(8, 3\)"):
        lp.loss_and_grad(np.zeros((2, 7, 3)), y)


def test_coarse_study_converges_and_implicit_is_faster_at_cf4():
    from mgnn.studies.bench import bench_gru_coarse, format_gru_coarse
    rows = bench_gru_coarse(seq_lens=(64,), cfs=(4,), hidden=8, batch=4, cycles=4)
    by = {r["coarse"]: r for r in rows}
    for r in rows:
        for part in ("forward", "adjoint"):
            res = r[part]
            assert len(res) == 4 and all(b < a for a, b in zip(res, res[1:]))
    assert by["implicit"]["forward"][-1] < by["rediscretise"]["forward"][-1]
    assert "| 64 | 4 | implicit |" in format_gru_coarse(rows)


def test_a_layer_rank_projects_the_inputs_of_its_own_steps_only():
    """ctx.steps = (lo, hi) (LayerParallel sets a layer rank's block): the input projection
    holds those rows as the whole sequence's would, the others NaN (a step outside would show);
    None: every step."""
    from mgnn import gru_classifier
    from mgnn.blocks.composed import StepContext
    model = gru_classifier(3, 4, 2, 10, dtype="float64", seed=0)
    P = model.step_params()
    x = np.random.default_rng(0).standard_normal((5, 10, 3))
    full, part = StepContext(buffers={}), StepContext(buffers={})
    full.begin(x)
    part.begin(x)
    part.steps = (3, 7)
    whole = model.step._input_projection(P, full)
    mine = model.step._input_projection(P, part)
    assert mine.shape == whole.shape == (5, 10, 12)
    np.testing.assert_array_equal(mine[:, 3:7], whole[:, 3:7])
    assert np.isnan(mine[:, :3]).all() and np.isnan(mine[:, 7:]).all()
    assert np.isfinite(whole).all()
