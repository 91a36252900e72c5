"""Real ``mpiexec -n P`` runs (P = 1..4 on this 2-core machine), each under a timeout."""
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")

try:
    import mpi4py  # noqa: F401
    HAVE_MPI = MPIEXEC is not None
except ImportError:
    HAVE_MPI = False

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(not HAVE_MPI, reason="mpi4py/mpiexec not installed")]


def mpirun(n, *args, timeout=300):
    """Run ``python *args`` on n ranks; returns CompletedProcess (never hangs past timeout)."""
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=REPO)
    return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _json(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the last JSON line: Open MPI may forward terminal escapes or warnings after it
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith(("{", "["))][-1])


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_distributed_solver_equals_serial(ranks):
    out = _json(mpirun(ranks, "-m", "tests.mpi.mpi_cases", "solver"))
    assert out["ranks"] == ranks and out["configs"] > 100


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_spatial_coarsening_distributed_equals_serial(ranks):
    out = _json(mpirun(ranks, "-m", "tests.mpi.mpi_cases", "spatial", timeout=120))
    assert out["ranks"] == ranks and out["configs"] == 16


@pytest.mark.parametrize("ranks, data_ranks", [(2, 1), (3, 1), (4, 1), (4, 2)])
def test_spatial_coarsening_network_distributed_equals_one_process(ranks, data_ranks):
    out = _json(mpirun(ranks, "-m", "tests.mpi.mpi_cases", "spatial_network", str(data_ranks),
                       timeout=240))
    assert out["ranks"] == ranks and out["checked"] == 6


@pytest.mark.parametrize("ranks", [2, 3])
def test_reference_cases_distributed(ranks):
    out = _json(mpirun(ranks, "-m", "tests.mpi.mpi_cases", "reference"))
    assert out["cases"] >= 3


def test_failure_on_one_rank_ends_all_ranks():
    t0 = time.perf_counter()
    proc = mpirun(3, "-m", "tests.mpi.mpi_cases", "fail", timeout=60)
    assert time.perf_counter() - t0 < 30
    assert proc.returncode != 0
    assert "rank 2: RuntimeError: user propagator failed at step" in proc.stderr


@pytest.mark.parametrize("ranks, data_ranks", [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (4, 2),
                                               (4, 4)])
def test_distributed_network_equals_single_process(ranks, data_ranks):
    out = _json(mpirun(ranks, "-m", "tests.mpi.mpi_cases", "network", str(data_ranks)))
    assert out["checked"] == 14  # 2 nets x (3 MGRIT settings x 2 coarsest solves + layer-wise)


@pytest.mark.parametrize("ranks, data_ranks", [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (4, 2),
                                               (4, 4)])
def test_batch_norm_and_dropout_distributed_equal_single_process(ranks, data_ranks):
    out = _json(mpirun(ranks, "-m", "tests.mpi.mpi_cases", "composed", str(data_ranks)))
    # 4 nets x (MGRIT, layer-wise) x 2 steps (full, ragged) with sync_bn; with replicas also
    # 2 nets with per-replica statistics
    assert out["checked"] == 16 + (2 if data_ranks > 1 else 0)


@pytest.mark.parametrize("ranks, data_ranks", [(1, 1), (2, 1), (3, 1), (4, 1), (4, 2)])
def test_recurrent_models_distributed_equal_single_process(ranks, data_ranks):
    out = _json(mpirun(ranks, "-m", "tests.mpi.mpi_cases", "recurrent", str(data_ranks)))
    assert out["checked"] == 8  # 2 GRUs, implicit GRU, RNN x (MGRIT, step after step)


def test_bad_input_on_one_rank_raises_everywhere():
    out = _json(mpirun(3, "-m", "tests.mpi.mpi_cases", "bad_input", timeout=120))
    assert "rank 2" in out["message"]


