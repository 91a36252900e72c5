"""The package and its top-level kernels/ folder install from a wheel and in editable mode."""
import os
import subprocess
import sys
import zipfile

import pytest

import mgnn.backend

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_kernel_dir_in_this_install():
    assert os.path.isfile(os.path.join(mgnn.backend.kernel_dir(), "README.md"))


@pytest.mark.slow
def test_wheel_ships_kernels(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "-w", str(tmp_path / "dist"), REPO],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("mgnn-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "mgnn/kernels/README.md" in names and "mgnn/backend/jit.py" in names
    for package in ("mgnn/studies", "mgnn/backend/numba_cpu", "mgnn/backend/numpy_ref",
                    "mgnn/backend/cupy_raw"):  # every package of the source tree is shipped
        assert f"{package}/__init__.py" in names, package
    shipped = {n for n in names if n.startswith("mgnn/") and n.endswith("/__init__.py")}
    here = {os.path.relpath(os.path.join(d, "__init__.py"), REPO).replace(os.sep, "/")
            for d, _, files in os.walk(os.path.join(REPO, "mgnn")) if "__init__.py" in files}
    assert here <= shipped, sorted(here - shipped)
    sources = sorted(f for f in os.listdir(os.path.join(REPO, "kernels"))
                     if f.endswith((".cu", ".cuh")))
    assert sources and all(f"mgnn/kernels/{f}" in names for f in sources), (sources, names)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(tmp_path / "site"), str(wheel)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    # the installed wheel builds and runs the host emulation of its own kernels
    code = ("import mgnn, mgnn.backend as b, numpy as np; k = b.get_backend('cuda-emulated'); "
            "x = np.ones((3, 4)); y = k.dense_forward(x, np.eye(4), np.zeros(4), 1.0, 2, True); "
            "assert np.allclose(y, 2 * x); print(mgnn.__file__); print(b.kernel_dir())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(tmp_path / "site"),
                                           MGNN_CACHE_DIR=str(tmp_path / "cache")))
    assert r.returncode == 0, r.stderr[-2000:]
    mod, kdir = r.stdout.split()
    assert mod.startswith(str(tmp_path / "site"))
    assert kdir == str(tmp_path / "site" / "mgnn" / "kernels")


def test_cpu_use_never_imports_gpu_modules():
    """import mgnn and a CPU training step load neither CuPy nor Numba CUDA (GPU modules load
    only when a GPU backend is asked for)."""
    code = ("import sys, numpy as np, mgnn\n"
            "m = mgnn.dense_resnet(4, 4, 2, 8)\n"
            "lp = mgnn.LayerParallel(m, mgnn.MGRITOptions(cf=2, max_levels=2, max_iter=1), None)\n"
            "lp.loss_and_grad(np.ones((3, 4)), np.array([0, 1, 0]))\n"
            "print([k for k in ('cupy', 'cupyx', 'numba.cuda') if k in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"


def test_moved_study_modules_keep_their_old_import_paths():
    """The studies live in mgnn/studies/; ``import mgnn.bench`` (etc.) still works and gives the
    same module object, with its own spec, and the core never imports a study."""
    import importlib
    import subprocess
    import sys

    from mgnn._moved import MOVED
    assert len(MOVED) == 6
    for old, new in MOVED.items():
        mod = importlib.import_module(old)
        assert mod is importlib.import_module(new) and mod.__name__ == new
        assert mod.__spec__.name == new and mod.__spec__.origin.endswith(
            os.path.join("studies", new.rsplit(".", 1)[1] + ".py"))
    from mgnn.pipeline import PipelineParallel
    from mgnn.studies.pipeline import PipelineParallel as P2
    assert PipelineParallel is P2
    code = ("import sys, mgnn, mgnn.network, mgnn.train\n"
            "print(sorted(m for m in sys.modules if m.startswith('mgnn.studies')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert out.strip() == "[]", out
