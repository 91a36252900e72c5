"""3D 3x3x3 convolution steps (PyTorch's Conv3d layout): the reference kernels and their checks."""

import numpy as np

from .activations import _act, _act_deriv


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
