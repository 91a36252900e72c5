"""The GPU backend's RawKernels (CUDA C in ``kernels/*.cu``) and their launch code.

:class:`RawBackend` implements the kernel contract of :mod:`mgnn.backend.numpy_ref` (and the
interval-batched kernels) over a *launcher*: :class:`CupyLauncher` (``cupy.RawModule`` on a GPU,
CuPy arrays) or :class:`mgnn.backend.host_emulation.EmulationLauncher` (the same CUDA C compiled
for the host, NumPy arrays). Grid and block shapes come from the launcher's geometry, which is
also compiled into the kernels (``-DMGNN_BM=...``), so both always agree.

Importing this module needs neither CuPy nor a GPU.
"""
import numpy as np

from . import kernel_dir

#: CUDA C files and the kernel templates each defines (each instantiated for float and double).
KERNEL_FILES = {
    "dense.cu": ("dense_forward", "dense_forward_batched", "dense_vjp_input",
                 "dense_vjp_input_batched", "dense_weight_grad", "dense_weight_grad_batched",
                 "bias_grad", "bias_grad_batched"),
    "conv.cu": ("conv_forward", "conv_forward_batched", "conv_vjp_input",
                "conv_vjp_input_batched", "conv_kernel_grad", "conv_kernel_grad_batched"),
    "head.cu": ("avgpool_forward", "avgpool_vjp", "softmax_xent"),
    "vector.cu": ("residual_batched", "combine_batched"),
}

#: Launch geometry on a GPU (see kernels/common.cuh): 64 x 64 GEMM tiles of 16-deep stages,
#: 4 x 4 outputs per thread (256 threads), 256-thread reductions and elementwise blocks.
GPU_GEOMETRY = {"BM": 64, "BN": 64, "BK": 16, "TM": 4, "TN": 4, "REDUCE": 256, "ELEM": 256,
                "MAX_GRID": 65535}


def module_source(fname):
    """CUDA C of ``kernels/<fname>`` with its ``#include "common.cuh"`` replaced by the header's
    text (what CupyLauncher and the NVRTC check compile)."""
    kdir = kernel_dir()
    with open(f"{kdir}/common.cuh") as fh:
        header = fh.read()
    with open(f"{kdir}/{fname}") as fh:
        code = fh.read()
    return code.replace('#include "common.cuh"', header)


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


#: Most problems one batched launch takes (the grid's y / z extent).
MAX_BATCH = 65535


def _check_count(count):
    if count > MAX_BATCH:
        raise ValueError(f"{count} states in one batched launch exceed CUDA's grid limit of "
                         f"{MAX_BATCH}; use more ranks or fewer layers per rank")


