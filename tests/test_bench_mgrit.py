"""``bench mgrit``: the counted layer evaluations equal the cost model's, and both statistics
(fastest and median samples) are reported for the forward and the adjoint solve."""
import numpy as np

from mgnn.bench import bench_mgrit, format_mgrit, time_samples


def test_bench_mgrit_counts_the_model_work_and_reports_both_statistics():
    rows = bench_mgrit(n_layers=32, width=4, batch=2, repeats=2, rounds=1)
    assert [r["direction"] for r in rows] == ["forward", "adjoint"]
    for r in rows:
        assert r["evals"] == r["model_evals"] and r["captured"] and r["stacked"]
        assert 0 < r["mgrit_s"] <= r["mgrit_median_s"] and 0 < r["serial_s"] <= r["serial_median_s"]
        for key in ("cost_model_ratio", "cost_model_ratio_median"):
            assert np.isfinite(r[key]) and r[key] > 0
        assert abs(r["cost_model_ratio"] * r["evals"] * r["serial_s"] / 32 - r["mgrit_s"]) < 1e-12
    text = format_mgrit(rows)
    assert text.count("medians:") == 2 and "target cost_model_ratio <= 1.1" in text


def test_time_samples_loops_until_each_sample_is_long_enough():
    calls = []
    samples = time_samples(lambda: calls.append(1), repeats=3, warmup=1, min_time=0.0)
    assert len(samples) == 3 and len(calls) == 1 + 1 + 3 and min(samples) >= 0
