"""Cost tables, cost-only models and predictions on virtual ranks (mgnn.studies.costs, mgnn.studies.predict,
``bench calibrate`` / ``bench predict``)."""
import json
import os
import types

import numpy as np
import pytest

from mgnn import dense_resnet
from mgnn.comm.virtual import Network, run_virtual
from mgnn.studies.costs import STEP_METHODS, CostTable, Recorder, cost_model, recording_model
from mgnn.mgrit.partition import Partition, balanced_starts
from mgnn.studies.predict import (build_model, calibrate, crossovers, default_config, main,
                          predict, predict_point)

GUARD = pytest.mark.timeout(300)
TINY = dict(n_layers=32, width=8, batch=8, levels=3, cf=2, fwd_iters=2, bwd_iters=1,
            micro=(2,))


@pytest.fixture(scope="module")
def tiny_table():
    cfg = default_config(**TINY)
    return cfg, calibrate(cfg, repeats=1, layers=16, log=None)


def _unit_table(cfg, seconds=1e-3):
    """A table in which every kernel call the recorder saw costs ``seconds`` (no overhead)."""
    rec = Recorder()
    model, x, y = build_model(cfg)
    rm = recording_model(model, rec)
    from mgnn.studies.predict import _trainer
    for method in ("serial", "mgrit"):
        _trainer(method, rm, None, cfg).loss_and_grad(x, y)
    keys = {CostTable.key(op, shape, dtype) for op, shape, dtype, _, _ in rec.samples}
    return CostTable({k: (seconds, 0.0) for k in keys}, alpha=0.0, beta=1e30), rec


@GUARD
def test_a_serial_prediction_is_its_kernel_calls_times_their_cost():
    cfg = default_config(**TINY)
    table, _ = _unit_table(cfg)
    # count the calls of one real serial step
    rec = Recorder()
    model, x, y = build_model(cfg)
    from mgnn.studies.predict import _trainer
    _trainer("serial", recording_model(model, rec), None, cfg).loss_and_grad(x, y)
    got = predict_point(cfg, table, "serial", 1)
    assert got["time"] == pytest.approx(1e-3 * len(rec.samples), rel=1e-12)
    assert got["ranks"][0]["compute"] == pytest.approx(got["time"], rel=1e-12)
    assert got["ranks"][0]["wait"] == 0.0


@GUARD
def test_cost_only_runs_are_deterministic_and_payloads_do_not_change_the_clock(tiny_table):
    cfg, table = tiny_table
    for method, P in (("mgrit", 4), ("layerwise", 3), ("pipeline", 2)):
        a = predict_point(cfg, table, method, P, micro=2)
        b = predict_point(cfg, table, method, P, micro=2)
        c = predict_point(cfg, table, method, P, micro=2, payloads=True)
        assert a == b == c, method
        assert a["time"] > 0
        for r in a["ranks"]:  # clock = compute + wait + message on every rank
            assert r["compute"] + r["wait"] + r["message"] == pytest.approx(a["time"], rel=1e-9,
                                                                            abs=1e-12)


@GUARD
def test_messages_and_the_network_enter_the_prediction(tiny_table):
    cfg, table = tiny_table
    fast = predict_point(cfg, table.with_network(0.0, 1e30), "layerwise", 4)["time"]
    slow = predict_point(cfg, table.with_network(1e-3, 1e30), "layerwise", 4)["time"]
    # layer-wise: 3 forward and 3 backward boundary messages lie on the critical path, plus
    # the latency terms of the step's collectives (log2 P alpha each): whole multiples of alpha
    extra = (slow - fast) / 1e-3
    assert extra >= 6 and extra == pytest.approx(round(extra), abs=1e-6)


@GUARD
def test_the_table_round_trips_and_interpolates_unmeasured_shapes(tiny_table, tmp_path):
    cfg, table = tiny_table
    path = tmp_path / "c.json"
    table.save(path)
    back = CostTable.load(path)
    assert back.entries == table.entries and back.overhead == table.overhead
    assert (back.alpha, back.beta) == (table.alpha, table.beta)
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".costs-")]  # atomic
    key = next(k for k in table.entries if k.startswith("chains_forward|"))
    op, shape, dtype = key.split("|")
    shape = tuple(json.loads(shape))
    a, b = table.entries[key]
    assert table.seconds(op, shape, dtype, 3) == pytest.approx(a + 3 * b)
    double = (2 * shape[0],) + shape[1:]  # twice the elements: b scales, a stays
    assert table.seconds(op, double, dtype, 3) == pytest.approx(a + 3 * 2 * b)
    with pytest.raises(KeyError, match="calibrate"):
        table.seconds(op, shape, "float16", 1)
    bad = tmp_path / "bad.json"
    bad.write_text("{\"format\": \"other\"}")
    with pytest.raises(ValueError, match="not an mgnn cost table"):
        CostTable.load(bad)


