import os

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))



def _shared_dir():
    """The shared folder (reference cases, MNIST): $MGNN_SHARED_DIR, ../shared next to the
    checkout, or /work/shared."""
    for cand in (os.environ.get("MGNN_SHARED_DIR"), os.path.join(HERE, "..", "..", "shared"),
                 "/work/shared"):
        if cand and os.path.isdir(cand):
            return os.path.abspath(cand)
    return os.path.abspath(os.path.join(HERE, "..", "..", "shared"))


SHARED = _shared_dir()
MNIST_DIR = os.environ.get("MGNN_MNIST_DIR") or os.path.join(SHARED, "datasets", "mnist")

RTOL = {"float32": 1e-5, "float64": 1e-12}


def assert_close(actual, expected, dtype, what=""):
    """Compare with the tolerance for ``dtype`` (float64: rtol 1e-12, float32: 1e-5); atol scaled by
    the reference's size."""
    expected = np.asarray(expected)
    actual = np.asarray(actual)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert actual.dtype == np.dtype(dtype), (what, actual.dtype)
    rtol = RTOL[np.dtype(dtype).name]
    scale = float(np.abs(expected).max()) if expected.size else 1.0
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, err_msg=what)


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


def mnist_available():
    return os.path.exists(os.path.join(MNIST_DIR, "t10k-labels-idx1-ubyte.gz"))


def sgd_steps(lp, model, x, y, steps=3):
    """``steps`` SGD steps (lr 0.1) of the training object ``lp`` on ``model``'s parameters
    (the running statistics and dropout masks move too): [(loss, flat gradient, flat
    buffers)] of each step, copies."""
    import mgnn
    opt = mgnn.optim.SGD(model.params, lr=0.1)
    out = []
    for _ in range(steps):
        loss, g = lp.loss_and_grad(x, y)
        out.append((loss, g.flat.copy(), model.buffers.flat.copy()))
        opt.step(g)
    return out
