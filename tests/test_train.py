"""Training loop, checkpoints (atomic, exact resume) and the command line."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import mgnn
from mgnn.__main__ import main
from mgnn.errors import CheckpointError
from mgnn.train import load_checkpoint, restore, save_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args):
    return ["train", "--data", "synthetic", "--layers", "4", "--width", "8", "--batch-size", "64",
            "--dtype", "float64", "--no-progress", "--seed", "7", *args]


def test_resume_equals_uninterrupted_run(tmp_path):
    full, part = tmp_path / "full.npz", tmp_path / "part.npz"
    assert main(_cli("--epochs", "2", "--checkpoint", str(full))) == 0
    assert main(_cli("--epochs", "1", "--checkpoint", str(part))) == 0
    assert load_checkpoint(part)["header"]["epoch"] == 1
    resumed = tmp_path / "resumed.npz"
    assert main(_cli("--epochs", "2", "--resume", str(part), "--checkpoint", str(resumed))) == 0
    a, b = load_checkpoint(full), load_checkpoint(resumed)
    assert a["header"]["epoch"] == b["header"]["epoch"] == 2
    assert a["header"]["step"] == b["header"]["step"] > 0
    for k in a["params"]:
        np.testing.assert_array_equal(a["params"][k], b["params"][k], err_msg=k)
    for k in a["optim"]:
        np.testing.assert_array_equal(a["optim"][k], b["optim"][k], err_msg=k)
    assert a["header"]["rng_state"] == b["header"]["rng_state"]
    # an interrupted-and-resumed run really differs from a fresh 1-epoch run
    assert not np.array_equal(load_checkpoint(part)["params"]["steps.weight"],
                              a["params"]["steps.weight"])


def test_checkpoint_is_atomic_and_checked(tmp_path, monkeypatch):
    m = mgnn.dense_resnet(4, 4, 3, 2, seed=0)
    opt = mgnn.Adam(m.params.flat, lr=0.1)
    rng = np.random.default_rng(0)
    path = tmp_path / "c.npz"
    save_checkpoint(path, m, opt, 1, 5, rng)
    before = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", boom)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, m, opt, 2, 9, rng)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["c.npz"]
    other = mgnn.dense_resnet(4, 5, 3, 2, seed=0)
    with pytest.raises(CheckpointError, match="width"):
        restore(load_checkpoint(path), other, mgnn.Adam(other.params.flat), rng)
    with pytest.raises(CheckpointError, match="Adam"):
        restore(load_checkpoint(path), m, mgnn.SGD(m.params.flat), rng)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match="junk.npz"):
        load_checkpoint(tmp_path / "junk.npz")


def test_cli_json_summary_and_learning(capsys):
    assert main(_cli("--epochs", "3", "--json", "--lr", "0.01")) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    s = json.loads(out[0])
    assert s["epochs"] == 3 and s["data"] == "synthetic" and s["test_accuracy"] > 0.9


def test_cli_unknown_and_bad_options():
    env = dict(os.environ, PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, "-m", "mgnn", "train", "--bogus-flag", "3"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert r.returncode == 2 and "--bogus-flag" in r.stderr
    r = subprocess.run([sys.executable, "-m", "mgnn", "train", "--optimizer", "rmsprop"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert r.returncode == 2 and "rmsprop" in r.stderr


def test_cli_errors_are_messages_not_tracebacks(capsys, tmp_path):
    assert main(["train", "--data", "mnist", "--data-dir", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "mgnn: error:" in err and "none" in err and "Traceback" not in err
    assert main(_cli("--layers", "0")) == 2
    assert "--layers must be >= 1, got 0" in capsys.readouterr().err


def test_digits_dense_training_learns():
    """A short run on the real digits data; the full `make run` target is >= 95%."""
    ds = mgnn.load_dataset("digits")
    m = mgnn.dense_resnet(64, 32, 10, 8, dtype="float32", seed=0)
    lp = mgnn.LayerParallel(m, backend="numba")
    opt = mgnn.Adam(m.params.flat, lr=0.003)
    hist = mgnn.fit(lp, opt, ds.as_model_input(ds.x_train, "dense", np.float32), ds.y_train,
                    ds.as_model_input(ds.x_test, "dense", np.float32), ds.y_test, epochs=3,
                    batch_size=32, rng=np.random.default_rng(0), progress=False)
    assert hist[-1]["loss"] < hist[0]["loss"]
    assert hist[-1]["test_accuracy"] > 0.9


def test_cli_mgrit_training_matches_serial_accuracy(capsys):
    """Acceptance: 3 levels, cf 4, 2 forward / 1 adjoint cycles with skip on digits reaches the
    serial run's test accuracy within 1 percentage point (same seed)."""
    common = ["train", "--data", "digits", "--epochs", "10", "--no-progress", "--json",
              "--seed", "0", "--layers", "32"]
    assert main(common) == 0
    serial = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(common + ["--levels", "3", "--cf", "4", "--fwd-iters", "2", "--bwd-iters", "1",
                          "--skip-downcycle"]) == 0
    captured = capsys.readouterr()
    mgrit = json.loads(captured.out.strip().splitlines()[-1])
    assert "levels [32, 8, 2]" in captured.err and "for res" in captured.err
    assert serial["test_accuracy"] > 0.95
    assert abs(mgrit["test_accuracy"] - serial["test_accuracy"]) <= 0.01, (serial, mgrit)


