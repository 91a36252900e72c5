"""Spatial grid transfer: restriction to the grid of half the resolution and interpolation back.

States are arrays (B, C, *spatial) with 2 or 3 spatial axes (the last ones), NumPy or CuPy,
float32/float64 (or complex); every function keeps the array library and the dtype and returns
a new C-contiguous array. Each applies one 1D operator per axis: on the CPU Numba passes (the
fixed windows of an even axis over the whole array, with its edge rows; the sparse rows of an
odd one), with CuPy a small dense matrix, a batched GEMM (the slice-by-slice application of
the same terms is kept as the reference, ``_apply``). The operators are tensor products of one 1D operator per spatial axis, and each
axis picks its grid convention from its size (so mixed axes work axis by axis):

* **odd** n = 2m + 1: *vertex-centred* (geometric multigrid's 2^k - 1 grids: 31 -> 15 -> 7 -> 3).
  Fine points 0..2m, coarse point i sits on fine point 2i + 1, the values outside the grid are
  zero (Dirichlet).
* **even** n = 2m: *cell-centred* (32 -> 16 -> 8). Coarse cell i covers fine cells 2i and 2i + 1.

Both coarsen n to m = n // 2 (:func:`coarse_size`); m < 1 is an error.

Interpolation P (coarse -> fine), per axis, ``interp``:

* vertex ``"linear"``: f[2i+1] = c[i], f[2i] = (c[i-1] + c[i]) / 2 with c[-1] = c[m] = 0
  (so f[0] = c[0] / 2 and f[2m] = c[m-1] / 2).
* vertex ``"nearest"``: f[j] = c[min(j // 2, m - 1)]: f[2i+1] = c[i]; f[2i], equally far from
  c[i-1] and c[i], takes the right one, c[i]; the last point f[2m] has only c[m-1].
* cell ``"linear"``: f[2i] = 3/4 c[i] + 1/4 c[i-1], f[2i+1] = 3/4 c[i] + 1/4 c[i+1], the edges
  clamped (c[-1] = c[0], c[m] = c[m-1]; so f[0] = c[0] and f[2m-1] = c[m-1]).
* cell ``"nearest"``: f[2i] = f[2i+1] = c[i].

In d dimensions the weight of a fine point is the product of the per-axis weights ((bi/tri)linear).
P maps constants to constants, except vertex-centred ``"linear"``, whose zero boundary halves the
values at the outermost fine points: on a constant, ``P 1`` is 1 at fine indices 1..2m-1 of each
vertex axis and (1/2)^k at a point that lies on index 0 or 2m of k vertex axes.

Restriction R (fine -> coarse), ``restrict``:

* ``"full"``: R = D^-1 P^T, the transpose of the matching interpolation with every row divided by
  its sum (D = diag(P^T 1), the column sums of P), so R maps constants to constants exactly. In
  1D the column sums of P are 2 for vertex ``"linear"`` (R: full weighting (1/4, 1/2, 1/4)), cell
  ``"nearest"`` (R: average pooling of each pair) and cell ``"linear"`` (R = P^T / 2: weights
  (1/8, 3/8, 3/8, 1/8) over f[2i-1..2i+2], the clamped edges fold to (1/2, 3/8, 1/8) at
  c[0]); so in d dimensions R = P^T / 2^d there. For vertex ``"nearest"`` they are 2, except 3 at
  the last coarse point: R averages f[2i], f[2i+1] into c[i] and the three points f[2m-2..2m]
  into c[m-1].
* ``"injection"``: vertex: c[i] = f[2i+1] (the coinciding point); cell: c[i] = f[2i] (the first
  cell of each pair). Independent of ``interp``.

R P = I (restriction undoes interpolation) on an axis for ``"nearest"`` (vertex or cell) with
either restriction and for injection after vertex ``"linear"``; not for ``"linear"`` with
``"full"`` (full weighting smooths) nor for cell ``"linear"`` with injection. In d dimensions
R P = I exactly when it holds on every axis.

The exact transposes R^T (:func:`restrict_transpose`) and P^T (:func:`interpolate_transpose`)
serve the adjoint solve: they are the same per-axis terms read in the other direction, so
<R u, v> = <u, R^T v> and <P e, g> = <e, P^T g> hold to round-off.
"""
import functools
import itertools
from fractions import Fraction

