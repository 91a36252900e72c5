"""scripts/gpu_check.py, the one prepared GPU check, tested without a GPU: its ``--emulate`` mode
runs the same benchmark functions on the cuda-emulated backend (tiny sizes), and the GPU-only
sections are driven far enough to check their parsing and reporting."""
import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from mgnn.backend import available_backends, gpu_available

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "gpu_check.py")
TABLE_HEADER = "| check | value | target | status |"

#: Rows of the benchmark section that must carry a finite number.
BENCH_ROWS = ("bench.dense.float32.fused_s", "bench.dense.float32.unfused_s",
              "bench.dense.float32.ratio", "bench.dense.float64.ratio",
              "bench.dense.float32.error", "bench.mem.copy_Bps", "bench.mem.axpy.ratio",
              "bench.mem.sq_norm.ratio", "bench.mem.residual.ratio", "bench.mem.correct.ratio",
              "bench.train.mgrit_s", "bench.train.serial_s", "bench.train.speedup",
              "bench.train.mgrit_nographs_s", "bench.train.graphs_equal",
              "bench.train.launches", "bench.gemm.w8.error", "bench.gemm.w8.ratio",
              "bench.gemm.w16.error", "bench.gemm.w16.ratio",
              "bench.gemm.w16.adjoint_error", "bench.conv.2d.c3.error", "bench.conv.2d.c3.ratio",
              "bench.conv.3d.c3.error", "bench.conv.3d.c3.mgnn_s")

needs_emulation = pytest.mark.skipif("cuda-emulated" not in available_backends(),
                                     reason="the cuda-emulated backend needs a C++ compiler")


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(*args, timeout=300):
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=REPO, env=env, timeout=timeout,
                          capture_output=True, text=True)


@pytest.mark.slow
@needs_emulation
def test_emulated_run_prints_the_table_and_writes_numeric_benchmarks(tmp_path):
    out = tmp_path / "x.json"
    proc = _run("--emulate", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert TABLE_HEADER in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1].startswith(tuple("0123456789"))  # summary line
    report = json.loads(out.read_text())
    assert report["mode"] == "emulated" and report["finished"] == "completed"
    rows = {r["id"]: r for r in report["rows"]}
    assert not [r for r in report["rows"] if r["status"] == "FAIL"], report["rows"]
    for rid in BENCH_ROWS:
        assert rid in rows, (rid, sorted(rows))
        v = rows[rid]["value"]
        assert isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), \
            rows[rid]
        assert rows[rid]["section"] == "bench"
        assert rows[rid]["display"] in proc.stdout  # every row is in the printed table
    assert rows["bench.train.launches"]["value"] > 0
    assert "default 512" in rows["bench.gemm.crossover"]["display"]
    for rid in ("tests.gpu", "cli.single", "cli.mpi2", "env.gpu"):
        assert rows[rid]["status"] == "SKIP"
    assert rows["env.versions"]["status"] == "INFO"


