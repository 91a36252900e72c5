"""Composed residual steps: batch norm and dropout blocks, their vjps, PyTorch's reference,
MGRIT exactness and running statistics."""
import os

import numpy as np
import pytest

import mgnn
from mgnn import MGRITOptions, gradcheck
from mgnn.backend import available_backends, get_backend
from mgnn.blocks.composed import (Activation, Affine, BatchNorm, ComposedStep, Dropout,
                                  StepContext)
from tests.conftest import SHARED

REF = os.path.join(SHARED, "reference", "torch", "bn_conv_resnet.npz")
BACKENDS = [b for b in ("numpy", "numba", "cuda-emulated") if b in available_backends()]


def _load_reference(model, ref):
    for k in model.params:
        model.params[k][...] = ref["param/" + k]


@pytest.mark.skipif(not os.path.exists(REF), reason="../shared/reference/torch not present")
@pytest.mark.parametrize("backend", BACKENDS)
def test_pytorch_bn_conv_resnet_reproduced(backend):
    ref = np.load(REF)
    model = mgnn.conv_resnet(2, 3, (4, 5), 3, 4, activation="tanh", batch_norm=True)
    _load_reference(model, ref)
    lp = mgnn.LayerParallel(model, backend=backend)
    loss, grads = lp.loss_and_grad(ref["x"], ref["y"])
    assert abs(loss - float(ref["loss"])) <= 1e-10 * abs(float(ref["loss"]))
    for k in grads:  # steps.bias: zero up to round-off (BN removes a per-channel shift)
        np.testing.assert_allclose(grads[k], ref["grad/" + k], rtol=1e-10, atol=1e-14,
                                   err_msg=k)
    np.testing.assert_allclose(model.buffers["steps.running_mean"], ref["running_mean"],
                               rtol=1e-10, atol=1e-15)
    np.testing.assert_allclose(model.buffers["steps.running_var"], ref["running_var"],
                               rtol=1e-10)
    np.testing.assert_allclose(lp.logits(ref["x"]), ref["eval_logits"], rtol=1e-10, atol=1e-15)
    assert model.train_steps == 1 and model.training


# ------------------------------------------------------------------------------ block gradchecks
def _block_check(block, x, theta, ctx, bk, n=0):
    names = list(theta)

    def forward(a):
        return block.forward({k: a[k] for k in names}, a["x"], n, ctx, bk)[0]

    def vjp(a, g):
        th = {k: a[k] for k in names}
        _, cache = block.forward(th, a["x"], n, ctx, bk)
        grads = {k: np.zeros_like(v) for k, v in th.items()}
        gx = block.vjp(th, cache, g, n, ctx, bk, grads, 1.0)
        return dict(grads, x=gx)

    return gradcheck(forward, vjp, dict(theta, x=x))


@pytest.mark.parametrize("shape", [(5, 3), (3, 2, 4, 3), (1, 2, 3, 3)])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_block_gradcheck(shape, training):
    rng = np.random.default_rng(1)
    C = shape[1]
    bn = BatchNorm(C)
    buffers = {"running_mean": rng.standard_normal((2, C)),
               "running_var": rng.uniform(0.5, 2, (2, C))}
    ctx = StepContext(training=training, buffers=buffers)
    theta = {"bn_weight": rng.uniform(0.5, 1.5, C), "bn_bias": rng.standard_normal(C)}
    res = _block_check(bn, 2 + rng.standard_normal(shape), theta, ctx, get_backend("numpy"), n=1)
    assert res.ok


@pytest.mark.parametrize("conv", [False, True])
@pytest.mark.parametrize("name", ["tanh", "relu"])
def test_affine_and_activation_blocks_gradcheck(conv, name):
    rng = np.random.default_rng(2)
    bk, ctx = get_backend("numba"), StepContext()
    shape, wshape = ((2, 3, 4, 4), (3, 3, 3, 3)) if conv else ((4, 3), (3, 3))
    theta = {"weight": rng.standard_normal(wshape), "bias": rng.standard_normal(3)}
    assert _block_check(Affine(conv), rng.standard_normal(shape), theta, ctx, bk).ok
    x = rng.standard_normal(shape)
    x[np.abs(x) < 1e-3] = 0.5  # relu's kink away from the finite differences
    assert _block_check(Activation(name), x, {}, ctx, bk).ok


