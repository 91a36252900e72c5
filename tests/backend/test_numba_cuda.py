"""The Numba CUDA kernels of mgnn.backend.numba_cuda: every kernel x dtype against the NumPy
references under the CUDA simulator (a subprocess: the simulator is chosen when numba.cuda is
imported), the import on a machine without a GPU, and the same cases on a real GPU."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = os.path.join("tests", "backend", "cudasim_cases.py")


def _run_cases(**env):
    """Run cudasim_cases.py in a fresh pytest; (return code, output, counts by outcome)."""
    full_env = dict(os.environ, NUMBA_NUM_THREADS="1", **env)
    if "NUMBA_ENABLE_CUDASIM" not in env:
        full_env.pop("NUMBA_ENABLE_CUDASIM", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", CASES],
        cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)",
                                                 summary)}
    return proc.returncode, out, counts


def _assert_all_passed(rc, out, counts):
    if rc != 0 or counts.get("passed", 0) <= 0 or set(counts) != {"passed"}:
        print(out)
    assert rc == 0, out[-4000:]
    assert counts.get("passed", 0) > 0, out[-4000:]
    assert set(counts) == {"passed"}, (counts, out[-4000:])  # nothing skipped, failed, errored


def test_kernels_under_the_simulator():
    _assert_all_passed(*_run_cases(NUMBA_ENABLE_CUDASIM="1"))


def _python_without_simulator(*args):
    """``python *args`` in a fresh process with the CUDA simulator off; its stdout (exit 0)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout


def test_import_without_a_gpu_touches_no_device():
    """Import in a fresh process; cuInit (which records the pid) must not have run."""
    code = (
        "import mgnn.backend.numba_cuda as nc\n"
        "from numba.cuda.cudadrv import driver\n"
        "print(nc.THREADS, nc._SIM, nc.CudaOps.name, driver.driver.pid is not None)\n")
    out = _python_without_simulator("-c", code)
    assert out.split() == ["256", "False", "cuda", "False"], out


def test_kernels_compile_on_numpy_without_row_stack():
    """NumPy 2.5 removed ``np.row_stack``, which numba-cuda 0.30.4 overloads when its typing
    registries load (seen on the H200 image: every kernel compile failed with AttributeError).
    Simulate that NumPy, compile a kernel to sm_90 PTX (no GPU needed) and check NumPy is left
    without the alias afterwards."""
    code = (
        "import numpy as np\n"
        "if hasattr(np, 'row_stack'):\n"
        "    del np.row_stack\n"
        "    np.__all__ = [n for n in np.__all__ if n != 'row_stack']\n"
        "import mgnn.backend.numba_cuda as nc\n"
        "from numba import cuda, types\n"
        "a = types.float32[::1]\n"
        "ptx, _ = cuda.compile_ptx(nc._add_kernel.py_func, (a, a, a), cc=(9, 0))\n"
        "print('.target sm_90' in ptx, hasattr(np, 'row_stack'))\n")
    out = _python_without_simulator("-c", code)
    assert out.split() == ["True", "False"], out


def _ptx_cases(*args):
    out = _python_without_simulator("-m", "tests.backend.ptx_cases", *args)
    return json.loads(out.strip().splitlines()[-1])


def _nvjitlink_missing():
    """Why nvJitLink (``cuda.bindings``, from the ``cuda`` extra: numba-cuda[cu13]) cannot be
    imported, or None when it can."""
    import importlib.util
    try:
        if importlib.util.find_spec("cuda.bindings.nvjitlink") is not None:
            return None
    except ModuleNotFoundError:
        pass
    return ("nvJitLink (cuda.bindings) is not installed: the PTX assembly check needs the cuda "
            "extra (pip install -e '.[cuda]')")


