"""Captured cycles of the recurrent kinds (GRU with implicit or rediscretised coarse steps, the
implicit GRU cell, 2-layer GRU, tanh RNN) over sequence time: replayed in one Numba call per
cycle (mgnn.backend.numba_cpu.tapes' recurrent drivers), bit for bit the uncaptured engine
calls, forward and adjoint, with the serial and the threaded driver."""
import numpy as np
import pytest

import mgnn
from mgnn.backend.numba_cpu import tapes as numba_tapes

from .tape_cases import assert_replays_match, training_steps

CASES = {
    "gru": lambda: mgnn.gru_classifier(3, 5, 3, 16, seed=2),
    "gru, 2 layers, rediscretised": lambda: mgnn.gru_classifier(3, 5, 3, 16, n_layers=2,
                                                                coarse="rediscretise", seed=2),
    "implicit gru": lambda: mgnn.gru_classifier(3, 5, 3, 16, cell="implicit_gru", seed=2),
    "rnn": lambda: mgnn.rnn_classifier(3, 5, 3, 16, seed=2),
}


@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_recurrent_cycles_replay_the_engine_calls_bit_for_bit(case, threaded, monkeypatch):
    if threaded:  # the threaded driver (each engine call's rows on Numba's threads)
        monkeypatch.setattr(numba_tapes.numba, "get_num_threads", lambda: 2)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 16, 3)), rng.integers(0, 3, 4)
    assert_replays_match(training_steps(CASES[case](), x, y, True),
                         training_steps(CASES[case](), x, y, False))
