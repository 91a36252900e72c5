"""Checkpoints: unreadable files and failed writes are one clear error naming the file, the path
is checked before the first epoch, leftovers of a killed writer are reused, the file mode follows
the umask, and ``--resume`` continues a ``--warm-start`` run exactly."""
import errno
import os
import stat
import zipfile

import numpy as np
import pytest

import mgnn
from mgnn.__main__ import main
from mgnn.errors import CheckpointError
from mgnn.network import LayerParallel
from mgnn.train import check_checkpoint_path, fit, load_checkpoint, save_checkpoint


def _cli(*args):
    return ["train", "--data", "synthetic", "--layers", "4", "--width", "8", "--batch-size", "64",
            "--dtype", "float64", "--no-progress", "--seed", "7", *args]


@pytest.fixture
def saved(tmp_path):
    m = mgnn.dense_resnet(4, 4, 3, 2, seed=0)
    opt = mgnn.Adam(m.params.flat, lr=0.1)
    path = tmp_path / "good.npz"
    save_checkpoint(path, m, opt, 1, 5, np.random.default_rng(0))
    return path


def _corrupt(tmp_path, good):
    """name -> bytes of broken checkpoints of every kind."""
    raw = good.read_bytes()
    import io
    buf = io.BytesIO()
    np.save(buf, np.arange(3))
    no_header = io.BytesIO()
    np.savez(no_header, x=np.arange(3))
    bad_header = io.BytesIO()
    np.savez(bad_header, header=np.frombuffer(b'{"epoch": 1}', dtype=np.uint8))
    flipped = bytearray(raw)
    i = raw.index(b"params/")  # inside the first member's data: CRC or format error
    flipped[i + 200:i + 260] = b"\xff" * 60
    odd = io.BytesIO()
    with zipfile.ZipFile(odd, "w") as z:
        z.writestr("header.npy", raw[:100])
    odd = bytearray(odd.getvalue())  # an unsupported compression method (NotImplementedError)
    for sig, at in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):
        i = odd.index(sig) + at
        odd[i:i + 2] = (99).to_bytes(2, "little")
    return {"empty.npz": b"", "truncated.npz": raw[:len(raw) // 2], "tail.npz": raw[:-10],
            "text.npz": b"hello, not a checkpoint\n", "array.npz": buf.getvalue(),
            "noheader.npz": no_header.getvalue(), "badheader.npz": bad_header.getvalue(),
            "flipped.npz": bytes(flipped), "method99.npz": bytes(odd)}


def test_unreadable_checkpoints_are_clear_errors(tmp_path, saved):
    assert load_checkpoint(saved)["header"]["epoch"] == 1
    for name, data in _corrupt(tmp_path, saved).items():
        p = tmp_path / name
        p.write_bytes(data)
        with pytest.raises(CheckpointError, match=f"{name}: not a readable mgnn checkpoint"):
            load_checkpoint(p)
    with pytest.raises(CheckpointError, match="not a readable"):
        load_checkpoint(tmp_path)  # a directory
    with pytest.raises(FileNotFoundError, match="checkpoint .*missing.npz not found"):
        load_checkpoint(tmp_path / "missing.npz")


def test_cli_resume_from_a_broken_checkpoint_is_one_line(tmp_path, saved, capsys):
    for name, data in list(_corrupt(tmp_path, saved).items())[:3]:
        p = tmp_path / name
        p.write_bytes(data)
        assert main(_cli("--epochs", "1", "--resume", str(p))) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"mgnn: error: {p}: not a readable" in err, err
    assert main(_cli("--epochs", "1", "--resume", str(tmp_path / "nope.npz"))) == 2
    assert capsys.readouterr().err == f"mgnn: error: checkpoint {tmp_path / 'nope.npz'} not found\n"


@pytest.mark.parametrize("where", ["directory", "under_a_file"])
def test_unwritable_checkpoint_path_fails_before_the_first_epoch(where, tmp_path, capsys,
                                                                 monkeypatch):
    path = tmp_path / "ckpt.npz"
    if where == "directory":
        path.mkdir()
    else:
        (tmp_path / "file").write_text("x")
        path = tmp_path / "file" / "ckpt.npz"
    steps = []
    monkeypatch.setattr(LayerParallel, "loss_and_grad",
                        lambda self, x, y, out=None: steps.append(1) or (_ for _ in ()).throw(
                            AssertionError("trained before the path check")))
    assert main(_cli("--epochs", "1", "--checkpoint", str(path))) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mgnn: error: cannot write checkpoint {path}: ") and \
        err.count("\n") == 1, err
    assert steps == []
    # the library's fit checks too, before its first step
    m = mgnn.dense_resnet(4, 4, 3, 2, seed=0)
    x, y = np.zeros((4, 4)), np.zeros(4, dtype=np.int64)
    with pytest.raises(CheckpointError, match="cannot write checkpoint"):
        fit(LayerParallel(m, backend="numpy"), mgnn.SGD(m.params.flat), x, y, x, y, epochs=1,
            batch_size=2, rng=np.random.default_rng(0), checkpoint=str(path), progress=False)
    assert steps == []


def test_write_failure_during_training_is_one_line(tmp_path, capsys, monkeypatch):
    real = np.savez

    def disk_full(f, **arrays):
        real(f, **arrays)  # part of the data is written, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(np, "savez", disk_full)
    path = tmp_path / "c.npz"
    assert main(_cli("--epochs", "1", "--checkpoint", str(path))) == 2
    err = capsys.readouterr().err
    assert err == f"mgnn: error: cannot write checkpoint {path}: No space left on device\n"
    assert os.listdir(tmp_path) == []  # neither the checkpoint nor a temporary file


def test_leftover_tmp_is_reused_and_mode_follows_umask(tmp_path, saved):
    m = mgnn.dense_resnet(4, 4, 3, 2, seed=0)
    opt = mgnn.Adam(m.params.flat, lr=0.1)
    path = tmp_path / "c.npz"
    leftover = tmp_path / ".c.npz.tmp"  # what a writer killed half-way leaves
    leftover.write_bytes(saved.read_bytes()[:300])
    old = os.umask(0o022)
    try:
        save_checkpoint(path, m, opt, 3, 7, np.random.default_rng(0))
        check_checkpoint_path(path)
    finally:
        os.umask(old)
    assert sorted(os.listdir(tmp_path)) == ["c.npz", "good.npz"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert load_checkpoint(path)["header"]["epoch"] == 3


def test_resume_with_warm_start_equals_the_uninterrupted_run(tmp_path):
    """The warm-start states (the last batch's forward states) are checkpointed: a resumed
    MGRIT run with --warm-start is bit for bit the uninterrupted one."""
    opts = ("--levels", "2", "--cf", "2", "--fwd-iters", "1", "--bwd-iters", "1",
            "--warm-start", "--layers", "8")
    full, part, resumed = (str(tmp_path / f) for f in ("full.npz", "part.npz", "res.npz"))
    assert main(_cli("--epochs", "2", "--checkpoint", full, *opts)) == 0
    assert main(_cli("--epochs", "1", "--checkpoint", part, *opts)) == 0
    warm = load_checkpoint(part)["warm"]
    assert warm["batch"] == 64 and sorted(warm["states"]) == list(range(9))
    assert main(_cli("--epochs", "2", "--resume", part, "--checkpoint", resumed, *opts)) == 0
    a, b = load_checkpoint(full), load_checkpoint(resumed)
    for k in a["params"]:
        np.testing.assert_array_equal(b["params"][k], a["params"][k], err_msg=k)
    for k in a["warm"]["states"]:
        np.testing.assert_array_equal(b["warm"]["states"][k], a["warm"]["states"][k])


def test_resume_continues_a_cosine_schedule_exactly(tmp_path):
    """The rate follows the epochs done, so 1 epoch of a 3-epoch decay + resume to 3 is the
    uninterrupted 3-epoch cosine run bit for bit (and differs from a constant-rate run); the
    decay length is checked on resume."""
    opts = ("--lr", "0.01", "--lr-schedule", "cosine", "--lr-min", "0.001", "--lr-epochs", "3")
    full, part, resumed, flat = (str(tmp_path / f) for f in ("f.npz", "p.npz", "r.npz", "c.npz"))
    assert main(_cli("--epochs", "3", "--checkpoint", full, *opts[:-2])) == 0  # default: 3
    assert main(_cli("--epochs", "3", "--checkpoint", flat, "--lr", "0.01")) == 0
    assert main(_cli("--epochs", "1", "--checkpoint", part, *opts)) == 0
    assert main(_cli("--epochs", "3", "--resume", part, "--checkpoint", resumed, *opts)) == 0
    a, b, c = load_checkpoint(full), load_checkpoint(resumed), load_checkpoint(flat)
    for k in a["params"]:
        np.testing.assert_array_equal(b["params"][k], a["params"][k], err_msg=k)
    assert not np.array_equal(a["params"]["steps.weight"], c["params"]["steps.weight"])
    assert main(_cli("--epochs", "4", "--resume", part, *opts[:-2])) == 2  # a 4-epoch decay


def test_resume_checks_the_options_that_change_the_continuation(tmp_path, capsys):
    part = str(tmp_path / "part.npz")
    assert main(_cli("--epochs", "1", "--checkpoint", part, "--lr", "0.01")) == 0
    capsys.readouterr()
    for flag, value, saved in (("--lr", "0.02", "0.01"), ("--batch-size", "32", "64"),
                               ("--weight-decay", "0.1", "0.0"), ("--seed", "8", "7"),
                               ("--lr-schedule", "cosine", "constant")):
        assert main(_cli("--epochs", "2", "--resume", part, "--lr", "0.01", flag, value)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{flag} {float(value) if '.' in value else value} " \
            f"differs from the checkpoint's {saved}" in err, err