def _cdiv(a, b):
    return -(-a // b)


class RawBackend:
    """The kernel contract of :mod:`mgnn.backend.numpy_ref` over a RawKernel launcher.

    Arrays are the launcher's (``self.xp``: CuPy on a GPU, NumPy under emulation), C-contiguous,
    all of one dtype. Outputs are new arrays of ``xp`` unless ``out`` is given. With
    ``poison_outputs`` (tests), every new output is filled with NaN before the launch, so an
    element a kernel fails to write shows up.
    """

    batched_relaxation = True

    def __init__(self, launcher, name="cuda"):
        self.launcher, self.xp, self.name = launcher, launcher.xp, name
        self.geometry = launcher.geometry
        self.poison_outputs = False

    # ------------------------------------------------------------------------------ plumbing
    def _empty(self, shape, dtype):
        out = self.xp.empty(shape, dtype=dtype)
        if self.poison_outputs:
            out.fill(np.nan)
        return out

    def _launch(self, name, dtype, grid, block, *args):
        self.launcher.launch(name, np.dtype(dtype), grid, block, args)

    def _gemm(self, name, M, N, count, dtype, *args):
        g = self.geometry
        threads = (g["BM"] // g["TM"]) * (g["BN"] // g["TN"])
        self._launch(name, dtype, (_cdiv(N, g["BN"]), _cdiv(M, g["BM"]), count), (threads, 1, 1),
                     *args)

    def _elementwise(self, name, total, dtype, *args, count=1):
        g = self.geometry
        blocks = max(1, min(_cdiv(total, g["ELEM"]), g["MAX_GRID"]))
        self._launch(name, dtype, (blocks, count, 1), (g["ELEM"], 1, 1), *args)

    def _outputs(self, count, shape, dtype):
        """``count`` new arrays of ``shape`` -- views into one allocation -- and the device array
        of their addresses (computed, not gathered: no per-array work on the host)."""
        _check_count(count)
        stack = self._empty((count,) + tuple(shape), dtype)
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
        for n in range(N):
            self._gemm("dense_forward", B, w, 1, U.dtype, U[n], W[n], b[n], U[n + 1],
                       D[n] if D.shape[0] else None, B, w, w, hh, act, 1)

    def dense_sweep_backward(self, U, D, W, h, lam, gW, gb):
        """Adjoint of :meth:`dense_sweep_forward`; returns lam_0, fills gW and gb."""
        for n in range(W.shape[0] - 1, -1, -1):
            self.dense_vjp_params(lam, D[n], U[n], h, out=(gW[n], gb[n]))
            lam = self.dense_vjp_input(lam, D[n], W[n], h, True)
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
        self._elementwise("conv_forward", B * Co * H * Wd, x.dtype, x, K, b, y, d, B, Ci, Co, H,
                          Wd, self._h(h, x.dtype), act, int(residual))
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
        self._elementwise("conv_vjp_input", B * Ci * H * Wd, gy.dtype, gy, deriv, K, gx, B, Ci,
                          Co, H, Wd, self._h(h, gy.dtype), int(residual))
        return gx

    def conv_vjp_params(self, gy, deriv, x, h):
        """(gK (co, ci, 3, 3), gb (co,)) with s = sigma' * gy."""
        B, Co, H, Wd = gy.shape
        Ci = x.shape[1]
        gK = self._empty((Co, Ci, 3, 3), gy.dtype)
        gb = self._empty((Co,), gy.dtype)
        hh = self._h(h, gy.dtype)
        red = (self.geometry["REDUCE"], 1, 1)
        self._launch("conv_kernel_grad", gy.dtype, (Co * Ci * 9, 1, 1), red, gy, deriv, x, gK, B,
                     Ci, Co, H, Wd, hh)
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
        self._elementwise("conv_forward_batched", B * C * H * Wd, dt, self._pointers(xs), K, b,
                          ptr_y, ptr_d, self._pointers(gs), self._layers(layers), B, C, H, Wd,
                          self._h(h, dt), act, count=len(xs))
        return ys, ds

    def conv_vjp_input_batched(self, gys, derivs, K, layers, h, gs=None):
        """One launch for len(gys) residual conv state vjps [+ gs[p]]."""
        B, C, H, Wd = gys[0].shape
        dt = gys[0].dtype
        gxs, ptr_gx = self._outputs(len(gys), gys[0].shape, dt)
        self._elementwise("conv_vjp_input_batched", B * C * H * Wd, dt, self._pointers(gys),
                          self._pointers(derivs), K, ptr_gx, self._pointers(gs),
                          self._layers(layers), B, C, H, Wd, self._h(h, dt), count=len(gys))
        return gxs

    def conv_deriv_batched(self, xs, K, b, layers, act):
        """[sigma'(conv3x3(xs[p], K_l) + b_l)] for l = layers[p], one launch."""
        if not xs:
            return []
        B, C, H, Wd = xs[0].shape
        dt = xs[0].dtype
        ds, ptr_d = self._outputs(len(xs), xs[0].shape, dt)
        self._elementwise("conv_forward_batched", B * C * H * Wd, dt, self._pointers(xs), K, b,
                          None, ptr_d, None, self._layers(layers), B, C, H, Wd, self._h(1.0, dt),
                          act, count=len(xs))
        return ds

    def conv_vjp_params_batched(self, gys, derivs, xs, layers, h, gK, gb):
        """In place, two launches: gK[l], gb[l] of every (state, layer) pair (layers distinct)."""
        if not xs:
            return
        B, C, H, Wd = xs[0].shape
        dt = xs[0].dtype
        hh, ptr_g, ptr_d = self._h(h, dt), self._pointers(gys), self._pointers(derivs)
        lay, red = self._layers(layers), (self.geometry["REDUCE"], 1, 1)
        self._launch("conv_kernel_grad_batched", dt, (C * C * 9, len(xs), 1), red, ptr_g, ptr_d,
                     self._pointers(xs), gK, lay, B, C, H, Wd, hh)
        self._launch("bias_grad_batched", dt, (C, len(xs), 1), red, ptr_g, ptr_d, gb, lay, B, C,
                     H * Wd, hh)

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
        return rows.mean(), g


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
