"""Under MPI the CLI compiles the kernels on rank 0 first (a single-process replica) while the
other ranks wait on a sleeping barrier (Numba's cache is unsafe under concurrent compiles):
the order of calls on each rank, with a recording communicator."""
import types

import pytest

from mgnn.__main__ import _compile_on_rank_zero_first


class RecordingComm:
    def __init__(self, rank, size, calls):
        self.rank, self.size, self.calls = rank, size, calls

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def Ibarrier(self):
        self.calls.append("Ibarrier")
        tests = iter([False, True])
        return types.SimpleNamespace(Test=lambda: next(tests))


def _run(rank, size, backend="numba", fail=None):
    calls, logs = [], []
    lp = types.SimpleNamespace(bk=types.SimpleNamespace(name=backend))

    def make_serial():
        calls.append("replica")
        if fail:
            raise fail

        class Replica:
            def loss_and_grad(self, x, y):
                calls.append(("loss_and_grad", x, y))
        return Replica()
    _compile_on_rank_zero_first(RecordingComm(rank, size, calls), lp, make_serial, "x", "y",
                                logs.append)
    return calls, logs


def test_rank_zero_compiles_then_every_rank_passes_the_barrier():
    calls, logs = _run(0, 3)
    assert calls == ["replica", ("loss_and_grad", "x", "y"), "Ibarrier"]
    assert len(logs) == 1 and "kernels compiled (or loaded) on rank 0 in " in logs[0]
    for rank in (1, 2):
        assert _run(rank, 3) == (["Ibarrier"], [])


@pytest.mark.parametrize("rank, size, backend", [(0, 1, "numba"), (0, 2, "numpy"),
                                                 (0, 2, "cuda")])
def test_nothing_to_do_for_one_rank_or_other_backends(rank, size, backend):
    assert _run(rank, size, backend) == ([], [])


def test_a_failing_warm_up_is_reported_and_rank_zero_still_reaches_the_barrier():
    calls, logs = _run(0, 2, fail=ValueError("bad batch"))
    assert calls == ["replica", "Ibarrier"]
    assert "kernel warm-up on rank 0 failed (ValueError: bad batch); every rank compiles" in logs[0]