import numpy as np

#: Interpolation names (``interp``).
INTERPS = ("linear", "nearest")
#: Restriction names (``restrict``).
RESTRICTS = ("full", "injection")
#: Numbers of spatial axes a state may have.
SPATIAL_NDIMS = (2, 3)

_HALF, _QUARTER, _THREE_QUARTERS = Fraction(1, 2), Fraction(1, 4), Fraction(3, 4)


def coarse_size(n):
    """Size of the coarse grid of one axis of ``n`` points: n // 2.

    Odd n = 2m + 1 (vertex-centred) and even n = 2m (cell-centred) both give m.

    Raises
    ------
    TypeError
        If ``n`` is not an int.
    ValueError
        If m < 1 (n < 2), naming n.
    """
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"grid size must be an int, got {n!r}")
    m = int(n) // 2
    if m < 1:
        raise ValueError(f"grid size {n} cannot be coarsened: a coarse grid needs n >= 2 "
                         f"(odd n = 2m + 1 and even n = 2m coarsen to m)")
    return m


def coarse_shape(spatial_shape):
    """:func:`coarse_size` of every axis of ``spatial_shape`` (a tuple of 2 or 3 ints)."""
    shape = _spatial_shape(spatial_shape)
    return tuple(coarse_size(n) for n in shape)


def interpolate(e, fine_shape, interp="linear"):
    """Interpolation P: coarse states to the fine grid.

    Parameters
    ----------
    e : array (B, C, *coarse_shape(fine_shape)), float32/float64, NumPy or CuPy
    fine_shape : tuple of 2 or 3 ints, the fine spatial shape
    interp : "linear" or "nearest"

    Returns
    -------
    array (B, C, *fine_shape), e's dtype and library
    """
    fine = _spatial_shape(fine_shape)
    _check_name("interp", interp, INTERPS)
    _check_state("e", e, len(fine))
    _check_coarse("e", e, fine)
    return _transfer(e, fine, interp, None, True)


def interpolate_transpose(g, interp="linear"):
    """P^T, the exact transpose of :func:`interpolate`: fine -> coarse.

    Parameters
    ----------
    g : array (B, C, *fine) with 2 or 3 spatial axes, float32/float64, NumPy or CuPy
    interp : "linear" or "nearest"

    Returns
    -------
    array (B, C, *coarse_shape(fine)), g's dtype and library
    """
    _check_name("interp", interp, INTERPS)
    _check_state("g", g)
    fine = tuple(g.shape[2:])
    return _transfer(g, fine, interp, None, False)


def restrict(u, interp="linear", restrict="full"):
    """Restriction R: fine states to the coarse grid.

    Parameters
    ----------
    u : array (B, C, *fine) with 2 or 3 spatial axes, float32/float64, NumPy or CuPy
    interp : "linear" or "nearest", the interpolation whose transpose "full" is
    restrict : "full" (D^-1 P^T, preserves constants) or "injection"

    Returns
    -------
    array (B, C, *coarse_shape(fine)), u's dtype and library
    """
    _check_name("interp", interp, INTERPS)
    _check_name("restrict", restrict, RESTRICTS)
    _check_state("u", u)
    fine = tuple(u.shape[2:])
    return _transfer(u, fine, interp, restrict, False)


def restrict_transpose(v, fine_shape, interp="linear", restrict="full"):
    """R^T, the exact transpose of :func:`restrict`: coarse -> fine.

    Parameters
    ----------
    v : array (B, C, *coarse_shape(fine_shape)), float32/float64, NumPy or CuPy
    fine_shape : tuple of 2 or 3 ints, the fine spatial shape
    interp, restrict : as in :func:`restrict`

    Returns
    -------
    array (B, C, *fine_shape), v's dtype and library
    """
    fine = _spatial_shape(fine_shape)
    _check_name("interp", interp, INTERPS)
    _check_name("restrict", restrict, RESTRICTS)
    _check_state("v", v, len(fine))
    _check_coarse("v", v, fine)
    return _transfer(v, fine, interp, restrict, True)


# --- the 1D operators -----------------------------------------------------------------------
# A 1D operator is a list of terms (fine slice, coarse slice, weight): the matrix with
# M[fine_j, coarse_k] += weight for the paired positions (j, k) of the two slices.

