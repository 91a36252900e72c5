"""Data sets: the MNIST IDX reader, scikit-learn's digits (the embedded default), a seeded
synthetic set; normalisation, seeded shuffling and batching.

All loaders return a :class:`Dataset` with images as float arrays (N, C, H, W) in [0, 1] before
normalisation; :meth:`Dataset.as_model_input` flattens them for dense models and casts to the
model's dtype explicitly.
"""
import gzip
import os
import tempfile
import zipfile
from dataclasses import dataclass

import numpy as np

from ._config import MNIST_ENV, cache_root
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
    """Train/test split. x_* (n, C, H, W) images or (n, C, D, H, W) volumes, float64 (volumes:
    float32) in [0, 1] before :meth:`normalised`; y_* (n,) int64 in [0, n_classes)."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    n_classes: int

    @property
    def image_shape(self):
        """(C, H, W) (or (C, D, H, W)) of one sample."""
        return self.x_train.shape[1:]

    def normalised(self):
        """A copy standardised with the training set's mean and standard deviation (scalars)."""
        mu = self.x_train.mean()
        sd = self.x_train.std() or 1.0
        return Dataset(self.name, (self.x_train - mu) / sd, self.y_train, (self.x_test - mu) / sd,
                       self.y_test, self.n_classes)

    def as_model_input(self, x, model_kind, dtype, seq_len=None):
        """x shaped for a 'dense' (n, C*H*W) or 'conv' (n, C, H, W) / (n, C, D, H, W) model, or as
        sequences
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


#: Classes of :func:`load_volumes`, in label order.
VOLUME_CLASSES = ("sphere", "cube", "cylinder", "cone", "torus", "octahedron")
_VOLUMES_FORMAT = 1  # part of the cache file name: bump when the generator's output changes
_VOLUMES_CHUNK = 64  # samples voxelised at once (bounds the temporaries to a few MB each)


def _volume_sdf(name, x, y, z):
    """Signed distance (negative inside; exact or a close lower bound) of shape ``name`` in its
    own frame, whose unit is the shape's size: x, y, z float32 arrays of one shape."""
    if name == "sphere":                         # radius 1
        return np.sqrt(x * x + y * y + z * z) - 1.0
    if name == "cube":                           # half side 0.8
        dx, dy, dz = np.abs(x) - 0.8, np.abs(y) - 0.8, np.abs(z) - 0.8
        outside = np.sqrt(np.maximum(dx, 0) ** 2 + np.maximum(dy, 0) ** 2 + np.maximum(dz, 0) ** 2)
        return outside + np.minimum(np.maximum(np.maximum(dx, dy), dz), 0)
    rho = np.sqrt(x * x + y * y)
    if name == "cylinder":                       # radius 0.75, height 1.7, axis z
        d1, d2 = rho - 0.75, np.abs(z) - 0.85
        return np.sqrt(np.maximum(d1, 0) ** 2 + np.maximum(d2, 0) ** 2) + \
            np.minimum(np.maximum(d1, d2), 0)
    if name == "cone":                           # base radius 0.9 at z = -0.9, apex at z = 0.9
        slant = 1.8 / float(np.hypot(1.8, 0.9))  # cosine of the half-angle
        return np.maximum((rho - 0.5 * (0.9 - z)) * slant, np.abs(z) - 0.9)
    if name == "torus":                          # radii 0.7 (ring) and 0.3 (tube), axis z
        return np.sqrt((rho - 0.7) ** 2 + z * z) - 0.3
    return (np.abs(x) + np.abs(y) + np.abs(z) - 1.2) * (1 / 3 ** 0.5)  # octahedron, vertices 1.2


