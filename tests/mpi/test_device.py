"""Device-array halo messages (mgnn.comm.device): CUDA-aware MPI detection (unit tests with mocked
ctypes libraries, no MPI processes) and real ``mpiexec -n 2`` exchanges through DeviceHalo on the
staged and the CUDA-aware path (a NumPy-backed ``xp`` shim; real CuPy arrays on a GPU)."""
import ctypes
import ctypes.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from mgnn.comm import device
from mgnn.comm.device import DeviceHalo, cuda_aware_mpi, make_device_halo, query_cuda_support
from mgnn.comm.halo import SerialHalo

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
TIMEOUT = shutil.which("timeout")

try:
    import mpi4py  # noqa: F401
    HAVE_MPI = MPIEXEC is not None
except ImportError:
    HAVE_MPI = False
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="mpi4py/mpiexec not installed")


def _env():
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=REPO)
    env.pop(device.ENV_CUDA_AWARE, None)
    return env


def mpirun(n, *args, timeout=60):
    """``python *args`` on n ranks under ``timeout`` (never hangs); returns CompletedProcess."""
    cmd = [MPIEXEC, "-n", str(n), sys.executable, *args]
    if TIMEOUT:
        cmd = [TIMEOUT, "-k", "5", str(timeout)] + cmd
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=timeout + 15)


def _json(proc):
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # the last JSON line: Open MPI may forward terminal escapes or warnings after it
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith(("{", "["))][-1])


@pytest.fixture
def fresh(monkeypatch):
    """No environment override and an empty detection cache (restored afterwards)."""
    monkeypatch.delenv(device.ENV_CUDA_AWARE, raising=False)
    monkeypatch.setattr(device, "_detected", {})
    return monkeypatch


# ---------------------------------------------------------------- detection


@pytest.mark.parametrize("value, expected", [("0", False), ("1", True), ("true", True),
                                             ("no", False), ("FALSE", False), (" Yes ", True)])
def test_env_override(fresh, value, expected):
    fresh.setattr(device, "_mpi_libraries", lambda: pytest.fail("the library was queried"))
    fresh.setenv(device.ENV_CUDA_AWARE, value)
    assert cuda_aware_mpi() == (expected, f"env MGNN_CUDA_AWARE_MPI={value}")


@pytest.mark.parametrize("value", ["maybe", "2", "on?"])
def test_bad_env_value_names_it(fresh, value):
    fresh.setenv(device.ENV_CUDA_AWARE, value)
    with pytest.raises(ValueError, match=re.escape(f"MGNN_CUDA_AWARE_MPI={value!r}")):
        cuda_aware_mpi()


def _fn(result, calls=None, flag=None):
    """A mock C function: records its arguments, writes ``flag`` through a pointer argument."""
    def fn(*args):
        if calls is not None:
            calls.append(args[:1])
        if flag is not None:
            args[1].contents.value = flag
        return result
    return fn


class Lib:
    """A mock ctypes library: its attributes are the C functions it exports."""

    def __init__(self, **functions):
        self.__dict__.update(functions)


def test_open_mpi_query():
    for value in (1, 0):
        lib = Lib(MPIX_Query_cuda_support=_fn(value))
        assert query_cuda_support([("libmpi.so.40", lib)], "Open MPI v5.0.3") == \
            (bool(value), f"MPIX_Query_cuda_support() = {value} (Open MPI v5.0.3)")
        assert lib.MPIX_Query_cuda_support.restype is ctypes.c_int
        assert lib.MPIX_Query_cuda_support.argtypes == []


def test_mpich_query_passes_cuda_and_reads_the_flag():
    for flag in (1, 0):
        calls = []
        lib = Lib(MPIX_GPU_query_support=_fn(0, calls, flag),
                  MPIX_Query_cuda_support=_fn(1 - flag))  # the MPICH-native query wins
        assert query_cuda_support([("libmpi.so.12", lib)], "MPICH 4.2.0") == \
            (bool(flag), f"MPIX_GPU_query_support(CUDA) = {flag} (MPICH 4.2.0)")
        assert calls == [(device.MPIX_GPU_SUPPORT_CUDA,)] and device.MPIX_GPU_SUPPORT_CUDA == 0
        assert lib.MPIX_GPU_query_support.argtypes == [ctypes.c_int,
                                                       ctypes.POINTER(ctypes.c_int)]


