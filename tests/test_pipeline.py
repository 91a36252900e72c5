"""The pipeline baseline gives the exact (serial backpropagation) loss and gradients."""
import numpy as np
import pytest

import mgnn
from mgnn.studies.pipeline import PipelineParallel


@pytest.mark.parametrize("micro_batches", [1, 2, 3, 7])
@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_pipeline_gradients_equal_serial(micro_batches, kind, rng):
    if kind == "dense":
        model = mgnn.dense_resnet(5, 4, 3, 9, seed=2)
        x = rng.standard_normal((7, 5))
    else:
        model = mgnn.conv_resnet(1, 2, (4, 4), 3, 5, seed=2)
        x = rng.standard_normal((7, 1, 4, 4))
    y = rng.integers(0, 3, 7)
    loss0, g0 = mgnn.LayerParallel(model, backend="numpy").loss_and_grad(x, y)
    loss, g = PipelineParallel(model, micro_batches=micro_batches).loss_and_grad(x, y)
    assert abs(loss - loss0) <= 1e-12 * abs(loss0)
    for k in g0:
        np.testing.assert_allclose(g[k], g0[k], rtol=1e-11, atol=1e-13, err_msg=k)


def test_pipeline_bad_micro_batches():
    model = mgnn.dense_resnet(5, 4, 3, 4)
    with pytest.raises(ValueError, match="micro_batches"):
        PipelineParallel(model, micro_batches=0)
    with pytest.raises(ValueError, match="3 micro-batches"):
        PipelineParallel(model, micro_batches=3).loss_and_grad(np.ones((2, 5)),
                                                               np.zeros(2, np.int64))


def test_pipeline_rejects_composed_steps():
    with pytest.raises(ValueError, match="fused step kinds only"):
        PipelineParallel(mgnn.dense_resnet(3, 2, 3, 4, batch_norm=True))
