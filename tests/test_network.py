"""Models, parameter layout, LayerParallel's serial path and its input validation."""
import numpy as np
import pytest

import mgnn
from mgnn.backend import get_backend


def test_param_names_shapes_and_flat_views():
    m = mgnn.dense_resnet(in_features=64, width=16, n_classes=10, n_layers=8, seed=0)
    assert list(m.params) == ["opening.weight", "opening.bias", "steps.weight", "steps.bias",
                              "closing.weight", "closing.bias"]
    assert m.params["steps.weight"].shape == (8, 16, 16)
    assert m.params["opening.weight"].shape == (16, 64)
    assert m.params["closing.weight"].shape == (10, 16)
    total = sum(v.size for v in m.params.values())
    assert m.params.flat.size == total
    m.params["steps.bias"][3, 2] = 7.5
    assert 7.5 in m.params.flat
    c = mgnn.conv_resnet(in_channels=1, channels=8, image_size=(28, 28), n_classes=10,
                         n_layers=4, pool=4)
    assert c.params["steps.weight"].shape == (4, 8, 8, 3, 3)
    assert c.params["opening.weight"].shape == (8, 1, 3, 3)
    assert c.params["closing.weight"].shape == (10, 8 * 16)


def test_initialisation_depends_on_the_seed_only():
    a = mgnn.dense_resnet(5, 4, 3, 6, seed=11, dtype="float64")
    b = mgnn.dense_resnet(5, 4, 3, 6, seed=11, dtype="float64")
    c = mgnn.dense_resnet(5, 4, 3, 6, seed=12, dtype="float64")
    f = mgnn.dense_resnet(5, 4, 3, 6, seed=11, dtype="float32")
    np.testing.assert_array_equal(a.params.flat, b.params.flat)
    assert not np.array_equal(a.params.flat, c.params.flat)
    np.testing.assert_array_equal(f.params.flat, a.params.flat.astype(np.float32))
    assert f.params.flat.dtype == np.float32


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_serial_loss_and_grad_equal_across_backends(kind, rng):
    for dtype, rtol in (("float64", 1e-12), ("float32", 1e-5)):
        if kind == "dense":
            m = mgnn.dense_resnet(6, 5, 3, 9, dtype=dtype, seed=2)
            x = rng.standard_normal((4, 6)).astype(dtype)
        else:
            m = mgnn.conv_resnet(2, 3, (5, 4), 3, 3, dtype=dtype, seed=2)
            x = rng.standard_normal((4, 2, 5, 4)).astype(dtype)
        y = rng.integers(0, 3, 4)
        la, ga = mgnn.LayerParallel(m, backend="numpy").loss_and_grad(x, y)
        lb, gb = mgnn.LayerParallel(m, backend="numba").loss_and_grad(x, y)
        assert isinstance(la, float) and abs(la - lb) <= rtol * abs(la)
        for k in ga:
            assert gb[k].dtype == np.dtype(dtype)
            scale = np.abs(ga[k]).max()
            np.testing.assert_allclose(gb[k], ga[k], rtol=rtol, atol=rtol * scale, err_msg=k)


def test_serial_forward_is_forward_euler(rng):
    """u_N from LayerParallel equals stepping u_{n+1} = u_n + h tanh(u_n W_n^T + b_n) by hand."""
    m = mgnn.dense_resnet(3, 3, 2, 5, t_final=2.0, seed=1)
    x = rng.standard_normal((2, 3))
    p = m.params
    u = np.tanh(x @ p["opening.weight"].T + p["opening.bias"])
    for n in range(5):
        u = u + 0.4 * np.tanh(u @ p["steps.weight"][n].T + p["steps.bias"][n])
    logits = u @ p["closing.weight"].T + p["closing.bias"]
    for be in ("numpy", "numba"):
        lp = mgnn.LayerParallel(m, backend=be)
        np.testing.assert_allclose(lp.logits(x), logits, rtol=1e-12)
        np.testing.assert_array_equal(lp.predict(x), logits.argmax(1))


