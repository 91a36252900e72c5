"""The spatial-coarsening study: call counts per level, work in fine-step equivalents, the
table and the training-step timer (tiny sizes)."""
import numpy as np

from mgnn import MGRITOptions
from mgnn.bench_spatial import (convergence_case, format_convergence, level_counts,
                                training_step, work_per_cycle)


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
