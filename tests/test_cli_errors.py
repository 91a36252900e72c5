"""Command-line input errors: one line ``mgnn: error: ...`` naming the flag and the value, exit
code 2, found before any kernel is compiled; bench takes train's flag names."""
import numpy as np
import pytest

import mgnn
from mgnn.__main__ import _check_layer_ranks, main, parse_args
from mgnn.data import load_dataset, load_synthetic
from mgnn.mgrit import DivergenceError
from mgnn.network import LayerParallel
from mgnn.train import fit


def _cli(*args):
    return ["train", "--data", "synthetic", "--layers", "4", "--width", "8", "--batch-size", "16",
            "--dtype", "float64", "--no-progress", "--epochs", "1", *args]


@pytest.fixture
def no_kernels(monkeypatch):
    """Fails the test if a training step (kernel compilation included) starts."""
    def boom(self, *a, **k):
        raise AssertionError("a training step ran before the input error")
    monkeypatch.setattr(LayerParallel, "loss_and_grad", boom)


BAD = [
    (["--epochs", "0"], "--epochs must be >= 1, got 0"),
    (["--epochs", "-3"], "--epochs must be >= 1, got -3"),
    (["--limit-train", "0"], "--limit-train must be >= 1, got 0"),
    (["--limit-train", "-1"], "--limit-train must be >= 1, got -1"),
    (["--limit-test", "0"], "--limit-test must be >= 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--width", "0"], "--width must be >= 1, got 0"),
    (["--layers", "0"], "--layers must be >= 1, got 0"),
    (["--fwd-iters", "1000000000"], "--fwd-iters must be <= 10000, got 1000000000"),
    (["--bwd-iters", "0"], "--bwd-iters must be >= 1, got 0"),
    (["--levels", "0"], "--levels must be >= 1, got 0"),
    (["--cf", "1"], "--cf must be >= 2, got 1"),
    (["--levels", "auto", "--cycle", "F"], "--levels auto models V-cycles, not --cycle F"),
    (["--min-coarse", "0"], "--min-coarse must be >= 1, got 0"),
    (["--data-ranks", "0"], "--data-ranks must be >= 1, got 0"),
    (["--lr", "0"], "--lr must be a finite number > 0.0, got 0.0"),
    (["--lr", "nan"], "--lr must be a finite number > 0.0, got nan"),
    (["--momentum", "1"], "--momentum must be a finite number in [0.0, 1.0), got 1.0"),
    (["--dropout", "1"], "--dropout must be a finite number in [0.0, 1.0), got 1.0"),
    (["--dropout", "-0.5"], "--dropout must be a finite number in [0.0, 1.0), got -0.5"),
    (["--lr-min", "-1"], "--lr-min must be a finite number >= 0.0, got -1.0"),
    (["--lr-schedule", "cosine", "--lr", "0.01", "--lr-min", "0.1"],
     "--lr-min 0.1 is above --lr 0.01"),
    (["--lr-schedule", "cosine", "--lr-min", "0.01"], "--lr-min 0.01 is above --lr 0.003"),
    (["--lr-min", "0.001"], "--lr-min 0.001 needs --lr-schedule cosine"),
    (["--lr-epochs", "3"], "--lr-epochs 3.0 needs --lr-schedule cosine"),
    (["--lr-schedule", "cosine", "--lr-epochs", "0"],
     "--lr-epochs must be a finite number > 0.0, got 0.0"),
    (["--weight-decay", "-0.1"], "--weight-decay must be a finite number >= 0.0, got -0.1"),
    (["--t-final", "inf"], "--t-final must be a finite number > 0.0, got inf"),
    (["--fwd-tol", "-1"], "--fwd-tol must be a finite number >= 0.0, got -1.0"),
    (["--nrelax", "0,-1"], "--nrelax entries must be between 0 and 100, got '0,-1'"),
    (["--batch-size", "2", "--data-ranks", "3"], "--batch-size 2 is smaller than --data-ranks 3"),
    (["--data", "mnist", "--data-dir", "/nonexistent/mnist"], "MNIST folder '/nonexistent/mnist'"),
]


