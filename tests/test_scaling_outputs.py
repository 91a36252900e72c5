"""Outputs of ``bench scaling``: file modes follow the umask, integer ticks, legends outside the
panels, and no pipeline-against-MGRIT verdict on one rank (synthetic rows, no MPI)."""
import os
import stat

import pytest

pytest.importorskip("matplotlib")
from mgnn import scaling  # noqa: E402

BASE = dict(n_layers=64, width=16, batch=32, levels=3, cf=4, fwd_iters=2, bwd_iters=1)


def _rows():
    rows = []
    for study, points in (("strong", [dict(ranks=P) for P in (1, 2, 4)]),
                          ("sweep-levels", [dict(ranks=4, levels=L) for L in (2, 3)])):
        for pt in points:
            cfg = dict(BASE, **pt)
            P = cfg["ranks"]
            for key, t in (("serial", 1.0), ("layerwise", 1.1), ("pipeline-2", 0.1 + 0.8 / P),
                           ("mgrit", 0.2 + 0.6 / P)):
                if key == "layerwise" and P == 1:
                    continue
                rows.append(dict(cfg, study=study, key=key, method=key.split("-")[0],
                                 micro_batches=2 if key.startswith("pipe") else 0, time_s=t,
                                 exposed_halo_pct=0.0, predicted_s=t * 0.9,
                                 oversubscribed=False))
    return scaling.finish_rows(rows)


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def test_files_follow_the_umask(tmp_path, umask_027):
    rows = _rows()
    pngs = scaling.write_outputs(str(tmp_path), rows, scaling.verdicts(rows),
                                 {"forward, 3 levels": [1.0, 0.1, 0.01]}, {"cores": 2})
    names = sorted(os.listdir(tmp_path))
    assert names == ["parallel.png", "residuals.png", "scaling.csv", "scaling.json",
                     "speedup.png", "time.png"], names  # no temporary file left over
    for name in names:
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o640, name
    assert len(pngs) == 4


def _check_axes(fig, values):
    import matplotlib.pyplot as plt
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax, xs in zip(fig.axes, values):
        assert list(ax.get_xticks()) == xs
        legend = ax.get_legend()
        box, leg = ax.get_window_extent(renderer), legend.get_window_extent(renderer)
        assert leg.x0 >= box.x1, "the legend overlaps the plotting area"
    others = [a.get_window_extent(renderer) for a in fig.axes]
    for ax in fig.axes:  # and no legend lies over a neighbouring panel
        leg = ax.get_legend().get_window_extent(renderer)
        assert not any(o.overlaps(leg) for o in others)
    plt.close(fig)


