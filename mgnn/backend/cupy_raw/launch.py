"""CUDA C sources, compile options and launch geometry; :class:`CupyLauncher` (``cupy.RawModule``
on a GPU) and :class:`DeviceGraph`; cuBLAS GEMM helpers. Needs neither CuPy nor a GPU to import."""
import os
import re

import numpy as np

from .. import kernel_dir


#: CUDA C files and the kernel templates each defines (each instantiated for float and double).
KERNEL_FILES = {
    "dense.cu": ("dense_forward", "dense_forward_batched", "dense_vjp_input",
                 "dense_vjp_input_batched", "dense_weight_grad", "dense_weight_grad_batched",
                 "bias_grad", "bias_grad_batched", "dense_stacked_forward",
                 "dense_stacked_adjoint", "dense_deriv_stacked", "dense_weight_grad_stacked",
                 "bias_grad_stacked", "stacked_product", "dense_stacked_forward_epilogue",
                 "dense_stacked_adjoint_epilogue", "dense_bias_act"),
    "conv.cu": ("conv_forward", "conv_forward_batched", "conv_vjp_input",
                "conv_vjp_input_batched", "conv_kernel_grad", "conv_kernel_grad_batched",
                "conv_stacked_forward", "conv_stacked_adjoint", "conv_deriv_stacked",
                "conv_kernel_grad_stacked", "conv_kernel_grad_sum"),
    "conv3d.cu": ("conv3d_forward", "conv3d_vjp_input", "conv3d_kernel_grad"),
    "head.cu": ("avgpool_forward", "avgpool_vjp", "softmax_xent"),
    "vector.cu": ("residual_batched", "combine_batched", "sum_partials"),
    "bn.cu": ("bn_stats", "bn_act_forward", "bn_act_vjp_sums", "bn_act_vjp_input"),
    "rng.cu": ("dropout_mask",),
    "recurrent.cu": ("gru_gates_forward", "gru_gates_vjp", "rnn_gates_forward", "rnn_gates_vjp"),
}

#: Launch geometry on a GPU (see kernels/common.cuh): 64 x 64 GEMM tiles of 16-deep stages,
#: 4 x 4 outputs per thread (256 threads), 256-thread reductions and elementwise blocks.
GPU_GEOMETRY = {"BM": 64, "BN": 64, "BK": 16, "TM": 4, "TN": 4, "REDUCE": 256, "ELEM": 256,
                "MAX_GRID": 65535}

#: Dense layers at least this wide run their stacked and serial-sweep GEMMs through the
#: launcher's ``gemm`` (cuBLAS strided-batched GEMMs, :func:`cublas_gemm`) and mgnn's epilogue
#: kernels; narrower ones through the fused hand-written kernels. ``$MGNN_GEMM_MIN_WIDTH`` or
#: :attr:`RawBackend.gemm_min_width` overrides it; ``scripts/gpu_check.py`` measures the
#: crossover on a GPU (this default is a guess until it has run on one).
GEMM_MIN_WIDTH = 512
GEMM_MIN_WIDTH_ENV = "MGNN_GEMM_MIN_WIDTH"

#: Positions (of B x spatial) per split of a conv kernel gradient: its GEMM (Co x Ci taps x B S)
#: has few output tiles and a long depth, so the depth is split into this many positions per
#: block, each split's partial written apart and the splits summed in order (deterministic).
KGRAD_SPLIT = 1024
#: Most elements of the split-K partials of one kernel-gradient launch (all its problems): fewer,
#: longer splits above it (64 MB of float32; the scratch is cached, never shrunk).
KGRAD_PART_MAX = 1 << 24


def gemm_min_width_default():
    """:data:`GEMM_MIN_WIDTH`, or ``$MGNN_GEMM_MIN_WIDTH`` (a positive integer) where set."""
    raw = os.environ.get(GEMM_MIN_WIDTH_ENV, "").strip()
    if not raw:
        return GEMM_MIN_WIDTH
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{GEMM_MIN_WIDTH_ENV}={raw!r}: expected a positive integer width")
    return value


