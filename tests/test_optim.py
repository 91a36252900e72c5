"""Optimizers against the textbook update rules, written out independently."""
import numpy as np
import pytest

from mgnn.optim import SGD, Adam, make_optimizer


def _grads(rng, n, steps):
    return [rng.standard_normal(n) for _ in range(steps)]


def test_sgd_momentum_weight_decay(rng):
    p0 = rng.standard_normal(5)
    gs = _grads(rng, 5, 4)
    p = p0.copy()
    opt = SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)
    for g in gs:
        opt.step(g)
    q, buf = p0.copy(), None
    for g in gs:
        d = g + 0.01 * q
        buf = d if buf is None else 0.9 * buf + d
        q = q - 0.1 * buf
    np.testing.assert_allclose(p, q, rtol=1e-14)


def test_adam(rng):
    p0 = rng.standard_normal(5)
    gs = _grads(rng, 5, 4)
    p = p0.copy()
    opt = Adam(p, lr=0.01)
    for g in gs:
        opt.step(g)
    q, m, v = p0.copy(), np.zeros(5), np.zeros(5)
    for t, g in enumerate(gs, 1):
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        q = q - 0.01 * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
    np.testing.assert_allclose(p, q, rtol=1e-12)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_state_roundtrip_continues_exactly(name, rng):
    gs = _grads(rng, 6, 6)
    p = rng.standard_normal(6)
    q = p.copy()
    a = make_optimizer(name, p, 0.05)
    for g in gs:
        a.step(g)
    b = make_optimizer(name, q, 0.05)
    for g in gs[:3]:
        b.step(g)
    state = b.state_dict()
    q2 = q.copy()
    c = make_optimizer(name, q2, 0.05)
    c.load_state_dict(state)
    for g in gs[3:]:
        c.step(g)
    np.testing.assert_array_equal(p, q2)


def test_float32_stays_float32_and_bad_input():
    p = np.ones(3, np.float32)
    opt = Adam(p, lr=0.1)
    opt.step(np.ones(3, np.float32))
    assert p.dtype == np.float32 and opt.m.dtype == np.float32
    with pytest.raises(TypeError, match="float64"):
        opt.step(np.ones(3))
    with pytest.raises(ValueError, match=r"\(4,\)"):
        opt.step(np.ones(4, np.float32))
    with pytest.raises(ValueError, match="lr"):
        SGD(p, lr=-1)
    with pytest.raises(ValueError, match="'rmsprop'"):
        make_optimizer("rmsprop", p, 0.1)


def test_momentum_must_be_below_one():
    p = np.ones(3)
    for bad in (1.0, 1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match=f"momentum must be .*{bad!r}"):
            SGD(p, lr=0.1, momentum=bad)
    SGD(p, lr=0.1, momentum=0.0)
    SGD(p, lr=0.1, momentum=0.999)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_param_dicts_work_as_params_and_grads(name, rng):
    """``opt.step(grads)`` with the ParamDict loss_and_grad returns equals ``opt.step(grads.flat)``;
    a plain dict or list is a TypeError saying what to pass."""
    import mgnn
    model = mgnn.dense_resnet(4, 3, 2, 5, dtype="float64", seed=0)
    p1, p2 = model.params.copy(), model.params.copy()
    a, b = make_optimizer(name, p1.flat, 0.05), make_optimizer(name, p2, 0.05)
    for _ in range(3):
        g = model.params.zeros_like()
        g.flat[:] = rng.standard_normal(g.flat.shape)
        a.step(g.flat)
        b.step(g)
    np.testing.assert_array_equal(p1.flat, p2.flat)
    for bad in (dict(g), list(g.flat)):
        with pytest.raises(TypeError, match=r"a ParamDict or its \.flat\), got"):
            b.step(bad)


def test_cosine_schedule_values_and_bad_input():
    from mgnn.optim import CosineLR, make_lr_schedule
    s = CosineLR(0.1, 4, 0.01)
    assert s(0.0) == pytest.approx(0.1, rel=1e-15) and s(4.0) == pytest.approx(0.01, rel=1e-15)
    assert s(2.0) == pytest.approx(0.055, rel=1e-14) and s(9.0) == s(4.0)
    assert s(1.0) == pytest.approx(0.01 + 0.09 * (1 + np.sqrt(0.5)) / 2, rel=1e-14)
    assert make_lr_schedule("constant", 0.1, 4) is None
    assert make_lr_schedule("cosine", 0.1, 4, 0.01)(4.0) == pytest.approx(0.01)
    with pytest.raises(ValueError, match="lr_min 0.2 is above lr 0.1"):
        CosineLR(0.1, 4, 0.2)
    with pytest.raises(ValueError, match="epochs must be > 0, got 0"):
        CosineLR(0.1, 0)
    with pytest.raises(ValueError, match=r"epochs done must be >= 0, got -1"):
        s(-1)
    with pytest.raises(ValueError, match="'step'"):
        make_lr_schedule("step", 0.1, 4)
