"""The predictor charges the real code's call structure (mgnn.studies.costs / predict): replays
of captured cycles as their rows, the final sweep's keep kernels, overheads per call and per
state, the critical-path bound, and the mpiexec validation grid."""
import shutil
import sys

import numpy as np
import pytest

from mgnn.backend import get_backend
from mgnn.backend import tape as T
from mgnn.comm.virtual import run_virtual
from mgnn.studies.costs import (CostTable, Recorder, _zero_outputs, cost_model,
                                recording_model, tape_seconds)
from mgnn.studies.predict import (_fit_overhead, _trainer, build_model, default_config,
                                  format_validation_grid, predict_point, validate_grid,
                                  validation_points)

GUARD = pytest.mark.timeout(300)
CFG = dict(n_layers=32, width=8, batch=8, levels=3, cf=2, fwd_iters=2, bwd_iters=1, micro=(2,))


def _ops(cfg):
    """Every (op, shape, dtype) a captured and an uncaptured MGRIT step and a serial one call."""
    rec = Recorder()
    model, x, y = build_model(cfg)
    rm = recording_model(model, rec)
    for method, capture in (("serial", True), ("mgrit", False), ("mgrit", True)):
        obj = _trainer(method, rm, None, cfg)
        obj.capture = capture
        for _ in range(2):
            obj.loss_and_grad(x, y)
    return {(op, shape, dtype) for op, shape, dtype, _, _ in rec.samples}


def _two_steps(comm, model, cfg, x, y, capture):
    """The virtual time of a second training step (the first captures where it may) and the
    rows of the forward and adjoint tapes that share a step (``SHARE_R``)."""
    obj = _trainer("mgrit", model, comm, cfg)
    obj.capture = capture
    obj.loss_and_grad(x, y)
    t0 = comm.clock
    obj.loss_and_grad(x, y)
    shared = sum(int(np.count_nonzero(t.rows[:, T.SHARE_R] >= 0))
                 for s in obj._solvers.values() for t in s._tapes.values() if t and t.replays)
    replays = sum(t.replays for s in obj._solvers.values() for t in s._tapes.values() if t)
    return comm.clock - t0, shared, replays


@GUARD
def test_a_replayed_cycle_is_charged_as_the_engine_calls_it_replaces():
    cfg = default_config(**CFG)
    b = 1e-4
    # per-state costs only: every kernel b per state, vector passes and replays free
    ops = _ops(cfg)
    table = CostTable({CostTable.key(*k): (0.0, 0.0 if k[0] == "run_tape" else b)
                       for k in ops}, alpha=0.0, beta=1e30)
    assert table.has("run_tape", "float32")  # the calibrated backend replays: so do these
    model, x, y = build_model(cfg)
    cm = cost_model(model, table)
    plain, _, none = run_virtual(1, _two_steps, cm, cfg, x, y, False)[0]
    replayed, shared, replays = run_virtual(1, _two_steps, cm, cfg, x, y, True)[0]
    assert none == 0 and replays >= 2  # the forward and the adjoint solve replayed
    # a shared first step replaces a coarse FAS point (b) by a vector pass (free here)
    assert replayed == pytest.approx(plain - shared * b, rel=1e-12)
    # and the rows' kernels are what they cost: priced again with vector passes
    vec = CostTable(dict(table.entries, **{CostTable.key(op, (8, 8), "float32"): (0.0, b)
                                           for op in ("vector:copy", "vector:correct")}),
                    alpha=0.0, beta=1e30)
    assert predict_point(cfg, vec, "mgrit", 1)["time"] > predict_point(cfg, table, "mgrit",
                                                                       1)["time"]