def test_cli_bad_mgrit_options(capsys):
    assert main(_cli("--levels", "3", "--cf", "1")) == 2
    assert "cf" in capsys.readouterr().err
    assert main(_cli("--levels", "2", "--nrelax", "a,b")) == 2
    assert "'a,b'" in capsys.readouterr().err
    assert main(_cli("--levels", "3", "--cf", "8", "--layers", "4")) == 2
    assert "n_steps=4" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["dense", "conv"])
def test_batch_norm_dropout_resume_equals_uninterrupted_run(tmp_path, model):
    """Running statistics and the dropout step counter are checkpointed: resume is bit-exact."""
    opts = ("--batch-norm", "--dropout", "0.2", "--model", model, "--levels", "2", "--cf", "2",
            "--layers", "4", "--batch-size", "32")
    full, part, resumed = (str(tmp_path / f) for f in ("full.npz", "part.npz", "res.npz"))
    assert main(_cli("--epochs", "2", "--checkpoint", full, *opts)) == 0
    assert main(_cli("--epochs", "1", "--checkpoint", part, *opts)) == 0
    assert main(_cli("--epochs", "2", "--resume", part, "--checkpoint", resumed, *opts)) == 0
    a, b, p = load_checkpoint(full), load_checkpoint(resumed), load_checkpoint(part)
    assert sorted(a["buffers"]) == ["steps.running_mean", "steps.running_var"]
    assert a["header"]["train_steps"] == b["header"]["train_steps"] == \
        2 * p["header"]["train_steps"] > 0
    for k in a["params"]:
        np.testing.assert_array_equal(b["params"][k], a["params"][k], err_msg=k)
    for k in a["buffers"]:
        np.testing.assert_array_equal(b["buffers"][k], a["buffers"][k], err_msg=k)
        assert not np.array_equal(p["buffers"][k], a["buffers"][k])  # updated in epoch 2


def test_checkpoint_buffers_must_match_the_model(tmp_path):
    bn = mgnn.dense_resnet(4, 4, 3, 2, seed=0, batch_norm=True)
    opt = mgnn.Adam(bn.params.flat, lr=0.1)
    rng = np.random.default_rng(0)
    path = tmp_path / "bn.npz"
    save_checkpoint(path, bn, opt, 1, 5, rng)
    ck = load_checkpoint(path)
    ck["buffers"]["steps.running_var"] = ck["buffers"]["steps.running_var"][:1]
    with pytest.raises(CheckpointError, match="checkpoint buffers"):
        restore(ck, bn, opt, rng)
    del ck["buffers"]["steps.running_var"]
    with pytest.raises(CheckpointError, match="checkpoint buffers"):
        restore(ck, bn, opt, rng)
    ck = load_checkpoint(path)
    ck["header"]["train_steps"] = 7
    assert restore(ck, bn, opt, rng) == (1, 5) and bn.train_steps == 7


