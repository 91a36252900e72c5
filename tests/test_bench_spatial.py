"""The spatial-coarsening study: call counts per level, work in fine-step equivalents, the
table and the training-step timer (tiny sizes)."""
import numpy as np

from mgnn import MGRITOptions
from mgnn.studies.bench_spatial import (convergence_case, format_convergence, format_mgrit_comparison,
                                level_counts, mgrit_comparison, training_step, work_per_cycle)


def test_level_counts_and_work_per_cycle_by_hand():
    # two levels, cf 2, N = 8, F-relaxation only, one cycle: F-relax (4 intervals x 1 F-point),
    # the restriction's F-relax (4) + 4 residual steps + 3 FAS steps on level 1 (points i >= 1
    # except the first: i = 2..4 need Phi_c(v_{i-1}), i = 1 too: 4), the coarsest chain (4),
    # the final F-relax (4)
    opts = MGRITOptions(cf=2, max_levels=2, nrelax=0, tol=0.0, max_iter=1,
                        warn_not_converged=False)
    counts = level_counts(8, opts)
    assert counts == {0: 4 + 4 + 4, 1: 4 + 4}
    # a level-1 step on 2D images coarsened once costs 1/4, in 3D 1/8
    assert work_per_cycle(counts, (0,), 2, 8, 1) == (12 + 8 / 4) / 8
    assert work_per_cycle(counts, (0,), 3, 8, 1) == (12 + 8 / 8) / 8
    assert work_per_cycle(counts, (), 3, 8, 1) == 20 / 8


def test_convergence_case_and_table():
    row = convergence_case((8, 8, 8), n_layers=8, channels=2, batch=2, cf=2, levels=2,
                           spatial=(0,), cycles=2, backend="numpy")
    assert len(row["forward"]) == 2 and len(row["adjoint"]) == 2
    assert row["fine_share"] < row["work_per_cycle"]
    plain = convergence_case((8, 8, 8), n_layers=8, channels=2, batch=2, cf=2, levels=2,
                             spatial=(), cycles=2, backend="numpy")
    assert plain["work_per_cycle"] > row["work_per_cycle"]
    assert plain["forward"][0] == row["forward"][0]  # the same first residual
    text = format_convergence([plain, row])
    assert "8x8x8" in text and len(text.splitlines()) == 3


def test_training_step_reports_time_and_histories():
    row = training_step(size=(8, 8, 8), n_layers=8, channels=2, batch=2, cf=2, levels=3,
                        spatial=(0, 1), repeats=1, backend="numpy")
    assert row["seconds_per_step"] > 0 and len(row["forward"]) == 2 and len(row["adjoint"]) == 1
    assert np.isfinite(row["forward"]).all()


def test_mgrit_comparison_counts_work_in_fine_step_equivalents():
    """bench mgrit's spatial rows: with the counts of the by-hand case above (N = 8, cf 2, two
    levels, one cycle each way: 12 fine and 8 coarse steps per solve, 4 of the fine ones the
    final F-relaxation), a coarse 3D step costing 1/8: forward work per cycle (12 - 4 + 8) / 8
    without and (12 - 4 + 1) / 8 with spatial coarsening; per training step both solves plus
    N gradients."""
    rows = mgrit_comparison(size=(8, 8, 8), n_layers=8, channels=2, batch=2, cf=2, levels=2,
                            fwd_iters=1, bwd_iters=1, repeats=1, backend="numpy")
    serial, plain, spatial = rows
    assert [r["run"] for r in rows] == ["serial", "mgrit", "mgrit-spatial"]
    assert serial["work_per_step"] == 3.0 and abs(serial["cost_model_ratio"] - 1.0) < 1e-12
    assert plain["fwd_work_per_cycle"] == plain["adj_work_per_cycle"] == 2.0
    assert spatial["fwd_work_per_cycle"] == spatial["adj_work_per_cycle"] == 9 / 8
    assert plain["work_per_step"] == (20 + 20 + 8) / 8
    assert spatial["work_per_step"] == (13 + 13 + 8) / 8
    assert plain["forward"][0] == spatial["forward"][0]  # the same first residual
    for r in rows:
        assert r["seconds_per_step"] > 0 and np.isfinite(r["cost_model_ratio"])
    text = format_mgrit_comparison(rows)
    assert "8x8x8" in text and len(text.splitlines()) == 4 and "spatial 0" in text