def _train(ranks, *args, layer_ranks=None):
    cmd = ["-m", "mgnn", "train", "--data", "digits", "--layers", "16", "--width", "16",
           "--epochs", "2", "--dtype", "float64", "--no-progress", "--json", "--seed", "3",
           "--levels", "3", "--cf", "2", "--fwd-iters", "2", "--bwd-iters", "1",
           "--layer-ranks", str(layer_ranks or ranks), *args]
    return _json(mpirun(ranks, *cmd))


def test_cli_four_layer_ranks_equal_single_process():
    one = _train(1)
    four = _train(4)
    assert four["ranks"] == 4
    assert abs(four["final_loss"] - one["final_loss"]) <= 1e-10 * one["final_loss"]
    assert four["test_accuracy"] == one["test_accuracy"] > 0.8


def test_cli_data_parallel_equals_single_process():
    one = _train(1)
    two_by_two = _train(4, "--data-ranks", "2", layer_ranks=2)
    assert abs(two_by_two["final_loss"] - one["final_loss"]) <= 1e-10 * one["final_loss"]
    assert two_by_two["test_accuracy"] == one["test_accuracy"]


def test_checkpoint_is_independent_of_the_rank_count(tmp_path):
    """Save after epoch 1 on 3 layer ranks, resume on 1 process (and on 2 ranks): identical to an
    uninterrupted single-process run (round-off)."""
    from mgnn.train import load_checkpoint
    full, part = tmp_path / "full.npz", tmp_path / "part.npz"
    _train(1, "--checkpoint", str(full))
    _train(3, "--checkpoint", str(part), "--epochs", "1")
    for ranks in (1, 2):
        resumed = tmp_path / f"resumed{ranks}.npz"
        _train(ranks, "--resume", str(part), "--checkpoint", str(resumed))
        a, b = load_checkpoint(full), load_checkpoint(resumed)
        assert a["header"]["step"] == b["header"]["step"]
        for k in a["params"]:
            np.testing.assert_allclose(b["params"][k], a["params"][k], rtol=1e-10, atol=1e-12,
                                       err_msg=k)
        for k in a["optim"]:
            np.testing.assert_allclose(b["optim"][k], a["optim"][k], rtol=1e-8, atol=1e-14,
                                       err_msg=k)


def test_cli_bad_rank_grid_is_a_clean_error():
    proc = mpirun(2, "-m", "mgnn", "train", "--layer-ranks", "3", timeout=120)
    assert proc.returncode != 0 and "--layer-ranks 3 x --data-ranks 1 != 2" in proc.stderr