def test_dropout_block_gradcheck_and_modes():
    rng = np.random.default_rng(3)
    bk = get_backend("numpy")
    drop = Dropout(0.4)
    x = rng.standard_normal((6, 2, 3, 3))
    ctx = StepContext(step=5, seed=11)
    assert _block_check(drop, x, {}, ctx, bk, n=2).ok  # the mask is fixed by (seed, t, n, s, e)
    y, m = drop.forward({}, x, 2, ctx, bk)
    kept = m != 0
    assert 0 < kept.mean() < 1
    np.testing.assert_array_equal(y[kept], x[kept] / 0.6)
    np.testing.assert_array_equal(drop.forward({}, x, 2, ctx, bk)[0], y)  # same evaluation, mask
    ctx.step = 6
    assert not np.array_equal(drop.forward({}, x, 2, ctx, bk)[0], y)  # next training step
    ctx.step = 5
    assert not np.array_equal(drop.forward({}, x, 3, ctx, bk)[0], y)  # another layer
    ctx.training = False
    np.testing.assert_array_equal(drop.forward({}, x, 2, ctx, bk)[0], x)


def test_dropout_masks_follow_the_global_sample():
    bk = get_backend("numpy")
    drop = Dropout(0.5)
    x = np.ones((8, 12))
    whole = drop.forward({}, x, 4, StepContext(step=3, seed=7), bk)[0]
    part = drop.forward({}, x[5:], 4, StepContext(step=3, seed=7, sample0=5), bk)[0]
    np.testing.assert_array_equal(part, whole[5:])


# ------------------------------------------------------------------------- whole-network checks
def _net_gradcheck(model, x, y, backend="numpy"):
    lp = mgnn.LayerParallel(model, backend=backend)
    names = list(model.params)

    def loss_at(a):
        for k in names:
            model.params[k][...] = a[k]
        model.train_steps = 0  # the same dropout masks at every evaluation
        return lp.loss_and_grad(x, y)

    def forward(a):
        return np.array(loss_at(a)[0])

    def vjp(a, g):
        return {k: g * v.copy() for k, v in loss_at(a)[1].items()}

    return gradcheck(forward, vjp, {k: v.copy() for k, v in model.params.items()},
                     max_entries=24)


@pytest.mark.parametrize("kind", ["dense", "conv"])
@pytest.mark.parametrize("extra", [dict(batch_norm=True), dict(dropout=0.3),
                                   dict(batch_norm=True, dropout=0.2)])
def test_whole_network_gradcheck(kind, extra):
    rng = np.random.default_rng(4)
    if kind == "dense":
        model = mgnn.dense_resnet(4, 3, 3, 3, seed=1, **extra)
        x = rng.standard_normal((5, 4))
    else:
        model = mgnn.conv_resnet(1, 2, (3, 4), 3, 3, seed=1, **extra)
        x = rng.standard_normal((3, 1, 3, 4))
    assert isinstance(model.step, ComposedStep)
    assert _net_gradcheck(model, x, rng.integers(0, 3, x.shape[0])).ok


def _pair(extra, seed=1):
    return [mgnn.conv_resnet(2, 3, (5, 4), 3, 16, seed=seed, **extra) for _ in range(2)]


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("extra", [dict(batch_norm=True), dict(dropout=0.3),
                                   dict(batch_norm=True, dropout=0.2)])
def test_converged_mgrit_equals_serial_and_running_stats_from_final_states(backend, extra):
    """Running statistics after one step equal the serial forward states' ones: they would
    differ if every relaxation (about 60 layer evaluations each here) updated them."""
    rng = np.random.default_rng(6)
    x, y = rng.standard_normal((6, 2, 5, 4)), rng.integers(0, 3, 6)
    serial_model, mgrit_model = _pair(extra)
    l0, g0 = mgnn.LayerParallel(serial_model, backend=backend).loss_and_grad(x, y)
    opts = MGRITOptions(cf=2, max_levels=3, tol=1e-13, max_iter=40)
    lp = mgnn.LayerParallel(mgrit_model, fwd=opts, bwd=opts, backend=backend)
    l1, g1 = lp.loss_and_grad(x, y)
    assert lp.stats["forward"]["iterations"] >= 2 and lp.stats["forward"]["converged"]
    assert abs(l1 - l0) <= 1e-10 * abs(l0)
    np.testing.assert_allclose(g1.flat, g0.flat, rtol=1e-10, atol=1e-12 * np.abs(g0.flat).max())
    np.testing.assert_allclose(mgrit_model.buffers.flat, serial_model.buffers.flat, rtol=1e-10)
    if extra.get("batch_norm"):  # not the initial statistics: one momentum update happened
        assert not np.allclose(mgrit_model.buffers["steps.running_var"], 1.0)


