"""Data loading: the IDX reader on good and broken files, MNIST, digits, synthetic, batching."""
import gzip
import hashlib
import os

import numpy as np
import pytest

from mgnn.data import batches, load_digits, load_mnist, load_synthetic, read_idx
from mgnn.errors import DataFormatError
from tests.conftest import MNIST_DIR, mnist_available


def _idx_bytes(arr, code=0x08):
    header = bytes([0, 0, code, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    return header + arr.tobytes()


@pytest.mark.parametrize("gz", [False, True])
def test_idx_roundtrip(tmp_path, gz, rng):
    a = rng.integers(0, 256, size=(3, 4, 5)).astype(np.uint8)
    p = tmp_path / ("a.idx.gz" if gz else "a.idx")
    data = _idx_bytes(a)
    p.write_bytes(gzip.compress(data) if gz else data)
    np.testing.assert_array_equal(read_idx(p), a)
    b = rng.standard_normal((2, 3)).astype(">f4")
    p2 = tmp_path / "f.idx"
    p2.write_bytes(_idx_bytes(b, 0x0D))
    np.testing.assert_array_equal(read_idx(p2), b)


@pytest.mark.parametrize("mutate, match", [
    (lambda d: b"\x01\x00" + d[2:], "magic"),
    (lambda d: d[:2] + b"\x07" + d[3:], "type code 0x07"),
    (lambda d: d[:-5], "truncated"),
    (lambda d: d + b"\x00", "extra"),
    (lambda d: d[:6], "truncated"),
    (lambda d: d[:2], "too short"),
])
def test_idx_broken_files_name_the_problem(tmp_path, mutate, match):
    p = tmp_path / "bad.idx"
    p.write_bytes(mutate(_idx_bytes(np.zeros((3, 4), np.uint8))))
    with pytest.raises(DataFormatError, match=match) as info:
        read_idx(p)
    assert "bad.idx" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_idx_corrupt_gzip(tmp_path):
    p = tmp_path / "bad.gz"
    p.write_bytes(gzip.compress(_idx_bytes(np.zeros((30, 40), np.uint8)))[:-20])
    with pytest.raises(DataFormatError, match="bad.gz"):
        read_idx(p)


def test_mnist_folder_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("MGNN_MNIST_DIR", raising=False)
    with pytest.raises(ValueError, match="MGNN_MNIST_DIR"):
        load_mnist(None)
    with pytest.raises(ValueError, match="nowhere"):
        load_mnist(str(tmp_path / "nowhere"))
    # labels count that does not match the images
    (tmp_path / "train-images-idx3-ubyte").write_bytes(_idx_bytes(np.zeros((3, 2, 2), np.uint8)))
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(_idx_bytes(np.zeros(4, np.uint8)))
    with pytest.raises(DataFormatError, match="3 images but 4 labels"):
        load_mnist(str(tmp_path))


@pytest.mark.skipif(not mnist_available(), reason="the shared MNIST files are not on this machine")
def test_real_mnist_files():
    with gzip.open(os.path.join(MNIST_DIR, "t10k-labels-idx1-ubyte.gz")) as f:
        assert hashlib.md5(f.read()).hexdigest() == "27ae3e4e09519cfbb04c329615203637"
    ds = load_mnist(MNIST_DIR)
    assert ds.x_train.shape == (60000, 1, 28, 28) and ds.x_test.shape == (10000, 1, 28, 28)
    assert ds.y_train.dtype == np.int64 and set(np.unique(ds.y_test)) == set(range(10))
    assert 0 <= ds.x_train.min() and ds.x_train.max() == 1.0
    assert ds.y_train[:5].tolist() == [5, 0, 4, 1, 9]


def test_digits_and_synthetic():
    d = load_digits()
    assert d.x_train.shape[1:] == (1, 8, 8) and len(d.y_train) + len(d.y_test) == 1797
    assert not set(map(bytes, d.x_test[:50])) & set(map(bytes, d.x_train))
    n = d.normalised()
    assert abs(n.x_train.mean()) < 1e-12 and abs(n.x_train.std() - 1) < 1e-12
    s1, s2 = load_synthetic(seed=3), load_synthetic(seed=3)
    np.testing.assert_array_equal(s1.x_train, s2.x_train)
    x = d.as_model_input(d.x_train, "dense", np.float32)
    assert x.shape == (len(d.y_train), 64) and x.dtype == np.float32


def test_batches_are_seeded_and_cover_everything():
    a = batches(10, 3, np.random.default_rng(5))
    b = batches(10, 3, np.random.default_rng(5))
    assert [len(x) for x in a] == [3, 3, 3, 1]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert sorted(np.concatenate(a).tolist()) == list(range(10))
    with pytest.raises(ValueError, match="0"):
        batches(10, 0, np.random.default_rng(0))
