"""Tunables and tolerances shared across mgnn (no imports from the rest of the package)."""
import os

#: Supported floating point dtypes, by name.
DTYPES = ("float32", "float64")

#: Activation names and the integer codes the kernels use.
ACTIVATIONS = {"tanh": 0, "relu": 1, "identity": 2}

#: Backends that need nothing beyond NumPy/Numba.
CPU_BACKENDS = ("numpy", "numba")

#: Finite-difference step and tolerance of :func:`mgnn.gradcheck` (float64).
GRADCHECK_EPS = 1e-6
GRADCHECK_RTOL = 1e-6
GRADCHECK_ATOL = 1e-9
#: Most entries of one array probed entry by entry by gradcheck (a random subset beyond that).
GRADCHECK_MAX_ENTRIES = 64

#: Environment variable naming the folder with the MNIST IDX files.
MNIST_ENV = "MGNN_MNIST_DIR"

#: Environment variable naming mgnn's cache folder (compiled kernels).
CACHE_ENV = "MGNN_CACHE_DIR"


def cache_root():
    """mgnn's per-user cache folder (not created here): ``$MGNN_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/mgnn`` (an absolute ``XDG_CACHE_HOME`` only, as the XDG spec says), else
    ``~/.cache/mgnn``."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return os.path.abspath(os.path.expanduser(root))
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mgnn")
