"""A kernel's first compile survives a shared Numba cache that another process left half-written
(mgnn/backend/jit.py): the process warns once, moves to a private cache folder and gets the same
result; a genuine typing error is still raised."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mgnn.backend import jit

# one dense residual sweep (a kernel calling inlined helpers) and one FAS vector kernel
PROBE = """
import json, os, warnings, numpy as np
warnings.simplefilter("always")
import mgnn
from mgnn.backend import get_backend, fas_ops, jit
bk = get_backend("numba")
rng = np.random.default_rng(0)
u = rng.standard_normal((4, 8)); w = rng.standard_normal((8, 8)); b = rng.standard_normal(8)
with warnings.catch_warnings(record=True) as caught:
    out = np.empty(3); fas_ops._add(np.ones(3), np.ones(3), out)
    z = bk.dense_forward(u, w, b, 0.1, 0, True)  # act 0: tanh
print(json.dumps({"z": np.asarray(z).tolist(), "sum": out.tolist(),
                  "private": jit.private_cache_dir(),
                  "warnings": [str(c.message) for c in caught
                               if issubclass(c.category, jit.CacheRaceWarning)]}))
"""


def _run(cache):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), NUMBA_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_half_written_shared_cache_falls_back_to_a_private_one(tmp_path):
    cache = tmp_path / "numba"
    clean = _run(cache)  # cold: compiles and fills the shared cache
    assert clean["private"] is None and clean["warnings"] == []
    indexes = [os.path.join(d, f) for d, _, fs in os.walk(cache) for f in fs if f.endswith(".nbi")]
    assert indexes
    for p in indexes:  # what a reader sees while another process is writing: cut files
        with open(p, "rb") as f:
            data = f.read()
        with open(p, "wb") as f:
            f.write(data[: len(data) // 2])
    raced = _run(cache)
    assert raced["private"] == str(cache / f"pid-{raced['private'].rsplit('-', 1)[1]}")
    assert len(raced["warnings"]) == 1 and "another process" in raced["warnings"][0]
    assert raced["z"] == clean["z"] and raced["sum"] == clean["sum"] == [2.0, 2.0, 2.0]
    assert any(f.endswith(".nbi") for _, _, fs in os.walk(raced["private"]) for f in fs)


def test_genuine_typing_error_is_still_raised(monkeypatch, tmp_path):
    """Retried once in a private folder; when that fails too, the process goes back to the
    shared cache (the private folder removed) and the error is raised, without a warning."""
    import warnings
    from numba.core import config
    from numba.core.errors import TypingError
    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(jit._private, "dir", None)
    tried = []
    real = jit.use_private_cache
    monkeypatch.setattr(jit, "use_private_cache", lambda: tried.append(real()) or tried[-1])

    @jit.njit(cache=True)
    def bad(a):
        return a.no_such_attribute

    with warnings.catch_warnings():
        warnings.simplefilter("error", jit.CacheRaceWarning)  # no cache-race warning for it
        with pytest.raises(TypingError):
            bad(np.ones(2))
    assert tried == [str(tmp_path / f"pid-{os.getpid()}")]  # retried once, privately
    assert jit.private_cache_dir() is None and config.CACHE_DIR == str(tmp_path)
    assert not os.path.exists(tried[0])


def test_njit_keeps_numba_options():
    @jit.njit(cache=False, fastmath=False)
    def twice(a):
        return 2 * a

    assert isinstance(twice, jit.RetryingDispatcher)
    assert twice(3.0) == 6.0 and twice.targetoptions["fastmath"] is False