@pytest.mark.parametrize("args, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_flag_is_one_line_before_any_kernel(args, message, capsys, no_kernels):
    assert main(_cli(*args)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mgnn: error: "), err
    assert message in err, err


@pytest.mark.parametrize("flag", ["--width", "--layers"])
def test_huge_sizes_give_a_memory_estimate(flag, capsys, no_kernels):
    assert main(_cli(flag, "1000000000")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{flag} 1000000000" in err and "GiB per rank" in err and "more than the" in err


def test_unknown_flag_shows_the_train_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(_cli("--bogus-flag", "3"))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python -m mgnn train" in err and "--bogus-flag" in err


def test_levels_takes_an_int_or_auto(capsys):
    with pytest.raises(SystemExit) as e:
        main(_cli("--levels", "many"))
    assert e.value.code == 2
    assert "--levels: must be an int or 'auto', got 'many'" in capsys.readouterr().err
    assert parse_args(_cli("--levels", "auto")).levels == "auto"
    assert parse_args(_cli("--levels", "3")).levels == 3


def test_layer_ranks_message_uses_layers_and_ranks():
    args = parse_args(_cli("--layers", "8", "--levels", "2", "--cf", "4"))
    _check_layer_ranks(args, 2)  # blocks start at layers 0 and 4: two ranks hold layers
    with pytest.raises(ValueError, match=r"^3 layer ranks but --layers 8 with --cf 4 allow at "
                                         r"most 2 "):
        _check_layer_ranks(args, 3)
    args = parse_args(_cli("--layers", "4"))
    with pytest.raises(ValueError, match=r"^5 layer ranks but --layers 4 allow at most 4 "):
        _check_layer_ranks(args, 5)


def test_data_limits_and_classes_are_checked():
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"limit_train must be >= 1, got {bad}"):
            load_dataset("synthetic", limit_train=bad)
    assert len(load_dataset("synthetic", limit_train=10, limit_test=3).y_test) == 3
    with pytest.raises(ValueError, match="n_classes must be >= 2, got 1"):
        load_synthetic(n_classes=1)


def test_bench_takes_train_flag_names():
    new = parse_args(["bench", "scaling", "--layers", "16", "--batch-size", "8"])
    old = parse_args(["bench", "scaling", "--n-layers", "16", "--batch", "8"])
    assert (new.n_layers, new.batch) == (old.n_layers, old.batch) == (16, 8)


def test_bench_bad_size_is_one_line(capsys):
    assert main(["bench", "scaling", "--layers", "0"]) == 2
    assert capsys.readouterr().err == "mgnn: error: --layers must be >= 1, got 0\n"


@pytest.mark.parametrize("args, message", [
    (["bench", "predict", "--activation", "relu"],
     "bench predict --activation relu: --activation is for bench scaling, mgrit only"),
    (["bench", "kernels", "--dtype", "float64"],
     "bench kernels --dtype float64: --dtype is for bench calibrate, predict, scaling, mgrit "
     "only"),
    (["bench", "scaling", "--model", "conv", "--dtype", "float64"],
     "bench scaling --dtype float64 needs --model dense, got --model conv"),
])
def test_bench_dense_only_flags_are_one_line(args, message, capsys, no_kernels):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("mgnn: error: " + message) and err.count("\n") == 1, err


def test_divergence_names_epoch_and_batch(monkeypatch):
    m = mgnn.dense_resnet(4, 4, 3, 4, dtype="float64", seed=0)
    lp = LayerParallel(m, backend="numpy")
    calls = []

    def diverge(x, y, out=None):
        calls.append(1)
        if len(calls) == 3:
            raise DivergenceError("MGRIT diverged: residual nan in cycle 0")
        return 0.5, m.params.zeros_like()

    monkeypatch.setattr(lp, "loss_and_grad", diverge)
    x, y = np.zeros((8, 4)), np.zeros(8, dtype=np.int64)
    with pytest.raises(DivergenceError, match=r"in cycle 0 at epoch 1, batch 3 of 4$"):
        fit(lp, mgnn.SGD(m.params.flat, lr=0.1), x, y, x, y, epochs=1, batch_size=2,
            rng=np.random.default_rng(0), progress=False)