def test_bench_scaling_writes_csv_json_and_plots(tmp_path):
    """The scaling driver under mpiexec (timings are reported, never asserted)."""
    out = tmp_path / "scaling"
    proc = mpirun(2, "-m", "mgnn", "bench", "scaling", "--ranks", "1,2", "--n-layers", "32",
                  "--micro", "1,4", "--repeats", "1", "--levels", "2", "--out", str(out),
                  timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "scaling.json").read_text())
    rows = doc["rows"]
    keys = {(r["study"], r["ranks"], r["key"]) for r in rows}
    for P, key in ((1, "serial"), (2, "layerwise"), (2, "pipeline-4"), (2, "mgrit"),
                   (2, "mgrit-nooverlap"), (1, "mgrit")):
        assert ("strong", P, key) in keys
    assert any(study == "weak" for study, _, _ in keys)
    for r in rows:
        assert r["time_s"] > 0 and r["predicted_s"] > 0 and r["speedup"] > 0
        assert 0 <= r["exposed_halo_pct"] <= 100.0 + 1e-9
    assert {v["study"] for v in doc["verdicts"]} >= {"strong", "weak"}
    assert set(doc["fields"]) >= {"time_s", "speedup", "model_efficiency"}
    assert all(len(h) >= 2 for h in doc["residuals"].values())
    csv_lines = (out / "scaling.csv").read_text().splitlines()
    assert len(csv_lines) == len(rows) + 1 and csv_lines[0].startswith("study,method")
    for name in ("time.png", "speedup.png", "parallel.png", "residuals.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "fastest" in proc.stdout


@pytest.mark.parametrize("ranks", [2, 3])
def test_repeated_solves_mismatched_shards_and_unwritable_checkpoints(ranks):
    assert _json(mpirun(ranks, "-m", "tests.mpi.mpi_cases", "robustness", timeout=120))["ranks"]


@pytest.mark.parametrize("ranks, data_ranks", [(2, 1), (3, 1), (4, 1), (4, 2)])
def test_pipeline_baseline_equals_serial(ranks, data_ranks):
    out = _json(mpirun(ranks, "-m", "tests.mpi.mpi_cases", "pipeline", str(data_ranks)))
    assert out["checked"] >= 4


def _train_small(ranks, backend, *args):
    return _train(ranks, "--backend", backend, "--layers", "8", "--width", "8",
                  "--epochs", "1", "--batch-size", "32", "--limit-train", "160",
                  "--limit-test", "64", *args)


def test_cli_emulated_gpu_kernels_on_two_ranks_equal_numba():
    """`train --backend cuda-emulated` under mpiexec -n 2: the GPU kernels (host emulation),
    batched relaxation and device-path code of the training loop give the numba run's numbers."""
    ref = _train_small(1, "numba")
    emu = _train_small(2, "cuda-emulated")
    assert emu["ranks"] == 2
    assert abs(emu["final_loss"] - ref["final_loss"]) <= 1e-10 * ref["final_loss"]
    assert emu["test_accuracy"] == ref["test_accuracy"]


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [1, 2])
def test_cli_cuda_backend_equals_numba(ranks):
    """`train --backend cuda` on one GPU, and under mpiexec -n 2 sharing it."""
    from mgnn.backend import gpu_available
    if not gpu_available():
        pytest.skip("needs a CUDA GPU (cupy.cuda.is_available())")
    ref = _train_small(1, "numba")
    gpu = _train_small(ranks, "cuda")
    assert gpu["ranks"] == ranks
    assert abs(gpu["final_loss"] - ref["final_loss"]) <= 1e-8 * ref["final_loss"]


@pytest.mark.parametrize("ranks, data_ranks", [(2, 1), (4, 1)])
def test_captured_cycles_on_layer_ranks_equal_uncaptured(ranks, data_ranks):
    """Tapes with the halo messages between their segments: three training steps bit for bit
    the uncaptured engine's (dense, conv, GRU; both coarsest modes; fixed, converged and
    F-cycles)."""
    out = _json(mpirun(ranks, "-m", "tests.mpi.mpi_cases", "captured", str(data_ranks),
                       timeout=600))
    assert out["ranks"] == ranks and out["checked"] == 18
    # dense, conv and GRU, 3 settings x 2 coarsest modes, each replayed with message segments
    assert out["segmented"] == 18


def test_bench_gpu_launches_on_two_layer_ranks():
    """``mpiexec -n 2 python -m mgnn bench gpu-launches``: the host side of a GPU training step
    on two layer ranks (the counting stand-in's arrays handed to MPI as a CUDA-aware library
    takes device buffers), reported once, by rank 0. The captured cycles are graphs cut at
    their halo messages: more graphs than one rank's 5, fewer launches than without."""
    proc = mpirun(2, "-m", "mgnn", "bench", "gpu-launches", "--quick", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert [r["method"] for r in rows] == ["mgrit", "mgrit no graphs", "serial"]
    for r in rows:
        assert r["ranks"] == 2 and r["host_seconds"] > 0
        assert 0 < r["busy_seconds"] <= r["host_seconds"] and r["mpi_seconds"] >= 0
        # rank 0 holds half of the 128 layers: a forward and a backward launch per layer at
        # least (with graphs: inside them)
        assert r["launches"] + r["graph_kernels"] >= 2 * 64
    assert rows[0]["launches_by_kernel"].get("graph", 0) > 5
    assert rows[0]["launches"] < rows[1]["launches"] / 2 and rows[1]["graph_kernels"] == 0