@pytest.mark.skipif(gpu_available(), reason="a GPU is present")
def test_without_a_gpu_and_without_emulate_exit_code_is_2(tmp_path):
    proc = _run("--out", str(tmp_path / "y.json"), timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA GPU" in proc.stderr and "--emulate" in proc.stderr


@pytest.mark.slow
@needs_emulation
def test_watchdog_ends_a_run_with_the_table(tmp_path):
    out = tmp_path / "w.json"
    proc = _run("--emulate", "--budget", "-44", "--out", str(out), timeout=120)  # fires at 1 s
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert TABLE_HEADER in proc.stdout and "WATCHDOG" in proc.stdout
    report = json.loads(out.read_text())
    assert report["finished"].startswith("watchdog")
    assert any(r["id"] == "watchdog" and r["status"] == "FAIL" for r in report["rows"])


def test_parsers():
    gc = _load()
    p = gc.parse_pytest_summary
    assert p(["....", "3 passed, 1 skipped, 370 deselected in 2.01s"]) == dict(
        passed=3, failed=0, skipped=1, deselected=370, errors=0, xfailed=0, xpassed=0)
    got = p(["FAILED tests/a.py::t - x", "===== 1 failed, 2 passed, 1 error in 3.2s ====="])
    assert (got["failed"], got["passed"], got["errors"]) == (1, 2, 1)
    assert p(["no tests ran in 0.1s"])["passed"] == 0
    assert p(["collecting ...", "Traceback"]) is None
    help_text = "  --dtype {float32,float64}\n  --backend {numpy,numba,cuda}\n"
    assert gc.backend_choices_from_help(help_text) == ["numpy", "numba", "cuda"]
    assert gc.backend_choices_from_help("no such flag") == []
    summary, final = gc.parse_train_output(
        ["mgnn train: ...", "final test accuracy 91.41%  (1.0 s training, 2.00 ms/batch)",
         json.dumps({"test_accuracy": 0.9141, "ranks": 1})])
    assert summary["test_accuracy"] == 0.9141 and final.startswith("final test accuracy 91.41%")
    assert gc.fmt_seconds(2e-5) == "20.0 us" and gc.fmt_rate(3.5e12) == "3.50 TB/s"


def test_a_failing_check_is_a_fail_row_and_the_rest_runs(tmp_path, capsys):
    gc = _load()
    out = tmp_path / "r.json"
    rep = gc.Report(str(out), {"mode": "test"})

    def boom():
        raise RuntimeError("kernel | exploded")

    assert gc.guarded(rep, "a", "bench", "first", boom) is None
    gc.guarded(rep, "b", "bench", "second", rep.add, "b", "bench", "second", value=1.5,
               unit="x", target=">= 1", status="PASS")
    args = gc.parse_args(["--out", str(out)])
    assert gc.finish(rep, args) == 1
    text = capsys.readouterr().out
    assert "| 3 bench: first | RuntimeError: kernel \\| exploded | - | FAIL |" in text
    assert "| 3 bench: second | 1.5x | >= 1 | PASS |" in text
    report = json.loads(out.read_text())
    assert [r["status"] for r in report["rows"]] == ["FAIL", "PASS"]
    assert report["counts"]["FAIL"] == 1
    rep.rows.pop(0)
    rep.add("c", "bench", "slow", value=0.5, target=">= 0.8", status="MISS")
    assert gc.finish(rep, args) == 0
    assert gc.finish(rep, gc.parse_args(["--out", str(out), "--strict"])) == 1


@pytest.mark.slow
@pytest.mark.skipif(gpu_available(), reason="a GPU is present (the sections would really run)")
def test_gpu_sections_report_failures_without_a_gpu(capsys):
    """The pytest and CLI sections run their subprocesses and parse them: without a GPU the GPU
    tests all skip (0 passed) and the CLI cannot train on 'cuda', so every row is a FAIL with a
    message, and nothing raises."""
    gc = _load()
    rep = gc.Report(None, {"mode": "test"})
    st = gc.Setup(emulated=False, backend="cuda", xp=np, sync=lambda: None, repeats=1, warmup=0,
                  min_time=0.0, dense=(8, 8), mem_elems=64, numba_threads=None,
                  train=dict(n_layers=16, width=8, batch=8, cf=4), budget=600)
    args = gc.parse_args(["--tests-timeout", "200", "--cli-timeout", "120"])
    gc.section_tests(rep, st, args)
    gc.section_cli(rep, st, args)
    rows = {r["id"]: r for r in rep.rows}
    t = rows["tests.gpu"]
    assert t["status"] == "FAIL" and "0 passed" in t["display"], t
    assert json.loads(t["detail"])["skipped"] > 0
    for rid in ("cli.single", "cli.mpi2"):
        assert rows[rid]["status"] == "FAIL" and rows[rid]["display"], rows[rid]


def test_missing_mpiexec_is_a_skip_not_a_failure(monkeypatch):
    """A GPU machine without an MPI launcher: the 2-rank CLI row says SKIP with the reason (the
    1-process row still runs), since a missing prerequisite is not a GPU failure."""
    import shutil
    gc = _load()
    ran = []

    def fake_run(cmd, timeout, echo=True, env=None):
        ran.append(cmd)
        text = ("  --backend {numpy,numba,cuda}\n" if "--help" in cmd else
                json.dumps({"test_accuracy": 0.5}) + "\n")
        return gc.CmdResult(rc=0, lines=text.splitlines(), timed_out=False, seconds=1.0)

    monkeypatch.setattr(gc, "run_cmd", fake_run)
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    rep = gc.Report(None, {"mode": "test"})
    st = gc.Setup(emulated=False, backend="cuda", xp=np, sync=lambda: None, repeats=1, warmup=0,
                  min_time=0.0, dense=(8, 8), mem_elems=64, numba_threads=None,
                  train=dict(n_layers=16, width=8, batch=8, cf=4), budget=600)
    gc.section_cli(rep, st, gc.parse_args([]))
    rows = {r["id"]: r for r in rep.rows}
    assert rows["cli.single"]["status"] == "PASS", rows["cli.single"]
    assert rows["cli.mpi2"]["status"] == "SKIP" and "mpiexec" in rows["cli.mpi2"]["detail"]
    assert not any("mpiexec" in str(c) for c in ran)


@pytest.mark.mpi
def test_the_cpu_section_measures_real_mpiexec_points(tmp_path):
    """Section 5 as the GPU machine runs it, at tiny sizes on P = 2 here (its 16 cores run
    P = 4, 8, 16): scripts/validate_predictor.py under real mpiexec, one row per measured
    point with the measured, predicted and bound times and PASS/MISS against 25 %; P beyond
    the cores and a used-up budget are skips, not failures."""
    import shutil
    gc = _load()
    if shutil.which("mpiexec", path=os.path.dirname(sys.executable)) is None:
        pytest.skip("mpiexec not installed")
    st = gc.Setup(emulated=True, backend="cuda-emulated", xp=np, sync=lambda: None, repeats=1,
                  warmup=0, min_time=0.0, dense=(8, 8), mem_elems=64, numba_threads=None,
                  train=dict(n_layers=16, width=8, batch=8, cf=4), budget=600)
    grid = ("--per-rank", "4", "--levels", "3", "--repeats", "3", "--width", "8", "--batch",
            "8", "--calibration-layers", "16")
    rep = gc.Report(str(tmp_path / "r.json"), {"mode": "test"})
    gc.section_cpu(rep, st, gc.parse_args(["--cpu-ranks", "2"]), grid=grid)
    rows = {r["id"]: r for r in rep.rows}
    row = rows["cpu.P2.n4.L3"]
    assert row["status"] in ("PASS", "MISS") and row["target"] == "|error| <= 25%"
    assert row["status"] == ("PASS" if abs(row["value"]) <= 0.25 else "MISS")
    got = json.loads(row["detail"])
    assert got["measured_s"] > 0 and 0 < got["bound_s"] < got["predicted_s"]
    rep = gc.Report(None, {"mode": "test"})
    gc.section_cpu(rep, st, gc.parse_args(["--cpu-ranks", "4096"]), grid=grid)
    assert rep.rows[0]["status"] == "SKIP" and "cores" in rep.rows[0]["detail"]
    rep = gc.Report(None, {"mode": "test"})
    gc.section_cpu(rep, st, gc.parse_args([]), grid=grid)  # emulated, no --cpu-ranks
    assert rep.rows[0]["status"] == "SKIP" and rep.rows[0]["detail"] == "emulated run"
    st.budget = 0.0
    rep = gc.Report(None, {"mode": "test"})
    gc.section_cpu(rep, st, gc.parse_args(["--cpu-ranks", "2"]), grid=grid)
    assert rep.rows[0]["status"] == "SKIP" and "budget" in rep.rows[0]["detail"]
