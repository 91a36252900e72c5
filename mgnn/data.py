"""Data sets: the MNIST IDX reader, scikit-learn's digits (the embedded default), a seeded
synthetic set; normalisation, seeded shuffling and batching.

All loaders return a :class:`Dataset` with images as float arrays (N, C, H, W) in [0, 1] before
normalisation; :meth:`Dataset.as_model_input` flattens them for dense models and casts to the
model's dtype explicitly.
"""
import gzip
import os
from dataclasses import dataclass

import numpy as np

from ._config import MNIST_ENV
from .errors import DataFormatError

_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
              0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def read_idx(path):
    """Read an IDX file (raw or ``.gz``) into a numpy array.

    Raises
    ------
    DataFormatError (a ValueError)
        Naming the file and the problem: bad magic number, unknown type code, a dimension count
        that does not match, or a payload shorter or longer than the header declares.
    FileNotFoundError
        If ``path`` does not exist.
    """
    path = os.fspath(path)
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise DataFormatError(f"{path}: cannot decompress/read ({exc})") from exc
    if len(raw) < 4:
        raise DataFormatError(f"{path}: {len(raw)} bytes, too short for an IDX header")
    if raw[0] != 0 or raw[1] != 0:
        raise DataFormatError(f"{path}: bad magic number {raw[:4].hex()} (IDX starts with 0000)")
    code, ndim = raw[2], raw[3]
    if code not in _IDX_TYPES:
        raise DataFormatError(f"{path}: unknown IDX type code 0x{code:02x}")
    if ndim < 1 or len(raw) < 4 + 4 * ndim:
        raise DataFormatError(f"{path}: header declares {ndim} dimensions but is truncated")
    dims = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_IDX_TYPES[code])
    want = int(np.prod(dims)) * dtype.itemsize
    payload = raw[4 + 4 * ndim:]
    if len(payload) != want:
        raise DataFormatError(f"{path}: dimensions {dims} need {want} bytes of data, the file has "
                              f"{len(payload)} ({'truncated' if len(payload) < want else 'extra'})")
    return np.frombuffer(payload, dtype=dtype).reshape(dims)


@dataclass
class Dataset:
    """Train/test split. x_* (n, C, H, W) float64 in [0, 1]; y_* (n,) int64 in [0, n_classes)."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    n_classes: int

    @property
    def image_shape(self):
        """(C, H, W) of one sample."""
        return self.x_train.shape[1:]

    def normalised(self):
        """A copy standardised with the training set's mean and standard deviation (scalars)."""
        mu = self.x_train.mean()
        sd = self.x_train.std() or 1.0
        return Dataset(self.name, (self.x_train - mu) / sd, self.y_train, (self.x_test - mu) / sd,
                       self.y_test, self.n_classes)

    def as_model_input(self, x, model_kind, dtype, seq_len=None):
        """x shaped for a 'dense' (n, C*H*W) or 'conv' (n, C, H, W) model, or as sequences
        (n, L, C*H*W / L) for a recurrent one ('gru', 'rnn'; ``seq_len`` L, e.g. 28 rows of
        an MNIST image: row-sequential MNIST), cast to ``dtype``."""
        if model_kind == "dense":
            x = x.reshape(x.shape[0], -1)
        elif model_kind in ("gru", "rnn"):
            size = int(np.prod(x.shape[1:]))
            if seq_len is None or seq_len < 1 or size % seq_len:
                raise ValueError(f"seq_len {seq_len!r} does not divide the {size} values of a "
                                 f"{self.name} sample")
            x = x.reshape(x.shape[0], seq_len, size // seq_len)
        return np.ascontiguousarray(x, dtype=dtype)


def _mnist_dir(data_dir):
    d = data_dir or os.environ.get(MNIST_ENV)
    if not d:
        raise ValueError(f"no MNIST folder: pass data_dir (CLI: --data-dir) or set {MNIST_ENV}")
    if not os.path.isdir(d):
        raise ValueError(f"MNIST folder {d!r} does not exist")
    return d


def _find(d, stem):
    for name in (stem + ".gz", stem):
        p = os.path.join(d, name)
        if os.path.exists(p):
            return p
    raise FileNotFoundError(f"{os.path.join(d, stem)}(.gz) not found")


def load_mnist(data_dir=None, limit_train=None, limit_test=None):
    """MNIST from the IDX files in ``data_dir`` (or ``$MGNN_MNIST_DIR``); images (n, 1, 28, 28)."""
    _check_limits(limit_train, limit_test)
    d = _mnist_dir(data_dir)
    parts = {}
    for split, stem in (("train", "train"), ("test", "t10k")):
        x = read_idx(_find(d, f"{stem}-images-idx3-ubyte"))
        y = read_idx(_find(d, f"{stem}-labels-idx1-ubyte"))
        if x.ndim != 3 or y.ndim != 1:
            raise DataFormatError(f"{d}: {stem} images must be 3-D and labels 1-D, got "
                                  f"{x.ndim}-D and {y.ndim}-D")
        if x.shape[0] != y.shape[0]:
            raise DataFormatError(f"{d}: {stem} has {x.shape[0]} images but {y.shape[0]} labels")
        if y.size and y.max() > 9:
            raise DataFormatError(f"{d}: {stem} labels out of range 0..9 (max {y.max()})")
        limit = limit_train if split == "train" else limit_test
        if limit is not None:
            x, y = x[:limit], y[:limit]
        parts[split] = (x[:, None].astype(np.float64) / 255.0, y.astype(np.int64))
    return Dataset("mnist", *parts["train"], *parts["test"], 10)


def load_digits(test_fraction=0.2, seed=0):
    """scikit-learn's 8x8 digits (1797 images, offline), split with a seeded permutation."""
    from sklearn.datasets import load_digits as _sk_digits
    d = _sk_digits()
    x = d.images[:, None].astype(np.float64) / 16.0
    y = d.target.astype(np.int64)
    perm = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(test_fraction * len(y)))
    te, tr = perm[:n_test], perm[n_test:]
    return Dataset("digits", x[tr], y[tr], x[te], y[te], 10)


