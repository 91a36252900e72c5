"""Arrays and kernels: the one dispatch point between mgnn and its backends.

A backend is a module with the kernel functions of :mod:`mgnn.backend.numpy_ref` (same names, same
signatures, same results to round-off). This package knows nothing of MGRIT or networks.
"""
import importlib

from .._config import ACTIVATIONS, CPU_BACKENDS, DTYPES

#: Every kernel a backend provides (the contract tests iterate over this).
KERNELS = (
    "dense_forward", "dense_forward_deriv", "dense_deriv", "dense_vjp_input", "dense_vjp",
    "dense_vjp_params",
    "dense_sweep_forward", "dense_sweep_backward",
    "conv_forward", "conv_forward_deriv", "conv_deriv", "conv_vjp_input", "conv_vjp", "conv_vjp_params",
    "avgpool_forward", "avgpool_vjp", "softmax_xent",
)

_MODULES = {"numpy": "numpy_ref", "numba": "numba_cpu"}


def vector_ops(name="numpy"):
    """The MGRIT vector operations of backend ``name`` ('numpy': the generic reference that works
    for any array type; 'numba': fused one-pass kernels)."""
    from .fas_ops import GenericOps, NumbaOps
    if name == "numba":
        return NumbaOps()
    if name == "numpy":
        return GenericOps()
    raise ValueError(f"unknown backend {name!r}; expected one of {sorted(_MODULES)}")


def available_backends():
    """Names of the backends usable on this machine, e.g. ``("numpy", "numba")``."""
    return tuple(CPU_BACKENDS)


def get_backend(name):
    """The backend module called ``name`` (``"numpy"`` or ``"numba"``).

    Raises
    ------
    ValueError
        If ``name`` is not a known backend.
    """
    if not isinstance(name, str) or name not in _MODULES:
        raise ValueError(f"unknown backend {name!r}; expected one of {sorted(_MODULES)}")
    return importlib.import_module(f".{_MODULES[name]}", __name__)


def activation_code(name):
    """Kernel code of the activation ``name`` ('tanh', 'relu', 'identity')."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; expected one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def check_dtype(dtype):
    """numpy dtype for ``dtype`` ('float32'/'float64' or a numpy dtype); ValueError otherwise."""
    import numpy as np
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}") from exc
    if dt.name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {DTYPES}")
    return dt


def kernel_dir():
    """Folder holding the CUDA C sources: ``mgnn/kernels`` when installed from a wheel, the
    top-level ``kernels/`` of the source tree otherwise (editable installs, a checkout)."""
    import importlib.util
    import os
    spec = importlib.util.find_spec("mgnn.kernels")
    if spec is not None and spec.submodule_search_locations:
        return os.fspath(list(spec.submodule_search_locations)[0])
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "kernels")
