"""``bench mgrit``: the counted layer evaluations equal the cost model's, and both statistics
(fastest and median samples) are reported for the forward and the adjoint solve."""
import numpy as np
import pytest

from mgnn.studies.bench import bench_mgrit, format_mgrit, time_samples


def test_bench_mgrit_counts_the_model_work_and_reports_both_statistics(monkeypatch):
    """With the timer stubbed, every statistic is known: MGRIT samples 4, 6, 8 (the fastest 4,
    median 6), the exact solve 2, 3, 10, its bare stacked chain 1.8, 2.5, 2.6 and the forward
    sweep 1.5, 5, 9 (serial: the fastest candidate by each statistic: forward fastest 1.5 (the
    sweep), median 2.5 (the chain); adjoint, which has no sweep, 1.8 and 2.5)."""
    import mgnn.studies.bench as bench
    fake = {"mgrit": [4.0, 6.0, 8.0], "uncaptured": [7.0] * 3, "exact": [2.0, 3.0, 10.0],
            "chain": [1.8, 2.5, 2.6], "sweep": [1.5, 5.0, 9.0]}
    order = []
    calls = ["mgrit", "uncaptured", "exact", "chain", "sweep", "mgrit", "uncaptured", "exact",
             "chain"]

    def samples(fn, repeats=7, warmup=2, min_time=0.05):
        fn()  # the real call runs once (the solvers must work), its time is replaced
        kind = calls[len(order)]  # rounds=1: forward, then adjoint (which has no sweep)
        order.append(kind)
        return list(fake[kind])
    monkeypatch.setattr(bench, "time_samples", samples)
    import numba

    from mgnn.backend.blas_threads import blas_controllers
    numba_before = numba.get_num_threads()
    blas = blas_controllers(True)
    blas_before = [c.num_threads for c in blas]
    try:
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        for c in blas:
            c.set_num_threads(2)
        counts = numba.get_num_threads(), [c.num_threads for c in blas]
        rows = bench_mgrit(n_layers=32, width=4, batch=2, repeats=3, rounds=1)
        # the pinned run's counts put back, Numba's and every BLAS's
        assert (numba.get_num_threads(), [c.num_threads for c in blas]) == counts
    finally:
        numba.set_num_threads(numba_before)
        for c, n in zip(blas, blas_before):
            c.set_num_threads(n)
    assert order == calls
    assert all((r["threads"], r["numba_threads"], r["blas_threads"]) == (1, 1, 1) and
               "threads=1 (BLAS 1, Numba 1)" in r["name"] for r in rows)
    assert [r["direction"] for r in rows] == ["forward", "adjoint"]
    for r in rows:
        assert r["evals"] == r["model_evals"] and r["captured"] and r["stacked"]
        assert (r["mgrit_s"], r["mgrit_median_s"]) == (4.0, 6.0)
    fwd, adj = rows
    assert (fwd["serial_s"], fwd["serial_median_s"]) == (1.5, 2.5)
    assert (adj["serial_s"], adj["serial_median_s"]) == (1.8, 2.5)  # no sweep for the adjoint
    assert np.isclose(fwd["cost_model_ratio"], 4.0 * 32 / (fwd["evals"] * 1.5))
    assert np.isclose(adj["cost_model_ratio_median"], 6.0 * 32 / (adj["evals"] * 2.5))
    text = format_mgrit(rows)
    assert text.count("medians:") == 2 and "target cost_model_ratio <= 1.1" in text


def test_time_samples_loops_until_each_sample_is_long_enough():
    calls = []
    samples = time_samples(lambda: calls.append(1), repeats=3, warmup=1, min_time=0.0)
    assert len(samples) == 3 and len(calls) == 1 + 1 + 3 and min(samples) >= 0


def test_bench_mgrit_auto_threads_as_layer_parallel_sets_them(monkeypatch):
    """threads='auto': one BLAS thread and Numba's threads on every core (what LayerParallel
    sets by default, unless the environment sets them), reported in each row."""
    import mgnn.studies.bench as bench
    from mgnn.comm import configure_threads
    monkeypatch.setattr(bench, "time_samples", lambda fn, **kw: (fn(), [1.0])[1])
    expected = configure_threads(None, "auto")  # what the bench will choose (then put back)
    rows = bench_mgrit(n_layers=32, width=4, batch=2, repeats=1, rounds=1, threads="auto")
    assert [r["direction"] for r in rows] == ["forward", "adjoint"]
    for r in rows:
        assert (r["threads"], r["blas_threads"], r["numba_threads"]) == \
            ("auto", expected["blas"], expected["numba"])
        assert f"threads=auto (BLAS {expected['blas']}, Numba {expected['numba']})" in r["name"]