def _check_count(name, value, least=1):
    """``value`` as an int >= ``least`` (ValueError/TypeError naming ``name`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < least:
        raise ValueError(f"{name} must be >= {least}, got {value}")
    return int(value)


def _check_limits(limit_train, limit_test):
    for name, limit in (("limit_train", limit_train), ("limit_test", limit_test)):
        if limit is not None:
            _check_count(name, limit)


def load_synthetic(n_train=512, n_test=128, image_size=(8, 8), n_classes=4, seed=0):
    """Seeded synthetic classification set: class templates plus noise, images (n, 1, H, W)."""
    n_train, n_test = _check_count("n_train", n_train), _check_count("n_test", n_test)
    n_classes = _check_count("n_classes", n_classes, least=2)
    rng = np.random.default_rng(seed)
    templates = rng.uniform(0, 1, size=(n_classes, 1) + tuple(image_size))

    def draw(n):
        y = rng.integers(0, n_classes, size=n)
        x = np.clip(templates[y] + 0.3 * rng.standard_normal((n, 1) + tuple(image_size)), 0, 1)
        return x, y.astype(np.int64)

    return Dataset("synthetic", *draw(n_train), *draw(n_test), n_classes)


def load_sine(seq_len=512, n_train=2048, n_test=512, n_classes=4, noise=1.0, seed=0):
    """Seeded long-sequence task: which of ``n_classes`` frequencies a noisy sinusoid has.

    Sample i is ``sin(2 pi f_k t / 64 + phase) + noise * N(0, 1)`` at t = 0..L-1 with
    f_k = k + 1 (cycles per 64 steps) and a uniform random phase; stored as (n, 1, 1, L)
    (one feature per step). The noise (standard deviation 1 against amplitude 1) hides the
    frequency in a short window: a classifier has to integrate over many steps, and the best
    possible accuracy grows with L. Chance level: 1 / n_classes.
    """
    seq_len = _check_count("seq_len", seq_len, least=2)
    n_train, n_test = _check_count("n_train", n_train), _check_count("n_test", n_test)
    n_classes = _check_count("n_classes", n_classes, least=2)
    rng = np.random.default_rng(seed)
    t = np.arange(seq_len)

    def draw(n):
        y = rng.integers(0, n_classes, size=n)
        f = 1.0 + y
        phase = rng.uniform(0, 2 * np.pi, size=n)
        x = np.sin(2 * np.pi * f[:, None] * t / 64.0 + phase[:, None])
        x += noise * rng.standard_normal(x.shape)
        return x[:, None, None, :], y.astype(np.int64)

    return Dataset("sine", *draw(n_train), *draw(n_test), n_classes)


def load_dataset(name, data_dir=None, seed=0, limit_train=None, limit_test=None, seq_len=512):
    """'digits', 'mnist', 'synthetic' or 'sine' (:func:`load_sine` of length ``seq_len``),
    normalised; ``limit_train`` / ``limit_test`` keep the first samples of each split (any
    data set): None (all) or an int >= 1."""
    _check_limits(limit_train, limit_test)
    if name == "sine":
        ds = load_sine(seq_len, seed=seed)
    elif name == "digits":
        ds = load_digits(seed=0)
    elif name == "mnist":
        ds = load_mnist(data_dir, limit_train, limit_test)
    elif name == "synthetic":
        ds = load_synthetic(seed=seed)
    else:
        raise ValueError(f"unknown data set {name!r}; expected 'digits', 'mnist', 'synthetic' "
                         "or 'sine'")
    if limit_train is not None or limit_test is not None:
        ds = Dataset(ds.name, ds.x_train[:limit_train], ds.y_train[:limit_train],
                     ds.x_test[:limit_test], ds.y_test[:limit_test], ds.n_classes)
    return ds.normalised()


def batches(n, batch_size, rng):
    """Index arrays of a seeded random permutation of range(n) in chunks of ``batch_size``
    (the last may be shorter). ``rng`` is a numpy Generator, advanced by one permutation."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    perm = rng.permutation(n)
    return [perm[i:i + batch_size] for i in range(0, n, batch_size)]
