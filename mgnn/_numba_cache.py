"""Where Numba caches mgnn's compiled CPU kernels; imported by ``mgnn/__init__.py`` before anything
that imports Numba.

mgnn's kernels are ``@njit(cache=True)``, and Numba's default cache is ``__pycache__`` next to the
source, i.e. inside the installed package or the checkout. Unless ``NUMBA_CACHE_DIR`` is set (to
anything; an empty value restores Numba's own placement), mgnn sets it to the first usable of

1. ``<cache root>/numba`` (:func:`mgnn._config.cache_root`: ``$MGNN_CACHE_DIR``,
   ``$XDG_CACHE_HOME/mgnn`` or ``~/.cache/mgnn``);
2. ``<temp dir>/mgnn-<uid>/numba``, a folder private to this user (mode 0700, owned by the user:
   cache files are pickles, so a folder others can write to is never used);

and leaves Numba's default when neither is writable. The variable is process-wide: other Numba
code of the process, and processes it starts (MPI ranks included), cache there too.
"""
import os
import sys
import tempfile

from ._config import cache_root

ENV = "NUMBA_CACHE_DIR"


def _writable(path, private=False):
    """Create ``path`` if needed; whether this process can write files in it (and, if
    ``private``, whether it is owned by this user and closed to others)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        if private:
            st = os.stat(path)
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                return False
        with tempfile.TemporaryFile(dir=path):
            return True
    except (OSError, AttributeError):  # AttributeError: no os.getuid (not POSIX)
        return False


def configure():
    """Set ``NUMBA_CACHE_DIR`` (and Numba's config if Numba is already imported) unless the user
    has set it; returns the folder Numba caches in, or None for Numba's own default."""
    if ENV in os.environ:
        return os.environ[ENV] or None
    home = os.path.join(cache_root(), "numba")
    tmp = os.path.join(tempfile.gettempdir(), f"mgnn-{getattr(os, 'getuid', lambda: 0)()}")
    if _writable(home):
        path = home
    elif _writable(tmp, private=True) and _writable(os.path.join(tmp, "numba")):
        path = os.path.join(tmp, "numba")
    else:
        return None
    os.environ[ENV] = path
    config = sys.modules.get("numba.core.config")
    if config is not None:  # Numba imported before mgnn read the environment without it
        config.CACHE_DIR = path
    return path


CACHE_DIR = configure()