def test_cli_passes_layers_dtype_and_activation_to_the_dense_solves(monkeypatch, capsys):
    """``bench mgrit --layers 32 --dtype float64 --activation tanh`` reaches every dense case
    (w = 16 and 64, threads 1 and auto); without them: N = 256, float32 relu."""
    import mgnn.studies.bench as bench
    import mgnn.studies.bench_spatial as bench_spatial
    from mgnn.__main__ import main
    seen = []
    monkeypatch.setattr(bench, "bench_mgrit", lambda **kw: seen.append(kw) or [])
    monkeypatch.setattr(bench_spatial, "mgrit_comparison", lambda **kw: [])
    monkeypatch.setattr(bench_spatial, "format_mgrit_comparison", lambda rows: "")
    monkeypatch.setattr(bench, "bench_training_steps", lambda **kw: [])
    assert main(["bench", "mgrit", "--layers", "32", "--dtype", "float64",
                 "--activation", "tanh"]) == 0
    dense = [k for k in seen if k.get("model", "dense") == "dense"]
    assert [(k["n_layers"], k["dtype"], k["activation"], k["width"], k["threads"])
            for k in dense] == [(32, "float64", "tanh", w, t)
                                for t in (1, "auto") for w in (16, 64)]
    conv = [(k["width"], k["batch"], k["image"], k["dtype"], k["activation"], k["threads"])
            for k in seen if k.get("model") == "conv"]  # the conv case: C 8, 16 at 28 x 28
    assert conv == [(c, 32, 28, "float64", "tanh", t) for t in (1, "auto") for c in (8, 16)]
    seen.clear()
    assert main(["bench", "mgrit"]) == 0
    assert {(k["n_layers"], k["dtype"], k["activation"]) for k in seen
            if k.get("model", "dense") == "dense"} == {(256, "float32", "relu")}


def test_bench_mgrit_conv_case_counts_its_work():
    """The conv case solves a conv ResNet (forward and adjoint) and reports its cost-model
    ratio like the dense one."""
    rows = bench_mgrit(n_layers=8, width=3, batch=2, image=5, model="conv", repeats=1,
                       rounds=1, cf=2, levels=2)
    assert [r["direction"] for r in rows] == ["forward", "adjoint"]
    for r in rows:
        assert r["model"] == "conv" and "conv C=3 5x5" in r["name"]
        assert r["evals"] > 8 and r["cost_model_ratio"] > 0 and r["stacked"]


def test_training_steps_of_every_kind_against_their_algorithmic_work():
    """The training-step rows: every model kind runs the stacked engine, the work is the cost
    model's (fine-step equivalents: a spatially coarsened level weighs less) and the ratio is
    the MGRIT step over serial x (W_fwd + W_adj + N) / 3N."""
    from mgnn.mgrit import cycle_work, level_sizes
    from mgnn.studies.bench import bench_training_steps, format_training_steps
    # two of the six cases (every kind's engine: tests/mgrit/test_engine_equality.py)
    rows = bench_training_steps(quick=True, repeats=1, rounds=1, cases=("dense w=16", "conv"))
    assert len(rows) == 2 and all(r["engines"] == ["StackedEngine"] for r in rows)
    dense = rows[0]
    N = dense["layers"]
    sizes = level_sizes(N, 4, 3, 1)
    nrelax = [0, 1]
    want = sum(cycle_work(sizes, 4, lambda lev: nrelax[min(lev, 1)], k == 0) for k in range(2))
    assert dense["work_fwd"] == dense["work_adj"] == want + sizes[0] - sizes[1]
    spatial = rows[-1]
    assert "spatial" in spatial["name"] and spatial["work_fwd"] < dense["work_fwd"] / 2
    for r in rows:
        algorithmic = r["serial_s"] * (r["work_fwd"] + r["work_adj"] + r["layers"]) / (
            3 * r["layers"])
        assert r["algorithmic_s"] == pytest.approx(algorithmic)
        assert r["ratio"] == pytest.approx(r["mgrit_s"] / algorithmic)
        # per phase: the bare chains' prices of a forward and an adjoint evaluation, the rest
        # of the serial step once
        assert 0 < r["step_fwd_s"] and 0 < r["step_adj_s"] and r["rest_s"] >= 0
        assert r["rest_s"] == pytest.approx(max(
            r["serial_s"] - r["layers"] * (r["step_fwd_s"] + r["step_adj_s"]), 0.0))
        phases = (r["work_fwd"] * r["step_fwd_s"] + r["work_adj"] * r["step_adj_s"]
                  + r["rest_s"])
        assert r["phases_s"] == pytest.approx(phases)
        assert r["phase_ratio"] == pytest.approx(r["mgrit_s"] / phases)
        assert r["fwd_solve_ratio"] > 0 and r["adj_solve_ratio"] > 0
    assert format_training_steps(rows).count("\n") == 4
