"""3D conv ResNets (conv_resnet with a (D, H, W) image size): PyTorch's Conv3d reference,
MGRIT with and without spatial coarsening, batch norm, the parameter layout, bad input."""
import os

import numpy as np
import pytest

import mgnn
from mgnn import LayerParallel, MGRITOptions
from mgnn.backend import available_backends
from tests.conftest import SHARED

REF = os.path.join(SHARED, "reference", "torch", "conv3d_resnet.npz")
BACKENDS = [b for b in ("numpy", "numba", "cuda-emulated") if b in available_backends()]


@pytest.mark.skipif(not os.path.exists(REF), reason="../shared/reference/torch not present")
@pytest.mark.parametrize("backend", BACKENDS)
def test_pytorch_conv3d_resnet_reproduced(backend):
    ref = np.load(REF)
    model = mgnn.conv_resnet(1, 2, (3, 4, 5), 3, 3, activation="relu")
    assert model.params["steps.weight"].shape == (3, 2, 2, 3, 3, 3)
    assert model.params["opening.weight"].shape == (2, 1, 3, 3, 3)
    for k in model.params:
        model.params[k][...] = ref["param/" + k]
    loss, grads = LayerParallel(model, backend=backend).loss_and_grad(ref["x"], ref["y"])
    assert abs(loss - float(ref["loss"])) <= 1e-10 * abs(float(ref["loss"]))
    for k in grads:
        np.testing.assert_allclose(grads[k], ref["grad/" + k], rtol=1e-10, atol=1e-15,
                                   err_msg=k)


def _data(shape, batch=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch,) + shape), rng.integers(0, 3, batch)


@pytest.mark.parametrize("size, spatial", [((7, 7, 7), ()), ((7, 7, 7), (0,)),
                                           ((8, 6, 8), (0, 1))])
def test_converged_mgrit_equals_backprop(size, spatial):
    model = mgnn.conv_resnet(1, 2, size, 3, 8, seed=4)
    x, y = _data((1,) + size)
    loss, ref = LayerParallel(model, backend="numba").loss_and_grad(x, y)
    o = MGRITOptions(cf=2, max_levels=3, tol=1e-13, max_iter=40, warn_not_converged=False)
    lp = LayerParallel(model, fwd=o, bwd=o, backend="numba", spatial_levels=spatial)
    l2, g = lp.loss_and_grad(x, y)
    assert lp.stats["forward"]["converged"] and lp.stats["adjoint"]["converged"]
    assert abs(l2 - loss) <= 1e-12 * abs(loss)
    for k in ref:
        np.testing.assert_allclose(g[k], ref[k], rtol=1e-10, atol=1e-13, err_msg=k)


def test_batch_norm_and_pooling_in_3d():
    model = mgnn.conv_resnet(1, 2, (4, 4, 4), 3, 4, batch_norm=True, pool=2, seed=1)
    x, y = _data((1, 4, 4, 4), batch=4)
    numpy_loss, numpy_g = LayerParallel(model, backend="numpy").loss_and_grad(x, y)
    model2 = mgnn.conv_resnet(1, 2, (4, 4, 4), 3, 4, batch_norm=True, pool=2, seed=1)
    loss, g = LayerParallel(model2, backend="numba").loss_and_grad(x, y)
    assert abs(loss - numpy_loss) <= 1e-12 * abs(loss)
    for k in g:
        np.testing.assert_allclose(g[k], numpy_g[k], rtol=1e-9, atol=1e-13, err_msg=k)
    assert model.params["closing.weight"].shape == (3, 2 * 8)
    # gradcheck of the whole network's loss in one random direction (float64)
    model3 = mgnn.conv_resnet(1, 2, (4, 4, 4), 3, 4, batch_norm=True, pool=2, seed=1)
    lp = LayerParallel(model3, backend="numpy")
    flat = model3.params.flat
    d = np.random.default_rng(5).standard_normal(flat.shape)
    _, g0 = lp.loss_and_grad(x, y)
    eps, base = 1e-6, flat.copy()
    flat[...] = base + eps * d
    lp_, _ = lp.loss_and_grad(x, y)
    flat[...] = base - eps * d
    lm_, _ = lp.loss_and_grad(x, y)
    flat[...] = base
    fd = (lp_ - lm_) / (2 * eps)
    assert abs(fd - float(g0.flat @ d)) <= 1e-6 * max(1.0, abs(fd))


def test_bad_3d_input_is_clear():
    model = mgnn.conv_resnet(1, 2, (4, 4, 4), 3, 4)
    lp = LayerParallel(model, backend="numpy")
    with pytest.raises(ValueError, match=r"x"):
        lp.loss_and_grad(np.zeros((2, 1, 4, 4)), np.array([0, 1]))
    with pytest.raises(ValueError, match=r"x"):
        lp.loss_and_grad(np.zeros((2, 1, 4, 4, 5)), np.array([0, 1]))
    with pytest.raises(ValueError, match=r"image_size must be \(H, W\) or \(D, H, W\)"):
        mgnn.conv_resnet(1, 2, (4, 4, 4, 4), 3, 4)
    with pytest.raises(ValueError, match="not divisible by pool=3"):
        mgnn.conv_resnet(1, 2, (4, 6, 6), 3, 4, pool=3)
