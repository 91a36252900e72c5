"""The asv suite (fast profile) runs, and times kernels rather than compilation: after a benchmark's
``setup`` no timed call compiles or loads a Numba kernel from the cache.

Each class is checked in a fresh interpreter (this file run as a script), so kernels compiled by
other tests cannot hide a setup that forgot to warm up.
"""
import itertools
import json
import os
import subprocess
import sys

import pytest

os.environ["MGNN_ASV_FAST"] = "1"
from asv_benchmarks import benchmarks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _classes():
    return [name for name in dir(benchmarks)
            if isinstance(getattr(benchmarks, name), type)
            and any(m.startswith(("time_", "peakmem_")) for m in dir(getattr(benchmarks, name)))]


def _compiled():
    """{dispatcher name: number of compiled signatures} of every Numba dispatcher in mgnn."""
    from numba.core.dispatcher import Dispatcher
    out = {}
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("mgnn") and mod is not None:
            for attr, d in vars(mod).items():
                if isinstance(d, Dispatcher):
                    out[f"{mod_name}.{attr}"] = len(d.overloads)
    return out


def check_class(name):
    """Every parameter combination of class ``name``: setup, then each timed method once.

    Returns a dict: ``ran`` (benchmarks called), ``skipped`` (combos whose setup raised
    NotImplementedError, asv's skip) and ``compiled`` (benchmark -> dispatchers that gained
    signatures in its first timed call; empty when setup warmed everything up).
    """
    cls = getattr(benchmarks, name)
    params = getattr(cls, "params", ())
    report = {"ran": 0, "skipped": [], "compiled": {}}
    for combo in itertools.product(*params) if params else [()]:
        obj = cls()
        try:
            obj.setup(*combo)
        except NotImplementedError as exc:
            report["skipped"].append(f"{combo}: {exc}")
            continue
        for m in sorted(dir(cls)):
            if m.startswith(("time_", "peakmem_")):
                before = _compiled()
                getattr(obj, m)(*combo)
                new = {k: v - before.get(k, 0) for k, v in _compiled().items()
                       if v > before.get(k, 0)}
                report["ran"] += 1
                if new:
                    report["compiled"][f"{name}.{m}{combo}"] = new
    return report


@pytest.mark.parametrize("name", _classes())
def test_timed_calls_do_not_compile(name):
    env = dict(os.environ, MGNN_ASV_FAST="1", PYTHONPATH=ROOT + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), name], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["compiled"] == {}, f"timed calls compiled Numba kernels: {report['compiled']}"
    if name == "GPUKernels" and report["skipped"]:
        assert all("no CUDA GPU" in s for s in report["skipped"]), report["skipped"]
    else:
        assert report["skipped"] == [] and report["ran"] > 0, report


def test_every_class_warms_up_in_setup():
    for name in _classes():
        cls = getattr(benchmarks, name)
        assert issubclass(cls, benchmarks._Warm), name
        assert cls.timeout >= 300, name  # a cold Numba cache compiles in setup


if __name__ == "__main__":
    print(json.dumps(check_class(sys.argv[1])))
