"""NumPy reference backend: slow, obvious, the test oracle for every other backend.

Conventions shared by every backend (see :mod:`mgnn.backend`):

* arrays are C-contiguous float32 or float64, all of one dtype; ``h`` is a scalar of that dtype;
* ``act`` is an integer activation code (0 tanh, 1 relu, 2 identity; see ``mgnn._config``);
* ``residual`` selects ``y = x + h sigma(z)`` (a residual step) or ``y = h sigma(z)`` (opening
  layers and affine closings use ``h = 1``);
* ``deriv`` is ``sigma'(z)`` at the pre-activation ``z``, shape of ``y``.
"""
import math
import operator

import numpy as np

name = "numpy"
xp = np  #: array module of this backend
batched_relaxation = False  #: MGRIT advances F-intervals one by one here
stacked_states = True  #: has the stacked-state kernels (:data:`mgnn.backend.STACKED_KERNELS`)


def _act(z, act):
    if act == 0:
        return np.tanh(z)
    if act == 1:
        return np.maximum(z, 0)
    return z.copy()


def _act_deriv(z, act):
    if act == 0:
        t = np.tanh(z)
        return 1 - t * t
    if act == 1:
        return (z > 0).astype(z.dtype)
    return np.ones_like(z)


# --------------------------------------------------------------------------------------- dense
def _dense_z(x, W, b):
    return x @ W.T + b


def dense_forward(x, W, b, h, act, residual):
    """y = [x +] h sigma(x W^T + b).

    x (B, i), W (o, i), b (o,), y (B, o); o == i when ``residual``.
    """
    y = h * _act(_dense_z(x, W, b), act)
    return x + y if residual else y


def dense_forward_deriv(x, W, b, h, act, residual):
    """:func:`dense_forward` and ``sigma'(z)`` (B, o) for a later vjp."""
    z = _dense_z(x, W, b)
    y = h * _act(z, act)
    return (x + y if residual else y), _act_deriv(z, act)


def dense_deriv(x, W, b, act):
    """sigma'(x W^T + b), (B, o)."""
    return _act_deriv(_dense_z(x, W, b), act)


def dense_vjp_input(gy, deriv, W, h, residual):
    """gx = [gy +] h (sigma' * gy) W, (B, i)."""
    gx = h * ((deriv * gy) @ W)
    return gy + gx if residual else gx


def dense_vjp(gy, deriv, x, W, h, residual):
    """(gx (B, i), gW = h s^T x (o, i), gb = h sum_B s (o,)) with s = sigma' * gy."""
    s = deriv * gy
    gx = h * (s @ W)
    return (gy + gx if residual else gx), h * (s.T @ x), h * s.sum(axis=0)


def dense_vjp_params(gy, deriv, x, h):
    """(gW = h s^T x (o, i), gb = h sum_B s (o,)) with s = sigma' * gy (no input gradient)."""
    s = deriv * gy
    return h * (s.T @ x), h * s.sum(axis=0)


def dense_sweep_forward(U, W, b, h, act, D):
    """Residual steps n = 0..N-1 in place: U[n+1] = U[n] + h sigma(U[n] W[n]^T + b[n]).

    U (N+1, B, w) with U[0] set; W (N, w, w); b (N, w); D (N, B, w) receives sigma'(z_n), or has
    length 0 to skip storing it.
    """
    for n in range(W.shape[0]):
        if D.shape[0]:
            U[n + 1], D[n] = dense_forward_deriv(U[n], W[n], b[n], h, act, True)
        else:
            U[n + 1] = dense_forward(U[n], W[n], b[n], h, act, True)


def dense_sweep_backward(U, D, W, h, lam, gW, gb):
    """Adjoint of :func:`dense_sweep_forward`: returns lam_0 (B, w) from lam = lam_N.

    U (N+1, B, w) and D (N, B, w) from the forward sweep; gW (N, w, w) and gb (N, w) are
    overwritten with the parameter gradients.
    """
    for n in range(W.shape[0] - 1, -1, -1):
        lam, gW[n], gb[n] = dense_vjp(lam, D[n], U[n], W[n], h, True)
    return lam


# ---------------------------------------------------------------------------------------- conv
def _conv3x3(x, K):
    """Cross-correlation, padding 1: x (B, ci, H, W), K (co, ci, 3, 3) -> (B, co, H, W)."""
    B, _, H, Wd = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.zeros((B, K.shape[0], H, Wd), dtype=x.dtype)
    for dy in range(3):
        for dx in range(3):
            out += np.einsum("bchw,oc->bohw", xp[:, :, dy:dy + H, dx:dx + Wd], K[:, :, dy, dx])
    return out


def _conv3x3_transpose(s, K):
    """Adjoint of :func:`_conv3x3` in x: s (B, co, H, W) -> (B, ci, H, W)."""
    B, _, H, Wd = s.shape
    gp = np.zeros((B, K.shape[1], H + 2, Wd + 2), dtype=s.dtype)
    for dy in range(3):
        for dx in range(3):
            gp[:, :, dy:dy + H, dx:dx + Wd] += np.einsum("bohw,oc->bchw", s, K[:, :, dy, dx])
    return gp[:, :, 1:-1, 1:-1]


def _conv3x3_kernel_grad(s, x):
    """Adjoint of :func:`_conv3x3` in K: (co, ci, 3, 3)."""
    H, Wd = x.shape[2:]
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    gK = np.empty((s.shape[1], x.shape[1], 3, 3), dtype=x.dtype)
    for dy in range(3):
        for dx in range(3):
            gK[:, :, dy, dx] = np.einsum("bohw,bchw->oc", s, xp[:, :, dy:dy + H, dx:dx + Wd])
    return gK


def _conv_z(x, K, b):
    return _conv3x3(x, K) + b[None, :, None, None]


def conv_forward(x, K, b, h, act, residual):
    """y = [x +] h sigma(conv3x3(x, K) + b); x (B, ci, H, W), K (co, ci, 3, 3), b (co,)."""
    y = h * _act(_conv_z(x, K, b), act)
    return x + y if residual else y


def conv_forward_deriv(x, K, b, h, act, residual):
    """:func:`conv_forward` and sigma'(z) (B, co, H, W)."""
    z = _conv_z(x, K, b)
    y = h * _act(z, act)
    return (x + y if residual else y), _act_deriv(z, act)


def conv_deriv(x, K, b, act):
    """sigma'(conv3x3(x, K) + b), (B, co, H, W)."""
    return _act_deriv(_conv_z(x, K, b), act)


def conv_vjp_input(gy, deriv, K, h, residual):
    """gx = [gy +] h conv3x3^T(sigma' * gy, K), (B, ci, H, W)."""
    gx = h * _conv3x3_transpose(deriv * gy, K)
    return gy + gx if residual else gx


def conv_vjp(gy, deriv, x, K, h, residual):
    """(gx (B, ci, H, W), gK (co, ci, 3, 3), gb (co,)) with s = sigma' * gy."""
    s = deriv * gy
    gx = h * _conv3x3_transpose(s, K)
    return ((gy + gx if residual else gx), h * _conv3x3_kernel_grad(s, x),
            h * s.sum(axis=(0, 2, 3)))


def conv_vjp_params(gy, deriv, x, h):
    """(gK (co, ci, 3, 3), gb (co,)) with s = sigma' * gy (no input gradient)."""
    s = deriv * gy
    return h * _conv3x3_kernel_grad(s, x), h * s.sum(axis=(0, 2, 3))


# -------------------------------------------------------------------------------------- conv3d
# The 3D twins of the conv kernels: 3x3x3 cross-correlation, zero padding 1, stride 1, NCDHW
# states x (B, ci, D, H, W), kernels K (co, ci, 3, 3, 3) (PyTorch's Conv3d layout), b (co,).
_TAPS3 = tuple((dz, dy, dx) for dz in range(3) for dy in range(3) for dx in range(3))


def _conv3_arg(name, a, first):
    """``a`` must be a C-contiguous float32/float64 array (of the dtype of the array ``first``
    (name, array) when given): its shape."""
    shape, dt = getattr(a, "shape", None), getattr(a, "dtype", None)
    if shape is None or dt is None or not hasattr(a, "flags"):
        raise TypeError(f"{name} must be an array, got {type(a).__name__}")
    if dt.char not in "fd":
        raise TypeError(f"{name} has dtype {dt}, expected float32 or float64")
    if first is not None and dt != first[1].dtype:
        raise TypeError(f"{name} has dtype {dt}, expected {first[1].dtype} (the dtype of "
                        f"{first[0]})")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return shape