def test_cost_models_refuse_what_they_cannot_charge():
    from mgnn import conv_resnet
    model = conv_resnet(1, 2, (6, 6), 3, 4, batch_norm=True, seed=0)
    with pytest.raises(ValueError, match="fused step kind"):
        cost_model(model, CostTable({}))
    with pytest.raises(TypeError, match="CostTable"):
        cost_model(dense_resnet(4, 4, 2, 4, seed=0), {"not": "a table"})


@GUARD
def test_4096_virtual_ranks_run_a_cost_only_mgrit_step():
    cfg = default_config(n_layers=16384, width=2, batch=1, levels=3, cf=4)
    table = calibrate(dict(cfg, n_layers=64), repeats=1, log=None)
    r = predict_point(cfg, table, "mgrit", 4096)
    assert len(r["ranks"]) == 4096
    # every rank owns 4 layers: the forward cycles step them, so every rank computed
    assert min(q["compute"] for q in r["ranks"]) > 0


@GUARD
def test_predict_rows_and_crossovers(tiny_table):
    cfg, table = tiny_table
    rows = predict(cfg, table, [1, 2, 4], log=None)
    methods = {(r["method"], r["ranks"]) for r in rows}
    assert ("serial", 1) in methods and ("mgrit", 4) in methods and ("pipeline", 4) in methods
    assert ("layerwise", 1) not in methods  # the same as serial
    serial = next(r for r in rows if r["method"] == "serial")
    assert serial["speedup"] == 1.0
    fake = [dict(method="serial", ranks=1, time_s=1.0), dict(method="mgrit", ranks=2, time_s=2.0),
            dict(method="mgrit", ranks=4, time_s=0.5), dict(method="layerwise", ranks=2,
                                                              time_s=3.0),
            dict(method="layerwise", ranks=4, time_s=0.4)]
    assert crossovers(fake) == {"serial": 4, "layerwise": 2, "pipeline": None}


def _args(**kw):
    base = dict(suite="predict", model="dense", n_layers=32, width=8, batch=8, levels=3, cf=2,
                fwd_iters=2, bwd_iters=1, micro="2", ranks="1,2,4", out=None, costs=None,
                dtype="float32", in_features=None, network="calibrated", cores=None,
                coarsest="redundant", weak=False, threads=1, channels=None, repeats=1,
                spatial_levels=None, backend="numba")
    base.update(kw)
    return types.SimpleNamespace(**base)


@GUARD
def test_bench_predict_writes_its_outputs(tiny_table, tmp_path):
    cfg, table = tiny_table
    costs = tmp_path / "costs.json"
    table.save(costs)
    out = tmp_path / "out"
    lines = []
    rows = main(_args(costs=str(costs), out=str(out), network="ib-hdr", weak=True),
                log=lines.append)
    doc = json.loads((out / "predict.json").read_text())
    assert doc["network"]["name"] == "ib-hdr" and doc["network"]["beta"] == 24e9
    assert {r["study"] for r in doc["rows"]} == {"strong", "weak"}
    assert len(doc["rows"]) == len(rows)
    for name in ("predict.csv", "predict.png", "predict_weak.png", "gantt_mgrit_P4.png",
                 "gantt_pipeline_P4.png"):
        assert (out / name).stat().st_size > 0, name
    assert any(line.startswith("MGRIT overtakes layerwise") for line in lines)
    assert set(doc["crossovers"]) == {"serial", "layerwise", "pipeline"}


def test_bench_predict_bad_input_names_the_flag(tiny_table, tmp_path):
    cfg, table = tiny_table
    with pytest.raises(ValueError, match="--model gru"):
        main(_args(model="gru"), log=None)
    with pytest.raises(ValueError, match="no such file"):
        main(_args(costs=str(tmp_path / "missing.json")), log=None)
    with pytest.raises(ValueError, match="--ranks"):
        main(_args(ranks="1,x"), log=None)
    costs = tmp_path / "c.json"
    table.save(costs)
    with pytest.raises(ValueError, match="calibrated for --dtype float32"):
        main(_args(costs=str(costs), dtype="float64"), log=None)


def test_level_counts_match_level_range_on_plain_and_mirrored_partitions():
    starts = balanced_starts(100, 7, 4)
    for part in (Partition(100, tuple(starts), tuple(range(7))),
                 Partition(100, tuple(starts), tuple(range(7))).mirrored()):
        for s, n in ((1, 100), (4, 25), (16, 6)):
            counts, displs = part.level_counts(s, n)
            ranges = [part.level_range(r, s, n) for r in range(7)]
            assert list(counts) == [b - a for a, b in ranges]
            assert list(displs) == [a for a, _ in ranges]
        with pytest.raises(ValueError, match="holds no block"):
            part.block_of_rank(7)