def test_running_stats_from_an_inexact_solve_are_its_final_iterates():
    """One MGRIT cycle: the statistics are those of the solve's final states (checked against
    batch statistics recomputed from the warm-start states), updated once."""
    rng = np.random.default_rng(7)
    x, y = rng.standard_normal((6, 2, 5, 4)), rng.integers(0, 3, 6)
    model = _pair(dict(batch_norm=True))[0]
    opts = MGRITOptions(cf=2, max_levels=3, tol=0.0, max_iter=1)
    lp = mgnn.LayerParallel(model, fwd=opts, bwd=opts, backend="numpy", warm_start=True)
    lp.loss_and_grad(x, y)
    states = lp._previous_states[0]
    steps, bk = model.group("steps"), get_backend("numpy")
    for n in range(model.n_layers):
        z = bk.conv_forward(states[n], steps["weight"][n], steps["bias"][n], 1.0, 2, False)
        mean, var = z.mean(axis=(0, 2, 3)), z.var(axis=(0, 2, 3), ddof=1)
        np.testing.assert_allclose(model.buffers["steps.running_mean"][n], 0.1 * mean,
                                   rtol=1e-12, atol=1e-16)
        np.testing.assert_allclose(model.buffers["steps.running_var"][n], 0.9 + 0.1 * var,
                                   rtol=1e-12)


def test_eval_mode_and_step_counter():
    rng = np.random.default_rng(8)
    x, y = rng.standard_normal((4, 5)), rng.integers(0, 3, 4)
    plain = mgnn.dense_resnet(5, 4, 3, 6, seed=3)
    drop = mgnn.dense_resnet(5, 4, 3, 6, seed=3, dropout=0.5)
    np.testing.assert_array_equal(drop.params.flat, plain.params.flat)  # same draws
    lp, lp0 = mgnn.LayerParallel(drop, backend="numba"), mgnn.LayerParallel(plain)
    np.testing.assert_allclose(lp.logits(x), lp0.logits(x), rtol=1e-14)  # eval: no dropout
    l1 = lp.loss_and_grad(x, y)[0]
    l2 = lp.loss_and_grad(x, y)[0]
    assert drop.train_steps == 2 and l1 != l2  # new masks each training step
    drop.eval()
    assert not drop.training
    assert lp.loss_and_grad(x, y)[0] == pytest.approx(lp0.loss_and_grad(x, y)[0], rel=1e-14)
    assert drop.train_steps == 2  # eval-mode calls are not training steps
    assert drop.train() is drop and drop.training


def test_fused_kinds_unchanged_without_bn_or_dropout():
    from mgnn.blocks import ConvStep, DenseStep
    assert isinstance(mgnn.conv_resnet(1, 2, (4, 4), 3, 4).step, ConvStep)
    assert isinstance(mgnn.dense_resnet(3, 2, 3, 4, dropout=0.0).step, DenseStep)
    m = mgnn.conv_resnet(1, 2, (4, 4), 3, 4, batch_norm=True)
    assert m.params["steps.bn_weight"].shape == (4, 2) and np.all(m.params["steps.bn_weight"] == 1)
    assert np.all(m.params["steps.bn_bias"] == 0)
    assert set(m.buffers) == {"steps.running_mean", "steps.running_var"}
    assert np.all(m.buffers["steps.running_var"] == 1)
    assert len(mgnn.conv_resnet(1, 2, (4, 4), 3, 4).buffers) == 0


def test_bad_input():
    with pytest.raises(ValueError, match="dropout must be in"):
        mgnn.dense_resnet(3, 2, 3, 4, dropout=1.0)
    with pytest.raises(ValueError, match="dropout must be in"):
        mgnn.conv_resnet(1, 2, (4, 4), 3, 4, dropout=-0.1)
    with pytest.raises(TypeError, match="dropout"):
        mgnn.dense_resnet(3, 2, 3, 4, dropout=True)
    with pytest.raises(TypeError, match="batch_norm"):
        mgnn.dense_resnet(3, 2, 3, 4, batch_norm=1)
    with pytest.raises(ValueError, match="eps"):
        mgnn.dense_resnet(3, 2, 3, 4, batch_norm=True, bn_eps=0.0)
    model = mgnn.dense_resnet(3, 2, 3, 4, batch_norm=True)
    lp = mgnn.LayerParallel(model, backend="numpy")
    x, y = np.ones((1, 3)), np.zeros(1, dtype=np.int64)
    with pytest.raises(ValueError, match=r"batch norm of layer 0 .*more than one value"):
        lp.loss_and_grad(x, y)
    assert model.train_steps == 0
    model.eval()
    lp.loss_and_grad(x, y)  # eval mode: running statistics, any batch
    conv = mgnn.conv_resnet(1, 2, (3, 3), 3, 2, batch_norm=True)  # B = 1, 9 values a channel
    mgnn.LayerParallel(conv).loss_and_grad(np.ones((1, 1, 3, 3)), np.zeros(1, dtype=np.int64))
    with pytest.raises(TypeError, match="sync_bn"):
        mgnn.LayerParallel(model, sync_bn="yes")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(6, 3), (3, 2, 5, 4)])