def test_bad_inputs_name_the_value(rng):
    m = mgnn.dense_resnet(4, 4, 3, 2, dtype="float64")
    lp = mgnn.LayerParallel(m, backend="numpy")
    x = rng.standard_normal((2, 4))
    y = np.array([0, 2])
    with pytest.raises(TypeError, match="float32"):
        lp.loss_and_grad(x.astype(np.float32), y)
    with pytest.raises(ValueError, match=r"\(2, 5\)"):
        lp.loss_and_grad(rng.standard_normal((2, 5)), y)
    bad = x.copy()
    bad[1, 1] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        lp.loss_and_grad(bad, y)
    with pytest.raises(ValueError, match=r"\[3\]"):
        lp.loss_and_grad(x, np.array([0, 3]))
    with pytest.raises(ValueError, match=r"\[-1\]"):
        lp.loss_and_grad(x, np.array([-1, 0]))
    with pytest.raises(TypeError, match="integer"):
        lp.loss_and_grad(x, np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"\(3,\)"):
        lp.loss_and_grad(x, np.array([0, 1, 2]))
    with pytest.raises(TypeError, match="list"):
        lp.loss_and_grad(x.tolist(), y)


def test_bad_model_arguments_name_the_value():
    with pytest.raises(ValueError, match="n_layers"):
        mgnn.dense_resnet(4, 4, 3, 0)
    with pytest.raises(TypeError, match="width"):
        mgnn.dense_resnet(4, 4.5, 3, 2)
    with pytest.raises(ValueError, match="float16"):
        mgnn.dense_resnet(4, 4, 3, 2, dtype="float16")
    with pytest.raises(ValueError, match="'sigmoid'"):
        mgnn.dense_resnet(4, 4, 3, 2, activation="sigmoid")
    with pytest.raises(ValueError, match="t_final"):
        mgnn.dense_resnet(4, 4, 3, 2, t_final=-1.0)
    with pytest.raises(ValueError, match="pool=3"):
        mgnn.conv_resnet(1, 2, (28, 28), 10, 2, pool=3)
    with pytest.raises(ValueError, match="'gpu'"):
        mgnn.LayerParallel(mgnn.dense_resnet(4, 4, 3, 2), backend="gpu")
    with pytest.raises(TypeError, match="Model"):
        mgnn.LayerParallel("not a model")


def test_activation_code_rejects_unknown():
    from mgnn.backend import activation_code
    with pytest.raises(ValueError, match="'gelu'"):
        activation_code("gelu")
    assert get_backend("numpy").name == "numpy"


def test_gpu_launch_model_interval_batching_cuts_launches():
    """Counted, not timed: one training step of the GPU backend (no kernel run) at N=256 takes
    fewer launches with interval-batched MGRIT (cf 4, 3 levels, 2/1 cycles) than layer by layer,
    which takes 4 per layer (+1 for the loss); the MGRIT step's gradients are one stacked launch
    per kind, and its steps after the first read no pointer and allocate nothing. With the
    cycles captured as graphs (from the third step on) the MGRIT kernels run inside them: a
    graph launch counts as one."""
    from mgnn.studies.bench import bench_gpu_launches
    graphs, mgrit, serial = bench_gpu_launches(n_layers=256, width=8, batch=4, repeats=1)
    # 4 per step, the loss, opening and closing: 1 forward + 3 vjp launches each
    assert serial["launches"] == 4 * 256 + 1 + 2 * (1 + 3)
    assert mgrit["launches"] < serial["launches"] / 2
    # forward: the cascadic cycle, a full cycle, the final relaxation; adjoint: 2 of those
    assert graphs["launches_by_kernel"]["graph"] == 5
    assert "dense_stacked_forward" not in graphs["launches_by_kernel"]
    assert graphs["launches"] < mgrit["launches"] / 4 and graphs["graph_kernels"] > 0
    assert graphs["pointers"] == 0 and graphs["allocations"] == 0
    by_kernel = mgrit["launches_by_kernel"]
    assert by_kernel["dense_stacked_forward"] > 0 and by_kernel["dense_stacked_adjoint"] > 0
    assert by_kernel["dense_weight_grad_stacked"] == by_kernel["dense_deriv_stacked"] == 1
    assert "dense_weight_grad_batched" not in by_kernel
    assert mgrit["pointers"] == 0 and mgrit["allocations"] == 0
    assert mgrit["host_seconds"] > 0 and serial["host_seconds"] > 0


def test_backend_object_missing_kernels_is_a_type_error():
    class Partial:
        xp = np
        dense_forward = staticmethod(lambda *a: None)
    with pytest.raises(TypeError, match="lacks kernels"):
        mgnn.LayerParallel(mgnn.dense_resnet(3, 3, 2, 4), backend=Partial())