def test_runs_without_payloads_carry_sizes_and_the_same_clocks():
    from mpi4py import MPI

    def program(comm):
        r = comm.Get_rank()
        send = np.full(1000, r + 1.0)
        recv = np.full(1000, 7.0)
        if r == 0:
            comm.Isend([send, MPI.DOUBLE], 1, tag=3).Wait()
        elif r == 1:
            comm.Irecv([recv, MPI.DOUBLE], 0, tag=3).Wait()
        red = np.full(4, float(r))
        comm.Allreduce(MPI.IN_PLACE, red)
        gat = np.full(2 * comm.Get_size(), -1.0)
        comm.Allgather(np.full(2, float(r)), gat)
        objs = comm.allgather(("rank", r))
        return recv[:3].tolist(), red.tolist(), gat.tolist(), objs, comm.clock
    net = Network(alpha=1e-6, beta=1e9)
    real = run_virtual(3, program, network=net)
    sized = run_virtual(3, program, network=net, payloads=False)
    assert real[1][0] == [1.0, 1.0, 1.0] and sized[1][0] == [0.0, 0.0, 0.0]  # zeros arrive
    assert real[0][1] == [3.0] * 4 and sized[2][1] == [2.0] * 4  # reductions left as they are
    assert sized[0][2] == [-1.0] * 6
    assert sized[2][3] == real[2][3] == [("rank", 0), ("rank", 1), ("rank", 2)]  # objects arrive
    assert [r[4] for r in real] == [r[4] for r in sized]  # the same clocks
    assert [s.as_dict() for s in real.stats] == [s.as_dict() for s in sized.stats]


def test_step_methods_table_names_real_methods():
    from mgnn.blocks import ConvStep, DenseStep
    from mgnn.blocks.recurrent import RecurrentStep
    for name in STEP_METHODS:
        assert any(hasattr(k, name) for k in (DenseStep, ConvStep, RecurrentStep)), name


def test_points_in_a_child_process_return_and_raise_as_in_this_one():
    import operator
    from mgnn.studies.predict import _in_child
    assert _in_child(divmod, 7, 2) == (3, 1)
    with pytest.raises(ZeroDivisionError):
        _in_child(operator.truediv, 1, 0)


@GUARD
def test_spatial_coarsening_is_predicted_from_its_own_calibration():
    cfg = default_config(model="conv", n_layers=16, channels=2, batch=4, cf=2, levels=3,
                         micro=(2,), spatial_levels=(0,))
    table = calibrate(cfg, repeats=1, log=None)
    # the coarse level's kernels were measured at the coarse grid's shape: the forward's and
    # the adjoint's stacked chains (the adjoint's sigma' taken at restricted states)
    for op in ("chains_forward", "chains_adjoint"):
        assert any(k.startswith(f"{op}|[4, 2, 14, 14]|") for k in table.entries), op
    one, two = (predict_point(cfg, table, "mgrit", P)["time"] for P in (1, 2))
    # (no speed-up asserted: at 16 layers of 2 channels it is within the calibration's noise)
    assert 0 < one < float("inf") and 0 < two < float("inf")
    plain = dict(cfg, spatial_levels=())
    with pytest.raises(ValueError, match="--spatial-levels: spatial coarsening needs --model"):
        main(_args(spatial_levels="0"), log=None)
    assert predict_point(plain, calibrate(plain, repeats=1, log=None), "mgrit", 2)["time"] > 0


@GUARD
def test_calibration_times_a_device_backend_through_its_launcher():
    """'cuda-emulated' (the CUDA kernels on the host emulation) stands in for a GPU here: the
    calibration runs the device backend's code path, waits for its launcher around every timed
    call and records which backend the table holds; the prediction runs the host path."""
    cfg = default_config(n_layers=8, width=4, batch=4, levels=2, cf=2, micro=(2,),
                         backend="cuda-emulated")
    syncs = []
    from mgnn.backend import get_backend
    launcher = get_backend("cuda-emulated").launcher
    plain = launcher.synchronize
    launcher.synchronize = lambda: (syncs.append(1), plain())[1]
    try:
        table = calibrate(cfg, repeats=1, layers=8, log=None)
    finally:
        launcher.synchronize = plain
    assert table.meta["backend"] == "cuda-emulated"
    assert len(syncs) >= 2 * sum(table.meta["calls"].values())  # before and after each call
    assert predict_point(dict(cfg, backend="numba"), table, "mgrit", 2)["time"] > 0