def test_integer_ticks_and_legends_outside():
    fig = scaling.plot_metric(_rows(), "speedup", "speedup")
    _check_axes(fig, [[1, 2, 4], [2, 3]][::-1] if fig.axes[0].get_title() != "strong"
                else [[1, 2, 4], [2, 3]])
    fig = scaling.plot_residuals({"forward": [1.0, 0.5, 0.1, 0.01], "adjoint": [1.0, 0.2]})
    fig.canvas.draw()
    ticks = [t for t in fig.axes[0].get_xticks() if 0 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    leg = fig.axes[0].get_legend().get_window_extent(fig.canvas.get_renderer())
    assert leg.x0 >= fig.axes[0].get_window_extent(fig.canvas.get_renderer()).x1


def test_no_pipeline_verdict_on_one_rank():
    rows = _rows()
    ver = scaling.verdicts(rows)
    text = scaling.format_table(rows, ver)
    one = [line for line in text.splitlines() if " P=1 " in line]
    assert one and not any("pipeline overtakes" in line for line in one), one
    assert any("pipeline overtakes MGRIT at M=2" in line for line in text.splitlines()
               if " P=4 " in line)
    assert all(v["pipeline_overtakes_mgrit_at_M"] is None for v in ver if v["ranks"] == 1)


def test_conv_study_point_compares_spatial_coarsening_in_fine_step_equivalents():
    """One process, conv ResNet with --spatial-levels 0: an mgrit-spatial row beside mgrit,
    whose work per step (fine-step equivalents, 28 x 28 -> 14 x 14: a coarse step costs 1/4)
    and cost-model time are below mgrit's; the work is the weighted cycle work by hand."""
    from mgnn.mgrit import MGRITOptions, cycle_work, level_sizes
    cfg = dict(model="conv", n_layers=8, width=1, batch=2, levels=2, cf=2, fwd_iters=2,
               bwd_iters=1, micro=[], spatial=(0,))
    rows = {r["key"]: r for r in scaling.study_point(None, cfg, repeats=1)}
    assert set(rows) == {"serial", "mgrit", "mgrit-nooverlap", "mgrit-spatial"}
    sizes = level_sizes(8, 2, 2, 2)
    opts = MGRITOptions(cf=2, max_levels=2, nrelax=[0, 1])

    def per_step(cost):
        work = [cycle_work(sizes, 2, opts.nrelax_on, k == 0, level_cost=cost) for k in range(2)]
        adj = cycle_work(sizes, 2, opts.nrelax_on, True, level_cost=cost)
        return (8 + sum(work) + adj + 2 * (sizes[0] - sizes[1])) / 8, sum(work) / 2 / 8

    for key, cost in (("mgrit", [1, 1]), ("mgrit-spatial", [1, 0.25])):
        step, cycle = per_step(cost)
        assert rows[key]["work_per_step"] == pytest.approx(step, rel=1e-14)
        assert rows[key]["work_per_cycle"] == pytest.approx(cycle, rel=1e-14)
    assert rows["mgrit-spatial"]["work_per_step"] < rows["mgrit"]["work_per_step"]
    assert rows["mgrit-spatial"]["predicted_s"] < rows["mgrit"]["predicted_s"]
    assert rows["mgrit-spatial"]["spatial"] == "0" and rows["serial"]["work_per_step"] == 3.0
    hist = scaling.residual_histories(cfg, cycles=2)
    assert set(hist) == {"forward, 2 levels", "adjoint, 2 levels",
                         "forward, 2 levels, spatial 0", "adjoint, 2 levels, spatial 0"}
    with pytest.raises(ValueError, match="needs --model conv"):
        scaling._spatial("0", "dense")
    with pytest.raises(ValueError, match="comma-separated ints"):
        scaling._spatial("0,x", "conv")


def test_dense_study_point_takes_the_dtype_and_activation():
    """--dtype float32 --activation relu reach the dense network of every row (the issue's
    configuration), its default stays float64 tanh, and other models refuse them by name."""
    import types

    import numpy as np

    cfg = dict(model="dense", n_layers=8, width=4, batch=4, levels=2, cf=2, fwd_iters=1,
               bwd_iters=1, micro=[2], dtype="float32", activation="relu")
    model, x, _ = scaling._problem(cfg)
    assert model.dtype == np.float32 and x.dtype == np.float32
    assert model.config["activation"] == "relu"
    rows = scaling.study_point(None, cfg, repeats=1)
    assert {r["key"] for r in rows} == {"serial", "pipeline-2", "mgrit", "mgrit-nooverlap"}
    assert all((r["dtype"], r["activation"]) == ("float32", "relu") for r in rows), rows
    default = scaling._problem(dict(cfg, dtype=None, activation=None))[0]
    assert (default.dtype, default.config["activation"]) == (np.float64, "tanh")

    args = types.SimpleNamespace(dtype=None, activation=None)
    assert scaling._dense_settings(args, "dense") == ("float64", "tanh")
    assert scaling._dense_settings(args, "conv") == (None, None)
    args = types.SimpleNamespace(dtype="float32", activation="relu")
    assert scaling._dense_settings(args, "dense") == ("float32", "relu")
    with pytest.raises(ValueError, match="--dtype float32 needs --model dense, got --model gru"):
        scaling._dense_settings(args, "gru")
    args = types.SimpleNamespace(dtype=None, activation="relu")
    with pytest.raises(ValueError, match="--activation relu needs --model dense"):
        scaling._dense_settings(args, "conv")