def _interp_terms(n, interp):
    """Terms of the 1D interpolation matrix P (n x n // 2)."""
    m = coarse_size(n)
    every = slice(0, m)
    if n % 2:  # vertex-centred, n = 2m + 1
        if interp == "linear":
            return [(slice(1, 2 * m, 2), every, Fraction(1)),        # f[2i+1] = c[i]
                    (slice(0, 2 * m - 1, 2), every, _HALF),          # f[2i]   += c[i] / 2
                    (slice(2, 2 * m + 1, 2), every, _HALF)]          # f[2i+2] += c[i] / 2
        return [(slice(1, 2 * m, 2), every, Fraction(1)),            # f[2i+1] = c[i]
                (slice(0, 2 * m - 1, 2), every, Fraction(1)),        # f[2i]   = c[i], i < m
                (slice(2 * m, 2 * m + 1), slice(m - 1, m), Fraction(1))]  # f[2m] = c[m-1]
    if interp == "nearest":  # cell-centred, n = 2m
        return [(slice(0, 2 * m, 2), every, Fraction(1)), (slice(1, 2 * m, 2), every, Fraction(1))]
    return [(slice(0, 2 * m, 2), every, _THREE_QUARTERS),            # f[2i]   = 3/4 c[i]
            (slice(1, 2 * m, 2), every, _THREE_QUARTERS),            # f[2i+1] = 3/4 c[i]
            (slice(2, 2 * m, 2), slice(0, m - 1), _QUARTER),         # + 1/4 c[i-1], i >= 1
            (slice(0, 1), slice(0, 1), _QUARTER),                    # + 1/4 c[0] at f[0]
            (slice(1, 2 * m - 1, 2), slice(1, m), _QUARTER),         # + 1/4 c[i+1], i < m-1
            (slice(2 * m - 1, 2 * m), slice(m - 1, m), _QUARTER)]    # + 1/4 c[m-1] at f[2m-1]


def _restrict_terms(n, interp, restrict):
    """Terms of the 1D restriction matrix R (n // 2 x n), as the transposed layout (fine, coarse,
    weight) of R^T."""
    m = coarse_size(n)
    every = slice(0, m)
    if restrict == "injection":
        return [(slice(1, 2 * m, 2) if n % 2 else slice(0, 2 * m, 2), every, Fraction(1))]
    if n % 2 and interp == "nearest":  # column sums of P: 2, and 3 at the last coarse point
        third = Fraction(1, 3)
        head = slice(0, m - 1)
        last = slice(m - 1, m)
        return [(slice(0, 2 * m - 2, 2), head, _HALF),               # c[i] = (f[2i] + f[2i+1]) / 2
                (slice(1, 2 * m - 2, 2), head, _HALF),               #   for i < m - 1
                (slice(2 * m - 2, 2 * m - 1), last, third),          # c[m-1] = the mean of
                (slice(2 * m - 1, 2 * m), last, third),              #   f[2m-2], f[2m-1], f[2m]
                (slice(2 * m, 2 * m + 1), last, third)]
    return [(f, c, w / 2) for f, c, w in _interp_terms(n, interp)]  # column sums of P all 2


def _transfer(x, fine, interp, restrict, to_fine):
    """The operator of (``interp``, ``restrict``: None for P and P^T) between the spatial shape
    ``fine`` and its coarse shape, in direction ``to_fine``, applied to ``x`` (B, C, *in),
    axis by axis: NumPy float/complex arrays through :func:`_transfer_sparse`, others (CuPy)
    through :func:`_transfer_dense`; :func:`_apply` of :func:`_plan` is the reference of
    both, slice by slice."""
    xp = _array_module(x)
    if xp is np:
        if x.dtype.str[1:] in _NUMBA_DTYPES:
            return _transfer_sparse(x, fine, interp, restrict, to_fine)
        return _apply(x, x.shape[:2] + _out_shape(fine, to_fine), _plan(fine, interp, restrict,
                                                                         to_fine))
    return _transfer_dense(x, fine, interp, restrict, to_fine, xp)


_NUMBA_DTYPES = ("f4", "f8", "c8", "c16")  # the Numba pass's dtypes; others take the slices


def _out_shape(fine, to_fine):
    return tuple(fine) if to_fine else coarse_shape(fine)


