"""The asv suite runs: every benchmark of the fast profile, once, without asv (GPU ones skip)."""
import itertools
import os

import pytest

os.environ["MGNN_ASV_FAST"] = "1"
from asv_benchmarks import benchmarks  # noqa: E402


def _cases():
    for name in dir(benchmarks):
        cls = getattr(benchmarks, name)
        if isinstance(cls, type) and any(m.startswith(("time_", "peakmem_")) for m in dir(cls)):
            params = getattr(cls, "params", ())
            for combo in itertools.product(*params) if params else [()]:
                yield cls, combo


@pytest.mark.parametrize("cls, combo", list(_cases()), ids=lambda v: str(v))
def test_benchmark_runs(cls, combo):
    obj = cls()
    try:
        obj.setup(*combo)
    except NotImplementedError as exc:  # asv's way of skipping (no GPU here)
        assert cls.__name__ == "GPUKernels", exc
        return
    for m in dir(cls):
        if m.startswith(("time_", "peakmem_")):
            getattr(obj, m)(*combo)