def _rotations(q):
    """Rotation matrices (n, 3, 3) float64 of the quaternions q (n, 4) (normalised here): from
    normally distributed q they are uniform over all 3D orientations."""
    w, x, y, z = (q / np.linalg.norm(q, axis=1, keepdims=True)).T
    rows = [[1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
            [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
            [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)]]
    return np.stack([np.stack(row, -1) for row in rows], -2)


def _draw_volumes(size, n, seed, split, noise):
    """One split of :func:`load_volumes`: x (n, 1, S, S, S) float32, y (n,) int64."""
    n_classes = len(VOLUME_CLASSES)
    rng = np.random.default_rng([seed, split])   # the objects: independent of the size
    y = rng.permutation(np.arange(n) % n_classes).astype(np.int64)
    rot = _rotations(rng.standard_normal((n, 4)))
    scale = rng.uniform(0.45, 0.7, n)            # object size / half the volume's width
    centre = rng.uniform(-0.15, 0.15, (n, 3))
    gain = rng.uniform(0.6, 1.0, n)              # intensity inside
    h = 2.0 / size                               # voxel width; the volume spans [-1, 1]^3
    p = (2 * np.arange(size) + 1) / size - 1.0
    grid = np.stack(np.meshgrid(p, p, p, indexing="ij"), -1).reshape(-1, 3).T  # (3, S^3)
    grid = grid.astype(np.float32)
    x = np.empty((n, size ** 3), np.float32)
    for label, name in enumerate(VOLUME_CLASSES):
        members = np.flatnonzero(y == label)
        for start in range(0, len(members), _VOLUMES_CHUNK):
            idx = members[start:start + _VOLUMES_CHUNK]
            # local coordinates q = R^T (p - centre) / scale, one (k, S^3) array per axis
            axes = rot[idx] / scale[idx, None, None]                    # (k, 3 world, 3 local)
            shift = np.einsum("ki,kij->kj", centre[idx], axes)
            axes, shift = axes.astype(np.float32), shift.astype(np.float32)
            local = []
            for a in range(3):  # three multiply-adds beat a K = 3 matmul
                q = axes[:, 0, a, None] * grid[0]
                q += axes[:, 1, a, None] * grid[1]
                q += axes[:, 2, a, None] * grid[2]
                q -= shift[:, a, None]
                local.append(q)
            dist = _volume_sdf(name, *local)                            # in shape units
            dist *= (scale[idx, None] / h).astype(np.float32)           # in voxels
            occupancy = np.clip(0.5 - dist, 0.0, 1.0, out=dist)         # one voxel of blur
            x[idx] = occupancy * gain[idx, None].astype(np.float32)
    noise_rng = np.random.default_rng([seed, split, size])
    buf = np.empty((_VOLUMES_CHUNK, size ** 3), np.float32)
    for start in range(0, n, _VOLUMES_CHUNK):
        block = x[start:start + _VOLUMES_CHUNK]
        eps = buf[:len(block)]
        noise_rng.standard_normal(out=eps, dtype=np.float32)
        eps *= np.float32(noise)
        block += eps
        np.clip(block, 0.0, 1.0, out=block)
    return x.reshape(n, 1, size, size, size), y


def volumes_cache_path(size, n_train, n_test, seed, noise, cache_dir=None):
    """The .npz file :func:`load_volumes` caches these arguments in: under ``cache_dir``, else
    ``<mgnn cache root>/data`` (:func:`mgnn._config.cache_root`: ``$MGNN_CACHE_DIR``,
    ``$XDG_CACHE_HOME/mgnn`` or ``~/.cache/mgnn``)."""
    folder = os.fspath(cache_dir) if cache_dir is not None else os.path.join(cache_root(), "data")
    name = (f"volumes-v{_VOLUMES_FORMAT}-s{size}-train{n_train}-test{n_test}-seed{seed}"
            f"-noise{float(noise)!r}.npz")
    return os.path.join(folder, name)


def load_volumes(size=16, n_train=1800, n_test=600, seed=0, noise=0.25, cache_dir=None,
                 cache=True):
    """Seeded synthetic 3D classification set: voxelised shapes under random size, position and
    orientation, with voxel noise (offline; details and timings in docs/data_volumes.md).

    Classes (:data:`VOLUME_CLASSES`): sphere, cube, cylinder, cone, torus, octahedron (labels
    0..5). Each sample is one shape, rotated uniformly over all 3D orientations, scaled to
    0.45..0.7 of half the volume's width, centred within +-0.15 of the middle, antialiased over
    one voxel, with an intensity 0.6..1; then ``noise`` * N(0, 1) is added to every voxel and the
    values are clipped to [0, 1]. Labels are balanced: every class has n // 6 or n // 6 + 1
    samples in each split, in random order. The objects of a seed do not depend on ``size`` (the
    same shapes at every resolution; only the noise differs), so 15^3 / 16^3 / 31^3 / 32^3 sets
    show the same scenes for both grid conventions.

    Parameters
    ----------
    size : int >= 8, the edge S of the cubic volumes (15, 16, 31, 32, ...)
    n_train, n_test : int >= 1, samples per split
    seed : int >= 0, the same seed (and arguments) gives identical arrays
    noise : float >= 0, standard deviation of the voxel noise
    cache_dir : folder of the cache (default ``<mgnn cache root>/data``, see
        :func:`volumes_cache_path`)
    cache : whether to read and write the cache (a .npz per argument set, written through a
        temporary file and ``os.replace``, so concurrent processes never see half a file; an
        unreadable cache file is regenerated)

    Returns
    -------
    Dataset "volumes": x_* (n, 1, S, S, S) float32 in [0, 1], y_* (n,) int64, 6 classes.
    """
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise TypeError(f"size must be an int, got {size!r}")
    if size < 8:
        raise ValueError(f"size must be >= 8, got {size}")
    size = int(size)
    n_train, n_test = _check_count("n_train", n_train), _check_count("n_test", n_test)
    seed = _check_count("seed", seed, least=0)
    if isinstance(noise, bool) or not isinstance(noise, (int, float, np.integer, np.floating)):
        raise TypeError(f"noise must be a number, got {noise!r}")
    if not np.isfinite(noise) or noise < 0:
        raise ValueError(f"noise must be a finite number >= 0, got {noise!r}")
    noise = float(noise)
    path = volumes_cache_path(size, n_train, n_test, seed, noise, cache_dir) if cache else None
    shapes = {"x_train": (n_train, 1, size, size, size), "y_train": (n_train,),
              "x_test": (n_test, 1, size, size, size), "y_test": (n_test,)}
    if path is not None and os.path.exists(path):
        try:
            with np.load(path, allow_pickle=False) as f:
                arrays = {k: f[k] for k in shapes}
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            arrays = None
        if arrays is not None and all(arrays[k].shape == shapes[k] for k in shapes) and \
                arrays["x_train"].dtype == np.float32 and arrays["y_train"].dtype == np.int64:
            return Dataset("volumes", arrays["x_train"], arrays["y_train"], arrays["x_test"],
                           arrays["y_test"], len(VOLUME_CLASSES))
    x_train, y_train = _draw_volumes(size, n_train, seed, 0, noise)
    x_test, y_test = _draw_volumes(size, n_test, seed, 1, noise)
    if path is not None:
        _atomic_savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    return Dataset("volumes", x_train, y_train, x_test, y_test, len(VOLUME_CLASSES))


def _atomic_savez(path, **arrays):
    """np.savez to ``path`` through a temporary file in the same folder renamed over it."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


NPZ_ARRAYS = ("x_train", "y_train", "x_test", "y_test")


def load_npz(path):
    """A user's data set from an ``.npz`` file with arrays ``x_train`` (n, ...) and ``x_test``
    (m, ...) of one sample shape (real numbers, finite; float32 kept, anything else read as
    float64) and integer labels ``y_train`` (n,), ``y_test`` (m,) in [0, n_classes);
    n_classes = 1 + the largest label. Not normalised (:func:`load_dataset` does that).
    Raises ValueError (or :class:`DataFormatError`) naming the file and the offending array."""
    if not os.path.isfile(path):
        raise ValueError(f"data file {path!r} does not exist")
    try:
        f = np.load(path, allow_pickle=False)
        if not isinstance(f, np.lib.npyio.NpzFile):  # a single .npy array under an .npz name
            raise DataFormatError(f"{path}: not an .npz archive (one array of shape "
                                  f"{getattr(f, 'shape', None)}); save the four arrays with "
                                  "numpy.savez")
        with f:
            missing = [k for k in NPZ_ARRAYS if k not in f.files]
            if missing:
                raise DataFormatError(f"{path}: missing array(s) {', '.join(missing)} (it has "
                                      f"{', '.join(f.files) or 'none'}; needs "
                                      f"{', '.join(NPZ_ARRAYS)})")
            arrays = {k: f[k] for k in NPZ_ARRAYS}
    except (OSError, EOFError, ValueError) as exc:
        if isinstance(exc, DataFormatError):
            raise
        raise DataFormatError(f"{path}: not a readable .npz file ({exc})") from None
    xs = {}
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.dtype.kind not in "biuf" or x.ndim < 2:
            raise DataFormatError(f"{path}: x_{split} must be a real array of shape (n, ...) "
                                  f"with n samples, got dtype {x.dtype}, shape {x.shape}")
        if y.ndim != 1 or y.dtype.kind not in "iu":
            raise DataFormatError(f"{path}: y_{split} must be 1-D integer labels, got dtype "
                                  f"{y.dtype}, shape {y.shape}")
        if len(y) != len(x):
            raise DataFormatError(f"{path}: x_{split} has {len(x)} samples but y_{split} "
                                  f"{len(y)} labels")
        if len(y) == 0:
            raise DataFormatError(f"{path}: x_{split} has no samples")
        if y.min() < 0:
            raise DataFormatError(f"{path}: y_{split} has a negative label ({y.min()})")
        x = x.astype(np.float32 if x.dtype == np.float32 else np.float64, copy=False)
        if not np.isfinite(x).all():
            raise DataFormatError(f"{path}: x_{split} has non-finite values")
        xs[split] = (np.ascontiguousarray(x), y.astype(np.int64))
    if xs["train"][0].shape[1:] != xs["test"][0].shape[1:]:
        raise DataFormatError(f"{path}: x_train samples are {xs['train'][0].shape[1:]} but x_test "
                              f"samples {xs['test'][0].shape[1:]}")
    n_classes = int(max(xs["train"][1].max(), xs["test"][1].max())) + 1
    if n_classes < 2:
        raise DataFormatError(f"{path}: the labels name one class only; a classifier needs 2")
    name = os.path.splitext(os.path.basename(path))[0]
    return Dataset(name, *xs["train"], *xs["test"], n_classes)


def load_dataset(name, data_dir=None, seed=0, limit_train=None, limit_test=None, seq_len=512,
                 volume_size=16):
    """'digits', 'mnist', 'synthetic', 'sine' (:func:`load_sine` of length ``seq_len``),
    'volumes' (:func:`load_volumes` of edge ``volume_size``, cached) or a path ending in ``.npz``
    (:func:`load_npz`), normalised;
    ``limit_train`` / ``limit_test`` keep the first samples of each split (any data set): None
    (all) or an int >= 1."""
    _check_limits(limit_train, limit_test)
    if isinstance(name, (str, os.PathLike)) and str(name).endswith(".npz"):
        ds = load_npz(os.fspath(name))
    elif name == "volumes":
        ds = load_volumes(volume_size, seed=seed)
    elif name == "sine":
        ds = load_sine(seq_len, seed=seed)
    elif name == "digits":
        ds = load_digits(seed=0)
    elif name == "mnist":
        ds = load_mnist(data_dir, limit_train, limit_test)
    elif name == "synthetic":
        ds = load_synthetic(seed=seed)
    else:
        raise ValueError(f"unknown data set {name!r}; expected 'digits', 'mnist', 'synthetic', "
                         "'sine', 'volumes' or a FILE.npz")
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
