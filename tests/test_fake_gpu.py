"""The CuPy code paths of mgnn (device parameters, inputs, optimizer, checkpoints, launches,
device halos) on a fake cupy (tests/fakegpu) in subprocesses: NumPy-backed "device" arrays that
refuse to mix with host arrays, RawModule through the host emulation, Numba CUDA in the
simulator. The real-GPU twins are the tests marked ``gpu``."""
import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE = os.path.join(REPO, "tests", "fakegpu")


def _env(**extra):
    return dict(os.environ, PYTHONPATH=os.pathsep.join([FAKE, REPO]), NUMBA_ENABLE_CUDASIM="1",
                NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", **extra)


def test_device_code_paths_on_the_fake_cupy():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.join(FAKE, "cases.py")], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    summary = out.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, summary


def _train(ranks, backend, *model, **env):
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if mpiexec is None:
        pytest.skip("mpiexec not installed")
    cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "mgnn", "train", "--data", "digits",
           "--layers", "8", *(model or ("--width", "6")), "--epochs", "1", "--batch-size", "32",
           "--limit-train", "96", "--limit-test", "32", "--dtype", "float64", "--no-progress",
           "--json", "--levels", "2", "--cf", "2", "--fwd-iters", "2", "--bwd-iters", "1",
           "--layer-ranks", str(ranks), "--backend", backend, "--timings"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(FAKE_CUPY_SMALL_TILES="1", **env),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    return proc


@pytest.mark.mpi
@pytest.mark.parametrize("aware", ["0", "1"])
def test_cli_cuda_backend_on_two_ranks_on_the_fake_cupy(aware):
    """`mpiexec -n 2 python -m mgnn train --backend cuda`: device states cross ranks staged
    through host buffers (0) or straight to MPI (1); same loss as the numba backend on one
    rank, and --timings names the path."""
    import json
    ref = json.loads(_train(1, "numba").stdout.strip().splitlines()[-1])
    proc = _train(2, "cuda", MGNN_CUDA_AWARE_MPI=aware)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert abs(got["final_loss"] - ref["final_loss"]) <= 1e-9 * ref["final_loss"]
    want = "straight to CUDA-aware MPI" if aware == "1" else "staged through pinned host buffers"
    assert want in proc.stderr + proc.stdout


@pytest.mark.mpi
def test_cli_spatial_coarsening_on_the_device_on_two_ranks_on_the_fake_cupy():
    """A conv ResNet with spatial coarsening (8x8 digits -> 4x4 on level 1) on the cuda
    backend over 2 ranks: coarse-level states cross ranks with their coarse shapes and the
    loss equals one numba process."""
    import json
    conv = ("--model", "conv", "--channels", "2", "--spatial-levels", "0")
    ref = json.loads(_train(1, "numba", *conv).stdout.strip().splitlines()[-1])
    got = json.loads(_train(2, "cuda", *conv).stdout.strip().splitlines()[-1])
    assert abs(got["final_loss"] - ref["final_loss"]) <= 1e-9 * ref["final_loss"]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,kind,coarsest,aware", [(1, "conv", "sequential", "0"),
                                                       (2, "dense", "redundant", "0"),
                                                       (4, "dense", "sequential", "1"),
                                                       (2, "conv", "sequential", "1"),
                                                       (3, "conv", "redundant", "0")])
def test_captured_graphs_on_several_layer_ranks_on_the_fake_cupy(ranks, kind, coarsest, aware):
    """Captured cycles on 1, 2, 3 and 4 layer ranks: on several each cycle is several graphs
    (cut at its halo messages, the redundant coarsest level's allgather included; one rank:
    one graph), made without allocating anything while capturing, launched at every step from
    the second on; four SGD steps on new data each give the uncaptured run's losses, residual
    histories, gradients and parameters bit for bit (tests/mpi/graph_cases.py), with device
    buffers staged through the host (aware 0) or handed to MPI (1)."""
    import json
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if mpiexec is None:
        pytest.skip("mpiexec not installed")
    proc = subprocess.run([mpiexec, "-n", str(ranks), sys.executable,
                           os.path.join(REPO, "tests", "mpi", "graph_cases.py"), kind,
                           coarsest], cwd=REPO,
                          env=_env(MGNN_CUDA_AWARE_MPI=aware), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["fake_cupy"] and got["same_as_uncaptured"], got
    assert got["max_diff_numba"] <= 1e-12, got
    n_solves = 2 * 3  # steps 2..4 capture or launch; a forward and an adjoint solve each
    assert got["cycles"] >= ranks * 4 and got["min_launches"] >= 3, got  # (3: every step after)
    assert (got["max_graphs_per_cycle"] > 1) == (ranks > 1), got
    assert got["graph_launches"] > ranks * n_solves and got["capture_allocs"] == 0, got
    # a send's wait rides on the next message (StackedEngine.wait_send): no graph is empty
    # (a sequential coarsest chain still has some: a receive right after another message)
    if coarsest == "redundant" or ranks == 1:
        assert got["empty_graphs"] == 0, got
    # one redundant coarsest solve per cycle and step, launched graphs included: 4 steps of
    # a forward solve (2 cycles) and an adjoint solve (1 cycle) at least
    assert (got["redundant_solves"] >= ranks * 4 * 3) == (coarsest == "redundant"), got
