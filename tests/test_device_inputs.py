"""DLPack inputs on a real GPU: a device-resident producer is imported without a copy, a
CPU-resident one (which ``cupy.from_dlpack`` refuses) through NumPy and one host-to-device copy.
The CPU twin runs on the fake cupy (tests/fakegpu/cases.py, whose ``from_dlpack`` refuses CPU
objects exactly as CuPy 14 does)."""
import numpy as np
import pytest

import mgnn
from mgnn import MGRITOptions


class DLPackOnly:
    """Someone else's array that speaks DLPack only (no CUDA array interface)."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kwargs):
        return self.a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


@pytest.mark.gpu
def test_dlpack_inputs_on_the_gpu(rng):
    from mgnn.backend import gpu_available
    if not gpu_available():
        pytest.skip("needs a CUDA GPU (cupy.cuda.is_available())")
    import cupy
    x, y = rng.standard_normal((8, 5)), rng.integers(0, 3, 8)
    opts = MGRITOptions(cf=2, max_levels=2, max_iter=2, tol=0.0)
    ref, g_ref = mgnn.LayerParallel(mgnn.dense_resnet(5, 6, 3, 8, seed=1, dtype="float64"), opts,
                                    opts, backend="numba").loss_and_grad(x, y)
    lp = mgnn.LayerParallel(mgnn.dense_resnet(5, 6, 3, 8, seed=1, dtype="float64"), opts, opts,
                            backend="cuda")
    xd = cupy.asarray(x)
    imported = lp.to_device(DLPackOnly(xd))
    assert isinstance(imported, cupy.ndarray) and imported.data.ptr == xd.data.ptr  # no copy
    with pytest.raises(TypeError):
        cupy.from_dlpack(DLPackOnly(x))  # what LayerParallel must not rely on
    for xi in (DLPackOnly(xd), DLPackOnly(x)):
        loss, g = lp.loss_and_grad(xi, cupy.asarray(y))
        assert abs(loss - ref) <= 1e-10 * abs(ref)
        np.testing.assert_allclose(cupy.asnumpy(g.flat), g_ref.flat, rtol=1e-9, atol=1e-12)
