"""scripts/torch_baseline.py: its flags, its interleaved timing, and (where PyTorch is installed,
a benchmark environment: never a dependency) that both frameworks compute the same step."""
import importlib.util
import os

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "torch_baseline", os.path.join(HERE, "..", "scripts", "torch_baseline.py"))
tb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tb)


def test_flags_are_checked(capsys):
    args = tb.parse_args([])
    assert (args.layers, args.width, args.batch_size, args.activation, args.dtype) == \
        (256, 64, 128, "relu", "float32")  # the performance issue's configuration
    for argv, message in ((["--layers", "0"], "--layers must be >= 1, got 0"),
                          (["--batch-size", "-2"], "--batch-size must be >= 1, got -2"),
                          (["--min-time", "0"], "--min-time must be > 0, got 0.0")):
        with pytest.raises(SystemExit):
            tb.parse_args(argv)
        assert message in capsys.readouterr().err


def test_conv_parts_rows_take_their_baseline_from_the_caller():
    """mgnn's bench never imports a deep-learning framework: the per-kernel conv rows get a
    baseline only from the caller (the script's ``--conv-parts`` passes PyTorch's); here a
    NumPy stand-in, called once with the rows' shapes."""
    from mgnn.studies.bench import bench_conv_parts
    assert tb.parse_args(["--conv-parts"]).conv_parts and not tb.parse_args([]).conv_parts
    seen = []

    def parts(u, K, s):
        seen.append((u.shape, K.shape, s.shape))
        return {k: (lambda: u.sum()) for k in ("forward", "input vjp", "kernel grad")}
    plain = bench_conv_parts(2, 2, 6, 2)
    rows = bench_conv_parts(2, 2, 6, 2, baseline=("numpy sum", parts))
    assert seen == [((2, 2, 6, 6), (2, 2, 3, 3), (2, 2, 6, 6))]
    assert [r["name"] for r in rows] == [r["name"] for r in plain] and len(rows) == 3
    assert all("ratio" not in r and "baseline" not in r for r in plain)
    assert all(r["baseline"].startswith("numpy sum (") and r["ratio"] > 0 for r in rows)


def test_timing_interleaves_the_candidates(monkeypatch):
    """Rounds take one sample of every candidate in turn (warm-up calls in the first round
    only); fastest and median per candidate."""
    order = []
    values = {"a": iter([3.0, 1.0, 2.0]), "b": iter([0.5, 0.5, 0.5])}

    def samples(fn, repeats, warmup, min_time):
        assert (repeats, min_time) == (1, 1.0)
        name = fn()
        order.append((name, warmup))
        return [next(values[name])]
    monkeypatch.setattr(tb, "time_samples", samples)
    res = tb.timed({"a": lambda: "a", "b": lambda: "b"}, rounds=3, min_time=1.0)
    assert order == [("a", 2), ("b", 2)] + [("a", 0), ("b", 0)] * 2
    assert res == {"a": (1.0, 2.0), "b": (0.5, 0.5)}


def test_pytorch_computes_mgnn_step():
    """Loss and every gradient of a 24-layer net agree with mgnn's to round-off (float64)."""
    torch = pytest.importorskip("torch")
    for act in ("tanh", "relu"):
        cfg = dict(model="dense", n_layers=24, width=6, batch=5, dtype="float64",
                   activation=act)
        model, x, y = tb._problem(cfg)
        dloss, err = tb.compare(model, x, y.astype(np.int64), torch)
        assert dloss < 1e-13 and err < 1e-12, (act, dloss, err)


def test_conv_flags_are_checked(capsys):
    args = tb.parse_args(["--model", "conv", "--channels", "8", "--threads", "2,1,2"])
    assert (args.model, args.channels, args.image, args.threads) == ("conv", 8, 28, [1, 2])
    for argv, message in ((["--conv3d"], "--conv3d and --batch-norm are for --model conv"),
                          (["--model", "conv", "--threads", "0"], "--threads must be >= 1"),
                          (["--model", "conv", "--threads", "a"], "comma-separated integers"),
                          (["--model", "conv", "--channels", "0"], "--channels must be >= 1")):
        with pytest.raises(SystemExit):
            tb.parse_args(argv)
        assert message in capsys.readouterr().err


def test_conv_network_is_the_requested_model():
    """--model conv builds mgnn's conv ResNet of the flags (2D, 3D, batch norm)."""
    for argv, spatial, bn in ((["--image", "6"], (6, 6), False),
                              (["--image", "4", "--conv3d"], (4, 4, 4), False),
                              (["--image", "6", "--batch-norm"], (6, 6), True)):
        args = tb.parse_args(["--model", "conv", "--channels", "3", "--layers", "2",
                              "--batch-size", "2", "--dtype", "float64"] + argv)
        model, x, y, cfg, desc = tb._network(args)
        assert x.shape == (2, 1) + spatial and y.dtype == np.int64
        assert model.params["steps.weight"].shape == (2, 3, 3) + (3,) * len(spatial)
        assert ("steps.bn_weight" in model.params) == bn and ("batch norm" in desc) == bn


def test_pytorch_computes_mgnn_conv_step():
    """Conv ResNets (2D, 2D with batch norm, 3D): loss and gradients agree (float64)."""
    torch = pytest.importorskip("torch")
    for extra in ([], ["--batch-norm"], ["--conv3d"]):
        args = tb.parse_args(["--model", "conv", "--channels", "3", "--layers", "3", "--image",
                              "5", "--batch-size", "4", "--dtype", "float64"] + extra)
        model, x, y, _, _ = tb._network(args)
        dloss, err = tb.compare(model, x, y, torch)
        assert dloss < 1e-13 and err < 1e-10, (extra, dloss, err)


def test_gru_flags_and_network(capsys):
    """--model gru builds mgnn's stacked GRU classifier of the flags; bad flags are named."""
    args = tb.parse_args(["--model", "gru", "--hidden", "5", "--seq-len", "7", "--gru-layers",
                          "2", "--features", "3", "--batch-size", "4", "--dtype", "float64"])
    model, x, y, cfg, desc = tb._network(args)
    assert x.shape == (4, 7, 3) and x.dtype == np.float64 and y.dtype == np.int64
    assert model.params["gru.weight_hh_l1"].shape == (15, 5) and model.n_layers == 7
    assert cfg["batch"] == 4 and "GRU H=5 L=7 layers=2" in desc
    for argv, message in ((["--model", "gru", "--seq-len", "1"], "--seq-len must be >= 2"),
                          (["--model", "gru", "--hidden", "0"], "--hidden must be >= 1"),
                          (["--model", "gru", "--batch-norm"], "are for --model conv")):
        with pytest.raises(SystemExit):
            tb.parse_args(argv)
        assert message in capsys.readouterr().err


def test_pytorch_computes_mgnn_gru_step():
    """The GRU classifier: loss and gradients agree with torch.nn.GRU (float64)."""
    torch = pytest.importorskip("torch")
    args = tb.parse_args(["--model", "gru", "--hidden", "6", "--seq-len", "9", "--gru-layers",
                          "2", "--features", "2", "--batch-size", "3", "--dtype", "float64"])
    model, x, y, _, _ = tb._network(args)
    dloss, err = tb.compare(model, x, y, torch)
    assert dloss < 1e-13 and err < 1e-10, (dloss, err)
