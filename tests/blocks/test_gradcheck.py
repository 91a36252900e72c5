"""Every layer kind's vjp against central differences and the dot-product identity (float64)."""
import numpy as np
import pytest

import mgnn
from mgnn.backend import get_backend
from mgnn.blocks import (ConvOpening, ConvStep, DenseClosing, DenseOpening, DenseStep, PoolClosing,
                         SoftmaxCrossEntropy, gradcheck)
from mgnn.errors import GradcheckError

BACKENDS = ["numpy", "numba"]


def _p(rng, shapes):
    return {k: rng.standard_normal(s) * 0.7 for k, s in shapes.items()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", ["tanh", "relu"])
@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_step_kinds(backend, activation, kind, rng):
    bk = get_backend(backend)
    step = DenseStep(4, activation) if kind == "dense" else ConvStep(2, (4, 3), activation)
    inputs = _p(rng, step.param_shapes())
    inputs["u"] = rng.standard_normal(step.state_shape(3))
    h = 0.3

    def fwd(a):
        return step.forward(a["weight"], a["bias"], a["u"], h, bk)

    def vjp(a, g):
        gu, gW, gb = step.vjp(a["weight"], a["bias"], a["u"], h, g, bk)
        assert np.allclose(gu, step.vjp_state(a["weight"], a["bias"], a["u"], h, g, bk))
        d = step.deriv(a["weight"], a["bias"], a["u"], bk)
        gW2, gb2 = step.vjp_params(a["u"], h, g, d, bk)
        assert np.allclose(gW, gW2) and np.allclose(gb, gb2)
        return {"u": gu, "weight": gW, "bias": gb}

    res = gradcheck(fwd, vjp, inputs)
    assert res.ok and set(res.max_rel_error) == {"u", "weight", "bias"}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layer", ["dense_open", "conv_open", "dense_close", "pool1", "pool2"])
def test_opening_and_closing_kinds(backend, layer, rng):
    bk = get_backend(backend)
    if layer == "dense_open":
        kind, x = DenseOpening(5, 4, "tanh"), rng.standard_normal((3, 5))
    elif layer == "conv_open":
        kind, x = ConvOpening(1, 3, (4, 4), "relu"), rng.standard_normal((2, 1, 4, 4))
    elif layer == "dense_close":
        kind, x = DenseClosing(4, 3), rng.standard_normal((3, 4))
    else:
        p = 1 if layer == "pool1" else 2
        kind, x = PoolClosing(2, (4, 4), 3, pool=p), rng.standard_normal((2, 2, 4, 4))
    inputs = _p(rng, kind.param_shapes())
    inputs["x"] = x

    def fwd(a):
        return kind.forward(a, a["x"], bk)[0]

    def vjp(a, g):
        _, cache = kind.forward(a, a["x"], bk)
        gx, gp = kind.vjp(a, a["x"], cache, g, bk)
        return {"x": gx, **gp}

    assert gradcheck(fwd, vjp, inputs).ok


@pytest.mark.parametrize("backend", BACKENDS)
def test_softmax_cross_entropy(backend, rng):
    bk = get_backend(backend)
    loss = SoftmaxCrossEntropy()
    y = rng.integers(0, 5, 4)
    res = gradcheck(lambda a: loss.forward_grad(a["z"], y, bk)[0],
                    lambda a, g: {"z": g * loss.forward_grad(a["z"], y, bk)[1]},
                    {"z": rng.standard_normal((4, 5)) * 3})
    assert res.ok


def test_gradcheck_detects_a_wrong_vjp(rng):
    """A vjp off by a factor 1.001 in one input must be reported, entrywise and by the identity."""
    A = rng.standard_normal((3, 4))

    def fwd(a):
        return np.tanh(a["x"] @ A.T)

    def bad_vjp(a, g):
        gx = (g * (1 - np.tanh(a["x"] @ A.T) ** 2)) @ A
        gx[0, 0] *= 1.001
        return {"x": gx}

    with pytest.raises(GradcheckError, match=r"x\[\(0, 0\)\]"):
        gradcheck(fwd, bad_vjp, {"x": rng.standard_normal((2, 4))})
    res = gradcheck(fwd, bad_vjp, {"x": rng.standard_normal((2, 4))}, raise_on_fail=False)
    assert not res.ok and res.failures


def test_gradcheck_rejects_float32_and_missing_gradients(rng):
    with pytest.raises(TypeError, match="float64"):
        gradcheck(lambda a: a["x"], lambda a, g: {"x": g}, {"x": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="'y'"):
        gradcheck(lambda a: a["x"] * a["y"], lambda a, g: {"x": g * a["y"]},
                  {"x": np.ones(3), "y": np.ones(3)})


def _network_gradcheck(model, x, y, backend):
    lp = mgnn.LayerParallel(model, backend=backend)
    p0 = model.params.flat.copy()

    def fwd(a):
        model.params.flat[:] = a["p"]
        return lp.loss_and_grad(x, y)[0]

    def vjp(a, g):
        model.params.flat[:] = a["p"]
        return {"p": g * lp.loss_and_grad(x, y)[1].flat}

    res = gradcheck(fwd, vjp, {"p": p0}, max_entries=200)
    model.params.flat[:] = p0
    return res


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_whole_dense_network(backend, activation, rng):
    model = mgnn.dense_resnet(6, 5, 3, n_layers=7, t_final=2.0, activation=activation, seed=3)
    res = _network_gradcheck(model, rng.standard_normal((4, 6)), rng.integers(0, 3, 4), backend)
    assert res.ok and res.max_rel_error["p"] < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pool", [1, 2])
def test_whole_conv_network(backend, pool, rng):
    model = mgnn.conv_resnet(1, 2, (4, 4), 3, n_layers=3, seed=4, pool=pool)
    res = _network_gradcheck(model, rng.standard_normal((2, 1, 4, 4)), rng.integers(0, 3, 2),
                             backend)
    assert res.ok and res.max_rel_error["p"] < 1e-6