def _per_axis(x, d, apply, last_first=True):
    """Contract the last ``d`` axes of ``x`` one by one, last first (or, ``last_first`` False,
    first first): ``apply(k, y3)`` maps the (pre, n_k, post) view of axis k to
    (pre, m_k, post)."""
    y = x
    for k in (reversed(range(d)) if last_first else range(d)):
        shape = y.shape
        ax = y.ndim - d + k
        pre, n = int(np.prod(shape[:ax])), shape[ax]
        z = apply(k, y.reshape(pre, n, int(np.prod(shape[ax + 1:]))))
        y = z.reshape(shape[:ax] + (z.shape[1],) + shape[ax + 1:])
    return y


def _transfer_dense(x, fine, interp, restrict, to_fine, xp):
    """:func:`_transfer` as one dense 1D matrix per axis, a (batched) GEMM each (CuPy)."""
    def apply(k, y3):
        A = _axis_matrix(fine[k], interp, restrict, to_fine, x.dtype, xp)
        if y3.shape[2] == 1:  # the last axis: one GEMM over every row
            return (y3.reshape(y3.shape[0], -1) @ A.T)[:, :, None]
        return xp.matmul(A, y3)
    return _per_axis(x, len(fine), apply)


def _transfer_sparse(x, fine, interp, restrict, to_fine):
    """:func:`_transfer` on the CPU, one Numba pass per axis. An axis of even size
    (cell-centred) runs its operator's fixed windows over the whole array at once, the edge
    rows from the sparse rows after (:func:`_structure`; (32, 8, 16, 16) float32 restricted in
    ~20 instead of 64 us a state). Other axes: the sparse rows (at most 4 terms) where rows are
    contiguous, and the last axis (every row one element apart) as one BLAS GEMM with the dense
    1D matrix (a gather per term there runs scalar: 10x slower). Towards the coarse grid the
    first axis goes first (the windows run over rows of the fine width), towards the fine grid
    the last axis."""
    from .numba_cpu import apply_axis_operator, apply_structured_axis, apply_structured_planes
    x = np.ascontiguousarray(x)
    if len(fine) == 2:  # both axes windows: one pass, a block of planes at a time
        forms = [_structure(n, interp, restrict, to_fine, x.dtype) for n in fine]
        if None not in forms:
            csrs = [_axis_csr(n, interp, restrict, to_fine, x.dtype) for n in fine]
            out = _out_shape(fine, to_fine)
            planes = x.reshape((-1,) + tuple(fine if not to_fine else coarse_shape(fine)))
            y = apply_structured_planes(planes, out[0], out[1], forms, csrs)
            return y.reshape(x.shape[:-2] + out)

    def apply(k, y3):
        form = _structure(fine[k], interp, restrict, to_fine, x.dtype)
        indptr, cols, w = _axis_csr(fine[k], interp, restrict, to_fine, x.dtype)
        if form is not None:
            return apply_structured_axis(y3, len(indptr) - 1, form, indptr, cols, w)
        if y3.shape[2] == 1:
            A = _axis_matrix(fine[k], interp, restrict, to_fine, x.dtype, np)
            return np.dot(y3.reshape(y3.shape[0], -1), A.T)[:, :, None]
        return apply_axis_operator(y3, indptr, cols, w, len(indptr) - 1)
    return _per_axis(x, len(fine), apply, last_first=to_fine)


_STRUCTURES = {}  # (n, interp, restrict, to_fine, dtype) -> the window form or None


def _structure(n, interp, restrict, to_fine, dtype):
    """The fixed-window form of one axis's operator for
    :func:`mgnn.backend.numba_cpu.apply_structured_axis`, or None where it has none.

    Towards the coarse grid (n = 2m): ``("down", lo, hi, a, w)``, the rows lo <= i < hi all
    out[i] = sum_t w[t] x[2i + a + t] (1 to 4 consecutive terms). Towards the fine grid:
    ``("up", lo, hi, a0, u, a1, v)``, the row pairs lo <= k < hi all out[2k] = sum_t u[t]
    x[k + a0 + t] and out[2k + 1] = sum_t v[t] x[k + a1 + t] (1 or 2 terms, as many in both).
    The pattern is the middle row's (pair's); [lo, hi) the run of rows around it that repeat
    it, every one checked against the matrix. None: odd n (vertex-centred), a middle row
    that is not such a window, or an empty row (the transpose of cell injection)."""
    key = (n, interp, restrict, to_fine, np.dtype(dtype).str)
    if key not in _STRUCTURES:
        _STRUCTURES[key] = _find_structure(
            _axis_matrix(n, interp, restrict, to_fine, np.float64, np), n, dtype)
    return _STRUCTURES[key]


