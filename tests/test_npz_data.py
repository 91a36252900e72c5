"""``train --data FILE.npz``: a user's own arrays from the command line; the file and its shapes
are checked against the model with one-line errors before any kernel runs, and training on the
saved copy of a built-in set equals training on the set itself."""
import json

import numpy as np
import pytest

from mgnn.__main__ import main
from mgnn.data import load_dataset, load_npz, load_synthetic
from mgnn.errors import DataFormatError
from mgnn.network import LayerParallel


def _save(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


@pytest.fixture
def synthetic_npz(tmp_path):
    ds = load_synthetic(seed=0)
    return ds, _save(tmp_path / "mine.npz", x_train=ds.x_train, y_train=ds.y_train,
                     x_test=ds.x_test, y_test=ds.y_test)


def _train(data, *extra):
    return ["train", "--data", data, "--layers", "4", "--width", "8", "--batch-size", "16",
            "--dtype", "float64", "--no-progress", "--epochs", "2", "--json", *extra]


def test_npz_equals_the_built_in_set(synthetic_npz, capsys):
    ds, path = synthetic_npz
    mine = load_dataset(path)
    ref = load_dataset("synthetic")
    assert mine.name == "mine" and mine.n_classes == ref.n_classes == 4
    np.testing.assert_array_equal(mine.x_train, ref.x_train)
    np.testing.assert_array_equal(mine.y_test, ref.y_test)
    runs = []
    for data in (path, "synthetic"):
        assert main(_train(data, "--model", "conv", "--channels", "4", "--lr", "0.01", "--epochs", "3")) == 0
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert runs[0]["data"] == "mine" and runs[1]["data"] == "synthetic"
    for key in ("final_loss", "test_accuracy"):
        assert runs[0][key] == runs[1][key], key
    assert runs[0]["test_accuracy"] > 0.5


def test_npz_trains_a_gru_with_the_first_axis_as_time(tmp_path, capsys):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 6, 3))
    y = (x[:, :, 0].sum(axis=1) > 0).astype(np.int64)
    path = _save(tmp_path / "seq.npz", x_train=x[:48], y_train=y[:48], x_test=x[48:],
                 y_test=y[48:])
    assert main(_train(path, "--model", "gru")) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["layers"] == 6 and out["data"] == "seq"


@pytest.fixture
def no_kernels(monkeypatch):
    def boom(self, *a, **k):
        raise AssertionError("a training step ran before the input error")
    monkeypatch.setattr(LayerParallel, "loss_and_grad", boom)


def _arrays(**change):
    rng = np.random.default_rng(1)
    a = dict(x_train=rng.random((20, 1, 4, 4)), y_train=np.arange(20) % 3,
             x_test=rng.random((6, 1, 4, 4)), y_test=np.arange(6) % 3)
    a.update(change)
    return {k: v for k, v in a.items() if v is not None}


BAD = [
    (dict(y_test=None), "missing array(s) y_test"),
    (dict(x_test=np.zeros((6, 1, 4, 5))), "x_train samples are (1, 4, 4) but x_test samples "
                                          "(1, 4, 5)"),
    (dict(y_train=np.arange(19) % 3), "x_train has 20 samples but y_train 19 labels"),
    (dict(y_train=np.ones(20)), "y_train must be 1-D integer labels, got dtype float64"),
    (dict(y_test=-np.ones(6, dtype=np.int64)), "y_test has a negative label (-1)"),
    (dict(x_train=np.full((20, 1, 4, 4), np.nan)), "x_train has non-finite values"),
    (dict(x_train=np.zeros(20)), "x_train must be a real array of shape (n, ...)"),
    (dict(y_train=np.zeros(20, dtype=np.int64), y_test=np.zeros(6, dtype=np.int64)),
     "the labels name one class only"),
]


@pytest.mark.parametrize("change, message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_npz_is_one_line_before_any_kernel(change, message, tmp_path, capsys, no_kernels):
    path = _save(tmp_path / "bad.npz", **_arrays(**change))
    with pytest.raises(DataFormatError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_npz(path)
    assert main(_train(path)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mgnn: error: ") and message in err, err


def test_file_and_model_errors(tmp_path, capsys, no_kernels):
    assert main(_train(str(tmp_path / "none.npz"))) == 2
    assert "data file" in capsys.readouterr().err
    lone = tmp_path / "lone.npz"
    with open(lone, "wb") as fh:
        np.save(fh, np.ones(3))  # a .npy file named .npz
    assert main(_train(str(lone))) == 2
    assert "not an .npz archive" in capsys.readouterr().err
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    assert main(_train(str(junk))) == 2
    assert "not a readable .npz file" in capsys.readouterr().err
    flat = _save(tmp_path / "flat.npz", **_arrays(x_train=np.ones((20, 16)),
                                                 x_test=np.ones((6, 16))))
    assert main(_train(flat, "--model", "conv")) == 2
    err = capsys.readouterr().err
    assert "--model conv needs samples of shape (C, H, W) or (C, D, H, W)" in err
    assert main(_train(flat, "--model", "gru", "--seq-len", "5")) == 2
    assert "--seq-len 5 does not divide the 16 values" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(_train("mydata.csv"))
    assert "or a FILE.npz" in capsys.readouterr().err