@GUARD
def test_conv_points_in_a_child_after_numba_ran_here():
    """P >= 256 runs in a child process, after the parent has run Numba's threaded kernels
    (the calibration)."""
    cfg = default_config(model="conv", n_layers=1024, channels=2, image_size=8, batch=4, cf=4,
                         levels=3, micro=(2,))
    table = calibrate(cfg, repeats=1, layers=64, log=None)
    rows = predict(cfg, table, [2, 256], methods=("mgrit",), log=None)
    assert [r["ranks"] for r in rows] == [2, 256] and rows[1]["time_s"] < rows[0]["time_s"]


def _lonely(comm):
    """Rank 1 waits for a message rank 0 never sends (module level: a spawned child imports it)."""
    if comm.Get_rank() == 1:
        comm.Recv(np.zeros(1), source=0, tag=5)


def test_virtual_run_errors_come_back_from_a_child_intact():
    import pickle
    from mgnn.comm.virtual import VirtualAbort, VirtualDeadlock
    from mgnn.studies.predict import _in_child

    with pytest.raises(VirtualDeadlock, match="rank 1 waits for a message from rank 0") as info:
        _in_child(run_virtual, 2, _lonely)
    assert set(info.value.blocked) == {1}
    back = pickle.loads(pickle.dumps(VirtualAbort("m", 2, 7)))
    assert (str(back), back.rank, back.errorcode) == ("m", 2, 7)


@GUARD
def test_an_oversubscribed_hop_delays_messages_only_past_the_cores(tiny_table):
    """meta['oversubscribed_hop_s'] adds to every message's latency where P > cores, and changes
    nothing where every rank has a core (or no cores are given)."""
    import copy
    cfg, table = tiny_table
    hopped = copy.deepcopy(table)
    hopped.meta["oversubscribed_hop_s"] = 1e-3
    for cores in (None, 4):  # a core each: the hop does not apply
        assert predict_point(cfg, hopped, "mgrit", 4, cores=cores) == \
            predict_point(cfg, table, "mgrit", 4, cores=cores)
    plain = predict_point(cfg, table, "layerwise", 4, cores=2)["time"]
    slow = predict_point(cfg, hopped, "layerwise", 4, cores=2)["time"]
    # layer-wise: at least 6 boundary messages on the critical path, each 1 ms later
    assert slow - plain >= 6e-3 * (1 - 1e-9)


def test_core_stretch_follows_the_busiest_core():
    """P ranks on fewer cores compute at the pace of the core holding ceil(P / cores) of them:
    3 ranks on 2 cores stretch like 4, 5 like 6; a core each (or no cores given) stretches
    nothing; u is clipped to [0, 1]."""
    from mgnn.studies.predict import core_stretch
    assert core_stretch(2, 2, 0.8) == core_stretch(1, None, 0.8) == 1.0
    assert core_stretch(3, 2, 0.8) == core_stretch(4, 2, 0.8) == pytest.approx(1.8)
    assert core_stretch(5, 2, 0.5) == core_stretch(6, 2, 0.5) == pytest.approx(2.0)
    assert core_stretch(17, 16, 0.25) == pytest.approx(1.25)
    assert core_stretch(4, 2, 1.7) == 2.0 and core_stretch(4, 2, -1.0) == 1.0
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=f"cores {bad!r}"):
            core_stretch(4, bad, 0.5)


def test_the_median_of_calibrations_is_taken_number_by_number():
    """CostTable.median: each entry's a and b, each overhead (pairs or plain numbers), alpha
    and beta apart, so one slow calibration moves nothing; tables of other ops are refused."""
    def table(s, extra=()):
        return CostTable({"step|[2]|float32": (1e-6 * s, 2e-6 * s), **dict(extra)},
                         {"mgrit": [3e-6 * s, 4e-7 * s], "serial": 5e-6 * s},
                         alpha=1e-6 * s, beta=1e9 / s, meta={"machine": "m"})
    mid = CostTable.median([table(1.0), table(9.0), table(1.2)])
    assert mid.entries["step|[2]|float32"] == pytest.approx((1.2e-6, 2.4e-6))
    assert mid.overhead["mgrit"] == pytest.approx([3.6e-6, 4.8e-7])
    assert mid.overhead["serial"] == pytest.approx(6e-6)
    assert (mid.alpha, mid.beta) == pytest.approx((1.2e-6, 1e9 / 1.2))
    assert mid.meta == {"machine": "m", "calibrations": 3}
    assert CostTable.median([table(2.0)]).entries == table(2.0).entries
    with pytest.raises(ValueError, match="price different ops"):
        CostTable.median([table(1.0), table(1.0, {"other|[2]|float32": (0.0, 0.0)})])
    with pytest.raises(TypeError, match="CostTables expected"):
        CostTable.median([])
    plain = table(1.0)
    plain.overhead["mgrit"] = 3e-6  # a per-call number where the others hold pairs
    with pytest.raises(ValueError, match="price different ops"):
        CostTable.median([table(1.0), plain])
