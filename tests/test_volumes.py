"""The synthetic 3D volumes (mgnn.data.load_volumes): shapes, determinism, balance, the cache,
bad input, and that the task is learnable but not trivial."""
import os

import numpy as np
import pytest

import mgnn.data as data
from mgnn.data import VOLUME_CLASSES, load_volumes, volumes_cache_path


def test_shapes_dtypes_and_range():
    for size in (8, 15, 16, 31, 32):
        d = load_volumes(size, n_train=12, n_test=7, seed=1, cache=False)
        assert d.name == "volumes" and d.n_classes == len(VOLUME_CLASSES) == 6
        assert d.x_train.shape == (12, 1, size, size, size)
        assert d.x_test.shape == (7, 1, size, size, size)
        assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int64
        assert d.image_shape == (1, size, size, size)
        for x in (d.x_train, d.x_test):
            assert x.min() >= 0.0 and x.max() <= 1.0 and x.flags.c_contiguous
        assert set(d.y_train.tolist()) <= set(range(6))


def test_seeded_and_balanced():
    a = load_volumes(16, n_train=60, n_test=13, seed=3, cache=False)
    b = load_volumes(16, n_train=60, n_test=13, seed=3, cache=False)
    c = load_volumes(16, n_train=60, n_test=13, seed=4, cache=False)
    for k in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(a, k), getattr(b, k))
    assert not np.array_equal(a.x_train, c.x_train)
    assert not np.array_equal(a.x_train, a.x_test[:1])  # train and test are different draws
    np.testing.assert_array_equal(np.bincount(a.y_train, minlength=6), [10] * 6)
    counts = np.bincount(a.y_test, minlength=6)
    assert counts.sum() == 13 and counts.max() - counts.min() <= 1
    assert not np.array_equal(a.y_train[:6], np.arange(6))  # shuffled, not in class order


def test_same_scenes_at_every_size():
    """A seed's objects do not depend on the size: 2x2x2 averages of the noise-free 32^3 set are
    close to the 16^3 set, and far from another seed's."""
    fine = load_volumes(32, n_train=12, n_test=1, seed=5, noise=0.0, cache=False)
    coarse = load_volumes(16, n_train=12, n_test=1, seed=5, noise=0.0, cache=False)
    other = load_volumes(16, n_train=12, n_test=1, seed=6, noise=0.0, cache=False)
    np.testing.assert_array_equal(fine.y_train, coarse.y_train)
    pooled = fine.x_train.reshape(12, 1, 16, 2, 16, 2, 16, 2).mean(axis=(3, 5, 7))
    near = np.abs(pooled - coarse.x_train).mean()
    far = np.abs(pooled - other.x_train).mean()
    assert near < 0.02 and far > 5 * near, (near, far)


def test_cache_hit_is_identical_and_skips_generation(tmp_path, monkeypatch):
    first = load_volumes(15, n_train=12, n_test=6, seed=2, cache_dir=tmp_path)
    path = volumes_cache_path(15, 12, 6, 2, 0.25, tmp_path)
    assert os.path.exists(path)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]  # no temporary left

    def boom(*args):
        raise AssertionError("regenerated despite the cache")

    monkeypatch.setattr(data, "_draw_volumes", boom)
    again = load_volumes(15, n_train=12, n_test=6, seed=2, cache_dir=tmp_path)
    for k in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(first, k), getattr(again, k))
        assert getattr(again, k).dtype == getattr(first, k).dtype
    with pytest.raises(AssertionError, match="regenerated"):  # other arguments: another file
        load_volumes(15, n_train=12, n_test=6, seed=2, noise=0.1, cache_dir=tmp_path)


def test_broken_cache_file_is_regenerated(tmp_path):
    want = load_volumes(16, n_train=6, n_test=6, seed=0, cache=False)
    path = volumes_cache_path(16, 6, 6, 0, 0.25, tmp_path)
    with open(path, "wb") as f:
        f.write(b"not a zip file")
    got = load_volumes(16, n_train=6, n_test=6, seed=0, cache_dir=tmp_path)
    np.testing.assert_array_equal(got.x_train, want.x_train)
    with np.load(path) as f:  # rewritten with the good arrays
        np.testing.assert_array_equal(f["x_test"], want.x_test)