def test_every_kernel_compiles_to_sm90_ptx():
    """The real Numba CUDA compiler (no GPU): every kernel x dtype of the launch registry to
    sm_90 PTX, assembled by nvJitLink (no spills, <= 64 registers: 1024-thread blocks need
    <= 64); every cuda.jit kernel of the module is in the registry."""
    missing = _nvjitlink_missing()
    if missing:
        pytest.skip(missing)
    import mgnn.backend.numba_cuda as nc
    out = _ptx_cases()
    assert out["missing"] == [], f"kernels missing from launch_signatures(): {out['missing']}"
    assert len(out["kernels"]) == len(nc.launch_signatures()) == 16
    for name, row in out["kernels"].items():
        assert row["target"] == "sm_90", (name, row)
        assert row["spill_bytes"] == 0 and 0 < row["registers"] <= 64, (name, row)


def test_the_ptx_check_fails_on_a_broken_kernel():
    out = _ptx_cases("--broken")
    assert out["broken"].startswith("TypingError"), out


def test_host_arrays_fall_back_to_the_generic_ops(rng):
    """Without the simulator the kernels take CuPy arrays only; NumPy arrays get GenericOps."""
    from mgnn.backend.fas_ops import GenericOps
    from mgnn.backend.numba_cuda import CudaOps

    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("this process runs the simulator, where NumPy arrays do take the kernels")
    ops, ref = CudaOps(), GenericOps()
    a, b, c = (rng.standard_normal((3, 5)) for _ in range(3))
    r, n2 = ops.residual(a, b, c)
    r_ref, n_ref = ref.residual(a, b, c)
    np.testing.assert_array_equal(r, r_ref)
    assert n2 == n_ref
    np.testing.assert_array_equal(ops.correct(a, b, c), ref.correct(a, b, c))
    np.testing.assert_array_equal(ops.add(a, b), a + b)
    assert ops.norm2(a) == ref.norm2(a)


def _gpu():
    cupy = pytest.importorskip("cupy")
    if not cupy.cuda.is_available():
        pytest.skip("no CUDA GPU (cupy.cuda.is_available() is False)")
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("this process runs the CUDA simulator")
    return cupy


@pytest.mark.gpu
def test_kernels_on_the_gpu():
    """The simulator cases again, with CuPy arrays on the device (4 threads per block)."""
    _gpu()
    _assert_all_passed(*_run_cases())


@pytest.mark.gpu
def test_full_blocks_on_the_gpu(rng):
    """Default threads per block, a size over MAX_BLOCKS * THREADS (grid-stride), a side stream."""
    cupy = _gpu()
    from mgnn.backend import numba_cuda as nc
    from mgnn.backend.fas_ops import GenericOps
    from mgnn.optim import Adam

    n = nc.MAX_BLOCKS * nc.THREADS * 2 + 3
    for dtype, rtol in (("float32", 1e-5), ("float64", 1e-12)):
        phi, u, g = (rng.standard_normal(n).astype(dtype) for _ in range(3))
        with cupy.cuda.Stream(non_blocking=True):
            r, n2 = nc.CudaOps().residual(cupy.asarray(phi), cupy.asarray(u), cupy.asarray(g))
            r_ref, _ = GenericOps().residual(phi, u, g)
            np.testing.assert_allclose(cupy.asnumpy(r), r_ref, rtol=rtol, atol=0)
            r64 = r_ref.astype(np.float64)
            np.testing.assert_allclose(float(n2), float(r64 @ r64), rtol=1e-12)

            p0 = rng.standard_normal(n).astype(dtype)
            ref = Adam(p0.copy(), lr=0.01, weight_decay=0.1)
            p, m, v = cupy.asarray(p0), cupy.zeros(n, dtype), cupy.zeros(n, dtype)
            for t in (1, 2):
                grad = rng.standard_normal(n).astype(dtype)
                ref.step(grad)
                nc.adam_update(p, cupy.asarray(grad), m, v, 0.01, 0.9, 0.999, 1e-8, 0.1, t)
            np.testing.assert_allclose(cupy.asnumpy(p), ref.params, rtol=rtol, atol=0)
            np.testing.assert_allclose(cupy.asnumpy(v), ref.v, rtol=rtol, atol=0)