def batched_gemm(xp, A, B, C, trans_a=False, trans_b=False):
    """C[p] = op(A[p]) op(B[p]) for stacks A, B, C of row-major matrices (views; each matrix
    C-contiguous, any batch stride), op = transpose where asked, by ``xp.matmul`` with ``out``
    (the host's stand-in for cuBLAS; on CuPy it copies non-contiguous operands: see
    :func:`cublas_gemm`)."""
    xp.matmul(A.transpose(0, 2, 1) if trans_a else A, B.transpose(0, 2, 1) if trans_b else B,
              out=C)


def _batch(X):
    """(address, batch stride in elements) of a stack view X (count, r, c) whose matrices are
    C-contiguous, else None."""
    isz = X.itemsize
    if X.strides[1:] != (X.shape[2] * isz, isz) or X.strides[0] % isz:
        return None
    return X.data.ptr, X.strides[0] // isz


def cublas_gemm(A, B, C, trans_a=False, trans_b=False):
    """:func:`batched_gemm` as one cuBLAS ``<t>gemmStridedBatched`` call on the views as they
    are: no copy, no allocation (CuPy's matmul copies strided or transposed operands), so it
    can sit inside a captured graph. The row-major C = op(A) op(B) is the column-major
    C^T = op(B)^T op(A)^T. Batch strides may be 0 (one matrix for every problem) or negative
    (layers walked backwards). Returns False (nothing done) where a matrix of A, B or C is not
    C-contiguous or C's batch is not dense."""
    import cupy
    from cupy_backends.cuda.libs import cublas
    a, b, c = _batch(A), _batch(B), _batch(C)
    count, M, N = C.shape
    if a is None or b is None or c is None or C.strides[0] != M * N * C.itemsize:
        return False
    K = A.shape[1] if trans_a else A.shape[2]
    fn = cublas.sgemmStridedBatched if C.dtype == np.float32 else cublas.dgemmStridedBatched
    one, zero = np.ones(1, C.dtype), np.zeros(1, C.dtype)
    op = lambda t: cublas.CUBLAS_OP_T if t else cublas.CUBLAS_OP_N  # noqa: E731
    handle = cupy.cuda.device.get_cublas_handle()
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    try:
        fn(handle, op(trans_b), op(trans_a), N, M, K, one.ctypes.data,
           b[0], K if trans_b else N, b[1], a[0], M if trans_a else K, a[1],
           zero.ctypes.data, c[0], N, c[1], count)
    finally:
        cublas.setPointerMode(handle, mode)
    return True


def state_run(X, first, step, count, xp=np):
    """The view X[first + p step], p < count (``step`` may be negative or, the same state for
    every p, zero: a broadcast view of ``xp``; ``count`` >= 1)."""
    if count == 1:
        return X[first:first + 1]
    if step == 0:
        return xp.broadcast_to(X[first:first + 1], (count,) + X.shape[1:])
    stop = first + (count - 1) * step + (1 if step > 0 else -1)
    return X[first:(stop if stop >= 0 else None):step]


def module_source(fname):
    """CUDA C of ``kernels/<fname>`` with each ``#include "<header>.cuh"`` line replaced by that
    header's text (what CupyLauncher and the NVRTC check compile; headers include no others)."""
    kdir = kernel_dir()
    with open(f"{kdir}/{fname}") as fh:
        lines = fh.read().split("\n")
    for k, line in enumerate(lines):
        match = re.fullmatch(r'#include "(\w+\.cuh)"', line.strip())
        if match:
            with open(f"{kdir}/{match.group(1)}") as fh:
                lines[k] = fh.read()
    return "\n".join(lines)


def geometry_flags(geometry):
    """Compiler defines of a launch geometry, e.g. ``['-DMGNN_BK=16', ...]``."""
    return [f"-DMGNN_{k}={v}" for k, v in sorted(geometry.items()) if k != "MAX_GRID"]