def test_default_cache_folder_follows_mgnn_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MGNN_CACHE_DIR", str(tmp_path))
    load_volumes(8, n_train=6, n_test=6, seed=0)
    assert os.listdir(tmp_path / "data") == [os.path.basename(
        volumes_cache_path(8, 6, 6, 0, 0.25))]
    assert volumes_cache_path(8, 6, 6, 0, 0.25).startswith(str(tmp_path / "data"))


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"size": 7}, ValueError, "size must be >= 8, got 7"),
    ({"size": 16.0}, TypeError, "size must be an int, got 16.0"),
    ({"size": True}, TypeError, "size must be an int, got True"),
    ({"n_train": 0}, ValueError, "n_train must be >= 1, got 0"),
    ({"n_test": 2.5}, TypeError, "n_test must be an int, got 2.5"),
    ({"seed": -1}, ValueError, "seed must be >= 0, got -1"),
    ({"noise": -0.1}, ValueError, "noise must be a finite number >= 0, got -0.1"),
    ({"noise": float("nan")}, ValueError, "noise must be a finite number >= 0, got nan"),
    ({"noise": "0.2"}, TypeError, "noise must be a number, got '0.2'"),
])
def test_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        load_volumes(**{"n_train": 6, "n_test": 6, "cache": False, **kwargs})


def _smoothed_moment_features(x):
    """Per sample: occupied fraction and the sorted eigenvalues of the second moments (and two
    of their ratios) of the 3x3x3-box-smoothed volume thresholded at 0.3: rotation invariant."""
    n, size = x.shape[0], x.shape[-1]
    padded = np.pad(x[:, 0], ((0, 0), (1, 1), (1, 1), (1, 1)))
    smooth = sum(padded[:, a:a + size, b:b + size, c:c + size]
                 for a in range(3) for b in range(3) for c in range(3)) / 27
    v = (smooth > 0.3).reshape(n, -1).astype(np.float64)
    p = (2 * np.arange(size) + 1) / size - 1
    pts = np.stack(np.meshgrid(p, p, p, indexing="ij"), -1).reshape(-1, 3)
    mass = v.sum(1)
    centre = v @ pts / mass[:, None]
    second = np.einsum("nv,vi,vj->nij", v, pts, pts) / mass[:, None, None]
    lam = np.linalg.eigvalsh(second - centre[:, :, None] * centre[:, None, :])
    return np.column_stack([mass / size ** 3, lam, lam[:, 0] / lam[:, 2], lam[:, 1] / lam[:, 2]])


def _softmax_regression_accuracy(f_train, y_train, f_test, y_test, steps=300, lr=0.5):
    mu, sd = f_train.mean(0), f_train.std(0)
    a = np.column_stack([(f_train - mu) / sd, np.ones(len(f_train))])
    b = np.column_stack([(f_test - mu) / sd, np.ones(len(f_test))])
    w = np.zeros((a.shape[1], 6))
    onehot = np.eye(6)[y_train]
    for _ in range(steps):
        z = a @ w
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        w -= lr * a.T @ (p - onehot) / len(a)
    return float(((b @ w).argmax(1) == y_test).mean())


def test_learnable_but_not_trivial():
    """Softmax regression on rotation-invariant moments of the smoothed volumes: well above
    chance (1/6) at the default noise, far from perfect; twice the noise costs accuracy."""
    accuracy = {}
    for noise in (0.25, 0.5):
        d = load_volumes(16, n_train=600, n_test=300, seed=0, noise=noise, cache=False)
        accuracy[noise] = _softmax_regression_accuracy(
            _smoothed_moment_features(d.x_train), d.y_train,
            _smoothed_moment_features(d.x_test), d.y_test)
    assert 0.4 < accuracy[0.25] < 0.9, accuracy
    assert accuracy[0.5] < accuracy[0.25] - 0.1, accuracy