def test_mpich_query_error_is_not_aware():
    aware, reason = query_cuda_support([("x", Lib(MPIX_GPU_query_support=_fn(5, flag=1)))],
                                       "MPICH")
    assert not aware and "error 5" in reason


def test_no_query_function_is_not_aware():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))  # a real library without the symbols
    aware, reason = query_cuda_support([("libc", libc), ("mock", Lib())], "Some MPI 1.0")
    assert aware is False
    assert reason == "no query function in Some MPI 1.0 (libc or mock): assuming not CUDA-aware"
    # a later library exporting the query is still found
    assert query_cuda_support([("libc", libc), ("mpi", Lib(MPIX_Query_cuda_support=_fn(1)))],
                              "Open MPI")[0] is True


def test_library_answer_is_cached(fresh):
    calls = []

    def libraries():
        calls.append(1)
        return [("libmpi", Lib(MPIX_Query_cuda_support=_fn(1)))], "Open MPI v4.1.6"

    fresh.setattr(device, "_mpi_libraries", libraries)
    first = cuda_aware_mpi()
    assert first == (True, "MPIX_Query_cuda_support() = 1 (Open MPI v4.1.6)")
    assert cuda_aware_mpi() == first and calls == [1]
    fresh.setenv(device.ENV_CUDA_AWARE, "0")  # the override still wins over the cache
    assert cuda_aware_mpi()[0] is False
    fresh.setenv(device.ENV_CUDA_AWARE, "")  # empty counts as unset
    assert cuda_aware_mpi() == first and calls == [1]


def test_without_mpi4py(fresh):
    fresh.setitem(sys.modules, "mpi4py", None)
    fresh.setitem(sys.modules, "mpi4py.MPI", None)
    aware, reason = cuda_aware_mpi()
    assert aware is False and reason.startswith("mpi4py is not available")
    assert device._detected == {}


@needs_mpi
def test_detection_of_the_installed_mpi():
    """The real library, in a fresh (singleton MPI) process: a bool, a reason, cached."""
    code = textwrap.dedent("""
        import json
        from mgnn.comm import device
        first = device.cuda_aware_mpi()
        device._mpi_libraries = None  # a second query would fail
        assert device.cuda_aware_mpi() == first
        print(json.dumps(first))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=60)
    aware, reason = _json(proc)
    assert isinstance(aware, bool) and reason
    assert reason.startswith(("MPIX_", "no query function in"))


# ---------------------------------------------------------------- construction, serial


def test_make_device_halo_serial_and_bad_wrap():
    halo = make_device_halo(None)
    assert isinstance(halo, SerialHalo) and halo.path == "none" and halo.size == 1
    assert halo.timers["staging"] == 0.0 and halo.cuda_aware is False
    with pytest.raises(TypeError, match="DeviceHalo wraps a Halo"):
        DeviceHalo(SerialHalo(), cuda_aware=False, xp=np)


# ---------------------------------------------------------------- 2 real MPI ranks

@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("mode", ["staged", "cuda-aware"])
def test_exchange_two_ranks_with_shim(mode):
    out = _json(mpirun(2, "-m", "tests.mpi.device_cases", "shim", mode))
    assert out["mode"] == mode and out["ranks"] == 2 and out["received"] == 54
    if mode == "staged":
        assert out["staging_s"] > 0 and out["pinned"] > 0
    else:
        assert out["staging_s"] == 0 and out["pinned"] == 0


@pytest.mark.gpu
@pytest.mark.mpi
@needs_mpi
def test_exchange_two_ranks_with_cupy():
    cupy = pytest.importorskip("cupy")
    if not cupy.cuda.is_available():
        pytest.skip("no CUDA GPU (cupy.cuda.is_available() is False)")
    out = _json(mpirun(2, "-m", "tests.mpi.device_cases", "cupy", timeout=120))
    assert out["paths"]["staged"] == 27  # 3 rounds x 3 tags x 3 kinds
    if out["detected"][0]:
        assert out["paths"]["cuda-aware"] == 27
