"""The GPU backend's RawKernels (CUDA C in ``kernels/*.cu``) and their launch code.

:class:`RawBackend` implements the kernel contract of :mod:`mgnn.backend.numpy_ref` (the
interval-batched kernels, and the stacked-state kernels of ``mgnn.backend.STACKED_KERNELS``: one
launch per relaxation wave, no pointer arrays) over a *launcher*: :class:`CupyLauncher`
(``cupy.RawModule`` on a GPU, CuPy arrays) or
:class:`mgnn.backend.host_emulation.EmulationLauncher` (the same CUDA C compiled for the host,
NumPy arrays). Grid and block shapes come from the launcher's geometry, which is
also compiled into the kernels (``-DMGNN_BM=...``), so both always agree.

Importing this module needs neither CuPy nor a GPU.
"""
import contextlib
import operator
import os
import re

import numpy as np

from . import kernel_dir
from .numpy_ref import _int, bn_dims, check_stacked_grads, conv3d_check, gate_check

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


def _check_count(count):
    if count > MAX_BATCH:
        raise ValueError(f"{count} states in one batched launch exceed CUDA's grid limit of "
                         f"{MAX_BATCH}; use more ranks or fewer layers per rank")


def _cdiv(a, b):
    return -(-a // b)


#: This backend has the stacked-state kernels of ``mgnn.backend.STACKED_KERNELS``.
stacked_states = True

#: Most cached launch plans (chains / points arrays) a RawBackend keeps; the cache is cleared
#: when it is full (a solver reuses a handful of arrays per level).
PLAN_CACHE_SIZE = 256


def _host_index(a, name, ndim):
    """``a`` as a host int64 array of ``ndim`` dimensions (a device array is copied: a sync)."""
    if hasattr(a, "get") and not isinstance(a, np.ndarray):
        a = a.get()
    a = np.asarray(a)
    if a.dtype.kind not in "iu" and a.size:
        raise TypeError(f"{name} must be an integer array, got dtype {a.dtype}")
    if a.size == 0:
        return np.zeros((0, 2) if ndim == 2 else (0,), np.int64)
    a = a.astype(np.int64, copy=False)
    if a.ndim != ndim or (ndim == 2 and a.shape[1] != 2):
        raise ValueError(f"{name} must have shape {'(n, 2)' if ndim == 2 else '(n,)'}, got "
                         f"{a.shape}")
    return a


def _runs(slots, outs):
    """Maximal runs of consecutive points whose slots and output slots both step by constants:
    a list of ``(slot0, stride, out0, out_stride, count)`` (Python ints), at most MAX_BATCH
    points each."""
    slots, outs = [int(v) for v in slots], [int(v) for v in outs]
    runs, n, a = [], len(slots), 0
    while a < n:
        b = min(a + 2, n)  # one or two points always form a run
        ds, do = slots[b - 1] - slots[a], outs[b - 1] - outs[a]
        while (b < n and b - a < MAX_BATCH and slots[b] - slots[b - 1] == ds
               and outs[b] - outs[b - 1] == do):
            b += 1
        runs.append((slots[a], ds, outs[a], do, b - a))
        a = b
    return runs


def _chain_plan(chains):
    """(launches, (lowest, highest) slot) of a chains array (n, 2) of (first, length): wave k
    advances slot first + k of every chain longer than k, one launch per arithmetic run of those
    slots (so one per wave when the firsts are evenly spaced and the lengths equal). Raises
    ValueError when chains overlap or one reads a slot another writes."""
    chains = chains[np.argsort(chains[:, 0], kind="stable")]
    if (chains[:, 1] < 0).any():
        raise ValueError(f"chain lengths must be >= 0, got {chains[:, 1].tolist()}")
    chains = chains[chains[:, 1] > 0]
    first, length = chains[:, 0], chains[:, 1]
    ends = first + length  # one past the last slot a chain writes
    clash = np.nonzero(ends[:-1] >= first[1:])[0]
    if clash.size:
        c = clash[0]
        raise ValueError(f"chains (first, length) {chains[c].tolist()} and "
                         f"{chains[c + 1].tolist()} overlap or depend on each other (each chain "
                         "reads the slot before its first; chains must be independent)")
    if not length.size:
        return (), (1, 0)
    launches = []
    for k in range(int(length.max())):
        active = first[length > k] + k
        launches += _runs(active, active)
    return tuple(launches), (int(first.min()), int(ends.max()) - 1)


def _points_plan(slots, out_slots):
    """(runs, (lowest, highest) slot, (lowest, highest) output slot) of a points call;
    ValueError on a length mismatch or a repeated output slot."""
    if slots.shape != out_slots.shape:
        raise ValueError(f"slots {slots.shape} and out_slots {out_slots.shape} differ in length")
    if np.unique(out_slots).size != out_slots.size:
        raise ValueError(f"out_slots must be distinct, got {out_slots.tolist()}")
    if not slots.size:
        return (), (1, 0), (0, -1)
    return (tuple(_runs(slots, out_slots)), (int(slots.min()), int(slots.max())),
            (int(out_slots.min()), int(out_slots.max())))


class RawBackend:
    """The kernel contract of :mod:`mgnn.backend.numpy_ref` over a RawKernel launcher.

    Arrays are the launcher's (``self.xp``: CuPy on a GPU, NumPy under emulation), C-contiguous,
    all of one dtype. Outputs are new arrays of ``xp`` unless ``out`` is given, or the call runs
    inside :meth:`workspace` (then they are reused buffers). With ``poison_outputs`` (tests),
    every new output is filled with NaN before the launch, so an element a kernel fails to write
    shows up.
    """

    batched_relaxation = True
    stacked_states = True

    def __init__(self, launcher, name="cuda"):
        self.launcher, self.xp, self.name = launcher, launcher.xp, name
        #: the launcher captures launch sequences as graphs (:meth:`begin_capture`)
        self.graphs = bool(getattr(launcher, "captures", False))
        self.buffer_generation = 0  #: counts scratch (re)allocations (graphs key on it)
        self.geometry = launcher.geometry
        self.poison_outputs = False
        #: dense layers at least this wide use the launcher's cuBLAS GEMM (:data:`GEMM_MIN_WIDTH`)
        self.gemm_min_width = gemm_min_width_default()
        #: positions per split of a conv kernel gradient's GEMM depth (:data:`KGRAD_SPLIT`)
        self.kgrad_split = KGRAD_SPLIT
        self._plans, self._scratch = {}, {}
        self._ws_counts, self._ws_buffers = None, {}

    @contextlib.contextmanager
    def workspace(self):
        """Within the block, the k-th new output of each shape and dtype is the k-th cached
        buffer of that shape and dtype (k counted from the block's start), so a block that runs
        the same kernels again (a training step) allocates nothing after its first run. Outputs
        returned inside a block are overwritten by the next block: copy what must outlive it.
        The cache keeps the most buffers of each shape one block used; :meth:`clear_workspace`
        frees them."""
        outer, self._ws_counts = self._ws_counts, {}
        try:
            yield self
        finally:
            self._ws_counts = outer

    def begin_capture(self):
        """Capture the launches that follow into a graph (the launcher's stream capture)."""
        self.launcher.begin_capture()

    def end_capture(self):
        """The graph captured since :meth:`begin_capture` (``launch()`` replays it)."""
        return self.launcher.end_capture()

    def clear_workspace(self):
        """Free the buffers cached by :meth:`workspace`."""
        self._ws_buffers = {}

    # ------------------------------------------------------------------------------ plumbing
    def _empty(self, shape, dtype, reuse=True):
        """A new output (a cached buffer inside :meth:`workspace` unless ``reuse`` is False)."""
        counts = self._ws_counts if reuse else None
        if counts is None:
            out = self.xp.empty(shape, dtype=dtype)
        else:
            key = (tuple(shape) if isinstance(shape, tuple) else (shape,), np.dtype(dtype).str)
            k = counts[key] = counts.get(key, 0) + 1
            pool = self._ws_buffers.setdefault(key, [])
            if len(pool) < k:
                pool.append(self.xp.empty(shape, dtype=dtype))
            out = pool[k - 1]
        if self.poison_outputs:
            out.fill(np.nan)
        return out

    def _launch(self, name, dtype, grid, block, *args):
        self.launcher.launch(name, np.dtype(dtype), grid, block, args)

    def _gemm(self, name, M, N, count, dtype, *args):
        """A GEMM launch: grid (ceil(N / BN), ceil(M / BM), count); nothing for an empty grid
        (CUDA rejects one; no output element exists)."""
        g = self.geometry
        threads = (g["BM"] // g["TM"]) * (g["BN"] // g["TN"])
        grid = (_cdiv(N, g["BN"]), _cdiv(M, g["BM"]), count)
        if min(grid) > 0:
            self._launch(name, dtype, grid, (threads, 1, 1), *args)

    def _elementwise(self, name, total, dtype, *args, count=1):
        g = self.geometry
        blocks = max(1, min(_cdiv(total, g["ELEM"]), g["MAX_GRID"]))
        self._launch(name, dtype, (blocks, count, 1), (g["ELEM"], 1, 1), *args)

    def _kernel_grad(self, name, arrays, dims, positions, Co, entries, count, layers, layer0, gK,
                     h):
        """gK[l] (entries = Ci taps per output channel) of ``count`` problems in two launches:
        the split-K GEMM partials of kernel ``name`` (``arrays`` and ``dims`` its leading
        arguments; :attr:`kgrad_split` positions per split) into a scratch, then their ordered
        sum (``conv_kernel_grad_sum``: l = layers[p], or layer0 + p when ``layers`` is None)."""
        if not (count and Co and entries):
            return
        if operator.index(self.kgrad_split) < 1:
            raise ValueError(f"kgrad_split={self.kgrad_split!r}: expected a positive number of "
                             "positions per split")
        g, dt = self.geometry, gK.dtype
        # splits of kgrad_split positions, fewer where their partials would pass KGRAD_PART_MAX
        nsplit = min(max(1, _cdiv(positions, self.kgrad_split)),
                     max(1, KGRAD_PART_MAX // (count * Co * entries)))
        ksplit = max(1, _cdiv(positions, nsplit))
        nsplit = max(1, _cdiv(positions, ksplit))  # what the kernels compute (conv_kgrad_splits)
        part = self._work("conv_kgrad_part", (count * nsplit * Co * entries,), dt)
        threads = (g["BM"] // g["TM"]) * (g["BN"] // g["TN"])
        self._launch(name, dt, (nsplit * _cdiv(entries, g["BN"]), _cdiv(Co, g["BM"]), count),
                     (threads, 1, 1), *arrays, part, *dims, ksplit)
        self._elementwise("conv_kernel_grad_sum", Co * entries, dt, part, nsplit, Co * entries,
                          layers, layer0, gK, h, count=count)

    def _outputs(self, count, shape, dtype):
        """``count`` new arrays of ``shape`` -- views into one allocation -- and the device array
        of their addresses (computed, not gathered: no per-array work on the host)."""
        _check_count(count)
        stack = self._empty((count,) + tuple(shape), dtype, reuse=False)  # they become states
        step = np.uint64(int(np.prod(shape)) * np.dtype(dtype).itemsize)
        ptrs = np.uint64(self.launcher.ptr(stack)) + step * np.arange(count, dtype=np.uint64)
        return list(stack), self.launcher.to_device(ptrs)

    def _pointers(self, arrays):
        """Device array of the addresses of ``arrays`` (uint64), or None if ``arrays`` is None."""
        if arrays is None:
            return None
        _check_count(len(arrays))
        for a in arrays:  # the kernels index densely: a strided view would be read wrongly
            if not a.flags.c_contiguous:
                raise ValueError(f"a state of shape {a.shape} is not C-contiguous; the GPU "
                                 "kernels need C-contiguous arrays")
        host = np.array([self.launcher.ptr(a) for a in arrays], dtype=np.uint64)
        return self.launcher.to_device(host)

    def _layers(self, layers):
        return self.launcher.to_device(np.asarray(layers, dtype=np.int32))

    @staticmethod
    def _h(h, dtype):
        return np.dtype(dtype).type(h)

    # ---------------------------------------------------------------------------------- dense
    def _dense(self, x, W, b, h, act, residual, want_y, want_d):
        B, I = x.shape
        O = W.shape[0]
        y = self._empty((B, O), x.dtype) if want_y else None
        d = self._empty((B, O), x.dtype) if want_d else None
        self._gemm("dense_forward", B, O, 1, x.dtype, x, W, b, y, d, B, I, O,
                   self._h(h, x.dtype), act, int(residual))
        return y, d

    def dense_forward(self, x, W, b, h, act, residual):
        """y (B, o) = [x +] h sigma(x W^T + b)."""
        return self._dense(x, W, b, h, act, residual, True, False)[0]

    def dense_forward_deriv(self, x, W, b, h, act, residual):
        """(y, sigma'(z)) in one launch."""
        return self._dense(x, W, b, h, act, residual, True, True)

    def dense_deriv(self, x, W, b, act):
        """sigma'(x W^T + b) (B, o)."""
        return self._dense(x, W, b, 1.0, act, False, False, True)[1]

    def dense_vjp_input(self, gy, deriv, W, h, residual, out=None):
        """gx (B, i) = [gy +] h (sigma' * gy) W."""
        B, O = gy.shape
        I = W.shape[1]
        gx = self._empty((B, I), gy.dtype) if out is None else out
        self._gemm("dense_vjp_input", B, I, 1, gy.dtype, gy, deriv, W, gx, B, I, O,
                   self._h(h, gy.dtype), int(residual))
        return gx

    def dense_vjp_params(self, gy, deriv, x, h, out=None):
        """(gW (o, i), gb (o,)) = (h s^T x, h sum_B s), s = sigma' * gy; ``out`` = (gW, gb)."""
        B, O = gy.shape
        I = x.shape[1]
        gW, gb = out if out is not None else (self._empty((O, I), gy.dtype),
                                              self._empty((O,), gy.dtype))
        hh = self._h(h, gy.dtype)
        self._gemm("dense_weight_grad", O, I, 1, gy.dtype, gy, deriv, x, gW, B, I, O, hh)
        self._launch("bias_grad", gy.dtype, (O, 1, 1), (self.geometry["REDUCE"], 1, 1), gy, deriv,
                     gb, B, O, 1, hh)
        return gW, gb

    def dense_vjp(self, gy, deriv, x, W, h, residual):
        """(gx, gW, gb) of one dense step."""
        return (self.dense_vjp_input(gy, deriv, W, h, residual),
                *self.dense_vjp_params(gy, deriv, x, h))

    def dense_sweep_forward(self, U, W, b, h, act, D):
        """Layer after layer, one launch per layer (the GPU's serial baseline); see numpy_ref."""
        N, (B, w) = W.shape[0], U.shape[1:]
        hh = self._h(h, U.dtype)
        if self.wide(w):  # per layer: cuBLAS GEMM, then bias + activation + residual
            Z = self._work("gemm_z", (1, B, w), U.dtype)
            for n in range(N):
                self.launcher.gemm(U[n:n + 1], W[n:n + 1], Z, trans_b=True)
                self._elementwise("dense_bias_act", B * w, U.dtype, Z, U, n, b, n, U, n + 1,
                                  D if D.shape[0] else None, n, B, w, hh, act, 1)
            return
        for n in range(N):
            self._gemm("dense_forward", B, w, 1, U.dtype, U[n], W[n], b[n], U[n + 1],
                       D[n] if D.shape[0] else None, B, w, w, hh, act, 1)

    def dense_sweep_backward(self, U, D, W, h, lam, gW, gb):
        """Adjoint of :meth:`dense_sweep_forward`; returns lam_0, fills gW and gb."""
        if self.wide(lam.shape[1]):
            return self._wide_sweep_backward(U, D, W, h, lam, gW, gb)
        for n in range(W.shape[0] - 1, -1, -1):
            self.dense_vjp_params(lam, D[n], U[n], h, out=(gW[n], gb[n]))
            lam = self.dense_vjp_input(lam, D[n], W[n], h, True)
        return lam

    def _wide_sweep_backward(self, U, D, W, h, lam, gW, gb):
        """:meth:`dense_sweep_backward` through cuBLAS: per layer S = h D_n * lam, gW[n] = S^T
        U[n] and Z = S W_n (two GEMMs), gb[n] (the bias kernel), lam <- lam + Z (epilogue)."""
        (B, w), dt = lam.shape, lam.dtype
        hh, one = self._h(h, dt), self._h(1.0, dt)
        S, Z = self._work("gemm_s", (1, B, w), dt), self._work("gemm_z", (1, B, w), dt)
        for n in range(W.shape[0] - 1, -1, -1):
            self._elementwise("stacked_product", B * w, dt, lam, 0, 0, D, n, 0, S, B * w, hh)
            self.launcher.gemm(S, U[n:n + 1], gW[n:n + 1], trans_a=True)
            self._launch("bias_grad", dt, (w, 1, 1), (self.geometry["REDUCE"], 1, 1), lam, D[n],
                         gb[n], B, w, 1, hh)
            self.launcher.gemm(S, W[n:n + 1], Z)
            out = self._empty((B, w), dt)
            self._elementwise("dense_stacked_adjoint_epilogue", B * w, dt, Z, lam, None, out, 1,
                              0, 0, 0, B, w, one, 2, None, 0)
            lam = out
        return lam

    def dense_forward_batched(self, xs, W, b, layers, h, act, store_deriv, gs=None):
        """One launch for len(xs) residual steps: ys[p] = xs[p] + h sigma(xs[p] W_l^T + b_l)
        [+ gs[p]], l = layers[p]; returns (ys, derivs or None), lists of new (B, w) arrays."""
        B, w = xs[0].shape
        dt = xs[0].dtype
        ys, ptr_y = self._outputs(len(xs), (B, w), dt)
        ds, ptr_d = self._outputs(len(xs), (B, w), dt) if store_deriv else (None, None)
        self._gemm("dense_forward_batched", B, w, len(xs), dt, self._pointers(xs), W, b, ptr_y,
                   ptr_d, self._pointers(gs), self._layers(layers), B, w, self._h(h, dt), act)
        return ys, ds

    def dense_vjp_input_batched(self, gys, derivs, W, layers, h, gs=None):
        """One launch for len(gys) state vjps: gys[p] + h (derivs[p] gys[p]) W_l [+ gs[p]]."""
        B, w = gys[0].shape
        dt = gys[0].dtype
        gxs, ptr_gx = self._outputs(len(gys), (B, w), dt)
        self._gemm("dense_vjp_input_batched", B, w, len(gys), dt, self._pointers(gys),
                   self._pointers(derivs), W, ptr_gx, self._pointers(gs), self._layers(layers), B,
                   w, self._h(h, dt))
        return gxs

    def dense_deriv_batched(self, xs, W, b, layers, act):
        """[sigma'(xs[p] W_l^T + b_l)] for l = layers[p], one launch (new (B, w) arrays)."""
        if not xs:
            return []
        B, w = xs[0].shape
        dt = xs[0].dtype
        ds, ptr_d = self._outputs(len(xs), (B, w), dt)
        self._gemm("dense_forward_batched", B, w, len(xs), dt, self._pointers(xs), W, b, None,
                   ptr_d, None, self._layers(layers), B, w, self._h(1.0, dt), act)
        return ds

    def dense_vjp_params_batched(self, gys, derivs, xs, layers, h, gW, gb):
        """In place, two launches: gW[l] = h s_p^T xs[p], gb[l] = h sum_B s_p with
        s_p = derivs[p] * gys[p], l = layers[p] (distinct), into the stacked gW (L, w, w), gb (L, w)."""
        if not xs:
            return
        B, w = xs[0].shape
        dt = xs[0].dtype
        hh, ptr_g, ptr_d = self._h(h, dt), self._pointers(gys), self._pointers(derivs)
        lay = self._layers(layers)
        self._gemm("dense_weight_grad_batched", w, w, len(xs), dt, ptr_g, ptr_d,
                   self._pointers(xs), gW, lay, B, w, hh)
        self._launch("bias_grad_batched", dt, (w, len(xs), 1), (self.geometry["REDUCE"], 1, 1),
                     ptr_g, ptr_d, gb, lay, B, w, 1, hh)

    # ----------------------------------------------------------------------------------- conv
    def _conv(self, x, K, b, h, act, residual, want_y, want_d):
        B, Ci, H, Wd = x.shape
        Co = K.shape[0]
        y = self._empty((B, Co, H, Wd), x.dtype) if want_y else None
        d = self._empty((B, Co, H, Wd), x.dtype) if want_d else None
        self._gemm("conv_forward", Co, B * H * Wd, 1, x.dtype, x, K, b, y, d, B, Ci, Co, H, Wd,
                   self._h(h, x.dtype), act, int(residual))
        return y, d

    def conv_forward(self, x, K, b, h, act, residual):
        """y = [x +] h sigma(conv3x3(x, K) + b) (B, co, H, W)."""
        return self._conv(x, K, b, h, act, residual, True, False)[0]

    def conv_forward_deriv(self, x, K, b, h, act, residual):
        """(y, sigma'(z)) in one launch."""
        return self._conv(x, K, b, h, act, residual, True, True)

    def conv_deriv(self, x, K, b, act):
        """sigma'(conv3x3(x, K) + b)."""
        return self._conv(x, K, b, 1.0, act, False, False, True)[1]

    def conv_vjp_input(self, gy, deriv, K, h, residual):
        """gx (B, ci, H, W) = [gy +] h conv3x3^T(sigma' * gy, K)."""
        B, Co, H, Wd = gy.shape
        Ci = K.shape[1]
        gx = self._empty((B, Ci, H, Wd), gy.dtype)
        self._gemm("conv_vjp_input", Ci, B * H * Wd, 1, gy.dtype, gy, deriv, K, gx, B, Ci, Co, H,
                   Wd, self._h(h, gy.dtype), int(residual))
        return gx

    def conv_vjp_params(self, gy, deriv, x, h):
        """(gK (co, ci, 3, 3), gb (co,)) with s = sigma' * gy."""
        B, Co, H, Wd = gy.shape
        Ci = x.shape[1]
        gK = self._empty((Co, Ci, 3, 3), gy.dtype)
        gb = self._empty((Co,), gy.dtype)
        hh = self._h(h, gy.dtype)
        red = (self.geometry["REDUCE"], 1, 1)
        self._kernel_grad("conv_kernel_grad", (gy, deriv, x), (B, Ci, Co, H, Wd), B * H * Wd,
                          Co, Ci * 9, 1, None, 0, gK, hh)
        self._launch("bias_grad", gy.dtype, (Co, 1, 1), red, gy, deriv, gb, B, Co, H * Wd, hh)
        return gK, gb

    def conv_vjp(self, gy, deriv, x, K, h, residual):
        """(gx, gK, gb) of one conv step."""
        return (self.conv_vjp_input(gy, deriv, K, h, residual),
                *self.conv_vjp_params(gy, deriv, x, h))

    def conv_forward_batched(self, xs, K, b, layers, h, act, store_deriv, gs=None):
        """One launch for len(xs) residual conv steps with layers ``layers`` [+ gs[p]];
        (ys, derivs|None)."""
        B, C, H, Wd = xs[0].shape
        dt = xs[0].dtype
        ys, ptr_y = self._outputs(len(xs), xs[0].shape, dt)
        ds, ptr_d = self._outputs(len(xs), xs[0].shape, dt) if store_deriv else (None, None)
        self._gemm("conv_forward_batched", C, B * H * Wd, len(xs), dt, self._pointers(xs), K, b,
                   ptr_y, ptr_d, self._pointers(gs), self._layers(layers), B, C, H, Wd,
                   self._h(h, dt), act)
        return ys, ds

    def conv_vjp_input_batched(self, gys, derivs, K, layers, h, gs=None):
        """One launch for len(gys) residual conv state vjps [+ gs[p]]."""
        B, C, H, Wd = gys[0].shape
        dt = gys[0].dtype
        gxs, ptr_gx = self._outputs(len(gys), gys[0].shape, dt)
        self._gemm("conv_vjp_input_batched", C, B * H * Wd, len(gys), dt, self._pointers(gys),
                   self._pointers(derivs), K, ptr_gx, self._pointers(gs), self._layers(layers), B,
                   C, H, Wd, self._h(h, dt))
        return gxs

    def conv_deriv_batched(self, xs, K, b, layers, act):
        """[sigma'(conv3x3(xs[p], K_l) + b_l)] for l = layers[p], one launch."""
        if not xs:
            return []
        B, C, H, Wd = xs[0].shape
        dt = xs[0].dtype
        ds, ptr_d = self._outputs(len(xs), xs[0].shape, dt)
        self._gemm("conv_forward_batched", C, B * H * Wd, len(xs), dt, self._pointers(xs), K, b,
                   None, ptr_d, None, self._layers(layers), B, C, H, Wd, self._h(1.0, dt), act)
        return ds

    def conv_vjp_params_batched(self, gys, derivs, xs, layers, h, gK, gb):
        """In place, two launches: gK[l], gb[l] of every (state, layer) pair (layers distinct)."""
        if not xs:
            return
        B, C, H, Wd = xs[0].shape
        dt = xs[0].dtype
        hh, ptr_g, ptr_d = self._h(h, dt), self._pointers(gys), self._pointers(derivs)
        lay, red = self._layers(layers), (self.geometry["REDUCE"], 1, 1)
        self._kernel_grad("conv_kernel_grad_batched", (ptr_g, ptr_d, self._pointers(xs)),
                          (B, C, H, Wd), B * H * Wd, C, C * 9, len(xs), lay, 0, gK, hh)
        self._launch("bias_grad_batched", dt, (C, len(xs), 1), red, ptr_g, ptr_d, gb, lay, B, C,
                     H * Wd, hh)

    # --------------------------------------------------------------------------------- conv3d
    # kernels/conv3d.cu; arguments are validated on the host (numpy_ref.conv3d_check, O(1)):
    # a kernel of the wrong rank would otherwise be read past its end.
    def _conv3d_size(self, *shape):
        """Elements of ``shape``; ValueError unless the int indices of conv3d.cu hold them."""
        n = int(np.prod(shape, dtype=np.int64))
        g = self.geometry
        if n + g["ELEM"] * g["MAX_GRID"] >= 2**31:
            raise ValueError(f"conv3d state of shape {tuple(shape)} has {n} elements; the GPU "
                             "kernels index with 32-bit ints (< 2^31 with the grid): use a "
                             "smaller batch")
        return n

    def _conv3d(self, x, K, b, h, act, residual, want_y, want_d):
        B, Ci, D, H, Wd = x.shape
        Co = K.shape[0]
        self._conv3d_size(B, max(Ci, Co), D, H, Wd)
        y = self._empty((B, Co, D, H, Wd), x.dtype) if want_y else None
        d = self._empty((B, Co, D, H, Wd), x.dtype) if want_d else None
        self._gemm("conv3d_forward", Co, B * D * H * Wd, 1, x.dtype, x, K, b, y, d, B, Ci, Co, D,
                   H, Wd, h, act, int(residual))
        return y, d

    def conv3d_forward(self, x, K, b, h, act, residual):
        """y = [x +] h sigma(conv3x3x3(x, K) + b) (B, co, D, H, W); contract of
        :func:`mgnn.backend.numpy_ref.conv3d_forward`."""
        h = conv3d_check(x=x, K=K, b=b, h=h, act=act, residual=residual)
        return self._conv3d(x, K, b, h, act, residual, True, False)[0]

    def conv3d_forward_deriv(self, x, K, b, h, act, residual):
        """(y, sigma'(z)) in one launch."""
        h = conv3d_check(x=x, K=K, b=b, h=h, act=act, residual=residual)
        return self._conv3d(x, K, b, h, act, residual, True, True)

    def conv3d_deriv(self, x, K, b, act):
        """sigma'(conv3x3x3(x, K) + b) (B, co, D, H, W)."""
        h = conv3d_check(x=x, K=K, b=b, h=1, act=act)
        return self._conv3d(x, K, b, h, act, False, False, True)[1]

    def _conv3d_vjp_input(self, gy, deriv, K, h, residual):
        B, Co, D, H, Wd = gy.shape
        Ci = K.shape[1]
        self._conv3d_size(B, max(Ci, Co), D, H, Wd)
        gx = self._empty((B, Ci, D, H, Wd), gy.dtype)
        self._gemm("conv3d_vjp_input", Ci, B * D * H * Wd, 1, gy.dtype, gy, deriv, K, gx, B, Ci,
                   Co, D, H, Wd, h, int(residual))
        return gx

    def _conv3d_vjp_params(self, gy, deriv, x, h):
        B, Co, D, H, Wd = gy.shape
        Ci = x.shape[1]
        self._conv3d_size(B, max(Ci, Co), D, H, Wd)
        gK = self._empty((Co, Ci, 3, 3, 3), gy.dtype)
        gb = self._empty((Co,), gy.dtype)
        red = (self.geometry["REDUCE"], 1, 1)
        if Co * Ci:
            self._kernel_grad("conv3d_kernel_grad", (gy, deriv, x), (B, Ci, Co, D, H, Wd),
                              B * D * H * Wd, Co, Ci * 27, 1, None, 0, gK, h)
        if Co:
            self._launch("bias_grad", gy.dtype, (Co, 1, 1), red, gy, deriv, gb, B, Co,
                         D * H * Wd, h)
        return gK, gb

    def conv3d_vjp_input(self, gy, deriv, K, h, residual):
        """gx (B, ci, D, H, W) = [gy +] h conv3x3x3^T(sigma' * gy, K)."""
        h = conv3d_check(K=K, gy=gy, deriv=deriv, h=h, residual=residual)
        return self._conv3d_vjp_input(gy, deriv, K, h, residual)

    def conv3d_vjp_params(self, gy, deriv, x, h):
        """(gK (co, ci, 3, 3, 3), gb (co,)) with s = sigma' * gy; two launches."""
        h = conv3d_check(x=x, gy=gy, deriv=deriv, h=h)
        return self._conv3d_vjp_params(gy, deriv, x, h)

    def conv3d_vjp(self, gy, deriv, x, K, h, residual):
        """(gx, gK, gb) of one conv3d step; three launches."""
        h = conv3d_check(x=x, K=K, gy=gy, deriv=deriv, h=h, residual=residual)
        return (self._conv3d_vjp_input(gy, deriv, K, h, residual),
                *self._conv3d_vjp_params(gy, deriv, x, h))

    # ------------------------------------------------------------------------- FAS vectors
    def residual_batched(self, phis, us, gs):
        """([r_p = phis[p] - us[p] (+ gs[p])], sum_p ||r_p||^2) in one launch; the norm is a 0-d
        float64 array of ``xp`` (on a GPU it stays on the device)."""
        if not phis:
            return [], 0.0
        n, dt = phis[0].size, phis[0].dtype
        g = self.geometry
        blocks = max(1, min(_cdiv(n, g["REDUCE"]), g["MAX_GRID"]))
        rs, ptr_r = self._outputs(len(phis), phis[0].shape, dt)
        partial = self.xp.empty(len(phis) * blocks, dtype=np.float64)
        self._launch("residual_batched", dt, (blocks, len(phis), 1), (g["REDUCE"], 1, 1),
                     self._pointers(phis), self._pointers(us),
                     None if gs is None else self._pointers(gs), ptr_r, partial, n)
        return rs, partial.sum()

    def combine_batched(self, mode, outs, xs, ys, zs=None):
        """outs[p] = (x + y) - z (mode 0), x + (y - z) (mode 1) or x + y (mode 2), one launch;
        ``outs`` None: new arrays. Returns the outputs."""
        if not xs:
            return []
        n, dt = xs[0].size, xs[0].dtype
        if outs is None:
            outs, ptr_out = self._outputs(len(xs), xs[0].shape, dt)
        else:
            ptr_out = self._pointers(outs)
        self._elementwise("combine_batched", n, dt, ptr_out, self._pointers(xs),
                          self._pointers(ys), None if zs is None else self._pointers(zs), n, mode,
                          count=len(xs))
        return outs

    # ------------------------------------------------------------------------ stacked states
    # The kernels of mgnn.backend.STACKED_KERNELS: whole relaxation waves of one stacked array
    # (m, *state) per launch; slots and layers are arithmetic progressions computed in the kernel
    # (no pointer arrays), the launch plan of a chains / points array is cached by its bytes, the
    # scratch of the residual norm by its size: no allocation and no ptr() after the first call.
    def _plan(self, tag, *arrays):
        key = (tag,) + tuple(a.tobytes() for a in arrays)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= PLAN_CACHE_SIZE:
                self._plans.clear()
            plan = self._plans[key] = (_chain_plan(*arrays) if tag == "chains"
                                       else _points_plan(*arrays))
        return plan

    def _buffer(self, name, size):
        """A cached float64 scratch array of ``size`` elements (:meth:`_work`); the 0-d norm
        buffer for ``size`` None."""
        return self._work(name, () if size is None else (max(size, 1),), np.float64)

    def _work(self, name, shape, dtype):
        """A cached scratch array of ``shape`` and ``dtype``: a view of a buffer that grows and
        never shrinks (growing it bumps :attr:`buffer_generation`: a captured graph wrote to
        the old one, so it is recaptured)."""
        dtype = np.dtype(dtype)
        size = int(np.prod(shape))
        key = (name, dtype.str)
        buf = self._scratch.get(key)
        if buf is None or buf.size < size:
            buf = self._scratch[key] = self._empty(max(size, 1), dtype, reuse=False)
            self.buffer_generation += 1
        return buf[:size].reshape(shape)

    def wide(self, w):
        """Dense layers of width ``w`` take the cuBLAS path (the launcher has ``gemm`` and
        ``w >= gemm_min_width``)."""
        return w >= self.gemm_min_width and callable(getattr(self.launcher, "gemm", None))

    def _stacked(self, kind, adjoint, U, G, R, P, X, d0, runs, span, out_span, layer0,
                 layer_step, h, act, mode, norm_out=None):
        """Check the arguments, then launch ``runs`` [(slot0, stride, out0, out_stride, count)]
        of the stacked kernel of ``kind``; X = b (forward) or D (adjoint). Returns the mode-0
        norm (device 0-d array or float), else 0.0."""
        xp_name = "L" if adjoint else "U"
        layer0, layer_step, d0, mode = (operator.index(v) for v in (layer0, layer_step, d0, mode))
        nd = 3 if kind == "dense" else 5
        if getattr(U, "ndim", None) != nd or U.dtype not in (np.float32, np.float64):
            raise ValueError(f"{kind}: {xp_name} must be a float32/float64 stack of {nd - 1}-d "
                             f"states, got {getattr(U, 'dtype', type(U).__name__)} "
                             f"{getattr(U, 'shape', '')}")
        dt, state, m, N = U.dtype, U.shape[1:], U.shape[0], P.shape[0]
        per = (state[1], state[1]) if kind == "dense" else (state[1], state[1], 3, 3)
        want = [(xp_name, U, U.shape), ("G", G, U.shape),
                ("W" if kind == "dense" else "K", P, (N,) + per),
                ("D", X, X.shape[:1] + state) if adjoint else ("b", X, (N, state[1]))]
        if R is not None:
            want.append(("R", R, R.shape[:1] + state))
        for name, a, shape in want:
            if a is not None and (a.shape != shape or a.dtype != dt or not a.flags.c_contiguous):
                raise ValueError(f"{kind}: {name} must be a C-contiguous {dt} array of shape "
                                 f"{shape}, got {a.dtype} {a.shape}")
        if mode not in (0, 1, 2):
            raise ValueError(f"mode must be 0 (residual), 1 (FAS) or 2 (plain), got {mode!r}")
        if not adjoint and act not in (0, 1, 2):
            raise ValueError(f"act={act!r}: expected an activation code 0, 1 or 2")
        out = None
        if mode == 0:
            out = self._buffer("norm", None) if norm_out is None else norm_out
            if out.shape != () or out.dtype != np.float64:
                raise ValueError(f"norm_out must be a 0-d float64 array, got {out.dtype} "
                                 f"{out.shape}")
        if span[0] <= span[1]:  # some step: its slots, layers (and sigma') must exist
            if span[0] < 1 or span[1] >= m:
                raise ValueError(f"slots {span[0]}..{span[1]} out of range 1..{m - 1} "
                                 f"({xp_name} has {m} slots; slot i reads slot i-1)")
            lay = sorted((layer0 + span[0] * layer_step, layer0 + span[1] * layer_step))
            if lay[0] < 0 or lay[1] >= N:
                raise ValueError(f"layers {lay[0]}..{lay[1]} (layer0={layer0}, layer_step="
                                 f"{layer_step}) out of range 0..{N - 1}")
            if adjoint and (lay[0] - d0 < 0 or lay[1] - d0 >= X.shape[0]):
                raise ValueError(f"layers {lay[0]}..{lay[1]} have no sigma' in D: it holds "
                                 f"layers {d0}..{d0 + X.shape[0] - 1} (d0={d0})")
            if R is not None and (out_span[0] < 0 or out_span[1] >= R.shape[0]):
                raise ValueError(f"out_slots {out_span[0]}..{out_span[1]} out of range "
                                 f"0..{R.shape[0] - 1}")
        if R is None:
            R = U
        elif (U if U.base is None else U.base) is (R if R.base is None else R.base):
            raise ValueError("R shares memory with U (the points kernels only read U)")
        g = self.geometry
        wide = kind == "dense" and self.wide(state[1])
        if kind == "dense" and not wide:  # blocks per problem: GEMM tiles
            per_problem = _cdiv(state[1], g["BN"]) * _cdiv(state[0], g["BM"])
        elif kind == "conv":  # the implicit GEMM's tiles: channels x positions
            per_problem = _cdiv(state[0] * int(np.prod(state[2:])), g["BN"]) * _cdiv(state[1],
                                                                                     g["BM"])
        else:  # elementwise blocks (wide dense: the epilogue)
            per_problem = max(1, min(_cdiv(int(np.prod(state)), g["ELEM"]), g["MAX_GRID"]))
        head = (U, G, R, P, X) + ((d0,) if adjoint else ())
        tail = (self._h(h, dt),) + (() if adjoint else (operator.index(act),)) + (mode,)
        name = f"{kind}_stacked_{'adjoint' if adjoint else 'forward'}"
        partial = (self._buffer("partial", sum(r[4] for r in runs) * per_problem) if mode == 0
                   else None)
        part = 0
        for slot0, stride, out0, out_stride, count in runs:
            args = (head + (slot0, stride, out0, out_stride, layer0, layer_step, *state) + tail
                    + (partial, part))
            if wide:
                self._wide_run(adjoint, U, G, R, P, X, d0, (slot0, stride, out0, out_stride,
                               count), layer0, layer_step, h, act, mode, partial, part)
            elif kind == "dense":
                self._gemm(name, state[0], state[1], count, dt, *args)
            else:
                self._gemm(name, state[1], state[0] * int(np.prod(state[2:])), count, dt, *args)
            part += count * per_problem
        if mode != 0:
            return 0.0
        self._launch("sum_partials", dt, (1, 1, 1), (g["REDUCE"], 1, 1), partial, out, part)
        return out if self.launcher.on_device else float(out)

    def _wide_run(self, adjoint, U, G, R, P, X, d0, run, layer0, layer_step, h, act, mode,
                  partial, part):
        """One run of a stacked dense launch through cuBLAS: the GEMM of every problem into a
        scratch stack Z, then the epilogue kernel (the adjoint first forms D_l * L[i-1])."""
        slot0, stride, out0, out_stride, count = run
        B, w = U.shape[1:]
        dt = U.dtype
        Z = self._work("gemm_z", (count, B, w), dt)
        weights = state_run(P, layer0 + slot0 * layer_step, stride * layer_step, count, self.xp)
        if adjoint:
            S = self._work("gemm_s", (count, B, w), dt)
            self._elementwise("stacked_product", B * w, dt, U, slot0 - 1, stride, X,
                              layer0 + slot0 * layer_step - d0, stride * layer_step, S, B * w,
                              self._h(1.0, dt), count=count)
            self.launcher.gemm(S, weights, Z)
            self._elementwise("dense_stacked_adjoint_epilogue", B * w, dt, Z, U, G, R, slot0,
                              stride, out0, out_stride, B, w, self._h(h, dt), mode, partial,
                              part, count=count)
        else:
            self.launcher.gemm(state_run(U, slot0 - 1, stride, count, self.xp), weights, Z,
                               trans_b=True)
            self._elementwise("dense_stacked_forward_epilogue", B * w, dt, Z, U, G, R, X, slot0,
                              stride, out0, out_stride, layer0, layer_step, B, w,
                              self._h(h, dt), operator.index(act), mode, partial, part,
                              count=count)

    def _chains(self, kind, adjoint, U, G, P, X, d0, chains, layer0, layer_step, h, act):
        launches, span = self._plan("chains", _host_index(chains, "chains", 2))
        self._stacked(kind, adjoint, U, G, None, P, X, d0, launches, span, None, layer0,
                      layer_step, h, act, 2)

    def _points(self, kind, adjoint, U, G, R, P, X, d0, slots, out_slots, layer0, layer_step, h,
                act, mode, norm_out):
        if R is None:
            raise ValueError("R (the output states) is required")
        runs, span, out_span = self._plan("points", _host_index(slots, "slots", 1),
                                          _host_index(out_slots, "out_slots", 1))
        return self._stacked(kind, adjoint, U, G, R, P, X, d0, runs, span, out_span, layer0,
                             layer_step, h, act, mode, norm_out)

    def dense_chains_forward(self, U, G, W, b, chains, layer0, layer_step, h, act):
        """In place, one launch per wave (per arithmetic run of a wave's slots): for each chain
        (first, length) of ``chains`` and k < length, i = first + k,
        U[i] = U[i-1] + h sigma(U[i-1] W_l^T + b_l) [+ G[i]], l = layer0 + i * layer_step.

        U, G (m, B, w) (G None: no rhs), W (N, w, w), b (N, w). ``chains`` (n, 2) int, a host
        array (a device array costs a copy and a sync); its launch plan is cached by its bytes.
        Chains must be independent (ValueError otherwise)."""
        self._chains("dense", False, U, G, W, b, 0, chains, layer0, layer_step, h, act)

    def dense_points_forward(self, U, G, R, W, b, slots, out_slots, layer0, layer_step, h, act,
                             mode, norm_out=None):
        """phi_p = Phi_l(U[i-1]) for i = slots[p] (U only read), into R[out_slots[p]]: mode 0
        R[o] = (phi - U[i]) [+ G[i]], mode 1 R[o] = (R[o] + U[i]) - phi, mode 2 R[o] = phi
        [+ G[i]]; one launch per arithmetic run of (slots, out_slots), plus one reduction
        launch in mode 0.

        Returns
        -------
        Mode 0: sum_p ||R[o]||^2 accumulated in float64 on the device: a 0-d float64 array of
        ``xp`` when the launcher is on a device (no sync; it is a cached buffer, overwritten by
        the next mode-0 call unless ``norm_out``, a 0-d float64 array, is given), a Python
        float under emulation / counting. Modes 1, 2: 0.0.
        """
        return self._points("dense", False, U, G, R, W, b, 0, slots, out_slots, layer0,
                            layer_step, h, act, mode, norm_out)

    def dense_chains_adjoint(self, L, G, W, D, d0, chains, layer0, layer_step, h):
        """As :meth:`dense_chains_forward` with the adjoint step
        L[i] = L[i-1] + h (D_l * L[i-1]) W_l [+ G[i]], D_l = D[l - d0] (D (n_d, B, w): sigma' of
        layers d0 ..)."""
        self._chains("dense", True, L, G, W, D, d0, chains, layer0, layer_step, h, None)

    def dense_points_adjoint(self, L, G, R, W, D, d0, slots, out_slots, layer0, layer_step, h,
                             mode, norm_out=None):
        """As :meth:`dense_points_forward` with the adjoint step (returns the same)."""
        return self._points("dense", True, L, G, R, W, D, d0, slots, out_slots, layer0,
                            layer_step, h, None, mode, norm_out)

    def conv_chains_forward(self, U, G, K, b, chains, layer0, layer_step, h, act):
        """As :meth:`dense_chains_forward` for conv states U (m, B, C, H, W), K (N, C, C, 3, 3),
        b (N, C): U[i] = U[i-1] + h sigma(conv3x3(U[i-1], K_l) + b_l) [+ G[i]]."""
        self._chains("conv", False, U, G, K, b, 0, chains, layer0, layer_step, h, act)

    def conv_points_forward(self, U, G, R, K, b, slots, out_slots, layer0, layer_step, h, act,
                            mode, norm_out=None):
        """As :meth:`dense_points_forward` for conv states (returns the same)."""
        return self._points("conv", False, U, G, R, K, b, 0, slots, out_slots, layer0,
                            layer_step, h, act, mode, norm_out)

    def conv_chains_adjoint(self, L, G, K, D, d0, chains, layer0, layer_step, h):
        """As :meth:`dense_chains_adjoint` for conv states:
        L[i] = L[i-1] + h conv_vjp_input(D_l * L[i-1], K_l) [+ G[i]]."""
        self._chains("conv", True, L, G, K, D, d0, chains, layer0, layer_step, h, None)

    def conv_points_adjoint(self, L, G, R, K, D, d0, slots, out_slots, layer0, layer_step, h,
                            mode, norm_out=None):
        """As :meth:`dense_points_adjoint` for conv states (returns the same)."""
        return self._points("conv", True, L, G, R, K, D, d0, slots, out_slots, layer0,
                            layer_step, h, None, mode, norm_out)

    # ----------------------------------------------------------------- stacked gradients
    def _count(self, count):
        _check_count(count)
        return count

    def dense_deriv_stacked(self, U, first, count, W, b, layer0, act, D):
        """D[p] = sigma'(U[first + p] W_l^T + b_l), l = layer0 + p, p < count: one launch, no
        pointer arrays (contract: :data:`mgnn.backend.STACKED_GRAD_KERNELS`)."""
        count = self._count(check_stacked_grads("dense", U, first, count, W, layer0, D, b))
        if count and self.wide(U.shape[2]):
            B, w = U.shape[1:]
            Z = self._work("gemm_z", (count, B, w), U.dtype)
            self.launcher.gemm(U[first:first + count], W[layer0:layer0 + count], Z,
                               trans_b=True)
            self._elementwise("dense_bias_act", B * w, U.dtype, Z, None, 0, b, layer0, None, 0,
                              D, 0, B, w, self._h(1.0, U.dtype), operator.index(act), 0,
                              count=count)
        elif count:
            B, w = U.shape[1:]
            self._gemm("dense_deriv_stacked", B, w, count, U.dtype, U, first, W, b, layer0, D,
                       B, w, operator.index(act))

    def dense_vjp_params_stacked(self, L, l_first, l_stride, D, U, u_first, count, layer0, h,
                                 gW, gb):
        """(gW[l], gb[l]) = dense_vjp_params(L[l_first + p l_stride], D[p], U[u_first + p], h),
        l = layer0 + p, p < count: two launches (weights, biases), no pointer arrays."""
        count = self._count(check_stacked_grads("dense", U, u_first, count, gW, layer0, D, gb,
                                                L, l_first, l_stride))
        if count:
            B, w = U.shape[1:]
            hh, args = self._h(h, U.dtype), (L, l_first, l_stride, D)
            if self.wide(w):  # gW[l] = (h D_p * Lam_p)^T U[u_first + p] by cuBLAS
                S = self._work("gemm_s", (count, B, w), U.dtype)
                self._elementwise("stacked_product", B * w, U.dtype, L, l_first, l_stride, D, 0,
                                  1, S, B * w, hh, count=count)
                self.launcher.gemm(S, U[u_first:u_first + count], gW[layer0:layer0 + count],
                                   trans_a=True)
            else:
                self._gemm("dense_weight_grad_stacked", w, w, count, U.dtype, *args, U,
                           u_first, layer0, gW, B, w, hh)
            self._launch("bias_grad_stacked", U.dtype, (w, count, 1),
                         (self.geometry["REDUCE"], 1, 1), *args, layer0, gb, B, w, 1, hh)

    def conv_deriv_stacked(self, U, first, count, K, b, layer0, act, D):
        """As :meth:`dense_deriv_stacked` for conv states (one launch)."""
        count = self._count(check_stacked_grads("conv", U, first, count, K, layer0, D, b))
        if count:
            B, C, H, Wd = U.shape[1:]
            self._gemm("conv_deriv_stacked", C, B * H * Wd, count, U.dtype, U, first, K, b,
                       layer0, D, B, C, H, Wd, operator.index(act))

    def conv_vjp_params_stacked(self, L, l_first, l_stride, D, U, u_first, count, layer0, h,
                                gK, gb):
        """As :meth:`dense_vjp_params_stacked` for conv states (two launches)."""
        count = self._count(check_stacked_grads("conv", U, u_first, count, gK, layer0, D, gb, L,
                                                l_first, l_stride))
        if count:
            B, C, H, Wd = U.shape[1:]
            hh, args, red = self._h(h, U.dtype), (L, l_first, l_stride, D), \
                (self.geometry["REDUCE"], 1, 1)
            self._kernel_grad("conv_kernel_grad_stacked", args + (U, u_first), (B, C, H, Wd),
                              B * H * Wd, C, C * 9, count, None, layer0, gK, hh)
            self._launch("bias_grad_stacked", U.dtype, (C, count, 1), red, *args, layer0, gb, B,
                         C, H * Wd, hh)

    # ------------------------------------------------------------------------- pooling, loss
    def avgpool_forward(self, u, p):
        """(B, C, p, p) window means of u (B, C, H, W)."""
        B, C, H, Wd = u.shape
        v = self._empty((B, C, p, p), u.dtype)
        self._elementwise("avgpool_forward", B * C * p * p, u.dtype, u, v, B, C, H, Wd, p)
        return v

    def avgpool_vjp(self, g, H, Wd):
        """Adjoint of :meth:`avgpool_forward`: (B, C, H, W)."""
        B, C, p = g.shape[:3]
        gu = self._empty((B, C, H, Wd), g.dtype)
        self._elementwise("avgpool_vjp", B * C * H * Wd, g.dtype, g, gu, B, C, H, Wd, p)
        return gu

    def softmax_xent(self, logits, y):
        """(mean loss, dlogits (B, K)); y (B,) int64 of the same array module. The loss is a
        0-d array of the logits' dtype (on a GPU it stays on the device until asked for)."""
        B, K = logits.shape
        g = self._empty((B, K), logits.dtype)
        rows = self._empty((B,), logits.dtype)
        self._launch("softmax_xent", logits.dtype, (B, 1, 1), (self.geometry["REDUCE"], 1, 1),
                     logits, y, g, rows, B, K)
        return rows.mean(out=self._empty((), logits.dtype)), g

    # ------------------------------------------------------------ batch norm + activation
    def _bn_reduce(self, name, z, *arrays):
        """Two (C,) outputs of the per-channel reduction ``name`` over z-shaped ``arrays``."""
        B, C, S = bn_dims(z)
        outs = (self._empty((C,), z.dtype), self._empty((C,), z.dtype))
        self._launch(name, z.dtype, (C, 1, 1), (self.geometry["REDUCE"], 1, 1), *arrays, *outs,
                     B, C, S)
        return outs

    def dropout_mask(self, seed, step, layer, sample0, batch, n_elements, threshold, out=None):
        """:func:`mgnn.backend.counter_rng.dropout_mask` in one launch of kernels/rng.cu."""
        from .counter_rng import launch_dropout_mask
        return launch_dropout_mask(self, seed, step, layer, sample0, batch, n_elements,
                                   threshold, out=out)

    def bn_stats(self, z):
        """Per-channel (mean (C,), m2 (C,)) of z (B, C, ...); contract of
        :func:`mgnn.backend.numpy_ref.bn_stats`. One block per channel."""
        return self._bn_reduce("bn_stats", z, z)

    def bn_act_forward(self, z, mean, invstd, gamma, beta, act):
        """(a, xhat, deriv) shaped like z; contract of
        :func:`mgnn.backend.numpy_ref.bn_act_forward`. One elementwise launch."""
        B, C, S = bn_dims(z)
        outs = tuple(self._empty(z.shape, z.dtype) for _ in range(3))
        self._elementwise("bn_act_forward", z.size, z.dtype, z, mean, invstd, gamma, beta, *outs,
                          z.size, C, S, act)
        return outs

    def bn_act_vjp_sums(self, ga, deriv, xhat):
        """Per-channel (s1, s2) (C,); contract of :func:`mgnn.backend.numpy_ref.bn_act_vjp_sums`.
        One block per channel."""
        return self._bn_reduce("bn_act_vjp_sums", ga, ga, deriv, xhat)

    def bn_act_vjp_input(self, ga, deriv, xhat, invstd, gamma, s1, s2, count):
        """gz shaped like z; contract of :func:`mgnn.backend.numpy_ref.bn_act_vjp_input`. One
        elementwise launch."""
        B, C, S = bn_dims(ga)
        gz = self._empty(ga.shape, ga.dtype)
        self._elementwise("bn_act_vjp_input", ga.size, ga.dtype, ga, deriv, xhat, invstd, gamma,
                          s1, s2, gz, ga.size, C, S, self._h(_int("count", count), ga.dtype))
        return gz

    # ------------------------------------------------------------ recurrent gate epilogues
    # Contracts of mgnn.backend.numpy_ref (RECURRENT_KERNELS); one elementwise launch of
    # kernels/recurrent.cu each, over the B*H elements of h.
    def gru_gates_forward(self, gi, gh, h, dt, mode):
        """(h_next (B, H), cache (B, 4, H)); contract of
        :func:`mgnn.backend.numpy_ref.gru_gates_forward`."""
        B, H, dt, mode = gate_check(h, dt, mode, gi=(gi, 3), gh=(gh, 3))
        outs = self._empty((B, H), h.dtype), self._empty((B, 4, H), h.dtype)
        self._elementwise("gru_gates_forward", B * H, h.dtype, gi, gh, h, *outs, B * H, H, dt,
                          mode)
        return outs

    def gru_gates_vjp(self, g, h, cache, dt, mode):
        """(dh_direct (B, H), dgi (B, 3H), dgh (B, 3H)); contract of
        :func:`mgnn.backend.numpy_ref.gru_gates_vjp`."""
        B, H, dt, mode = gate_check(h, dt, mode, g=(g, 1), cache=(cache, (4,)))
        outs = (self._empty((B, H), h.dtype), self._empty((B, 3 * H), h.dtype),
                self._empty((B, 3 * H), h.dtype))
        self._elementwise("gru_gates_vjp", B * H, h.dtype, g, h, cache, *outs, B * H, H, dt,
                          mode)
        return outs

    def rnn_gates_forward(self, gi, gh, h, dt):
        """(h_next, deriv), both (B, H); contract of
        :func:`mgnn.backend.numpy_ref.rnn_gates_forward`."""
        B, H, dt, _ = gate_check(h, dt, 0, gi=(gi, 1), gh=(gh, 1))
        outs = self._empty((B, H), h.dtype), self._empty((B, H), h.dtype)
        self._elementwise("rnn_gates_forward", B * H, h.dtype, gi, gh, h, *outs, B * H, dt)
        return outs

    def rnn_gates_vjp(self, g, h, deriv, dt):
        """(dh_direct, da), both (B, H); contract of
        :func:`mgnn.backend.numpy_ref.rnn_gates_vjp`."""
        B, H, dt, _ = gate_check(h, dt, 0, g=(g, 1), deriv=(deriv, 1))
        outs = self._empty((B, H), h.dtype), self._empty((B, H), h.dtype)
        self._elementwise("rnn_gates_vjp", B * H, h.dtype, g, deriv, *outs, B * H, dt)
        return outs


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
