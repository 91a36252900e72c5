"""The plumbing every kernel family of :class:`..RawBackend` uses: outputs, workspaces,
launches, GEMMs, pointer arrays, graph capture."""
import contextlib
import operator

import numpy as np

from .launch import KGRAD_PART_MAX, KGRAD_SPLIT, gemm_min_width_default
from .plans import _cdiv, _check_count


class RawBase:
    """The plumbing of :class:`mgnn.backend.cupy_raw.RawBackend` (its kernel families are
    mixins beside this module)."""

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
