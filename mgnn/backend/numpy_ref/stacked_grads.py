"""The stacked gradient kernels' contract (:data:`mgnn.backend.STACKED_GRAD_KERNELS`), checks
and reference loops."""

from .stacked import _STATE_NDIM, _int


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
