"""Captured cycles of the composed dense kinds (batch norm, dropout, both; train and eval
mode): replayed in one Numba call per cycle (mgnn.backend.numba_cpu.tapes' composed drivers),
bit for bit the uncaptured engine calls, forward and adjoint, with the serial and the threaded
driver."""
import numpy as np
import pytest

import mgnn
from mgnn.backend.numba_cpu import tapes as numba_tapes

from .tape_cases import assert_replays_match, training_steps

CASES = [(True, 0.0), (False, 0.2), (True, 0.2)]


def _steps(bn, drop, capture, steps=4):
    model = mgnn.dense_resnet(5, 6, 3, 16, batch_norm=bn, dropout=drop, seed=2)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((6, 5)), rng.integers(0, 3, 6)
    return training_steps(model, x, y, capture, steps), x


@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("bn, drop", CASES)
def test_composed_cycles_replay_the_engine_calls_bit_for_bit(bn, drop, threaded, monkeypatch):
    if threaded:  # the threaded drivers (each engine call's rows on Numba's threads)
        monkeypatch.setattr(numba_tapes.numba, "get_num_threads", lambda: 2)
    (captured, x), (uncaptured, _) = _steps(bn, drop, True), _steps(bn, drop, False)
    assert_replays_match(captured, uncaptured)
    lp, lp0 = captured[2], uncaptured[2]
    if bn:  # eval mode (running statistics): inference's forward solves, replayed after the
        lp.model.eval()  # first, equal the uncaptured ones
        lp0.model.eval()
        want = lp0.logits(x)
        for _ in range(3):
            np.testing.assert_array_equal(lp.logits(x), want)


def test_composed_tapes_keep_chains_and_coarse_steps_apart():
    """The composed kinds' tapes have no shared first steps (their replay runs rows as the
    engine's calls); the fused kinds' tapes still fold them."""
    from mgnn.backend import tape as T
    (_, tapes, _), _ = _steps(True, 0.2, True, steps=2)
    rows = [t.rows for d in tapes for t in d.values() if t.rows is not None]
    assert rows and all((r[:, T.SHARE_R] < 0).all() for r in rows)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((6, 5)), rng.integers(0, 3, 6)
    _, dense_tapes, _ = training_steps(mgnn.dense_resnet(5, 6, 3, 16, seed=2), x, y, True, 2)
    dense = [t.rows for t in dense_tapes[0].values() if t.rows is not None]
    assert any((r[:, T.SHARE_R] >= 0).any() for r in dense)


def test_tapes_with_shared_first_steps_are_refused():
    """These drivers do not run shared first steps: a tape holding one (or rows of another
    layout) is refused with a ValueError, not replayed wrongly."""
    from mgnn.backend import tape as T
    from mgnn.backend.numba_cpu import composed_run_tape, recurrent_run_tape, stores_list
    rows = np.full((1, T.COLS), -1, dtype=np.int64)
    rows[0, T.OP], rows[0, T.SHARE_R] = T.CHAIN, 1
    W = np.zeros((16, 6, 6))
    with pytest.raises(ValueError, match="without shared first steps"):
        composed_run_tape(stores_list([np.zeros((3, 6, 6))]), rows, np.ones(1), (W,),
                          np.zeros(1))
    with pytest.raises(ValueError, match="without shared first steps"):
        composed_run_tape(stores_list([np.zeros((3, 6, 6))]), rows[:, :5], np.ones(1), (W,),
                          np.zeros(1))
    with pytest.raises(TypeError, match="recurrent tape"):  # float32 weights, float64 stores
        recurrent_run_tape(stores_list([np.zeros((3, 2, 1, 4))]), rows, [(1.0, 0)],
                           np.zeros(1), 0, np.zeros((2, 3, 12), np.float32),
                           np.zeros((1, 4, 12)), np.zeros((1, 4, 12)), np.zeros((1, 12)),
                           np.zeros((1, 12)))