@pytest.mark.parametrize("act", ["tanh", "relu"])
def test_fused_bn_activation_equals_the_composed_blocks(backend, shape, act):
    """The fast path (BN + activation in the backend's BN kernels) against the reference
    composition of the BatchNorm and Activation blocks, forward, vjp, parameter gradients and
    running statistics, in train and eval mode."""
    from mgnn.blocks.composed import BatchNormAct
    rng = np.random.default_rng(9)
    C = shape[1]
    bk, ref = get_backend(backend), get_backend("numpy")
    fused, bn, activation = BatchNormAct(C, act), BatchNorm(C), Activation(act)
    theta = {"bn_weight": rng.uniform(0.5, 1.5, C), "bn_bias": rng.standard_normal(C)}
    x, ga = rng.standard_normal(shape) + 1.0, rng.standard_normal(shape)
    for training in (True, False):
        bufs = {"running_mean": rng.standard_normal((3, C)),
                "running_var": rng.uniform(0.5, 2, (3, C))}
        ctx = StepContext(training=training, buffers=bufs)
        a, cache = fused.forward(theta, x, 2, ctx, bk)
        y, c_bn = bn.forward(theta, x, 2, ctx, ref)
        a_ref, c_act = activation.forward(theta, y, 2, ctx, ref)
        np.testing.assert_allclose(a, a_ref, rtol=1e-12, atol=1e-14)
        g_fused = {k: np.zeros(C) for k in theta}
        g_ref = {k: np.zeros(C) for k in theta}
        gx = fused.vjp(theta, cache, ga, 2, ctx, bk, g_fused, 0.5)
        gx_ref = bn.vjp(theta, c_bn, activation.vjp(theta, c_act, ga, 2, ctx, ref), 2, ctx, ref,
                        g_ref, 0.5)
        np.testing.assert_allclose(gx, gx_ref, rtol=1e-11, atol=1e-13)
        for k in theta:
            np.testing.assert_allclose(g_fused[k], g_ref[k], rtol=1e-12, atol=1e-13)
        if training:
            b2 = {k: v.copy() for k, v in bufs.items()}
            fused.commit(bufs, 2, cache)
            bn.commit(b2, 2, c_bn)
            for k in bufs:
                np.testing.assert_allclose(bufs[k], b2[k], rtol=1e-13)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_masks_identical_on_every_backend(backend):
    """StepContext.mask goes through the backend's dropout_mask kernel: the same bits as the
    numpy reference (numba; the CUDA C kernel under host emulation)."""
    ctx = StepContext(step=2**31 + 5, sample0=3, seed=2**40 + 1)
    ref = ctx.mask(get_backend("numpy"), 7, (5, 3, 4, 4), np.float32, 2**23)
    got = ctx.mask(get_backend(backend), 7, (5, 3, 4, 4), np.float32, 2**23)
    np.testing.assert_array_equal(got, ref)
    assert 0.3 < ref.mean() < 0.7


@pytest.mark.parametrize("training", [True, False])
def test_fused_bn_activation_block_gradcheck(training):
    from mgnn.blocks.composed import BatchNormAct
    rng = np.random.default_rng(10)
    ctx = StepContext(training=training, buffers={"running_mean": rng.standard_normal((1, 3)),
                                                  "running_var": rng.uniform(0.5, 2, (1, 3))})
    theta = {"bn_weight": rng.uniform(0.5, 1.5, 3), "bn_bias": rng.standard_normal(3)}
    assert _block_check(BatchNormAct(3, "tanh"), rng.standard_normal((4, 3, 2, 3)), theta, ctx,
                        get_backend("numba")).ok


def test_sync_bn_without_replicas_is_a_no_op():
    rng = np.random.default_rng(11)
    x, y = rng.standard_normal((5, 4)), rng.integers(0, 3, 5)
    a, b = (mgnn.dense_resnet(4, 3, 3, 4, seed=2, batch_norm=True) for _ in range(2))
    lp = mgnn.LayerParallel(a, sync_bn=True)
    assert lp.ctx.replicas is None  # nothing to synchronise with: no collective per evaluation
    la, ga = lp.loss_and_grad(x, y)
    lb, gb = mgnn.LayerParallel(b).loss_and_grad(x, y)
    assert la == lb and np.array_equal(ga.flat, gb.flat)
    np.testing.assert_array_equal(a.buffers.flat, b.buffers.flat)


def test_cli_trains_with_batch_norm_and_dropout(capsys):
    import json
    from mgnn.__main__ import main
    assert main(["train", "--data", "synthetic", "--model", "conv", "--channels", "3",
                 "--layers", "4", "--levels", "2", "--cf", "2", "--epochs", "1",
                 "--batch-size", "32", "--batch-norm", "--dropout", "0.1", "--sync-bn",
                 "--no-progress", "--json", "--dtype", "float64"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["test_accuracy"] > 0.2 and np.isfinite(summary["final_loss"])