def _find_structure(A, n, dtype):
    """:func:`_structure` of the dense 1D matrix A (out, in) of an axis of n fine points."""
    if n % 2:
        return None
    n_out, n_in = A.shape

    def pattern(i, base):  # ((offset, weight), ...) of row i, offsets from ``base``
        return tuple((int(j) - base, float(A[i, j])) for j in np.nonzero(A[i])[0])

    def window(p, most):  # (a, weights) if the offsets run a, a + 1, ... (1..most terms)
        if not 1 <= len(p) <= most or [o for o, _ in p] != list(range(p[0][0], p[0][0] + len(p))):
            return None
        return p[0][0], np.array([w for _, w in p], dtype=dtype)

    def run(same, mid):  # the rows around ``mid`` that repeat its pattern: [lo, hi)
        lo, hi = mid, mid + 1
        while lo > 0 and same[lo - 1]:
            lo -= 1
        while hi < len(same) and same[hi]:
            hi += 1
        return lo, hi
    if 2 * n_out == n_in:  # towards the coarse grid
        pats = [pattern(i, 2 * i) for i in range(n_out)]
        mid = n_out // 2
        win = window(pats[mid], 4)
        if win is None:
            return None
        lo, hi = run([p == pats[mid] for p in pats], mid)
        return ("down", lo, hi, win[0], win[1])
    if n_out == 2 * n_in:  # towards the fine grid
        even = [pattern(2 * k, k) for k in range(n_in)]
        odd = [pattern(2 * k + 1, k) for k in range(n_in)]
        mid = n_in // 2
        u, v = window(even[mid], 2), window(odd[mid], 2)
        if u is None or v is None or len(u[1]) != len(v[1]):
            return None
        lo, hi = run([e == even[mid] and o == odd[mid] for e, o in zip(even, odd)], mid)
        return ("up", lo, hi, u[0], u[1], v[0], v[1])
    return None


_CSR = {}  # (n, interp, restrict, to_fine, dtype) -> (indptr, cols, weights)


def _axis_csr(n, interp, restrict, to_fine, dtype):
    """The rows of :func:`_axis_matrix` (NumPy) in CSR form: (indptr, cols, weights)."""
    key = (n, interp, restrict, to_fine, np.dtype(dtype).str)
    got = _CSR.get(key)
    if got is None:
        A = _axis_matrix(n, interp, restrict, to_fine, np.float64, np)
        rows, cols = np.nonzero(A)
        indptr = np.searchsorted(rows, np.arange(A.shape[0] + 1)).astype(np.int64)
        got = _CSR[key] = (indptr, cols.astype(np.int64), A[rows, cols].astype(dtype))
    return got


_MATRICES = {}  # (n, interp, restrict, to_fine, dtype, library) -> the 1D matrix there


def _axis_matrix(n, interp, restrict, to_fine, dtype, xp):
    """The 1D operator of one axis of ``n`` fine points as a dense (out, in) matrix of
    ``dtype`` in array library ``xp``: T (n x m) with T[f, c] = the terms' weights
    (:func:`_interp_terms` for ``restrict`` None, else :func:`_restrict_terms`), to the fine
    grid T, from it T^T."""
    key = (n, interp, restrict, to_fine, np.dtype(dtype).str, xp.__name__,
           None if xp is np else xp.cuda.Device().id)  # a matrix lives on one device
    A = _MATRICES.get(key)
    if A is None:
        m = coarse_size(n)
        T = np.zeros((n, m))
        terms = _interp_terms(n, interp) if restrict is None else \
            _restrict_terms(n, interp, restrict)
        for f, c, w in terms:
            T[np.arange(n)[f], np.arange(m)[c]] += float(w)
        A = np.ascontiguousarray(T if to_fine else T.T).astype(dtype)
        A = _MATRICES[key] = A if xp is np else xp.asarray(A)
    return A


