"""mgnn's ``njit``: Numba's, with a compile that survives another process writing the same cache.

mgnn's kernels are ``@njit(cache=True)`` and every process of a run (MPI ranks, pytest workers,
two users' jobs) shares one cache folder (:mod:`mgnn._numba_cache`). Numba's cache is not safe
under concurrent writers: a process that reads an index or data file while another one writes it
fails with ``EOFError``/``UnpicklingError``, or, when the half-written file belongs to a callee,
with a spurious ``TypingError`` from the caller's type inference. The dispatcher here catches those
on a kernel's first compile, moves every mgnn kernel of this process to a private cache folder
(``<NUMBA_CACHE_DIR>/pid-<pid>``) and compiles again; if that succeeds it warns once (the shared
cache was the problem). A genuine typing error fails the second compile as well: the process goes
back to the shared cache and the error is raised as Numba raised it, without a warning.

Where a kernel is cached (:class:`PackageCacheLocator`): Numba files a function under a hash of
its source folder's absolute path and stamps it with its own file's content, so a second
checkout or install of the same mgnn (a fresh clone, a CI run, a ``pip install``) compiles
everything again, while an edit to a kernel's callee in another file (an inlined helper) leaves
the caller's stale compiled code in use. mgnn's kernels are filed instead under
``<cache dir>/mgnn-<digest>/<folder inside the package>``, the digest covering the content of
every file of ``mgnn/backend`` (and the Numba version): identical code shares compiled kernels
wherever it lives, and any change to the backend's sources compiles them all again.
"""
import functools
import hashlib
import os
import pickle
import warnings

import numba
from numba.core import caching, config, errors
from numba.core.registry import CPUDispatcher

#: Errors a concurrent cache writer causes in a reader (see the module docstring).
CACHE_RACE_ERRORS = (errors.TypingError, EOFError, pickle.UnpicklingError)

_dispatchers = []  # every dispatcher made by njit below, in creation order
_BACKEND = os.path.dirname(os.path.abspath(__file__))  # mgnn/backend
_PACKAGE = os.path.dirname(_BACKEND)                   # mgnn


@functools.lru_cache(maxsize=None)
def backend_digest():
    """SHA-256 (hex, 16 characters) of the Numba version and every ``.py`` file of
    ``mgnn/backend`` (relative paths and contents, in sorted order): the cache folder's key."""
    h = hashlib.sha256(numba.__version__.encode())
    files = []
    for folder, dirs, names in os.walk(_BACKEND):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        files += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    for path in sorted(files):
        h.update(os.path.relpath(path, _BACKEND).replace(os.sep, "/").encode() + b"\0")
        with open(path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:16]


def _inside(path, folder):
    try:
        return os.path.commonpath([os.path.abspath(path), folder]) == folder
    except ValueError:  # another drive
        return False


class PackageCacheLocator(caching.UserProvidedCacheLocator):
    """Numba's cache locator for mgnn's own kernels (module docstring): the user-provided cache
    folder (``NUMBA_CACHE_DIR``, set by :mod:`mgnn._numba_cache`), under ``mgnn-<digest>`` and
    the kernel's folder inside the package, whatever the package's absolute path; stamped with
    the file's content and :func:`backend_digest`. Other functions keep Numba's locators."""

    def __init__(self, py_func, py_file):
        super().__init__(py_func, py_file)
        inside = os.path.relpath(os.path.dirname(os.path.abspath(py_file)), _PACKAGE)
        self._cache_path = os.path.join(config.CACHE_DIR, f"mgnn-{backend_digest()}",
                                        *inside.split(os.sep))

    def get_source_stamp(self):
        return super().get_source_stamp(), backend_digest()

    @classmethod
    def from_function(cls, py_func, py_file):
        if not config.CACHE_DIR or not _inside(py_file, _BACKEND):
            return None
        return super().from_function(py_func, py_file)


def _register_locator():
    """Put :class:`PackageCacheLocator` first among Numba's locators (once)."""
    impl = getattr(caching, "CacheImpl", None)
    classes = getattr(impl, "_locator_classes", None)
    if isinstance(classes, list) and PackageCacheLocator not in classes:
        classes.insert(0, PackageCacheLocator)


_register_locator()
_private = {"dir": None, "shared": None}


class CacheRaceWarning(RuntimeWarning):
    """Numba's shared kernel cache was unreadable (another process writing it): this process
    compiles into its own cache folder from now on."""


def private_cache_dir():
    """The per-process folder mgnn's kernels cache into after a cache race (None before one)."""
    return _private["dir"]


def use_private_cache():
    """Move every mgnn kernel of this process to ``<cache dir>/pid-<pid>`` (once; later calls
    do nothing). Returns the folder."""
    if _private["dir"] is not None:
        return _private["dir"]
    base = config.CACHE_DIR or os.path.join(os.path.dirname(__file__), "__pycache__")
    path = os.path.join(base, f"pid-{os.getpid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    _private["shared"] = config.CACHE_DIR
    _point_caches_at(path)
    _private["dir"] = path
    return path


def _point_caches_at(folder):
    config.CACHE_DIR = folder
    for disp in _dispatchers:
        if disp._cache.__class__.__name__ != "NullCache":
            disp.enable_caching()  # a FunctionCache whose locator reads the new CACHE_DIR


def _back_to_shared():
    """Undo :func:`use_private_cache` (the retry failed too: the error was not the cache's):
    the shared folder again, the private one removed if nothing was written to it."""
    path, _private["dir"] = _private["dir"], None
    _point_caches_at(_private["shared"])
    for folder, _, _ in os.walk(path, topdown=False):  # empty folders only, deepest first
        try:
            os.rmdir(folder)
        except OSError:
            pass


class RetryingDispatcher(CPUDispatcher):
    """A CPU dispatcher whose first compile of a signature retries once with a private cache
    when it fails with one of :data:`CACHE_RACE_ERRORS`."""

    def _compile_for_args(self, *args, **kws):
        try:
            return super()._compile_for_args(*args, **kws)
        except CACHE_RACE_ERRORS as exc:
            if _private["dir"] is not None:
                raise  # already private: a genuine error
            first = exc
        path = use_private_cache()
        try:
            result = super()._compile_for_args(*args, **kws)
        except CACHE_RACE_ERRORS:  # a genuine error: it was not the cache
            _back_to_shared()
            raise
        warnings.warn(f"mgnn: Numba's kernel cache could not be read ({type(first).__name__} "
                      f"compiling {self.py_func.__qualname__}); another process is probably "
                      f"writing it. This process now caches its kernels in {path}.",
                      CacheRaceWarning, stacklevel=3)
        return result


def njit(*args, **options):
    """``numba.njit`` (same arguments) returning a :class:`RetryingDispatcher`."""
    def wrap(disp):
        disp.__class__ = RetryingDispatcher
        _dispatchers.append(disp)
        return disp

    if len(args) == 1 and callable(args[0]) and not options.get("signature"):
        return wrap(numba.njit(**options)(args[0]))
    decorate = numba.njit(*args, **options)
    return lambda fn: wrap(decorate(fn))
