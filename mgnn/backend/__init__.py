"""Arrays and kernels: the one dispatch point between mgnn and its backends.

A backend is an object with the kernel functions of :mod:`mgnn.backend.numpy_ref` (same names, same
signatures, same results to round-off), an array module ``xp`` (its arrays: NumPy or CuPy) and a
flag ``batched_relaxation`` (whether MGRIT should advance all F-intervals in one batched launch).
This package knows nothing of MGRIT or networks.

Backends: ``numpy`` (the reference), ``numba`` (CPU), ``cuda`` (CuPy arrays, RawKernels and Numba
CUDA kernels; only where ``cupy.cuda.is_available()``) and ``cuda-emulated`` (the ``cuda``
backend's RawKernels compiled for the host and run on NumPy arrays: slow, for checking the GPU
code on machines without a GPU). GPU modules are imported only when a GPU backend is asked for.
"""
import importlib
import shutil

from .._config import ACTIVATIONS, CPU_BACKENDS, DTYPES

#: Every kernel a backend provides (the contract tests iterate over this).
KERNELS = (
    "dense_forward", "dense_forward_deriv", "dense_deriv", "dense_vjp_input", "dense_vjp",
    "dense_vjp_params",
    "dense_sweep_forward", "dense_sweep_backward",
    "conv_forward", "conv_forward_deriv", "conv_deriv", "conv_vjp_input", "conv_vjp", "conv_vjp_params",
    "conv3d_forward", "conv3d_forward_deriv", "conv3d_deriv", "conv3d_vjp_input", "conv3d_vjp",
    "conv3d_vjp_params",
    "avgpool_forward", "avgpool_vjp", "softmax_xent",
    "dense_forward_batched", "dense_vjp_input_batched", "dense_deriv_batched",
    "dense_vjp_params_batched", "conv_forward_batched", "conv_vjp_input_batched",
    "conv_deriv_batched", "conv_vjp_params_batched",
)
#: Optional stacked-state kernels (in place on a level's states stacked in one array; contract in
#: :mod:`mgnn.backend.numpy_ref`): a backend that has them sets ``stacked_states = True``.
STACKED_KERNELS = ("dense_chains_forward", "dense_points_forward", "dense_chains_adjoint",
                   "dense_points_adjoint", "conv_chains_forward", "conv_points_forward",
                   "conv_chains_adjoint", "conv_points_adjoint")
#: Optional stacked gradient kernels (sigma' and parameter gradients of consecutive layers read
#: from stacked states; contract in :mod:`mgnn.backend.numpy_ref`), with the stacked kernels.
STACKED_GRAD_KERNELS = ("dense_deriv_stacked", "dense_vjp_params_stacked", "conv_deriv_stacked",
                        "conv_vjp_params_stacked")
#: Optional kernels that keep a forward solve's final-sweep linearisation (Numba only; contract
#: in their docstrings, tested against ``*_chains_forward`` and ``*_deriv_stacked`` /
#: ``recurrent_caches``): the chains that also write sigma' / gate caches and flag their rows,
#: and the ones that compute only the rows not flagged. Where a backend lacks them the
#: linearisation is evaluated whole after the solve.
KEEP_KERNELS = ("dense_chains_forward_derivs", "dense_deriv_missing", "conv_chains_forward_derivs",
                "conv_deriv_missing", "recurrent_chains_forward_keep", "recurrent_caches_missing")

#: Optional dropout-mask kernel (counter-based Philox; contract in :mod:`mgnn.backend.numpy_ref`).
RNG_KERNELS = ("dropout_mask",)
#: Optional batch-norm + activation kernels (the fused BN -> sigma path of a block; contract in
#: :mod:`mgnn.backend.numpy_ref`); a backend that has them sets nothing else.
BN_KERNELS = ("bn_stats", "bn_act_forward", "bn_act_vjp_sums", "bn_act_vjp_input")
#: Optional recurrent gate kernels (the elementwise epilogue of a GRU / tanh-RNN cell step after
#: its GEMMs, forward and vjp; contract in :mod:`mgnn.backend.numpy_ref`).
RECURRENT_KERNELS = ("gru_gates_forward", "gru_gates_vjp", "rnn_gates_forward", "rnn_gates_vjp")