def conv3d_check(x=None, K=None, b=None, gy=None, deriv=None, h=None, act=None, residual=False):
    """Validate the arguments of a conv3d kernel in O(1) checks (NumPy or CuPy arrays).

    ``x`` (B, ci, D, H, W), ``K`` (co, ci, 3, 3, 3), ``b`` (co,), ``gy`` and ``deriv``
    (B, co, D, H, W): C-contiguous, all float32 or all float64; the ones given must agree in B,
    ci, co and (D, H, W); ``residual`` needs ci == co; ``act`` 0, 1 or 2; ``h`` a real scalar.

    Returns
    -------
    h as a scalar of the arrays' dtype (None if ``h`` is None).

    Raises
    ------
    TypeError
        A non-array, a dtype other than float32/float64 or different dtypes, a non-real ``h``.
    ValueError
        A wrong rank or shape, a non-contiguous array, channel / size mismatches, unknown ``act``.
    """
    first, shapes = None, {}
    for name, a in (("x", x), ("gy", gy), ("deriv", deriv), ("K", K), ("b", b)):
        if a is not None:
            shapes[name] = _conv3_arg(name, a, first)
            first = first or (name, a)
    for name in ("x", "gy", "deriv"):
        if name in shapes and len(shapes[name]) != 5:
            want = "(B, ci, D, H, W)" if name == "x" else "(B, co, D, H, W)"
            raise ValueError(f"{name} has shape {shapes[name]}, expected {want}: conv3d states "
                             "are NCDHW")
    if "K" in shapes and (len(shapes["K"]) != 5 or shapes["K"][2:] != (3, 3, 3)):
        raise ValueError(f"K has shape {shapes['K']}, expected (co, ci, 3, 3, 3)")
    if "deriv" in shapes and shapes["deriv"] != shapes["gy"]:
        raise ValueError(f"deriv has shape {shapes['deriv']}, expected {shapes['gy']} (that of "
                         "gy)")
    ci = shapes["x"][1] if "x" in shapes else (shapes["K"][1] if "K" in shapes else None)
    co = shapes["gy"][1] if "gy" in shapes else (shapes["K"][0] if "K" in shapes else None)
    if "K" in shapes and shapes["K"][:2] != (co, ci):
        raise ValueError(f"K has shape {shapes['K']}, expected ({co}, {ci}, 3, 3, 3): (co, ci) "
                         "must match the channels of gy and x")
    if "b" in shapes and shapes["b"] != (co,):
        raise ValueError(f"b has shape {shapes['b']}, expected ({co},)")
    if "x" in shapes and "gy" in shapes:
        sx, sg = shapes["x"], shapes["gy"]
        if sx[0] != sg[0] or sx[2:] != sg[2:]:
            raise ValueError(f"x has shape {sx} but gy {sg}: batch and (D, H, W) must agree")
    if residual and ci != co:
        raise ValueError(f"residual=True needs as many input as output channels, got ci={ci}, "
                         f"co={co}")
    if act is not None and (isinstance(act, (bool, np.bool_))
                            or not isinstance(act, (int, np.integer)) or act not in (0, 1, 2)):
        raise ValueError(f"unknown activation code act={act!r}; expected 0, 1 or 2")
    if h is None:
        return None
    if isinstance(h, (bool, np.bool_)) or not isinstance(h, (int, float, np.integer,
                                                              np.floating)):
        raise TypeError(f"h must be a real scalar, got {h!r}")
    return first[1].dtype.type(h)


def _conv3x3x3(x, K):
    """Cross-correlation, padding 1: x (B, ci, D, H, W), K (co, ci, 3, 3, 3) -> (B, co, D, H, W)."""
    B, _, D, H, Wd = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1), (1, 1)))
    out = np.zeros((B, K.shape[0], D, H, Wd), dtype=x.dtype)
    for dz, dy, dx in _TAPS3:
        out += np.einsum("bcdhw,oc->bodhw", xp[:, :, dz:dz + D, dy:dy + H, dx:dx + Wd],
                         K[:, :, dz, dy, dx])
    return out


def _conv3x3x3_transpose(s, K):
    """Adjoint of :func:`_conv3x3x3` in x: s (B, co, D, H, W) -> (B, ci, D, H, W)."""
    B, _, D, H, Wd = s.shape
    gp = np.zeros((B, K.shape[1], D + 2, H + 2, Wd + 2), dtype=s.dtype)
    for dz, dy, dx in _TAPS3:
        gp[:, :, dz:dz + D, dy:dy + H, dx:dx + Wd] += np.einsum("bodhw,oc->bcdhw", s,
                                                                K[:, :, dz, dy, dx])
    return gp[:, :, 1:-1, 1:-1, 1:-1]


def _conv3x3x3_kernel_grad(s, x):
    """Adjoint of :func:`_conv3x3x3` in K: (co, ci, 3, 3, 3)."""
    D, H, Wd = x.shape[2:]
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1), (1, 1)))
    gK = np.empty((s.shape[1], x.shape[1], 3, 3, 3), dtype=x.dtype)
    for dz, dy, dx in _TAPS3:
        gK[:, :, dz, dy, dx] = np.einsum("bodhw,bcdhw->oc", s,
                                         xp[:, :, dz:dz + D, dy:dy + H, dx:dx + Wd])
    return gK


def _conv3d_z(x, K, b):
    return _conv3x3x3(x, K) + b[None, :, None, None, None]


def conv3d_forward(x, K, b, h, act, residual):
    """y = [x +] h sigma(conv3x3x3(x, K) + b), (B, co, D, H, W); x (B, ci, D, H, W),
    K (co, ci, 3, 3, 3), b (co,); co == ci when ``residual``."""
    h = conv3d_check(x=x, K=K, b=b, h=h, act=act, residual=residual)
    y = h * _act(_conv3d_z(x, K, b), act)
    return x + y if residual else y


def conv3d_forward_deriv(x, K, b, h, act, residual):
    """:func:`conv3d_forward` and sigma'(z) (B, co, D, H, W)."""
    h = conv3d_check(x=x, K=K, b=b, h=h, act=act, residual=residual)
    z = _conv3d_z(x, K, b)
    y = h * _act(z, act)
    return (x + y if residual else y), _act_deriv(z, act)


def conv3d_deriv(x, K, b, act):
    """sigma'(conv3x3x3(x, K) + b), (B, co, D, H, W)."""
    conv3d_check(x=x, K=K, b=b, act=act)
    return _act_deriv(_conv3d_z(x, K, b), act)


def conv3d_vjp_input(gy, deriv, K, h, residual):
    """gx = [gy +] h conv3x3x3^T(sigma' * gy, K), (B, ci, D, H, W); gy, deriv (B, co, D, H, W)."""
    h = conv3d_check(K=K, gy=gy, deriv=deriv, h=h, residual=residual)
    gx = h * _conv3x3x3_transpose(deriv * gy, K)
    return gy + gx if residual else gx


def conv3d_vjp(gy, deriv, x, K, h, residual):
    """(gx (B, ci, D, H, W), gK (co, ci, 3, 3, 3), gb (co,)) with s = sigma' * gy."""
    h = conv3d_check(x=x, K=K, gy=gy, deriv=deriv, h=h, residual=residual)
    s = deriv * gy
    gx = h * _conv3x3x3_transpose(s, K)
    return ((gy + gx if residual else gx), h * _conv3x3x3_kernel_grad(s, x),
            h * s.sum(axis=(0, 2, 3, 4)))


def conv3d_vjp_params(gy, deriv, x, h):
    """(gK (co, ci, 3, 3, 3), gb (co,)) with s = sigma' * gy (no input gradient)."""
    h = conv3d_check(x=x, gy=gy, deriv=deriv, h=h)
    s = deriv * gy
    return h * _conv3x3x3_kernel_grad(s, x), h * s.sum(axis=(0, 2, 3, 4))