def _apply(x, out_shape, plan):
    """Run a :func:`_plan` on ``x`` into a new array of ``out_shape`` (x's library and dtype):
    the slice-by-slice reference of :func:`_transfer`."""
    xp = _array_module(x)
    out = xp.zeros(out_shape, dtype=x.dtype)
    for pairs, scale in plan:
        for dst, src in pairs:
            view = out[dst]
            view += x[src]
        if scale != 1.0:
            out *= scale
    return out


@functools.lru_cache(maxsize=256)
def _plan(fine, interp, restrict, to_fine):
    """The slice additions and scalings that apply an operator, for spatial shape ``fine``.

    The operator is the tensor product of one 1D operator per axis (:func:`_interp_terms` when
    ``restrict`` is None, else :func:`_restrict_terms`): out[f] += w x[c] (``to_fine``) or
    out[c] += w x[f] (its transpose), for every combination of one term per axis, w the product
    of their weights. So that only the output is allocated, the combinations are grouped by
    weight and summed by Horner's rule,
    w_1 T_1 + ... + w_G T_G = ((T_1 (w_1/w_2) + T_2) (w_2/w_3) + ...) w_G (w ascending):
    every update is an in-place add of a slice of x or an in-place scaling of out.

    Returns
    -------
    tuple of (pairs, scale): add x[src] to out[dst] for each (dst, src) in pairs, then out *= scale
    """
    if restrict is None:
        axis_terms = [_interp_terms(n, interp) for n in fine]
    else:
        axis_terms = [_restrict_terms(n, interp, restrict) for n in fine]
    groups = {}
    for combo in itertools.product(*axis_terms):
        fine_idx = tuple(t[0] for t in combo)
        coarse_idx = tuple(t[1] for t in combo)
        if any(_empty(s) for s in fine_idx + coarse_idx):
            continue
        weight = Fraction(1)
        for t in combo:
            weight *= t[2]
        dst, src = (fine_idx, coarse_idx) if to_fine else (coarse_idx, fine_idx)
        groups.setdefault(weight, []).append(((Ellipsis,) + dst, (Ellipsis,) + src))
    weights = sorted(groups)
    plan = []
    for j, weight in enumerate(weights):
        scale = weight / weights[j + 1] if j + 1 < len(weights) else weight
        plan.append((tuple(groups[weight]), float(scale)))
    return tuple(plan)


def _empty(s):
    """Whether slice ``s`` (start, stop >= 0) selects nothing."""
    return s.stop <= s.start


# --- validation -----------------------------------------------------------------------------

def _array_module(x):
    family = type(x).__module__.partition(".")[0]
    if family == "numpy":
        return np
    if family == "cupy":
        import cupy
        return cupy
    raise TypeError(f"states must be NumPy or CuPy arrays, got {type(x).__name__}")


def _check_name(what, value, allowed):
    choices = " or ".join(repr(a) for a in allowed)
    if not isinstance(value, str):
        raise TypeError(f"{what} must be {choices}, got {value!r}")
    if value not in allowed:
        raise ValueError(f"{what} must be {choices}, got {value!r}")


def _spatial_shape(shape):
    try:
        shape = tuple(shape)
    except TypeError:
        raise TypeError(f"a spatial shape must be a tuple of 2 or 3 ints, got {shape!r}") from None
    if len(shape) not in SPATIAL_NDIMS:
        raise ValueError(f"a spatial shape must have 2 or 3 axes, got {shape!r}")
    for n in shape:
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"a spatial shape must be a tuple of ints, got {shape!r}")
    return tuple(int(n) for n in shape)


def _check_state(name, x, n_spatial=None):
    _array_module(x)
    if x.dtype.kind not in "fc":
        raise TypeError(f"{name} must have a floating-point dtype, got {x.dtype}")
    want = (n_spatial,) if n_spatial is not None else SPATIAL_NDIMS
    if x.ndim - 2 not in want:
        axes = " or ".join(str(k) for k in want)
        raise ValueError(f"{name} must be (B, C, *spatial) with {axes} spatial axes, got shape "
                         f"{tuple(x.shape)}")


def _check_coarse(name, x, fine):
    want = coarse_shape(fine)
    if tuple(x.shape[2:]) != want:
        raise ValueError(f"{name} has spatial shape {tuple(x.shape[2:])}, but the fine shape "
                         f"{fine} coarsens to {want}")