_MODULES = {"numpy": "numpy_ref", "numba": "numba_cpu"}
GPU_BACKENDS = ("cuda", "cuda-emulated")
_ALL = tuple(_MODULES) + GPU_BACKENDS
_instances = {}


class BackendUnavailableError(ValueError):
    """A known backend that this machine cannot run (e.g. 'cuda' without a GPU)."""


def gpu_available():
    """Whether CuPy is installed and sees a CUDA device (never raises)."""
    try:
        import cupy
        return bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001 -- no CuPy, no driver, no device: all mean "no GPU"
        return False


def vector_ops(name="numpy"):
    """The MGRIT vector operations of backend ``name`` ('numpy': the generic reference that works
    for any array type; 'numba': fused one-pass kernels; 'cuda' / 'cuda-emulated': one batched
    RawKernel launch for all points of a level, single points through Numba CUDA / generic).
    ``name`` may also be a backend object (see :func:`get_backend`): batched operations if it
    has RawKernel vector kernels, else the generic reference."""
    from .fas_ops import BatchedOps, GenericOps, NumbaOps
    if not isinstance(name, str):
        if callable(getattr(name, "residual_batched", None)):
            return BatchedOps(name, GenericOps())
        return GenericOps()
    if name == "numba":
        return NumbaOps()
    if name == "numpy":
        return GenericOps()
    if name == "cuda-emulated":
        from .fas_ops import BatchedOps
        return BatchedOps(get_backend(name), GenericOps())
    if name == "cuda":
        raw = get_backend("cuda")  # raises BackendUnavailableError without a GPU
        from .fas_ops import BatchedOps
        from .numba_cuda import CudaOps
        return BatchedOps(raw, CudaOps())
    raise ValueError(f"unknown backend {name!r}; expected one of {sorted(_ALL)}")


def available_backends():
    """Names of the backends usable on this machine, e.g. ``("numpy", "numba", "cuda-emulated")``
    ('cuda-emulated' needs a C++ compiler, 'cuda' a GPU)."""
    names = list(CPU_BACKENDS)
    if shutil.which("g++") or shutil.which("c++"):
        names.append("cuda-emulated")
    if gpu_available():
        names.append("cuda")
    return tuple(names)


def get_backend(name):
    """The backend called ``name``: 'numpy', 'numba', 'cuda' or 'cuda-emulated'.

    Raises
    ------
    ValueError
        If ``name`` is not a known backend.
    BackendUnavailableError (a ValueError)
        If it is known but cannot run here ('cuda' without a GPU).
    """
    if not isinstance(name, str) or name not in _ALL:
        raise ValueError(f"unknown backend {name!r}; expected one of {sorted(_ALL)}")
    if name in _MODULES:
        return importlib.import_module(f".{_MODULES[name]}", __name__)
    if name not in _instances:
        from .cupy_raw import KERNEL_FILES, CupyLauncher, RawBackend
        if name == "cuda":
            if not gpu_available():
                raise BackendUnavailableError(
                    "backend 'cuda' needs CuPy and a CUDA GPU, but cupy.cuda.is_available() is "
                    "False here (install mgnn[cuda] on a GPU machine; 'cuda-emulated' runs the "
                    "same kernels on the CPU, slowly)")
            _instances[name] = RawBackend(CupyLauncher(), name)
        else:
            from .host_emulation import EmulationLauncher
            _instances[name] = RawBackend(EmulationLauncher(list(KERNEL_FILES), KERNEL_FILES),
                                          name)
    return _instances[name]


def is_device_array(a):
    """Whether ``a`` is a CuPy (device) array; never imports CuPy."""
    import sys
    cp = sys.modules.get("cupy")
    return cp is not None and isinstance(a, cp.ndarray)


def to_host(a):
    """``a`` as a NumPy array (a copy from the device for CuPy arrays; ``a`` itself if NumPy)."""
    import numpy as np
    if is_device_array(a):
        return a.get()
    return np.asarray(a)


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
