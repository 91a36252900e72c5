"""``python -m mgnn train`` under a real ``mpiexec -n 2``: input errors found before training are
the serial run's one line on every rank (exit code 2, no traceback, no MPI_Abort), a resumed
``--warm-start`` run continues exactly, and rank 0 compiles the kernels before the other ranks
(tests/test_compile_first.py checks the order of calls)."""
import os
import subprocess
import sys

import numpy as np
import pytest

from mgnn.train import load_checkpoint
from tests.mpi.test_mpi import HAVE_MPI, MPIEXEC, REPO

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(not HAVE_MPI, reason="mpi4py/mpiexec not installed")]

ENV = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
           PYTHONPATH=REPO, PYTHONWARNINGS="ignore")
SMALL = ["--data", "synthetic", "--layers", "8", "--width", "8", "--batch-size", "64",
         "--dtype", "float64", "--no-progress", "--seed", "3"]


def per_rank(tmp_path, *args, n=2, main=("-m", "mgnn")):
    """Run ``python *main train *args`` on n ranks; [(exit code, stderr)] of each rank, and the
    launcher's own CompletedProcess."""
    cmd = (f'r=${{PMI_RANK:-$OMPI_COMM_WORLD_RANK}}; "$0" "$@" '
           f'2>"{tmp_path}/err.$r"; c=$?; echo $c >"{tmp_path}/rc.$r"; exit $c')
    proc = subprocess.run([MPIEXEC, "-n", str(n), "sh", "-c", cmd, sys.executable, *main,
                           "train", *args],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    return [(int((tmp_path / f"rc.{r}").read_text()), (tmp_path / f"err.{r}").read_text())
            for r in range(n)], proc


CASES = {
    "missing data folder": (["--data", "mnist", "--data-dir", "/nonexistent/mnist"],
                            "MNIST folder '/nonexistent/mnist' does not exist"),
    "layer ranks vs coarse grid": (["--levels", "2", "--cf", "16"],
                                   "2 layer ranks but --layers 8 with --cf 16 allow at most 1"),
    "huge width": (["--width", "1000000000"], "--width 1000000000 and --batch-size 64"),
    "bad flag": (["--epochs", "0"], "--epochs must be >= 1, got 0"),
    "corrupt checkpoint": (["--resume", "{tmp}/bad.npz"], "{tmp}/bad.npz: not a readable mgnn"),
    "checkpoint path is a folder": (["--checkpoint", "{tmp}"], "cannot write checkpoint {tmp}:"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_input_errors_are_one_line_on_every_rank(case, tmp_path):
    args, message = CASES[case]
    (tmp_path / "bad.npz").write_bytes(b"PK\x03\x04 truncated")
    args = [a.format(tmp=tmp_path) for a in args]
    ranks, proc = per_rank(tmp_path, *SMALL, *args)
    lines = {err for _, err in ranks}
    assert len(lines) == 1, ranks  # the same line on both ranks
    line = lines.pop()
    for rc, err in ranks:
        assert rc == 2, ranks
        assert err.count("\n") == 1 and err.startswith("mgnn: error: "), ranks
        assert message.format(tmp=tmp_path) in err, ranks
    assert proc.returncode == 2, proc.stderr
    for text in (line, proc.stdout, proc.stderr):
        assert "Traceback" not in text and "Abort" not in text and "BAD TERMINATION" not in text


DISK_FULL = """
import errno, os, sys
import numpy as np
from mgnn.__main__ import main
def disk_full(f, **arrays):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
np.savez = disk_full  # only the first rank writes checkpoints
sys.exit(main(sys.argv[1:]))
"""


def test_checkpoint_write_failure_during_training_is_one_line_on_every_rank(tmp_path):
    path = tmp_path / "c.npz"
    ranks, proc = per_rank(tmp_path, *SMALL, "--epochs", "1", "--checkpoint", str(path),
                           main=("-c", DISK_FULL))
    want = f"mgnn: error: cannot write checkpoint {path}: No space left on device\n"
    assert ranks == [(2, want), (2, want)], ranks
    assert "Abort" not in proc.stderr + proc.stdout
    assert not path.exists() and not (tmp_path / ".c.npz.tmp").exists()


def test_resume_with_warm_start_on_two_replicas_equals_the_uninterrupted_run(tmp_path):
    """Warm-start states of both data replicas are checkpointed (as one global batch)."""
    opts = [*SMALL, "--data-ranks", "2", "--levels", "2", "--cf", "2", "--fwd-iters", "1",
            "--bwd-iters", "1", "--warm-start"]
    full, part, res = (str(tmp_path / f) for f in ("full.npz", "part.npz", "res.npz"))
    for args in (["--epochs", "2", "--checkpoint", full], ["--epochs", "1", "--checkpoint", part],
                 ["--epochs", "2", "--resume", part, "--checkpoint", res]):
        ranks, proc = per_rank(tmp_path, *opts, *args)
        assert [rc for rc, _ in ranks] == [0, 0], ranks
    a, b = load_checkpoint(full), load_checkpoint(res)
    assert a["warm"]["batch"] == 64
    for k in a["params"]:
        np.testing.assert_array_equal(b["params"][k], a["params"][k], err_msg=k)


def test_rank_zero_compiles_first_then_every_rank_trains(tmp_path):
    """Under MPI the kernels are compiled (or loaded) into Numba's cache by rank 0 alone before
    the collective compile step (concurrent compiles into one cache can kill a rank), and the
    run then trains on both ranks."""
    proc = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "mgnn", "train", *SMALL,
                           "--epochs", "1", "--levels", "2", "--cf", "2"],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.count("kernels compiled (or loaded) on rank 0 in ") == 1, out
    assert out.index("on rank 0 in ") < out.index("kernels ready in ") < out.index("epoch   1/1")
    assert "final test accuracy" in out


def test_levels_auto_chooses_one_level_count_on_every_rank(tmp_path):
    """--levels auto on 2 layer ranks: the choice is logged with the critical path of every
    level count, made from the slowest rank's times (so every rank takes the same one: a
    difference would hang or fail the solve), and training runs with it. A GRU (its step reads
    the sequence's inputs) and a dense ResNet; then with the choice forced to 3 levels (this
    machine's times pick 1 at this size), the MGRIT run that follows a choice."""
    import json
    import re
    runs = {"dense": (["-m", "mgnn"], SMALL + ["--layers", "32", "--cf", "2"]),
            "gru": (["-m", "mgnn"], ["--model", "gru", "--data", "sine", "--seq-len", "16",
                                     "--width", "8", "--batch-size", "16", "--no-progress",
                                     "--limit-train", "64", "--limit-test", "32"]),
            # (the module: mgnn.mgrit's attribute 'hierarchy' is the function of that name)
            "forced": (["-c", "import sys, importlib; h = importlib.import_module("
                              "'mgnn.mgrit.hierarchy'); h.auto_levels = "
                              "lambda *a, **k: (3, {1: 90.0, 2: 50.0, 3: 40.0}); "
                              "from mgnn.__main__ import main; sys.exit(main(sys.argv[1:]))"],
                       SMALL + ["--layers", "32", "--cf", "2"])}
    for name, (main, args) in runs.items():
        proc = subprocess.run([MPIEXEC, "-n", "2", sys.executable, *main, "train", *args,
                               "--epochs", "1", "--levels", "auto", "--json"], cwd=REPO,
                              env=ENV, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (name, proc.stderr)
        m = re.search(r"--levels auto: (\d+) \(critical path in forward steps per level "
                      r"count: 1: \d+, 2: \d+", proc.stderr)
        assert m, (name, proc.stderr)
        levels = int(m.group(1))
        assert ("MGRIT: levels" in proc.stderr) == (levels > 1), (name, proc.stderr)
        assert json.loads(proc.stdout)["levels"] == levels
        if name == "forced":
            assert levels == 3 and "MGRIT: levels [32, 16, 8] (intervals), cf 2" in proc.stderr


def test_levels_auto_on_one_layer_rank_is_layer_by_layer(capsys):
    from mgnn.__main__ import main
    assert main(["train", *SMALL, "--epochs", "1", "--levels", "auto"]) == 0
    assert "--levels auto: 1 (one layer rank" in capsys.readouterr().out
