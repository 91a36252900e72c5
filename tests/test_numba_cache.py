"""mgnn keeps Numba's cache of its kernels out of its own source tree (mgnn/_numba_cache.py)."""
import json
import os
import subprocess
import sys

import pytest

import mgnn

ENV = "NUMBA_CACHE_DIR"

# compiles (cold cache) and caches one small mgnn kernel, then reports where things are
PROBE = """
import json, os, numpy as np, mgnn, numba
from mgnn.backend import fas_ops
a = np.ones(3)
out = np.empty(3)
fas_ops._add(a, a, out)
print(json.dumps({"cache_dir": numba.config.CACHE_DIR, "env": os.environ.get("NUMBA_CACHE_DIR"),
                  "package": os.path.dirname(mgnn.__file__), "sum": out.tolist()}))
"""


def _cache_files(root):
    """{path: mtime} of Numba cache files (index .nbi, data .nbc) under ``root``."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith((".nbi", ".nbc")):
                p = os.path.join(d, f)
                out[p] = os.stat(p).st_mtime_ns
    return out


def test_kernel_cache_goes_to_the_user_cache_not_the_package(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (ENV, "MGNN_CACHE_DIR")}
    env.update(HOME=str(tmp_path / "home"), XDG_CACHE_HOME=str(tmp_path / "xdg"),
               NUMBA_NUM_THREADS="1")
    package = os.path.dirname(mgnn.__file__)
    before = _cache_files(package)
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    want = str(tmp_path / "xdg" / "mgnn" / "numba")
    assert info["sum"] == [2.0, 2.0, 2.0]
    assert info["cache_dir"] == want and info["env"] == want
    assert os.path.realpath(info["package"]) == os.path.realpath(package)
    cached = [os.path.basename(p) for p in _cache_files(want)]
    assert any(f.startswith("fas_ops._add-") and f.endswith(".nbi") for f in cached), cached
    assert _cache_files(package) == before  # nothing written into the source tree


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """(mgnn._numba_cache, numba's config) with no NUMBA_CACHE_DIR / MGNN_CACHE_DIR /
    XDG_CACHE_HOME, HOME and the temp dir in tmp_path; os.environ and Numba's config restored
    afterwards."""
    import numba.core.config as config
    monkeypatch.setattr(config, "CACHE_DIR", config.CACHE_DIR)
    for k in (ENV, "MGNN_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    from mgnn import _numba_cache
    return _numba_cache, config


def test_default_is_home_cache_and_numba_config_follows(clean_env, tmp_path):
    _numba_cache, config = clean_env
    want = str(tmp_path / "home" / ".cache" / "mgnn" / "numba")
    assert _numba_cache.configure() == want
    assert os.environ[ENV] == want and config.CACHE_DIR == want  # numba already imported
    assert os.path.isdir(want)


def test_mgnn_cache_dir_and_relative_xdg(clean_env, tmp_path, monkeypatch):
    _numba_cache = clean_env[0]
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec: absolute only
    want = str(tmp_path / "home" / ".cache" / "mgnn" / "numba")
    assert _numba_cache.configure() == want
    monkeypatch.delenv(ENV)
    monkeypatch.setenv("MGNN_CACHE_DIR", str(tmp_path / "mine"))
    assert _numba_cache.configure() == str(tmp_path / "mine" / "numba")


@pytest.mark.parametrize("value", ["/somewhere/of/mine", ""])
def test_user_setting_is_kept(clean_env, monkeypatch, value):
    _numba_cache = clean_env[0]
    monkeypatch.setenv(ENV, value)
    assert _numba_cache.configure() == (value or None)
    assert os.environ[ENV] == value


def test_unwritable_cache_falls_back_to_a_private_temp_folder(clean_env, tmp_path, monkeypatch):
    _numba_cache = clean_env[0]
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")  # a file in the way: makedirs fails, also for root
    monkeypatch.setenv("MGNN_CACHE_DIR", str(blocker / "cache"))
    private = tmp_path / "tmp" / f"mgnn-{os.getuid()}"
    assert _numba_cache.configure() == str(private / "numba")
    assert os.stat(private).st_mode & 0o777 == 0o700
    # a folder of that name that others may write to is never used: Numba's default stays
    monkeypatch.delenv(ENV)
    os.chmod(private, 0o777)
    assert _numba_cache.configure() is None
    assert ENV not in os.environ


# compiles (or loads) one kernel of the mgnn on sys.path; reports cache hits and the digest
HIT_PROBE = """
import json, numpy as np, mgnn
from mgnn.backend import fas_ops, jit
a = np.ones(3)
out = np.empty(3)
fas_ops._add(a, a, out)
print(json.dumps({"hits": sum(fas_ops._add.stats.cache_hits.values()),
                  "misses": sum(fas_ops._add.stats.cache_misses.values()),
                  "digest": jit.backend_digest(), "package": mgnn.__file__,
                  "sum": out.tolist()}))
"""


def test_identical_checkouts_share_compiled_kernels_and_a_backend_edit_recompiles(tmp_path):
    """Two copies of the package at different paths share one cache entry (a fresh clone
    compiles nothing the first copy compiled); a change anywhere in mgnn/backend (here a
    comment in another module than the kernel's) files the kernels under a new digest."""
    import shutil
    package = os.path.dirname(mgnn.__file__)
    copies = []
    for name in ("first", "second"):
        root = tmp_path / name
        shutil.copytree(package, root / "mgnn", ignore=shutil.ignore_patterns("__pycache__"))
        copies.append(root)
    env = {k: v for k, v in os.environ.items() if k not in ("MGNN_CACHE_DIR", "PYTHONPATH")}
    env.update({ENV: str(tmp_path / "cache"), "NUMBA_NUM_THREADS": "1"})

    def probe(root):
        proc = subprocess.run([sys.executable, "-c", HIT_PROBE], env=env, cwd=root,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        info = json.loads(proc.stdout.strip().splitlines()[-1])
        assert os.path.dirname(info["package"]) == str(root / "mgnn")
        assert info["sum"] == [2.0, 2.0, 2.0]
        return info

    first, second = probe(copies[0]), probe(copies[1])
    assert (first["hits"], first["misses"]) == (0, 1)  # compiled into the empty cache
    assert (second["hits"], second["misses"]) == (1, 0)  # the other path loads it
    assert first["digest"] == second["digest"]
    assert os.path.isdir(tmp_path / "cache" / f"mgnn-{first['digest']}" / "backend")
    with open(copies[1] / "mgnn" / "backend" / "numba_cpu" / "dense.py", "a") as f:
        f.write("\n# an edit in another file of the backend\n")
    edited = probe(copies[1])
    assert edited["digest"] != first["digest"]
    assert (edited["hits"], edited["misses"]) == (0, 1)
