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
"""
import os
import pickle
import warnings

import numba
from numba.core import config, errors
from numba.core.registry import CPUDispatcher

#: Errors a concurrent cache writer causes in a reader (see the module docstring).
CACHE_RACE_ERRORS = (errors.TypingError, EOFError, pickle.UnpicklingError)

_dispatchers = []  # every dispatcher made by njit below, in creation order
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