def test_tape_rows_are_priced_by_kind():
    rows = np.array([T.blank(T.CHAIN) for _ in range(3)] + [T.blank(T.POINT)]
                    + [T.blank(T.INJECT), T.blank(T.CORRECT), T.blank(T.INJECT),
                       T.blank(T.COPY)], dtype=np.int64)
    rows[0, T.N], rows[1, T.N], rows[2, T.N] = 3, 2, 1
    rows[1, T.R], rows[1, T.MODE] = 0, 0            # a residual tail
    rows[2, T.SHARE_R], rows[2, T.CORR_SLOT] = 0, 1  # a shared step, a carried correction
    rows[2, T.INJ_SLOT], rows[2, T.INJ_G] = 2, 0     # a carried injection into two stores
    rows[3, T.MODE] = 1                              # a FAS point
    rows[4, T.LEN], rows[4, T.G] = 4, -1             # an injection of 4 states, one store
    rows[5, T.LEN] = 5                               # a correction of 5
    rows[6, T.LEN], rows[6, T.G] = 2, 1              # an injection of 2 into two stores
    rows[7, T.R] = 1                                 # a copy of store 1 (3 slots)
    shape, dt = (2, 3), "float32"
    price = {"chains_forward": 1.0, "points_forward:0": 10.0, "points_forward:1": 100.0,
             "vector:copy": 1000.0, "vector:correct": 10000.0}
    table = CostTable({CostTable.key(op, shape, dt): (7.0, p) for op, p in price.items()})
    got = tape_seconds(table, rows, shape, dt, False, [9, 3])
    # 6 chain steps, 1 residual, 1 FAS point, 2 + 4 + 4 + 3 copies, 2 + 5 corrections (a never)
    assert got == 6 * 1 + 10 + 100 + 13 * 1000 + 7 * 10000
    rows[7, T.R] = 0  # the same rows copying another store: another price, not the cached one
    assert tape_seconds(table, rows, shape, dt, False, [9, 3]) == got + 6 * 1000
    with pytest.raises(KeyError, match="chains_adjoint"):
        tape_seconds(table, rows, shape, dt, True, [9, 3])


def test_the_cost_only_final_sweep_flags_the_rows_the_kernel_keeps():
    from mgnn import dense_resnet
    bk = get_backend("numba")
    model = dense_resnet(4, 4, 2, 12, seed=0)
    W, b = model.step_params()["weight"], model.step_params()["bias"]
    rng = np.random.default_rng(0)
    U = rng.standard_normal((14, 3, 4)).astype(model.dtype)
    for chains, layer0, step, d_lo in (([[1, 3], [5, 2]], -1, 1, 0), ([[2, 4]], 12, -1, 3),
                                       ([[1, 5]], -2, 2, 2)):
        chains = np.array(chains, dtype=np.int64)
        D = np.zeros((6, 3, 4), model.dtype)
        real, charged = np.zeros(6, np.int8), np.zeros(6, np.int8)
        if not model.step.can_keep_derivs(bk):
            pytest.skip("no keep kernels in this backend")
        model.step.chains_forward_derivs(W, b, U.copy(), chains, layer0, step, model.dtype.type(
            0.1), D, d_lo, real, bk)
        _zero_outputs("chains_forward_derivs", (W, b, U.copy(), chains, layer0, step, 0.1, D,
                                                d_lo, charged, bk))
        assert real.tolist() == charged.tolist() and real.any()


def test_the_bound_drops_every_orchestration_cost():
    shape, dt = (8, 8), "float32"
    table = CostTable({CostTable.key("chains_forward", shape, dt): (5e-6, 2e-6),
                       CostTable.key("run_tape", shape, dt): (3e-6, 1e-6)},
                      overhead={"mgrit": [4e-5, 1e-6]}, alpha=2e-6, beta=1e9)
    bound = table.without_orchestration()
    assert bound.seconds("chains_forward", shape, dt, 3, "mgrit") == pytest.approx(6e-6)
    assert table.seconds("chains_forward", shape, dt, 3, "mgrit") == pytest.approx(
        5e-6 + 6e-6 + 4e-5 + 3e-6)
    assert bound.seconds("run_tape", shape, dt, 9, "mgrit") == 0.0
    assert bound.has("run_tape", dt)  # the bound replays too: the rows without the replay
    assert (bound.alpha, bound.beta) == (table.alpha, table.beta)


@GUARD
def test_the_bound_is_below_the_prediction_and_both_are_deterministic():
    from mgnn.studies.predict import calibrate
    cfg = default_config(**CFG)
    table = calibrate(cfg, repeats=1, layers=16, log=None)
    assert set(table.overhead) >= {"serial", "mgrit"}
    assert all(len(o) == 2 and min(o) >= 0 for o in table.overhead.values())
    for P in (1, 2, 4):
        got = predict_point(cfg, table, "mgrit", P)
        # the shadow clock of the one run is the run charged from the bound's table
        low = predict_point(cfg, table.without_orchestration(), "mgrit", P)
        assert got["bound"] == pytest.approx(low["time"], rel=1e-12)
        assert low["bound"] == pytest.approx(low["time"], rel=1e-12)
        assert 0 < got["bound"] < got["time"]
        assert predict_point(cfg, table, "mgrit", P) == got