class CupyLauncher:
    """Launches the RawKernels with CuPy on the current device and stream (asynchronously)."""

    name = "cupy"
    on_device = True

    def __init__(self, geometry=None):
        import cupy
        self.xp = cupy
        self.geometry = dict(GPU_GEOMETRY if geometry is None else geometry)
        options = raw_module_options(self.geometry)
        self._functions = {}
        self._modules = []
        for fname, names in KERNEL_FILES.items():
            exprs = [f"{k}<{t}>" for k in names for t in ("float", "double")]
            # the header is inlined: CuPy's kernel cache keys on the code string, not on files
            # reached through -I, so an edited common.cuh could otherwise serve stale binaries
            module = cupy.RawModule(code=module_source(fname), options=options,
                                    name_expressions=exprs)
            self._modules.append(module)
            for k in names:
                for t, dt in (("float", np.float32), ("double", np.float64)):
                    self._functions[(k, np.dtype(dt))] = (module, f"{k}<{t}>")
        self.launches = 0
        #: CUDA stream capture is available (CuPy's Stream.begin_capture; not on HIP)
        self.captures = callable(getattr(getattr(cupy.cuda, "Stream", None), "begin_capture",
                                         None)) and not getattr(cupy.cuda.runtime, "is_hip",
                                                                False)

    @staticmethod
    def ptr(a):
        """Device address of the first element of ``a``."""
        return a.data.ptr

    def to_device(self, a):
        """``a`` as a C-contiguous CuPy array (no copy if it already is one)."""
        return self.xp.ascontiguousarray(self.xp.asarray(a))

    def launch(self, name, dtype, grid, block, args):
        fn = self._functions[(name, np.dtype(dtype))]
        if isinstance(fn, tuple):  # first launch: look the function up once
            fn = self._functions[(name, np.dtype(dtype))] = fn[0].get_function(fn[1])
        scalar = np.dtype(dtype).type
        conv = []
        for a in args:
            if a is None:
                conv.append(np.uint64(0))
            elif isinstance(a, (bool, int, np.integer)):
                conv.append(np.int32(a))
            elif isinstance(a, (float, np.floating)):
                conv.append(scalar(a))
            else:
                conv.append(a)
        self.launches += 1
        fn(tuple(grid), tuple(block), tuple(conv))

    def synchronize(self):
        """Wait for the current stream."""
        self.xp.cuda.get_current_stream().synchronize()

    def gemm(self, A, B, C, trans_a=False, trans_b=False):
        """C[p] = op(A[p]) op(B[p]) by cuBLAS on the current stream (:func:`cublas_gemm`; CuPy's
        matmul where an operand's matrices are not C-contiguous)."""
        self.launches += 1
        if not cublas_gemm(A, B, C, trans_a, trans_b):
            batched_gemm(self.xp, A, B, C, trans_a, trans_b)

    def begin_capture(self):
        """Capture what follows (launches and CuPy work) into a CUDA graph, on a private
        non-blocking stream made current; the work queued before is finished first."""
        cuda = self.xp.cuda
        self._outer = cuda.get_current_stream()
        self._outer.synchronize()
        if getattr(self, "_capture_stream", None) is None:
            self._capture_stream = cuda.Stream(non_blocking=True)
        self._capture_stream.use()
        self._capture_stream.begin_capture()

    def end_capture(self):
        """The captured :class:`DeviceGraph` (the stream current before is current again)."""
        try:
            graph = self._capture_stream.end_capture()
        finally:
            self._outer.use()
        return DeviceGraph(graph, self)


class DeviceGraph:
    """A captured CUDA graph; :meth:`launch` replays it on the current stream (one launch)."""

    def __init__(self, graph, launcher):
        self.graph, self.launcher = graph, launcher

    def launch(self):
        self.launcher.launches += 1
        self.graph.launch(stream=self.launcher.xp.cuda.get_current_stream())


#: Most problems one batched launch takes (the grid's y / z extent).
MAX_BATCH = 65535