# ------------------------------------------------------------------------------ pooling, loss
def avgpool_forward(u, p):
    """Average pool to a (p, p) grid: u (B, C, H, W) with H, W divisible by p -> (B, C, p, p)."""
    B, C, H, Wd = u.shape
    return u.reshape(B, C, p, H // p, p, Wd // p).mean(axis=(3, 5))


def avgpool_vjp(g, H, Wd):
    """Adjoint of :func:`avgpool_forward`: g (B, C, p, p) -> (B, C, H, W)."""
    p = g.shape[2]
    scale = g.dtype.type(1.0 / ((H // p) * (Wd // p)))
    return np.repeat(np.repeat(g, H // p, axis=2), Wd // p, axis=3) * scale


def softmax_xent(logits, y):
    """Mean softmax cross-entropy and its gradient.

    logits (B, K) float, y (B,) int64 in [0, K) -> (loss: float of logits' dtype, dlogits (B, K)).
    """
    B = logits.shape[0]
    m = logits.max(axis=1, keepdims=True)
    e = np.exp(logits - m)
    ssum = e.sum(axis=1, keepdims=True)
    logp = logits - m - np.log(ssum)
    loss = -logp[np.arange(B), y].mean()
    g = e / ssum
    g[np.arange(B), y] -= 1
    return logits.dtype.type(loss), g / logits.dtype.type(B)


# ------------------------------------------------------------------- interval-batched steps
def _export_batched():
    import sys
    from .batched_loops import batched_kernels
    globals().update(batched_kernels(sys.modules[__name__]))


_export_batched()


# --------------------------------------------------------------------- stacked-state kernels
# The solver keeps a level's states in one C-contiguous array U (m, *state) ("slots"); the step
# into slot i maps U[i-1] to U[i] with the layer l_i = layer0 + i * layer_step (layer_step may be
# negative) and step size h. For kind k in ('dense', 'conv'), all in place:
#   k_chains_forward(U, G, W, b, chains, layer0, layer_step, h, act)
#       chains (n, 2) int of independent (first slot, length); for i in first..first+length-1:
#       U[i] = Phi_{l_i}(U[i-1]) [+ G[i]]  (order (x + h sigma) + g; G None or like U);
#   k_points_forward(U, G, R, W, b, slots, out_slots, layer0, layer_step, h, act, mode) -> float
#       phi = Phi_{l_i}(U[i-1]) for i = slots[p] (U only read) into R[o], o = out_slots[p]
#       (distinct; R is not U): mode 0 R[o] = (phi - U[i]) [+ G[i]], returns sum ||R[o]||^2
#       accumulated in float64; mode 1 R[o] = (R[o] + U[i]) - phi; mode 2 R[o] = phi [+ G[i]];
#   k_chains_adjoint(L, G, W, D, d0, chains, layer0, layer_step, h),
#   k_points_adjoint(L, G, R, W, D, d0, slots, out_slots, layer0, layer_step, h, mode) -> float
#       the same with the adjoint step lam + h (D_l * lam) W_l (conv: conv_vjp_input), D[l - d0]
#       holding sigma' of layer l.
# Modes 1 and 2 return 0.0. A backend that has these sets ``stacked_states = True``.
_STATE_NDIM = {"dense": 3, "conv": 5}


def _int(what, v):
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {v!r}") from None


def _array(what, a, dtype, shape):
    """``a`` must be a C-contiguous ndarray of ``dtype`` and ``shape`` (None entries: any)."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{what} must be a NumPy array, got {type(a).__name__}")
    if a.dtype is not dtype and a.dtype != dtype:
        raise TypeError(f"{what} has dtype {a.dtype}, expected {dtype} (the dtype of U)")
    if a.ndim != len(shape) or a.shape[1:] != shape[1:] or shape[0] not in (None, a.shape[0]):
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise ValueError(f"{what} has shape {a.shape}, expected {want}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")


def _index_array(what, a, ndim):
    a = np.asarray(a)
    if a.dtype.kind not in "iu" and a.size:
        raise TypeError(f"{what} must be an integer array, got dtype {a.dtype}")
    if a.ndim != ndim or (ndim == 2 and a.shape[1] != 2):
        want = "(n, 2)" if ndim == 2 else "(n,)"
        raise ValueError(f"{what} has shape {a.shape}, expected {want}")
    return a if a.dtype == np.int64 and a.flags.c_contiguous else a.astype(np.int64, order="C")


def index_check(idx, outs, m, n_out):
    """Bounds of the chains (``idx`` (n, 2), ``outs`` empty) or points (``idx`` (n, 1) slots,
    ``outs`` (n,)) of a stacked kernel on U with m slots and R with n_out: ``(code, k, lo, hi)``,
    code 0 (valid; lo..hi the slots stepped into, lo > hi if none) or the first fault: 1 chain k
    has a negative length, 2 chain k leaves slots 1..m-1, 3 chain k overlaps or reads what an
    earlier one (by first slot) writes, 4 slot k outside 1..m-1, 5 out slot k outside R, 6 out
    slot value k repeated. Vectorised NumPy; the numba backend has a compiled twin."""
    first = idx[:, 0]
    n = idx[:, 1] if idx.shape[1] == 2 else np.ones_like(first)
    live = n > 0
    for code, bad in ((1, n < 0), (2 if idx.shape[1] == 2 else 4,
                                   live & ((first < 1) | (first + n > m))),
                      (5, (outs < 0) | (outs >= n_out))):
        if bad.any():
            return code, int(np.flatnonzero(bad)[0]), 0, -1
    rows = np.flatnonzero(live)
    if not rows.size:
        return 0, 0, 1, 0
    rows = rows[np.argsort(first[rows], kind="stable")]
    clash = first[rows[1:]] <= (first + n)[rows[:-1]]
    if idx.shape[1] == 2 and clash.any():
        return 3, int(rows[1:][np.flatnonzero(clash)[0]]), 0, -1
    srt = np.sort(outs)
    dup = np.flatnonzero(srt[1:] == srt[:-1])
    if dup.size:
        return 6, int(srt[dup[0]]), 0, -1
    return 0, 0, int(first[rows[0]]), int((first + n)[rows].max()) - 1


_INDEX_FAULTS = {1: "has a negative length", 2: "(first, length) leaves the slots 1..{m} of {s}",
                 3: "overlaps or reads a slot another chain writes (chains must be independent)",
                 4: "is not a slot 1..{m} of {s}", 5: "is not a slot 0..{r} of R"}
_NO_OUTS = np.zeros(0, dtype=np.int64)


def check_stacked(kind, U, G, W, P, idx, layer0, layer_step, h, act=None, R=None, out=None,
                  mode=None, d0=None, index_check=index_check):
    """Validate the arguments of a stacked kernel of ``kind`` ('dense' / 'conv') in O(1) checks plus
    one bounds check of the chains / slots (``index_check``); raises TypeError / ValueError
    naming the value.

    ``P`` is b (forward, ``d0`` None) or D (adjoint); ``idx`` the chains (``R`` None) or the slots
    (points, with ``out`` the out_slots). Returns ``(idx, outs, h)``: ``idx`` int64 (n, 2)
    chains or (n, 1) slots, ``outs`` int64 (empty for chains: a step writes its own slot) and
    ``h`` as a scalar of U's dtype.
    """
    if not isinstance(U, np.ndarray):
        raise TypeError(f"U must be a NumPy array, got {type(U).__name__}")
    if U.dtype.char not in "fd":
        raise TypeError(f"U has dtype {U.dtype}, expected float32 or float64")
    if U.ndim != _STATE_NDIM[kind]:
        raise ValueError(f"U has shape {U.shape}; {kind} states stacked are "
                         f"{'(m, B, w)' if kind == 'dense' else '(m, B, C, H, W)'}")
    dt, m, state = U.dtype, U.shape[0], U.shape[1:]
    if not U.flags.c_contiguous:
        raise ValueError("U must be C-contiguous")
    c = state[1]
    _array("W", W, dt, (None, c, c) if kind == "dense" else (None, c, c, 3, 3))
    N = W.shape[0]
    if d0 is None:
        _array("b", P, dt, (N, c))
        lo, hi = 0, N
    else:
        d0 = _int("d0", d0)
        _array("D", P, dt, (None,) + state)
        lo, hi = max(0, d0), min(N, d0 + P.shape[0])
    if G is not None:
        _array("G", G, dt, U.shape)
    if act is not None and act not in (0, 1, 2):
        raise ValueError(f"unknown activation code act={act!r}; expected 0, 1 or 2")
    layer0, layer_step = _int("layer0", layer0), _int("layer_step", layer_step)
    if not isinstance(h, (float, int, np.floating, np.integer)):
        raise TypeError(f"h must be a real scalar, got {h!r}")
    if R is None:
        what, idx, outs, n_out = "chains", _index_array("chains", idx, 2), _NO_OUTS, 0
    else:
        _array("R", R, dt, (None,) + state)
        if np.may_share_memory(R, U):
            raise ValueError("R shares memory with U; the output must be a different array")
        if mode not in (0, 1, 2):
            raise ValueError(f"unknown mode {mode!r}; expected 0 (residual), 1 (FAS), 2 (plain)")
        what, idx = "slots", _index_array("slots", idx, 1)[:, None]
        outs, n_out = _index_array("out_slots", out, 1), R.shape[0]
        if outs.shape[0] != idx.shape[0]:
            raise ValueError(f"out_slots has shape {outs.shape}, slots {idx.shape[:1]}")
    code, k, lo_i, hi_i = index_check(idx, outs, m, n_out)
    if code == 6:
        raise ValueError(f"out_slots {outs.tolist()} repeats slot {k} of R")
    if code:
        name, arr = ("out_slots", outs) if code == 5 else (what, idx if R is None else idx[:, 0])
        why = _INDEX_FAULTS[code].format(m=m - 1, r=n_out - 1, s="U")
        raise ValueError(f"{name}[{k}] = {arr[k].tolist()} {why}")
    if lo_i <= hi_i:
        for i in (lo_i, hi_i):  # l is linear in i: the extreme slots bound the layers
            if not lo <= layer0 + i * layer_step < hi:
                src = "W / b" if d0 is None else f"W / D (layers d0={d0}..{d0 + P.shape[0] - 1})"
                raise ValueError(f"the step into slot {i} uses layer {layer0 + i * layer_step} "
                                 f"(layer0={layer0}, layer_step={layer_step}), not in {src}")
    return idx, outs, dt.type(h)


def _points_out(phi, U, G, R, i, o, mode):
    """R[o] from phi for point i in ``mode`` (see STACKED_KERNELS); ||R[o]||^2 in mode 0."""
    if mode == 1:
        R[o] += U[i]
        R[o] -= phi
        return 0.0
    if mode == 0:
        np.subtract(phi, U[i], out=R[o])
    else:
        R[o] = phi
    if G is not None:
        R[o] += G[i]
    if mode:
        return 0.0
    r = R[o].astype(np.float64).ravel()
    return float(r @ r)


def stacked_loops(bk):
    """{name: function}: the 8 stacked kernels as loops over the single-step kernels of backend
    module ``bk`` (``k_forward`` / ``k_vjp_input``), plus NumPy arithmetic in the stated order."""
    fns = {}
    for kind in ("dense", "conv"):
        fns.update(_stacked_kind(bk, kind))
    return fns


def _stacked_kind(bk, kind):
    fwd, vjp = getattr(bk, f"{kind}_forward"), getattr(bk, f"{kind}_vjp_input")

    def fwd_step(U, W, b, layer0, layer_step, h, act):
        return lambda i: fwd(U[i - 1], W[layer0 + i * layer_step], b[layer0 + i * layer_step],
                             h, act, True)

    def adj_step(L, W, D, d0, layer0, layer_step, h):
        return lambda i: vjp(L[i - 1], D[layer0 + i * layer_step - d0],
                             W[layer0 + i * layer_step], h, True)

    def run_chains(step, U, G, chains):
        for first, n in chains.tolist():
            for i in range(first, first + n):
                y = step(i)
                U[i] = y if G is None else y + G[i]

    def run_points(step, U, G, R, slots, outs, mode):
        return float(sum(_points_out(step(i), U, G, R, i, o, mode)
                         for i, o in zip(slots[:, 0].tolist(), outs.tolist())))

    def chains_forward(U, G, W, b, chains, layer0, layer_step, h, act):
        chains, _, h = check_stacked(kind, U, G, W, b, chains, layer0, layer_step, h, act)
        run_chains(fwd_step(U, W, b, layer0, layer_step, h, act), U, G, chains)

    def points_forward(U, G, R, W, b, slots, out_slots, layer0, layer_step, h, act, mode):
        s, o, h = check_stacked(kind, U, G, W, b, slots, layer0, layer_step, h, act, R,
                                out_slots, mode)
        return run_points(fwd_step(U, W, b, layer0, layer_step, h, act), U, G, R, s, o, mode)

    def chains_adjoint(L, G, W, D, d0, chains, layer0, layer_step, h):
        chains, _, h = check_stacked(kind, L, G, W, D, chains, layer0, layer_step, h, d0=d0)
        run_chains(adj_step(L, W, D, d0, layer0, layer_step, h), L, G, chains)

    def points_adjoint(L, G, R, W, D, d0, slots, out_slots, layer0, layer_step, h, mode):
        s, o, h = check_stacked(kind, L, G, W, D, slots, layer0, layer_step, h, None, R,
                                out_slots, mode, d0)
        return run_points(adj_step(L, W, D, d0, layer0, layer_step, h), L, G, R, s, o, mode)

    fns = {}
    for fn in (chains_forward, points_forward, chains_adjoint, points_adjoint):
        fn.__name__ = fn.__qualname__ = f"{kind}_{fn.__name__}"
        fn.__doc__ = (f"Stacked ``{fn.__name__}`` as a loop of ``{bk.__name__}`` single steps "
                      f"(contract: :data:`mgnn.backend.STACKED_KERNELS`).")
        fns[fn.__name__] = fn
    return fns


def _export_stacked():
    import sys
    globals().update(stacked_loops(sys.modules[__name__]))


_export_stacked()


# ------------------------------------------------------------ stacked gradient kernels
# sigma' and parameter gradients of `count` consecutive layers l = layer0 + p (p < count) read
# from stacked states by slot arithmetic (:data:`mgnn.backend.STACKED_GRAD_KERNELS`), for kind k
# in ('dense', 'conv'):
#   k_deriv_stacked(U, first, count, W, b, layer0, act, D)
#       D[p] = k_deriv(U[first + p], W[l], b[l], act)          D (>= count, *state), written
#   k_vjp_params_stacked(L, l_first, l_stride, D, U, u_first, count, layer0, h, gW, gb)
#       (gW[l], gb[l]) = k_vjp_params(L[l_first + p l_stride], D[p], U[u_first + p], h)
#       (l_stride may be negative: an adjoint stored in reversed index has l_stride -1)
# A backend that has them sets ``stacked_states = True`` and defines all four.
def check_stacked_grads(kind, U, first, count, P, layer0, D, b, L=None, l_first=0, l_stride=1):
    """Validate the arguments of a stacked gradient kernel of ``kind`` ('dense' / 'conv') in O(1)
    checks (any array module); ``P``, ``b`` are W, b (deriv) or gW, gb (vjp_params), ``L`` the
    adjoint states of vjp_params (None for deriv). Returns ``count`` as an int; TypeError /
    ValueError naming the value."""
    dt = getattr(U, "dtype", None)
    if dt is None or dt.char not in "fd" or U.ndim != _STATE_NDIM[kind]:
        raise TypeError(f"U must be a float32/float64 stack of {kind} states "
                        f"({_STATE_NDIM[kind]}-d), got {dt} {getattr(U, 'shape', type(U))}")
    state, c = U.shape[1:], U.shape[2]
    per = (c, c) if kind == "dense" else (c, c, 3, 3)
    named = {"U": U, "D": D, "W": P, "b": b} if L is None else {"U": U, "D": D, "L": L,
                                                                 "gW": P, "gb": b}
    for name, a in named.items():
        want = {"U": state, "D": state, "L": state, "W": per, "gW": per, "b": (c,),
                "gb": (c,)}[name]
        if (getattr(a, "dtype", None) != dt or a.shape[1:] != want
                or not a.flags.c_contiguous):
            raise ValueError(f"{name} must be a C-contiguous {dt} array of shape (*, "
                             f"{', '.join(map(str, want))}), got {getattr(a, 'dtype', None)} "
                             f"{getattr(a, 'shape', type(a).__name__)}")
    first, count, layer0 = _int("first", first), _int("count", count), _int("layer0", layer0)
    l_first, l_stride = _int("l_first", l_first), _int("l_stride", l_stride)
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if not count:
        return 0
    what = "u_first" if L is not None else "first"
    checks = [(what, first, first + count - 1, U.shape[0], "slots of U"),
              ("layer0", layer0, layer0 + count - 1, min(P.shape[0], b.shape[0]), "layers"),
              ("count", 0, count - 1, D.shape[0], "rows of D")]
    if L is not None:
        last = l_first + (count - 1) * l_stride
        checks.append(("l_first", min(l_first, last), max(l_first, last), L.shape[0],
                       f"slots of L (l_stride={l_stride})"))
    for name, lo, hi, n, of in checks:
        if lo < 0 or hi >= n:
            raise ValueError(f"{name}: {lo}..{hi} out of range of the {n} {of} (count={count})")
    return count


def stacked_grad_loops(bk):
    """{name: function}: the 4 stacked gradient kernels as loops over the single kernels
    ``k_deriv`` / ``k_vjp_params`` of backend module ``bk``."""
    fns = {}
    for kind in ("dense", "conv"):
        deriv, vjp_params = getattr(bk, f"{kind}_deriv"), getattr(bk, f"{kind}_vjp_params")

        def deriv_stacked(U, first, count, W, b, layer0, act, D, kind=kind, deriv=deriv):
            count = check_stacked_grads(kind, U, first, count, W, layer0, D, b)
            for p in range(count):
                D[p] = deriv(U[first + p], W[layer0 + p], b[layer0 + p], act)

        def vjp_params_stacked(L, l_first, l_stride, D, U, u_first, count, layer0, h, gW, gb,
                               kind=kind, vjp_params=vjp_params):
            count = check_stacked_grads(kind, U, u_first, count, gW, layer0, D, gb, L, l_first,
                                        l_stride)
            h = U.dtype.type(h)
            for p in range(count):
                gW[layer0 + p], gb[layer0 + p] = vjp_params(L[l_first + p * l_stride], D[p],
                                                            U[u_first + p], h)

        for fn in (deriv_stacked, vjp_params_stacked):
            fn.__name__ = fn.__qualname__ = f"{kind}_{fn.__name__}"
            fn.__doc__ = (f"Stacked ``{fn.__name__}`` as a loop of ``{bk.__name__}`` single "
                          f"kernels (contract: :data:`mgnn.backend.STACKED_GRAD_KERNELS`).")
            fns[fn.__name__] = fn
    return fns


def _export_stacked_grads():
    import sys
    globals().update(stacked_grad_loops(sys.modules[__name__]))


_export_stacked_grads()


# ------------------------------------------------------------ batch norm + activation
# The fused path of a block BN -> sigma (:data:`mgnn.backend.BN_KERNELS`, PyTorch semantics): z is
# (B, C) (dense) or (B, C, H, W) (conv), channel axis 1, statistics per channel c over the other
# axes, M = B (dense) or B H W elements per channel; mean, invstd, gamma, beta, s1, s2 are (C,);
# everything is of z's dtype (float32 sums are accumulated in float64).
def bn_dims(z):
    """(B, C, S) of a BN input z (B, C, *spatial): S = prod(spatial) (1 for dense)."""
    if z.ndim < 2:
        raise ValueError(f"batch norm needs z of shape (B, C, ...), got shape {z.shape}")
    B, C = z.shape[:2]
    return B, C, (z.size // (B * C) if B * C else 0)


def _chan(v, z):
    """Per-channel v (C,) broadcast against z (B, C, ...)."""
    return v.reshape((1, -1) + (1,) * (z.ndim - 2))


def _chan_axes(z):
    return (0,) + tuple(range(2, z.ndim))


def bn_stats(z):
    """Per-channel (mean (C,), m2 (C,)) of z (B, C, ...): the mean and the sum of squared
    deviations from it (two-pass, in float64), so that the biased variance is m2 / M."""
    bn_dims(z)
    z64 = z.astype(np.float64)
    mean = z64.mean(axis=_chan_axes(z))
    m2 = ((z64 - _chan(mean, z)) ** 2).sum(axis=_chan_axes(z))
    return mean.astype(z.dtype), m2.astype(z.dtype)


def bn_act_forward(z, mean, invstd, gamma, beta, act):
    """(a, xhat, deriv), each shaped like z (B, C, ...): xhat = (z - mean) invstd,
    y = gamma xhat + beta, a = sigma(y), deriv = sigma'(y); mean, invstd, gamma, beta (C,)."""
    bn_dims(z)
    xhat = (z - _chan(mean, z)) * _chan(invstd, z)
    y = _chan(gamma, z) * xhat + _chan(beta, z)
    return _act(y, act), xhat, _act_deriv(y, act)


def bn_act_vjp_sums(ga, deriv, xhat):
    """Per-channel (s1, s2) (C,): s1 = sum gy, s2 = sum gy xhat with gy = ga * deriv (all shaped
    like z); also the gradients of beta and gamma."""
    bn_dims(ga)
    gy = ga * deriv
    ax = _chan_axes(ga)
    return (gy.sum(axis=ax, dtype=np.float64).astype(ga.dtype),
            (gy * xhat).sum(axis=ax, dtype=np.float64).astype(ga.dtype))


def bn_act_vjp_input(ga, deriv, xhat, invstd, gamma, s1, s2, count):
    """gz = gamma invstd (gy - s1 / count - xhat s2 / count), gy = ga * deriv, shaped like z:
    the input gradient of BN -> sigma given (s1, s2) of :func:`bn_act_vjp_sums` summed over the
    ``count`` (int) elements per channel that the statistics cover (the global batch under
    synchronised BN)."""
    bn_dims(ga)
    count = _int("count", count)
    gy = ga * deriv
    return _chan(gamma * invstd, ga) * ((gy - _chan(s1 / count, ga))
                                        - xhat * _chan(s2 / count, ga))


def dropout_mask(seed, step, layer, sample0, batch, n_elements, threshold, out=None):
    """Dropout keep mask (batch, n_elements) uint8: the counter-based Philox mask of
    :func:`mgnn.backend.counter_rng.dropout_mask` (1 = keep)."""
    from .counter_rng import dropout_mask as mask
    return mask(seed, step, layer, sample0, batch, n_elements, threshold, out=out)


# ------------------------------------------------------------------ recurrent gate epilogues
# The elementwise part of a GRU / tanh-RNN cell step (:data:`mgnn.backend.RECURRENT_KERNELS`); the
# GEMMs gi = x W_ih^T + b_ih and gh = h W_hh^T + b_hh are done by the caller. GRU gates are stacked
# (r, z, n) along the last axis of gi and gh (PyTorch's layout: columns [0:H], [H:2H], [2H:3H]):
# r = sigmoid(gi_r + gh_r), z = sigmoid(gi_z + gh_z), n = tanh(gi_n + r gh_n), and
#   mode 0 (explicit): h' = h + dt (1 - z)(n - h), computed as (1 - z) n + z h when dt == 1
#                      (PyTorch's GRU);
#   mode 1 (implicit): h' = (h + dt (1 - z) n) / (1 + dt (1 - z)).
# The tanh RNN: h' = h + dt (tanh(gi + gh) - h), h' = tanh(gi + gh) when dt == 1.
# dt is a real > 0 (1 on the fine level, cf^level on coarse MGRIT levels), used in h's dtype.


def gate_check(h, dt, mode, **arrays):
    """Validate a gate-kernel call (cheap: it runs on every step); returns (B, H, dt as a Python
    float, mode).

    h must be a C-contiguous float32/float64 array (B, H); each keyword value is ``(array, k)``:
    the array must be C-contiguous of h's dtype and of shape (B, k H) for an int k, (B, k[0], H)
    for a 1-tuple k. dt: a finite real > 0; mode: 0 or 1.
    """
    shape, dtype = getattr(h, "shape", None), getattr(h, "dtype", None)
    if shape is None or len(shape) != 2 or dtype.char not in "fd" or not h.flags.c_contiguous:
        raise ValueError(f"h must be a C-contiguous float32/float64 array of shape (B, H), got "
                         f"{getattr(h, 'dtype', type(h).__name__)} {shape or ''}")
    B, H = shape
    for name, (a, k) in arrays.items():
        want = (B, k * H) if k.__class__ is int else (B, k[0], H)
        if (getattr(a, "shape", None) != want or (a.dtype is not dtype and a.dtype != dtype)
                or not a.flags.c_contiguous):
            raise ValueError(f"{name} must be a C-contiguous {dtype} array of shape {want}, "
                             f"got {getattr(a, 'dtype', type(a).__name__)} "
                             f"{getattr(a, 'shape', '')}")
    if dt.__class__ is not float:
        if isinstance(dt, (bool, np.bool_)) or not isinstance(dt, (int, float, np.integer,
                                                                    np.floating)):
            raise TypeError(f"dt must be a real number, got {dt!r}")
        dt = float(dt)
    if not (math.isfinite(dt) and dt > 0):
        raise ValueError(f"dt must be finite and > 0, got {dt!r}")
    if mode.__class__ is not int:
        mode = _int("mode", mode)
    if mode != 0 and mode != 1:
        raise ValueError(f"mode must be 0 (explicit) or 1 (implicit), got {mode!r}")
    return B, H, dt, mode


def _sigmoid(x):
    """1 / (1 + exp(-x)) without overflow: exp(-|x|) only."""
    e = np.exp(-np.abs(x))
    s = 1 / (1 + e)
    return np.where(x >= 0, s, e * s)


def gru_gates_forward(gi, gh, h, dt, mode):
    """GRU gate epilogue: (h_next (B, H), cache (B, 4, H)).

    gi, gh (B, 3H): input and hidden projections with their biases, gates (r, z, n) stacked;
    h (B, H); dt > 0; mode 0 explicit / 1 implicit (see the section comment). cache[:, 0..3] =
    r, z, n, gh_n: what :func:`gru_gates_vjp` needs.
    """
    B, H, dt, mode = gate_check(h, dt, mode, gi=(gi, 3), gh=(gh, 3))
    r = _sigmoid(gi[:, :H] + gh[:, :H])
    z = _sigmoid(gi[:, H:2 * H] + gh[:, H:2 * H])
    ghn = gh[:, 2 * H:]
    n = np.tanh(gi[:, 2 * H:] + r * ghn)
    if mode == 1:
        a = dt * (1 - z)
        h_next = (h + a * n) / (1 + a)
    elif dt == 1:
        h_next = (1 - z) * n + z * h
    else:
        h_next = h + dt * (1 - z) * (n - h)
    return h_next, np.ascontiguousarray(np.stack([r, z, n, ghn], axis=1))


def gru_gates_vjp(g, h, cache, dt, mode):
    """vjp of :func:`gru_gates_forward` with cotangent g (B, H) of h_next:
    (dh_direct (B, H), dgi (B, 3H), dgh (B, 3H)).

    dh_direct is the path h -> h_next that bypasses gh (the caller adds dgh @ W_hh); dgi, dgh are
    the cotangents of gi and gh (they differ only in the n block: dgh_n = dgi_n * r).
    """
    B, H, dt, mode = gate_check(h, dt, mode, g=(g, 1), cache=(cache, (4,)))
    r, z, n, ghn = (cache[:, k] for k in range(4))
    if mode == 1:  # h' = (h + a n) / (1 + a), a = dt (1 - z)
        a = dt * (1 - z)
        inv = 1 / (1 + a)
        c_h, c_n, c_z = inv, a * inv, -dt * (n - h) * inv * inv
    elif dt == 1:  # h' = (1 - z) n + z h
        c_h, c_n, c_z = z, 1 - z, h - n
    else:  # h' = h + dt (1 - z)(n - h)
        c_n = dt * (1 - z)
        c_h, c_z = 1 - c_n, -dt * (n - h)
    dpn = g * c_n * (1 - n * n)
    dpr = dpn * ghn * r * (1 - r)
    dpz = g * c_z * z * (1 - z)
    return (g * c_h, np.concatenate([dpr, dpz, dpn], axis=1),
            np.concatenate([dpr, dpz, dpn * r], axis=1))


def rnn_gates_forward(gi, gh, h, dt):
    """tanh-RNN epilogue: (h_next, deriv), both (B, H): t = tanh(gi + gh), h_next = h + dt (t - h)
    (= t when dt == 1), deriv = 1 - t^2; gi, gh, h (B, H), dt > 0."""
    B, H, dt, _ = gate_check(h, dt, 0, gi=(gi, 1), gh=(gh, 1))
    t = np.tanh(gi + gh)
    return (t if dt == 1 else h + dt * (t - h)), 1 - t * t


def rnn_gates_vjp(g, h, deriv, dt):
    """vjp of :func:`rnn_gates_forward` with cotangent g (B, H): (dh_direct, da), both (B, H):
    dh_direct = (1 - dt) g (the path bypassing gh), da = dt g deriv (the cotangent of gi and of
    gh). h (B, H) is only checked (kept for the GRU's signature)."""
    B, H, dt, _ = gate_check(h, dt, 0, g=(g, 1), deriv=(deriv, 1))
    return g * (1 - dt), g * dt * deriv


# --- whole-sequence recurrent sweeps (serial training: one call per sequence) ----------------
# cell 0 = GRU (gates r, z, n; caches (B, 4H): r, z, n, gh_n), 1 = tanh RNN (caches (B, H):
# 1 - tanh^2). Layer k of step n reads layer k-1's new hidden state (layer 0 the input
# projection gi0[:, n], computed outside: it does not depend on the state).

def _recurrent_arrays(cell, dtype, arrays):
    """ValueError naming the first of ``arrays`` ({name: (array, shape)}) that is not a
    C-contiguous float32/float64 array of ``dtype`` and its shape; checks ``cell``."""
    if isinstance(cell, bool) or cell not in (0, 1):
        raise ValueError(f"cell must be 0 (GRU) or 1 (RNN), got {cell!r}")
    for name, (a, shape) in arrays.items():
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array, got {type(a).__name__}")
        if a.shape != tuple(shape) or a.dtype != dtype or \
                a.dtype.char not in "fd" or not a.flags.c_contiguous:
            raise ValueError(f"{name} must be a C-contiguous {dtype} array of shape "
                             f"{tuple(shape)}, got {getattr(a, 'dtype', type(a).__name__)} "
                             f"{getattr(a, 'shape', '')}")


def _step_rule(dt, mode):
    if isinstance(dt, bool) or not isinstance(dt, (int, float, np.floating, np.integer)) or \
            not np.isfinite(dt) or dt <= 0:
        raise ValueError(f"dt must be a finite real > 0, got {dt!r}")
    if isinstance(mode, bool) or mode not in (0, 1):
        raise ValueError(f"mode must be 0 (explicit) or 1 (implicit), got {mode!r}")


def _point_mode(point_mode):
    """ValueError unless ``point_mode`` is None (chains) or a STACKED_KERNELS mode 0, 1, 2."""
    if point_mode is not None and (isinstance(point_mode, bool) or point_mode not in (0, 1, 2)):
        raise ValueError(f"unknown mode {point_mode!r}; expected 0 (residual), 1 (FAS), 2 (plain)")


def _distinct(written, read):
    """ValueError naming the first array of ``written`` ({name: array}) that shares memory with
    another written one or with one of ``read`` (None entries skipped): a kernel's outputs
    must not alias each other or its inputs."""
    items = [(n, a) for n, a in written.items() if a is not None]
    others = [(n, a) for n, a in read.items() if a is not None]
    for k, (name, a) in enumerate(items):
        for other, b in items[k + 1:] + others:
            if other != name and np.may_share_memory(a, b):
                raise ValueError(f"{name} shares memory with {other}; the kernel writes {name}, "
                                 "so it must be a different array")


def _rec_stack_args(cell, S, G, R, want, dt, mode, point_mode, layer0, layer_step):
    """The checks every stacked recurrent call on the stack S (m, B, nl, H) shares: the arrays
    of ``want`` ({name: (array, shape)}), G like S or None, R (r, B, nl, H) or None, the update
    rule and the point mode; returns (layer0, layer_step) as ints."""
    want = dict(want)
    if G is not None:
        want["G"] = (G, S.shape)
    if R is not None:
        want["R"] = (R, (getattr(R, "shape", (0,))[0],) + S.shape[1:])
    _recurrent_arrays(cell, S.dtype, want)
    _step_rule(dt, mode)
    _point_mode(point_mode)
    return _int("layer0", layer0), _int("layer_step", layer_step)


def _rec_indices(idx, outs, m, R, what_m, index_check):
    """The int64 chains (n, 2) (``R`` None) or (slots (n,), out slots (n,)) of a stacked
    recurrent call on a stack of m slots; ValueError naming the first bad entry. Returns
    (idx or (slots, outs), lo, hi): slots lo..hi are stepped into (lo > hi: none)."""
    if R is None:
        idx = _index_array("chains", idx, 2)
        code, k, lo, hi = index_check(idx, _NO_OUTS, m, 0)
    else:
        idx = _index_array("slots", idx, 1)
        outs = _index_array("out_slots", outs, 1)
        if outs.shape != idx.shape:
            raise ValueError(f"out_slots has shape {outs.shape}, slots {idx.shape}")
        code, k, lo, hi = index_check(idx[:, None], outs, m, R.shape[0])
    if code == 6:
        raise ValueError(f"bad out_slots: {outs.tolist()} repeats slot {k} of R")
    if code:
        what = "chains" if R is None else ("out_slots" if code == 5 else "slots")
        why = _INDEX_FAULTS[code].format(m=m - 1, r=(0 if R is None else R.shape[0]) - 1,
                                         s=what_m)
        raise ValueError(f"bad {what}: entry {k} {why}")
    return (idx if R is None else (idx, outs)), lo, hi


def _weights(cell, nl, H, WihT, WhhT, bih, bhh):
    GH = (3 if cell == 0 else 1) * H
    return {"WihT": (WihT, (nl, H, GH)), "WhhT": (WhhT, (nl, H, GH)), "bih": (bih, (nl, GH)),
            "bhh": (bhh, (nl, GH))}


def recurrent_sweep_check(cell, gi0, U, WihT, WhhT, bih, bhh, D, dt=1.0, mode=0):
    """Validate a sweep call; returns (L, B, nl, H, G). Shapes: gi0 (B, L, G H), U (L + 1, B,
    nl, H), WihT / WhhT (nl, H, G H) (WihT[0] unused), bih / bhh (nl, G H), D (L, nl, B, C H)
    with C = 4 (GRU) or 1 (RNN), or a 0-length first axis (no caches). One float dtype, all
    C-contiguous; dt > 0, mode 0 or 1."""
    _recurrent_arrays(cell, getattr(U, "dtype", None), {"U": (U, getattr(U, "shape", ()))})
    if U.ndim != 4:
        raise ValueError(f"U must be (L + 1, B, nl, H), got shape {U.shape}")
    L1, B, nl, H = U.shape
    G, C = (3, 4) if cell == 0 else (1, 1)
    want = {"gi0": (gi0, (B, L1 - 1, G * H)), **_weights(cell, nl, H, WihT, WhhT, bih, bhh)}
    if D.shape[0]:
        want["D"] = (D, (L1 - 1, nl, B, C * H))
    _recurrent_arrays(cell, U.dtype, want)
    _step_rule(dt, mode)
    _distinct({"U": U, "D": D}, {"gi0": gi0, "WhhT": WhhT})
    return L1 - 1, B, nl, H, G


def recurrent_sweep_back_check(cell, lam, U, D, Wih, Whh, dt, mode, DGI, DGH):
    """Validate a backward sweep call (shapes as :func:`recurrent_sweep_backward` documents)."""
    _recurrent_arrays(cell, getattr(U, "dtype", None), {"U": (U, getattr(U, "shape", ()))})
    if U.ndim != 4:
        raise ValueError(f"U must be (L + 1, B, nl, H), got shape {U.shape}")
    L1, B, nl, H = U.shape
    GH, C = (3 * H, 4) if cell == 0 else (H, 1)
    _recurrent_arrays(cell, U.dtype, {
        "lam": (lam, (B, nl, H)), "D": (D, (L1 - 1, nl, B, C * H)), "Wih": (Wih, (nl, GH, H)),
        "Whh": (Whh, (nl, GH, H)), "DGI": (DGI, (L1 - 1, nl, B, GH)),
        "DGH": (DGH, (L1 - 1, nl, B, GH))})
    _step_rule(dt, mode)
    _distinct({"DGI": DGI, "DGH": DGH}, {"lam": lam, "U": U, "D": D})


def recurrent_sweep_forward(cell, gi0, U, WihT, WhhT, bih, bhh, D, dt, mode):
    """U[n + 1] = the step of every layer out of U[n] for n = 0..L-1 (in place), and D[n, k]
    the gate caches (if D has L rows). Reference: the gate kernels step after step."""
    L = recurrent_sweep_check(cell, gi0, U, WihT, WhhT, bih, bhh, D, dt, mode)[0]
    for n in range(L):
        U[n + 1], caches = _rec_step(cell, U[n], gi0[:, n], WihT, WhhT, bih, bhh, dt, mode)
        if D.shape[0]:
            D[n] = np.stack(caches)


def recurrent_sweep_backward(cell, lam, U, D, Wih, Whh, dt, mode, DGI, DGH):
    """The adjoint sweep of :func:`recurrent_sweep_forward` from the cotangent ``lam`` (B, nl, H)
    of U[L]: returns that of U[0]; DGI[n, k], DGH[n, k] (L, nl, B, G H) receive the cotangents of
    the input and hidden projections of layer k at step n (the parameter gradients are GEMMs of
    them). Wih / Whh (nl, G H, H) (Wih[0] unused); D the forward's caches."""
    lam = np.ascontiguousarray(lam)
    recurrent_sweep_back_check(cell, lam, U, D, Wih, Whh, dt, mode, DGI, DGH)
    for n in range(D.shape[0] - 1, -1, -1):
        lam, dgis, dghs = _rec_back(cell, lam, U[n], D[n], Wih, Whh, dt, mode)
        DGI[n], DGH[n] = np.stack(dgis), np.stack(dghs)
    return lam


def _rec_step(cell, src, gi_t, WihT, WhhT, bih, bhh, dt, mode):
    """(dst, caches): every layer's cell out of src (B, nl, H) with layer 0's input projection
    gi_t (B, G H); caches[k] (B, C H) the gate cache of layer k."""
    dst, caches = np.empty_like(src), []
    inp = None
    for k in range(src.shape[1]):
        gi = np.ascontiguousarray(gi_t if k == 0 else inp @ WihT[k] + bih[k])
        hk = np.ascontiguousarray(src[:, k])
        gh = hk @ WhhT[k] + bhh[k]
        out, cache = (gru_gates_forward(gi, gh, hk, dt, mode) if cell == 0 else
                      rnn_gates_forward(gi, gh, hk, dt))
        dst[:, k] = out
        caches.append(cache.reshape(src.shape[0], -1))
        inp = out
    return dst, caches


def recurrent_stacked_check(cell, gi0, U, G, R, idx, layer0, layer_step, WihT, WhhT, bih, bhh,
                            dt, mode, out_slots=None, point_mode=None, index_check=index_check):
    """Validate a stacked recurrent kernel call (chains when R is None, else points); returns
    the int64 chains (n, 2), or (slots (n,), out slots (n,)). U (m, B, nl, H), G like U or
    None, R (r, B, nl, H) not sharing U's memory, gi0 (B, L, G H) and the weights as in
    :func:`recurrent_sweep_check`. The time step into slot i is layer0 + i layer_step, inside
    0..L-1."""
    _recurrent_arrays(cell, getattr(U, "dtype", None), {"U": (U, getattr(U, "shape", ()))})
    if U.ndim != 4:
        raise ValueError(f"U must be a stack (m, B, nl, H), got shape {U.shape}")
    m, B, nl, H = U.shape
    GH = (3 if cell == 0 else 1) * H
    gi_shape = tuple(getattr(gi0, "shape", ()))
    L = gi_shape[1] if len(gi_shape) == 3 else -1  # any sequence length; -1 fails the check
    want = {"gi0": (gi0, (B, L, GH)), **_weights(cell, nl, H, WihT, WhhT, bih, bhh)}
    layer0, layer_step = _rec_stack_args(cell, U, G, R, want, dt, mode, point_mode, layer0,
                                         layer_step)
    _distinct({"U": U if R is None else None, "R": R}, {"U": U, "G": G, "gi0": gi0})
    idx, lo, hi = _rec_indices(idx, out_slots, m, R, "U", index_check)
    if lo <= hi:
        for i in (lo, hi):
            if not 0 <= layer0 + i * layer_step < L:
                raise ValueError(f"the step into slot {i} uses time step {layer0 + i * layer_step}"
                                 f" (layer0={layer0}, layer_step={layer_step}), not in 0..{L - 1}")
    return idx


def recurrent_chains_forward(cell, gi0, U, G, chains, layer0, layer_step, WihT, WhhT, bih, bhh,
                             dt, mode):
    """Stacked relaxation of a recurrent model: along each chain (first slot, length) U[i] =
    the cells of time step layer0 + i layer_step out of U[i - 1] (+ G[i]); arrays as in
    :func:`recurrent_sweep_forward`, dt / mode the update rule of the level's step."""
    chains = recurrent_stacked_check(cell, gi0, U, G, None, chains, layer0, layer_step, WihT,
                                     WhhT, bih, bhh, dt, mode)
    for first, n in chains.tolist():
        for i in range(first, first + n):
            t = layer0 + i * layer_step
            y = _rec_step(cell, U[i - 1], gi0[:, t], WihT, WhhT, bih, bhh, dt, mode)[0]
            U[i] = y if G is None else y + G[i]


def recurrent_points_forward(cell, gi0, U, G, R, slots, out_slots, layer0, layer_step, WihT,
                             WhhT, bih, bhh, dt, mode, point_mode):
    """The step into each of U's ``slots`` combined into R's ``out_slots`` (point_mode 0
    residual, returns the squared norm; 1 FAS; 2 plain: STACKED_KERNELS' modes)."""
    slots, outs = recurrent_stacked_check(cell, gi0, U, G, R, slots, layer0, layer_step, WihT,
                                          WhhT, bih, bhh, dt, mode, out_slots, point_mode)
    r2 = 0.0
    for i, o in zip(slots.tolist(), outs.tolist()):
        t = layer0 + i * layer_step
        phi = _rec_step(cell, U[i - 1], gi0[:, t], WihT, WhhT, bih, bhh, dt, mode)[0]
        r2 += _points_out(phi, U, G, R, i, o, point_mode)
    return r2


# --- the stacked adjoint of a recurrent model (the MGRIT adjoint solve, one call per sweep) ---
# The linearisation of time step t is its gate caches D[t - d0] (nl, B, C H) at the forward state
# U[t + u_off] (B, nl, H) (slots of the forward solve's store); the vjp of step t with the update
# rule (dt, mode) of the level's step size maps the cotangent of u_{t+1} to that of u_t.

def _rec_back(cell, lam, Ut, Dt, Wih, Whh, dt, mode):
    """(cotangent of u_t (B, nl, H), [dgi_k], [dgh_k] (B, G H) for k = 0..nl-1) from the
    cotangent ``lam`` (B, nl, H) of u_{t+1}, the state Ut (B, nl, H) and the caches Dt
    (nl, B, C H) of step t: the gate kernels layer after layer, last layer first."""
    B, nl, H = lam.shape
    out, dgis, dghs = np.empty_like(lam), [None] * nl, [None] * nl
    carry = None  # cotangent of layer k's new hidden state from layer k+1's input
    for k in range(nl - 1, -1, -1):
        g = np.ascontiguousarray(lam[:, k]) if carry is None else lam[:, k] + carry
        hk = np.ascontiguousarray(Ut[:, k])
        if cell == 0:
            dh, dgi, dgh = gru_gates_vjp(g, hk, Dt[k].reshape(B, 4, H), dt, mode)
        else:
            dh, dgi = rnn_gates_vjp(g, hk, np.ascontiguousarray(Dt[k]), dt)
            dgh = dgi
        out[:, k] = dh + dgh @ Whh[k]
        dgis[k], dghs[k] = dgi, dgh
        carry = dgi @ Wih[k] if k > 0 else None
    return out, dgis, dghs


def _rec_lin_arrays(cell, L, U, D, Wih, Whh):
    """Validate the stack L (m, B, nl, H), the states U (k, B, nl, H), the caches D
    (nd, nl, B, C H) and Wih / Whh (nl, G H, H); returns (B, nl, H)."""
    _recurrent_arrays(cell, getattr(L, "dtype", None), {"L": (L, getattr(L, "shape", ()))})
    if L.ndim != 4:
        raise ValueError(f"L must be a stack (m, B, nl, H), got shape {L.shape}")
    _, B, nl, H = L.shape
    GH, C = (3 * H, 4) if cell == 0 else (H, 1)
    _recurrent_arrays(cell, L.dtype, {
        "U": (U, (getattr(U, "shape", (0,))[0], B, nl, H)),
        "D": (D, (getattr(D, "shape", (0,))[0], nl, B, C * H)),
        "Wih": (Wih, (nl, GH, H)), "Whh": (Whh, (nl, GH, H))})
    return B, nl, H


def _rec_rows(first, last, u_off, d0, U, D):
    """ValueError unless time steps first..last (first <= last) have states U[t + u_off] and
    caches D[t - d0]."""
    for t in (first, last):
        if not 0 <= t + u_off < U.shape[0]:
            raise ValueError(f"time step {t} reads state row {t + u_off} (u_off={u_off}), not in "
                             f"0..{U.shape[0] - 1}")
        if not 0 <= t - d0 < D.shape[0]:
            raise ValueError(f"time step {t} reads cache row {t - d0} (d0={d0}), not in "
                             f"0..{D.shape[0] - 1}")


def recurrent_adjoint_check(cell, L, G, R, idx, layer0, layer_step, U, u_off, D, d0, Wih, Whh,
                            dt, mode, out_slots=None, point_mode=None, index_check=index_check):
    """Validate a stacked recurrent adjoint call (chains when R is None, else points); returns
    the int64 chains (n, 2), or (slots (n,), out slots (n,)). L (m, B, nl, H) the adjoint
    stack, G like L or None, R (r, B, nl, H) not sharing L's memory; the step into slot i is
    the vjp of time step t = layer0 + i layer_step at the state U[t + u_off] with the caches
    D[t - d0] (see :func:`recurrent_chains_adjoint`)."""
    B, nl, H = _rec_lin_arrays(cell, L, U, D, Wih, Whh)
    layer0, layer_step = _rec_stack_args(cell, L, G, R, {}, dt, mode, point_mode, layer0,
                                         layer_step)
    u_off, d0 = _int("u_off", u_off), _int("d0", d0)
    _distinct({"L": L if R is None else None, "R": R}, {"L": L, "G": G, "U": U, "D": D})
    idx, lo, hi = _rec_indices(idx, out_slots, L.shape[0], R, "L", index_check)
    if lo <= hi:
        t_lo, t_hi = sorted((layer0 + lo * layer_step, layer0 + hi * layer_step))
        _rec_rows(t_lo, t_hi, u_off, d0, U, D)
    return idx


def recurrent_chains_adjoint(cell, L, G, chains, layer0, layer_step, U, u_off, D, d0, Wih, Whh,
                             dt, mode):
    """Stacked adjoint relaxation of a recurrent model: along each chain (first slot, length)
    L[i] = the vjp of time step t = layer0 + i layer_step applied to L[i - 1] (+ G[i]), at the
    state U[t + u_off] (B, nl, H) with the gate caches D[t - d0] (nl, B, C H) of
    :func:`recurrent_sweep_forward`; Wih / Whh (nl, G H, H) (Wih[0] unused), dt / mode the
    update rule of the level's step. Reference: the gate kernels step after step."""
    chains = recurrent_adjoint_check(cell, L, G, None, chains, layer0, layer_step, U, u_off, D,
                                     d0, Wih, Whh, dt, mode)
    for first, n in chains.tolist():
        for i in range(first, first + n):
            t = layer0 + i * layer_step
            y = _rec_back(cell, L[i - 1], U[t + u_off], D[t - d0], Wih, Whh, dt, mode)[0]
            L[i] = y if G is None else y + G[i]


def recurrent_points_adjoint(cell, L, G, R, slots, out_slots, layer0, layer_step, U, u_off, D,
                             d0, Wih, Whh, dt, mode, point_mode):
    """The adjoint step into each of L's ``slots`` (see :func:`recurrent_chains_adjoint`)
    combined into R's ``out_slots`` (point_mode 0 residual, returns the squared norm; 1 FAS;
    2 plain: STACKED_KERNELS' modes)."""
    slots, outs = recurrent_adjoint_check(cell, L, G, R, slots, layer0, layer_step, U, u_off, D,
                                          d0, Wih, Whh, dt, mode, out_slots, point_mode)
    r2 = 0.0
    for i, o in zip(slots.tolist(), outs.tolist()):
        t = layer0 + i * layer_step
        phi = _rec_back(cell, L[i - 1], U[t + u_off], D[t - d0], Wih, Whh, dt, mode)[0]
        r2 += _points_out(phi, L, G, R, i, o, point_mode)
    return r2


def recurrent_caches_check(cell, gi0, U, first, count, layer0, WihT, WhhT, bih, bhh, D, Y, dt,
                           mode):
    """Validate a :func:`recurrent_caches` call; returns (first, count, layer0) as ints."""
    _recurrent_arrays(cell, getattr(U, "dtype", None), {"U": (U, getattr(U, "shape", ()))})
    if U.ndim != 4:
        raise ValueError(f"U must be a stack (m, B, nl, H), got shape {U.shape}")
    m, B, nl, H = U.shape
    GH, C = (3 * H, 4) if cell == 0 else (H, 1)
    first, count, layer0 = _int("first", first), _int("count", count), _int("layer0", layer0)
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    gi_shape = tuple(getattr(gi0, "shape", ()))
    Ls = gi_shape[1] if len(gi_shape) == 3 else -1
    want = {"gi0": (gi0, (B, Ls, GH)), **_weights(cell, nl, H, WihT, WhhT, bih, bhh),
            "D": (D, (count, nl, B, C * H))}
    if getattr(Y, "shape", (None,))[0] != 0:
        want["Y"] = (Y, (count, B, nl, H))
    _recurrent_arrays(cell, U.dtype, want)
    _step_rule(dt, mode)
    _distinct({"D": D, "Y": Y}, {"U": U, "gi0": gi0})
    if count and not (0 <= first and first + count <= m):
        raise ValueError(f"slots {first}..{first + count - 1} are not slots 0..{m - 1} of U")
    if count and not (0 <= layer0 and layer0 + count <= Ls):
        raise ValueError(f"time steps {layer0}..{layer0 + count - 1} are not in 0..{Ls - 1}")
    return first, count, layer0


def recurrent_caches(cell, gi0, U, first, count, layer0, WihT, WhhT, bih, bhh, D, Y, dt, mode):
    """The linearisation of ``count`` time steps at given states: for p < count, time step
    t = layer0 + p out of the state U[first + p] (B, nl, H): D[p] (nl, B, C H) its gate caches
    and, if Y has rows, Y[p] (B, nl, H) its output (layer k's new hidden state is layer k+1's
    input, which the weight gradients read). Arrays as in :func:`recurrent_sweep_forward`."""
    first, count, layer0 = recurrent_caches_check(cell, gi0, U, first, count, layer0, WihT, WhhT,
                                                  bih, bhh, D, Y, dt, mode)
    for p in range(count):
        t = layer0 + p
        y, caches = _rec_step(cell, U[first + p], gi0[:, t], WihT, WhhT, bih, bhh, dt, mode)
        D[p] = np.stack(caches)
        if Y.shape[0]:
            Y[p] = y


def recurrent_cotangents_check(cell, L, l0, l_step, U, u0, D, d0, count, Wih, Whh, dt, mode,
                               DGI, DGH, row0):
    """Validate a :func:`recurrent_gate_cotangents` call; returns its int arguments."""
    B, nl, H = _rec_lin_arrays(cell, L, U, D, Wih, Whh)
    GH = (3 if cell == 0 else 1) * H
    ints = [_int(w, v) for w, v in (("l0", l0), ("l_step", l_step), ("u0", u0), ("d0", d0),
                                    ("count", count), ("row0", row0))]
    l0, l_step, u0, d0, count, row0 = ints
    rows = getattr(DGI, "shape", (0,))[0]
    _recurrent_arrays(cell, L.dtype, {"DGI": (DGI, (rows, nl, B, GH)),
                                      "DGH": (DGH, (rows, nl, B, GH))})
    _step_rule(dt, mode)
    _distinct({"DGI": DGI, "DGH": DGH}, {"L": L, "U": U, "D": D})
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if count:
        for what, a, step, n in (("L", l0, l_step, L.shape[0]), ("U", u0, 1, U.shape[0]),
                                 ("D", d0, 1, D.shape[0]), ("DGI", row0, 1, rows)):
            for i in (a, a + (count - 1) * step):
                if not 0 <= i < n:
                    raise ValueError(f"{what} row {i} is not in 0..{n - 1}")
    return ints


def recurrent_gate_cotangents(cell, L, l0, l_step, U, u0, D, d0, count, Wih, Whh, dt, mode, DGI,
                              DGH, row0):
    """For p < count: DGI[row0 + p, k], DGH[row0 + p, k] (B, G H) = the cotangents of layer
    k's input and hidden projections in the vjp of a step at the state U[u0 + p] with the
    caches D[d0 + p], applied to the cotangent L[l0 + p l_step] of its output (what the weight
    gradients are GEMMs of, after the adjoint solve)."""
    l0, l_step, u0, d0, count, row0 = recurrent_cotangents_check(
        cell, L, l0, l_step, U, u0, D, d0, count, Wih, Whh, dt, mode, DGI, DGH, row0)
    for p in range(count):
        _, dgis, dghs = _rec_back(cell, L[l0 + p * l_step], U[u0 + p], D[d0 + p], Wih, Whh, dt,
                                  mode)
        DGI[row0 + p], DGH[row0 + p] = np.stack(dgis), np.stack(dghs)