def test_the_overhead_fit_recovers_per_call_and_per_state_parts():
    pts = [(10, 50, 10 * 3e-5 + 50 * 1e-6), (10, 1500, 10 * 3e-5 + 1500 * 1e-6)]
    a, b = _fit_overhead(pts)
    assert a == pytest.approx(3e-5) and b == pytest.approx(1e-6)
    # per-state time that falls with the states: the per-call part alone, never negative
    a, b = _fit_overhead([(10, 50, 1e-3), (10, 1500, 0.9e-3)])
    assert b == 0.0 and a > 0
    assert _fit_overhead([(7, 0, 7e-5)]) == pytest.approx((1e-5, 0.0))


def test_validation_points_say_why_a_setting_cannot_run():
    pts = {(P, n, L): why for P, n, L, why in validation_points((1, 2), (1, 4), (3, 5), cf=2)}
    assert "cf = 2" in pts[(2, 1, 3)]
    assert pts[(2, 4, 3)] is None
    assert "reach 3 levels" in pts[(2, 4, 5)]  # 8 layers: 8, 4, 2


@GUARD
@pytest.mark.skipif(shutil.which("mpiexec", path=sys.prefix + "/bin") is None,
                    reason="needs mpiexec (pip install 'mgnn[mpi]')")
def test_the_validation_grid_measures_real_mpiexec_runs():
    from mgnn.studies.predict import calibrate
    cfg = default_config(**CFG)
    table = calibrate(cfg, repeats=1, layers=16, log=None)
    rows = validate_grid(cfg, table, [(1, 4, 3, None), (2, 4, 3, None), (2, 1, 3, "skip")],
                         repeats=2, log=None, timeout=240, launches=2)
    assert [(r["ranks"], r["n_layers"]) for r in rows] == [(1, 4), (2, 8)]
    for r in rows:  # two mpiexec runs a point, the faster one's median counts
        assert len(r["launches_s"]) == 2 and r["measured_s"] == min(r["launches_s"]) > 0
        assert 0 < r["bound_s"] < r["predicted_s"]
        assert r["error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
    text = format_validation_grid(rows)
    assert text.count("\n") == 3 and "| 2 | 4 | 8 | 3 |" in text
    with pytest.raises(ValueError, match="launches 0"):
        validate_grid(cfg, table, [(1, 4, 3, None)], launches=0, log=None)


def test_the_shadow_clock_runs_the_same_program_with_its_own_charges():
    from mgnn.comm.virtual import Network

    def program(comm):
        r = comm.Get_rank()
        buf = np.zeros(4)
        comm.charge(3e-3 if r == 0 else 1e-3, 1e-3)
        if r == 0:
            comm.Isend(buf, 1, tag=1).Wait()
        else:
            comm.Irecv(buf, 0, tag=1).Wait()  # real: waits for rank 0; shadow: arrives at 1e-3
        comm.charge(1e-3, 2e-3)
        comm.Barrier()
        return comm.clock, comm.shadow_clock

    out = run_virtual(2, program, network=Network(alpha=1e-4, beta=1e30))
    a = 1e-4  # one message, and a barrier of one alpha (2 ranks)
    assert out[1][0] == pytest.approx(3e-3 + a + 1e-3 + a)
    assert out[1][1] == pytest.approx(1e-3 + a + 2e-3 + a)
    assert out[0][1] == pytest.approx(out[1][1])  # the barrier ends at the later shadow clock

    def posted_first(comm):
        # rank 1 posts its receive first (shadow 5e-3, later than the message's arrival at
        # 1e-3 + a); rank 0 is last on the real clock, rank 1 on the shadow one
        r = comm.Get_rank()
        buf = np.zeros(2)
        if r == 1:
            comm.charge(1e-3, 5e-3)
            req = comm.Irecv(buf, 0, tag=2)
            while not req.Test():
                pass
            after = comm.shadow_clock
        else:
            comm.charge(4e-3, 1e-3)
            comm.Isend(buf, 1, tag=2).Wait()
            after = comm.shadow_clock
        comm.Barrier()
        return after, comm.clock, comm.shadow_clock

    out = run_virtual(2, posted_first, network=Network(alpha=1e-4, beta=1e30))
    assert out[1][0] == pytest.approx(5e-3)  # posted after the arrival: no shadow wait
    assert out[0][0] == pytest.approx(1e-3)
    assert out[0][1] == out[1][1] == pytest.approx(4e-3 + a + a)  # real: rank 0's send
    assert out[0][2] == out[1][2] == pytest.approx(5e-3 + a)  # shadow: rank 1's clock
    with pytest.raises(ValueError, match="shadow must be a finite number"):
        run_virtual(1, lambda comm: comm.charge(1.0, -1.0))


def test_a_point_the_calibration_never_called_is_priced_as_a_chain_step():
    shape, dt = (4, 4), "float32"
    table = CostTable({CostTable.key("chains_adjoint", shape, dt): (2e-6, 3e-6)})
    assert table.seconds("points_adjoint:1", shape, dt, 2) == pytest.approx(8e-6)
    assert any("points_adjoint:1" in s for s in table.inexact)
    with pytest.raises(KeyError, match="points_forward:0"):  # no forward chains either
        table.seconds("points_forward:0", shape, dt, 1)


@GUARD
def test_the_predicted_step_is_the_steady_state_on_one_and_several_ranks():
    from mgnn.studies.predict import calibrate
    cfg = default_config(**CFG)
    table = calibrate(cfg, repeats=1, layers=16, log=None)
    model, x, y = build_model(cfg)
    cm = cost_model(model, table)

    def steps(comm):
        obj = _trainer("mgrit", cm, comm, cfg)
        out = []
        for _ in range(4):
            comm.Barrier()
            t0 = comm.clock
            with np.errstate(all="ignore"):
                obj.loss_and_grad(x, y)
            comm.Barrier()
            out.append(comm.clock - t0)
        return out

    for P in (1, 2):
        times = run_virtual(P, steps)[0]
        assert times[2] == pytest.approx(times[3], rel=1e-12)  # steady from step 3
        got = predict_point(cfg, table, "mgrit", P, model=(model, x, y))["time"]
        assert got == pytest.approx(times[3], rel=1e-9), P


@GUARD
def test_the_planner_picks_the_fastest_setting_within_the_gradient_budget(tmp_path):
    import json
    import types
    from mgnn.studies.predict import calibrate, format_plan, main, plan, train_command
    cfg = default_config(**dict(CFG, n_layers=16))
    table = calibrate(cfg, repeats=1, layers=16, log=None)
    rows, errors = plan(cfg, table, 4, grad_tol=0.05, cycles=((2, 1), (3, 2)), data=(1, 2),
                        micro=(2,), log=None, top=50)  # (every candidate)
    assert rows[-1]["method"] == "serial"
    times = [r["time_s"] for r in rows[:-1]]
    assert times == sorted(times) and len(rows) >= 3
    mg = [r for r in rows if r["method"] == "mgrit"]
    assert mg and all(r["grad_error"] <= 0.05 for r in mg)
    for r in mg:  # the fewest cycles within the budget
        fewer = [k for k in errors if k[:2] == (r["cf"], r["levels"]) and k[2] < r["fwd_iters"]]
        assert all(errors[k] > 0.05 for k in fewer)
        assert 0 < r["bound_s"] < r["time_s"]
    # an error of 0 for the exact methods, a real one for MGRIT (not zero: a few cycles)
    assert all(0 < e < float("inf") for e in errors.values())
    # layer by layer over every split, data-parallel alone (4 replicas) among them: exact
    lw = {r["data"]: r for r in rows if r["method"] == "layerwise"}
    assert all(r["grad_error"] == 0.0 for r in lw.values())
    assert set(lw) == {1, 2, 4}  # (data=(1, 2) and P)
    assert train_command(cfg, lw[4]).endswith("--layer-ranks 1 --data-ranks 4 --levels 1")
    assert all(r["ranks"] // r["data"] > 1 for r in mg)  # no MGRIT on one layer rank
    cmd = train_command(cfg, mg[0])
    assert cmd.startswith("mpiexec -n 4 python -m mgnn train --model dense --width 8")
    assert f"--levels {mg[0]['levels']} --cf {mg[0]['cf']}" in cmd
    assert "P = 4" in format_plan(rows, cfg, 4, 0.05)
    costs = tmp_path / "c.json"
    table.save(costs)
    args = types.SimpleNamespace(
        suite="predict", model="dense", n_layers=16, width=8, batch=8, levels=3, cf=2,
        fwd_iters=2, bwd_iters=1, micro="2", ranks="2", out=str(tmp_path / "out"),
        costs=str(costs), dtype="float32", in_features=None, network="calibrated", cores=None,
        coarsest="redundant", weak=False, threads=1, channels=None, repeats=1,
        spatial_levels=None, backend="numba", plan=True, grad_tol=0.05)
    got = main(args, log=None)
    doc = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert doc["rows"][0]["time_s"] == got[0]["time_s"] and doc["grad_tol"] == 0.05
    with pytest.raises(ValueError, match="--grad-tol must be a number > 0"):
        main(types.SimpleNamespace(**dict(vars(args), grad_tol=0.0)), log=None)


@GUARD
def test_data_replicas_predict_their_shards():
    from mgnn.studies.predict import calibrate
    cfg = default_config(**dict(CFG, batch=16))
    # every call costs its states' elements (no per-call part, no overhead): the same numbers
    # on every machine
    import json
    import math
    keys = calibrate(cfg, repeats=1, layers=16, log=None).entries
    table = CostTable({k: (0.0, 1e-9 * math.prod(json.loads(k.split("|")[1]))) for k in keys},
                      alpha=1e-6, beta=1e9)
    one = predict_point(cfg, table, "layerwise", 2)
    two = predict_point(dict(cfg, data_ranks=2), table, "layerwise", 4)
    # two replicas of the same 2 layer ranks, each on half the batch (8 of 16 samples)
    ratio = max(r["compute"] for r in two["ranks"]) / max(r["compute"] for r in one["ranks"])
    # (0.55 here: a few charges do not scale with the batch; every rank on the whole batch,
    # before replicas got their shards, gave 1.0)
    assert 0.45 < ratio < 0.6


@GUARD
def test_levels_auto_predicts_the_count_train_would_pick():
    """``levels='auto'``: per P the count :func:`mgnn.mgrit.auto_levels` picks from the table's
    step, call and message costs (train --levels auto's rule); the prediction is the one of
    that count; a cheaper message never picks fewer levels."""
    import json
    import math
    from mgnn.mgrit import auto_levels
    from mgnn.studies.predict import calibrate, limits, predict, resolve_levels
    cfg = default_config(**dict(CFG, n_layers=64, levels="auto"))
    keys = calibrate(cfg, repeats=1, layers=16, log=None).entries
    table = CostTable({k: (2e-6, 1e-9 * math.prod(json.loads(k.split("|")[1]))) for k in keys},
                      {"mgrit": [3e-6, 0.0]}, alpha=1e-6, beta=1e9)
    b = 1e-9 * 8 * 8  # a forward chain step of 8 states of width 8
    for P in (1, 4, 16):
        want = auto_levels(64, 2, P, (2, 1), lambda lev: min(lev, 1), True, 2,
                           (2e-6 + 3e-6 + 1e-6 + 8 * 8 * 4 / 1e9) / b)[0]
        assert resolve_levels(cfg, table, P)["levels"] == want
    assert resolve_levels(cfg, table, 1)["levels"] == 1
    # one level is layer by layer, as train --levels 1 runs it (not a one-level MGRIT solve)
    assert predict_point(cfg, table, "mgrit", 1)["time"] == \
        predict_point(cfg, table, "serial", 1)["time"]
    deep = resolve_levels(cfg, table, 16)["levels"]
    assert deep > 1
    cheap = resolve_levels(cfg, table.with_network(0.0, 1e15), 16)["levels"]
    assert cheap >= deep
    assert predict_point(cfg, table, "mgrit", 16)["time"] == \
        predict_point(dict(cfg, levels=deep), table, "mgrit", 16)["time"]
    rows = predict(cfg, table, [16], methods=("serial", "mgrit"), log=None)
    assert [r.get("levels") for r in rows] == [None, deep]
    assert limits(rows, cfg, table)[0]["ranks"] == 16
    assert resolve_levels(dict(cfg, levels=3), table, 16)["levels"] == 3


def test_levels_auto_is_for_predict_and_train_only(capsys):
    from mgnn.__main__ import main
    assert main(["bench", "mgrit", "--levels", "auto"]) == 2
    assert "bench mgrit --levels auto: auto is for bench calibrate and predict" in \
        capsys.readouterr().err


def test_the_cost_only_gru_final_sweep_flags_the_rows_the_kernel_keeps():
    from mgnn import gru_classifier
    from mgnn.blocks.composed import StepContext
    bk = get_backend("numba")
    model = gru_classifier(3, 4, 2, 12, dtype="float64", seed=0)
    kind = model.step
    if not kind.can_keep_derivs(bk):
        pytest.skip("no keep kernels in this backend")
    rng = np.random.default_rng(0)
    U = rng.standard_normal((14, 3, 1, 4))
    for chains, layer0, step, lo in (([[1, 3], [5, 2]], -1, 1, 0), ([[2, 4]], 12, -1, 3),
                                     ([[1, 5]], -2, 2, 2)):
        chains = np.array(chains, dtype=np.int64)
        flags = []
        for run in ("real", "charged"):
            ctx = StepContext(buffers={})
            ctx.x = rng.standard_normal((3, 12, 3))
            kept = kind.kept_arrays(U.shape[1:], 6, U.dtype,
                                    lambda name, shape, dtype: np.zeros(shape, dtype))
            done = np.zeros(6, np.int8)
            args = (model.step_params(), U.copy(), chains, layer0, step, 1.0, kept, lo, done,
                    bk, ctx)
            if run == "real":
                kind.chains_forward_layers_keep(*args)
            else:
                _zero_outputs("chains_forward_layers_keep", args)
            flags.append(done.tolist())
        assert flags[0] == flags[1] and any(flags[0])


@GUARD
def test_a_cost_only_gru_step_charges_every_kernel_and_runs_none(monkeypatch):
    """GRU predictions: a cost-only MGRIT step on 1 and 2 virtual ranks (the stacked chains,
    points, kept linearisation, gate cotangents; serial: the sweeps) calls no recurrent
    kernel (each is charged instead), and the charged time is deterministic and positive."""
    import mgnn.backend.numba_cpu as nb
    from mgnn.studies.predict import calibrate
    cfg = default_config(**dict(CFG, model="gru", n_layers=32, width=8, micro=()))
    table = calibrate(cfg, repeats=1, layers=16, log=None)
    assert {"chains_forward_layers", "chains_adjoint_layers", "vjp_params_stacked_layers",
            "sweep_forward_layers", "sweep_backward_layers"} <= {
        k.split("|")[0] for k in table.entries}

    def boom(*a, **k):
        raise AssertionError("a recurrent kernel ran in a cost-only step")
    for name in dir(nb):
        if name.startswith(("recurrent_", "gru_gates", "rnn_gates")) and \
                not name.endswith("_check"):
            monkeypatch.setattr(nb, name, boom)
    model, x, y = build_model(cfg)
    for method in ("serial", "mgrit"):  # (the patch holds: a real step runs into it)
        with pytest.raises(AssertionError, match="a recurrent kernel ran"):
            _trainer(method, model, None, cfg).loss_and_grad(x, y)
    # the batch's input projection (every step's x W_ih0^T: every rank, once per batch) is an
    # op of its own, charged once per training step: made to cost ~1 s, each step costs that
    # much more (priced at the step's input shape, scaled from the calibrated ones)
    assert any(k.startswith("input_projection|") for k in table.entries)
    slow = CostTable({k: ((0.0, 1.0) if k.startswith("input_projection|") else ab)
                      for k, ab in table.entries.items()}, table.overhead, table.alpha,
                     table.beta)
    shape = (8, 32, 4)  # (B, L, I)
    one = (slow.seconds("input_projection", shape, "float32", 1) -
           table.seconds("input_projection", shape, "float32", 1))
    assert one >= 1.0
    for method, P in (("serial", 1), ("mgrit", 1), ("mgrit", 2), ("layerwise", 2)):
        a = predict_point(cfg, table, method, P)
        b = predict_point(cfg, table, method, P)
        assert a["time"] == b["time"] > 0, (method, P)
        if method == "mgrit":
            assert 0 < a["bound"] < a["time"]
        extra = predict_point(cfg, slow, method, P)["time"] - a["time"]
        if P == 1:
            assert abs(extra - one) < 1e-3 * one, (method, P, extra, one)
        else:  # every rank projects its own 16 steps when its first forward kernel needs
            # them: in parallel, or (as the real code orders it) after a wait for rank 0
            half = (slow.seconds("input_projection", (8, 16, 4), "float32", 1) -
                    table.seconds("input_projection", (8, 16, 4), "float32", 1))
            assert half < one and half * (1 - 1e-3) < extra < 2 * half * (1 + 1e-3), \
                (method, P, extra, half)


def test_gru_predictions_have_no_pipeline(capsys):
    from mgnn.__main__ import main
    assert main(["bench", "predict", "--model", "gru", "--micro", "4"]) == 2
    assert "--micro 4: bench predict --model gru predicts no pipeline" in capsys.readouterr().err