def nvcc_source():
    """CUDA C that includes every kernel file and takes the address of every kernel template for
    float and double, so that a whole-program ``nvcc -c`` compiles every instantiation."""
    lines = [f'#include "{f}"' for f in KERNEL_FILES]
    lines.append("void *mgnn_kernel_instances[] = {")
    lines += [f"    (void *)&{k}<{t}>," for names in KERNEL_FILES.values() for k in names
              for t in ("float", "double")]
    lines.append("};")
    return "\n".join(lines) + "\n"


def compile_with_nvcc(arch="sm_90", geometry=None, nvcc="nvcc"):
    """Compile every kernel instantiation with ``nvcc -arch=<arch>``, warnings as errors.

    Returns the compiler's output (empty when clean). Raises ``RuntimeError`` with the
    compiler's messages on any error or warning, ``FileNotFoundError`` if ``nvcc`` is missing.
    """
    import os
    import subprocess
    import tempfile
    geometry = GPU_GEOMETRY if geometry is None else geometry
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "mgnn_kernels.cu")
        with open(src, "w") as fh:
            fh.write(nvcc_source())
        cmd = [nvcc, f"-arch={arch}", "-std=c++17", "-Werror", "all-warnings",
               "-Xcompiler", "-Wall,-Wextra,-Werror", f"-I{kernel_dir()}",
               *geometry_flags(geometry), "-c", src, "-o", os.path.join(tmp, "k.o")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stdout}{proc.stderr}")
        return proc.stdout + proc.stderr


def raw_module_options(geometry):
    """The compile options :class:`CupyLauncher` gives ``cupy.RawModule`` (CuPy adds its own:
    ``-arch``, ``-ftz=true``, ``--device-as-default-execution-space``, ``--pch`` if enabled)."""
    return ("-std=c++17", *geometry_flags(geometry))


def compile_with_nvrtc(arch="90", geometry=None):
    """Compile every kernel file through CuPy's own NVRTC path, as ``cupy.RawModule`` will on a
    GPU of compute capability ``arch``, without a GPU or driver.

    The architecture is passed explicitly; CuPy's option lookup (which would query NVRTC's
    limits for the current device) is answered with ``-arch=sm_{arch}``, a cubin, as CuPy picks
    for a device NVRTC knows. Not thread-safe (it swaps that private function for the call). The options are
    :func:`raw_module_options` plus ``-ftz=true`` (which CuPy's kernel cache adds); CuPy's
    compile adds the rest itself. Every name expression must resolve to a kernel.

    Returns {file name: NVRTC log}. Raises ``RuntimeError`` with the log if a file fails, NVRTC
    warns or a name expression is unresolved.
    """
    import io

    from cupy.cuda import compiler
    geometry = GPU_GEOMETRY if geometry is None else geometry
    lookup = compiler._get_arch_for_options_for_nvrtc
    compiler._get_arch_for_options_for_nvrtc = lambda arch=None: (f"-arch=sm_{arch}", "cubin")
    logs = {}
    try:
        for fname, names in KERNEL_FILES.items():
            exprs = [f"{k}<{t}>" for k in names for t in ("float", "double")]
            log = io.StringIO()
            try:
                binary, mapping = compiler.compile_using_nvrtc(
                    module_source(fname), options=raw_module_options(geometry) + ("-ftz=true",),
                    arch=str(arch), filename=fname, name_expressions=exprs, log_stream=log)
            except compiler.CompileException as exc:
                raise RuntimeError(f"NVRTC rejected {fname}:\n{exc}") from None
            text = log.getvalue()
            unresolved = [e for e in exprs if not (mapping or {}).get(e)]
            if "warning" in text.lower() or unresolved or not binary:
                raise RuntimeError(f"NVRTC: {fname}: unresolved {unresolved}:\n{text}")
            logs[fname] = text
    finally:
        compiler._get_arch_for_options_for_nvrtc = lookup
    return logs