def test_fit_skips_a_batch_that_batch_norm_cannot_normalise():
    """97 samples in batches of 32: the final batch of one sample has one value per channel
    (dense BN); fit skips it instead of failing after a whole epoch."""
    ds = mgnn.load_synthetic(n_train=97, n_test=16, image_size=(2, 2), seed=0)
    model = mgnn.dense_resnet(4, 3, 4, 2, seed=0, batch_norm=True)
    lp = mgnn.LayerParallel(model)
    x = ds.as_model_input(ds.x_train, "dense", "float64")
    xt = ds.as_model_input(ds.x_test, "dense", "float64")
    opt = mgnn.SGD(model.params.flat, lr=0.01)
    hist = mgnn.fit(lp, opt, x, ds.y_train, xt, ds.y_test, epochs=1, batch_size=32,
                    rng=np.random.default_rng(0), progress=False)
    assert len(hist) == 1 and model.train_steps == 3
    with pytest.raises(TypeError, match="eps must be a real number"):
        mgnn.dense_resnet(4, 3, 4, 2, batch_norm=True, bn_eps=True)
    mgnn.dense_resnet(4, 3, 4, 2, batch_norm=True, bn_eps=np.float32(1e-5))


def test_clip_grad_scales_the_update_to_the_norm():
    ds = mgnn.load_synthetic(n_train=32, n_test=8, image_size=(2, 2), seed=0)
    model = mgnn.gru_classifier(1, 4, 4, 4, seed=0)
    lp = mgnn.LayerParallel(model)
    x = ds.as_model_input(ds.x_train, "gru", "float64", seq_len=4)
    xt = ds.as_model_input(ds.x_test, "gru", "float64", seq_len=4)
    before = model.params.flat.copy()
    _, g = lp.loss_and_grad(x, ds.y_train)
    assert lp.grad_norm(g) == pytest.approx(np.linalg.norm(g.flat), rel=1e-14)
    assert lp.grad_norm(g) > 1e-3
    mgnn.fit(lp, mgnn.SGD(model.params.flat, lr=1.0), x, ds.y_train, xt, ds.y_test, epochs=1,
             batch_size=32, rng=np.random.default_rng(0), progress=False, clip_grad=1e-3)
    assert np.linalg.norm(model.params.flat - before) == pytest.approx(1e-3, rel=1e-12)
    with pytest.raises(ValueError, match="clip_grad must be a positive number"):
        mgnn.fit(lp, mgnn.SGD(model.params.flat, lr=1.0), x, ds.y_train, xt, ds.y_test,
                 epochs=1, batch_size=32, rng=np.random.default_rng(0), clip_grad=0.0)


def test_fit_sets_the_rate_from_the_fraction_of_the_run_done():
    """Every step's rate is lr_schedule(epoch + j / batches), set before the step."""
    ds = mgnn.load_synthetic(n_train=32, n_test=8, image_size=(2, 2), seed=0)
    model = mgnn.dense_resnet(4, 3, ds.n_classes, 2, dtype="float64", seed=0)
    lp = mgnn.LayerParallel(model)
    x, xt = ds.x_train.reshape(32, -1), ds.x_test.reshape(8, -1)
    opt = mgnn.SGD(model.params.flat, lr=1.0)
    seen = []

    class Recorder:  # the rate fit set on it just before each step
        lr = None

        def step(self, g):
            seen.append(self.lr)
            opt.step(g)

    mgnn.fit(lp, Recorder(), x, ds.y_train, xt, ds.y_test, epochs=2, batch_size=16,
             rng=np.random.default_rng(0), progress=False, lr_schedule=lambda e: 1.0 + e)
    assert seen == [1.0, 1.5, 2.0, 2.5]
    with pytest.raises(TypeError, match="lr_schedule must be a callable"):
        mgnn.fit(lp, opt, x, ds.y_train, xt, ds.y_test, epochs=1, batch_size=16,
                 rng=np.random.default_rng(0), lr_schedule=0.1)
    before = model.params.flat.copy()
    for bad in (-1.0, float("nan"), "fast"):
        with pytest.raises(ValueError, match=r"lr_schedule\(0\) returned .*finite number >= 0"):
            mgnn.fit(lp, opt, x, ds.y_train, xt, ds.y_test, epochs=1, batch_size=16,
                     rng=np.random.default_rng(0), progress=False,
                     lr_schedule=lambda e, bad=bad: bad)
    np.testing.assert_array_equal(model.params.flat, before)  # nothing stepped
