"""Which rank owns which point on which level (pure index maths; no MPI, no state arrays),
and balanced block starts under a work model of the MGRIT cycle.

Fine indices 0..N are block-distributed: block ``q`` (in solver order) holds fine indices
``starts[q] .. starts[q+1]-1`` (``starts[B] = N + 1``); block ``q`` lives on communicator rank
``ranks[q]``. The owner of fine index i owns point i on every level where i is a point, and owns
the step out of i (push propagators) or the step into i (pull propagators, see
:class:`mgnn.mgrit.MGRITSolver`).
"""
import bisect
import functools
import math
import numbers
import operator
from dataclasses import dataclass

import numpy as np

from .hierarchy import level_costs, step_weights


def block_starts(n_points, n_blocks, align=1):
    """First index of each of ``n_blocks`` contiguous blocks of range(n_points), as even as possible
    with every block starting on a multiple of ``align`` (uneven counts allowed).

    Raises ValueError if there are fewer multiples of ``align`` than blocks (some block would own
    no C-point).
    """
    if n_blocks < 1:
        raise ValueError(f"number of blocks must be >= 1, got {n_blocks}")
    n_units = (n_points - 1) // align + 1
    if n_units < n_blocks:
        raise ValueError(f"{n_points} points with C-points every {align} give {n_units} C-points, "
                         f"fewer than the {n_blocks} layer ranks: every rank must own a C-point")
    base, extra = divmod(n_units, n_blocks)
    starts, u = [], 0
    for q in range(n_blocks):
        starts.append(u * align)
        u += base + (1 if q < extra else 0)
    return starts


def replica_rows(lo, hi, n_layers, stride, n_rows, adjoint=False):
    """The rows [r0, r1) of the redundant coarsest level's layer copies that the owner of
    layers [lo, hi) holds: row r is layer r * stride (forward) or n_layers - (r + 1) * stride
    (adjoint), for r in range(n_rows) (see :class:`mgnn.propagators.CoarseReplica`). Empty
    spans are (r, r)."""
    hi = min(hi, n_layers)
    if adjoint:  # lo <= N - (r + 1) S < hi  <=>  (N - hi) // S <= r < (N - lo) // S
        r0, r1 = (n_layers - hi) // stride, (n_layers - lo) // stride
    else:  # lo <= r S < hi  <=>  ceil(lo / S) <= r < ceil(hi / S)
        r0, r1 = -(-lo // stride), -(-hi // stride)
    r0, r1 = min(max(r0, 0), n_rows), min(max(r1, 0), n_rows)
    return r0, max(r0, r1)


def _positive_int(name, v, lo=1):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {v!r}")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v!r}")
    return int(v)


def _extra(name, v):
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    return float(v)


def _nrelax_fn(nrelax):
    """``nrelax`` (int, sequence with the last value repeating, or callable level -> int) as a
    callable."""
    if callable(nrelax):
        return nrelax
    seq = tuple(nrelax) if isinstance(nrelax, (list, tuple)) else (nrelax,)
    if not seq:
        raise ValueError("nrelax must not be empty")
    for v in seq:
        _positive_int("nrelax", v, 0)
    return lambda lev: int(seq[min(lev, len(seq) - 1)])


def layer_work(n_steps, cf=1, sizes=None, nrelax=1, skip=False, cycle="V",
               coarsest="redundant", mirrored=False, level_cost=None):
    """Layer evaluations per MGRIT cycle charged to the owner of each fine index (the balance
    model of :func:`balanced_starts`).

    Parameters
    ----------
    n_steps : int
        N (layers 0..N-1; layer i is the step out of fine index i).
    cf : int
        Coarsening factor (only used with ``sizes``).
    sizes : list of int or None
        Intervals per level (:func:`~mgnn.mgrit.hierarchy.level_sizes`, ``sizes[0] == N``).
        None or a single level: no MGRIT (layer-by-layer), work 1 per layer.
    nrelax : int, sequence of int or callable level -> int
        (C, F) sweeps after the first F per level (as :class:`MGRITOptions`).
    skip : bool
        The cascadic cycle 0 of ``skip_downcycle``.
    cycle : {'V', 'F'}
    coarsest : {'redundant', 'sequential'}
        'redundant': every rank solves the coarsest level itself (not charged here: the same on
        every rank, see :func:`block_work`); 'sequential': the coarsest steps are charged to the
        owners of their start points.
    mirrored : bool
        The adjoint solve (reversed indices, pull propagator, :meth:`Partition.mirrored`): its
        level-l step from reversed point m to m + cf^l runs on the owner of fine index
        N - m - cf^l.
    level_cost : sequence of float or None
        Cost of one step on each level in fine-step equivalents (spatial coarsening: the pixel
        ratio of the level's images to the fine ones); None: 1 everywhere.

    Returns
    -------
    ndarray of float64, shape (N,)
        Evaluations per cycle on the owner of fine index i (level-l steps count once each, as in
        :func:`~mgnn.mgrit.hierarchy.cycle_work`; the final F-relaxation of a solve excluded).
        Its sum plus the redundant coarsest steps is ``cycle_work``.
    """
    N = _positive_int("n_steps", n_steps)
    work = np.zeros(N)
    if sizes is None or len(sizes) == 1:
        if sizes is not None and int(sizes[0]) != N:
            raise ValueError(f"sizes {list(sizes)} do not start with n_steps={N}")
        work += 1.0
        return work
    cf = _positive_int("cf", cf, 2)
    sizes = [int(n) for n in sizes]
    if sizes[0] != N or any(b != a // cf or b < 1 for a, b in zip(sizes, sizes[1:])):
        raise ValueError(f"sizes {sizes} are not a level hierarchy of n_steps={N} with cf={cf} "
                         f"(expected [N, N // cf, N // cf^2, ...])")
    if cycle not in ("V", "F"):
        raise ValueError(f"cycle must be 'V' or 'F', got {cycle!r}")
    if coarsest not in ("redundant", "sequential"):
        raise ValueError(f"coarsest must be 'redundant' or 'sequential', got {coarsest!r}")
    cost = level_costs(level_cost, len(sizes))
    every, into_f, solves = step_weights(sizes, cf, _nrelax_fn(nrelax), bool(skip), cycle)
    if coarsest == "sequential":
        every[-1] += solves
    for lev, n in enumerate(sizes):
        j = np.arange(n)
        w = cost[lev] * (every[lev] + into_f[lev] * ((j + 1) % cf != 0))
        s = cf ** lev
        np.add.at(work, N - (j + 1) * s if mirrored else j * s, w)
    return work


def _model(n_steps, cf, sizes, nrelax, skip, cycle, coarsest, work):
    """(N, per-layer work, work every block does) of the arguments shared below."""
    N = _positive_int("n_steps", n_steps)
    if work is None:
        w = layer_work(N, cf, sizes, nrelax, skip, cycle, coarsest)
        shared = 0.0
        if sizes is not None and len(sizes) > 1 and coarsest == "redundant":
            shared = float(step_weights(list(sizes), cf, _nrelax_fn(nrelax), bool(skip),
                                        cycle)[2] * sizes[-1])
        return N, w, shared
    if sizes is not None:
        raise ValueError("give either work (per-layer work) or sizes (the MGRIT model), not both")
    w = np.asarray(work, dtype=np.float64)
    if w.shape != (N,) or not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"work must be {N} finite numbers >= 0 (one per layer), got shape "
                         f"{w.shape}" + ("" if w.shape != (N,) else f", min {w.min()}"))
    return N, w, 0.0


def block_work(n_steps, starts, cf=1, sizes=None, nrelax=1, extra_first=0.0, extra_last=0.0,
               skip=False, cycle="V", coarsest="redundant", work=None):
    """Work of each block of ``starts`` under the model of :func:`balanced_starts` (same
    arguments), for reports such as the per-rank work of ``--timings``.

    Returns
    -------
    list of float
        One value per block (in the order of ``starts``): the layer evaluations per cycle of its
        layers (:func:`layer_work`, or ``work``), plus ``extra_first`` on the first block and
        ``extra_last`` on the last, plus the redundant coarsest solve on every block
        (``coarsest='redundant'`` with ``sizes``; not added with ``work``).
    """
    N, w, shared = _model(n_steps, cf, sizes, nrelax, skip, cycle, coarsest, work)
    st = [int(a) for a in starts]
    if not st or st[0] != 0 or any(b <= a for a, b in zip(st, st[1:])) or st[-1] > N:
        raise ValueError(f"starts {list(starts)} must begin at 0, increase strictly and stay "
                         f"<= n_steps={N}")
    S = np.concatenate(([0.0], np.cumsum(w)))
    out = [float(S[min(b, N)] - S[a]) + shared for a, b in zip(st, st[1:] + [N])]
    out[0] += _extra("extra_first", extra_first)
    out[-1] += _extra("extra_last", extra_last)
    return out


def balanced_starts(n_steps, n_blocks, cf=1, sizes=None, nrelax=1, extra_first=0.0,
                    extra_last=0.0, skip=False, cycle="V", coarsest="redundant", work=None):
    """First fine index of each of ``n_blocks`` contiguous blocks of layers 0..N-1 (fine indices
    0..N, point N on the last block) that minimises the largest block's work.

    Every block starts on a multiple of ``cf`` (a level-0 C-point) and holds at least one layer.
    Work per block: :func:`block_work` (per MGRIT cycle, each level-l step counted on the owner of
    its start point; ``extra_first``/``extra_last`` on the end blocks). Among the splits with the
    least largest work, the cuts lie as near as allowed to equal shares of the total work.
    Exact up to floating-point rounding (bisection on the largest work with a greedy check:
    O(n_blocks log N) per check).

    Parameters
    ----------
    n_steps : int
        N, the number of layers.
    n_blocks : int
        Number of blocks (layer ranks).
    cf : int
        Block starts are multiples of cf (1: any layer; the MGRIT coarsening factor otherwise).
    sizes : list of int or None
        Intervals per level (:func:`~mgnn.mgrit.hierarchy.level_sizes`) for the MGRIT work model
        (:func:`layer_work`); None: no MGRIT, work 1 per layer.
    nrelax : int, sequence of int or callable level -> int
        (C, F) sweeps after the first F per level (:meth:`MGRITOptions.nrelax_on` fits).
    extra_first, extra_last : float
        Work of the opening layer (first block) and of the closing layer + loss (last block), in
        layer evaluations.
    skip, cycle, coarsest :
        As :func:`layer_work` (coarsest 'redundant' adds the same to every block: no effect).
    work : array-like of shape (N,) or None
        Per-layer work replacing the model (e.g. forward + adjoint cycles + gradients summed from
        :func:`layer_work` calls); then ``sizes`` must be None.

    Returns
    -------
    list of int
        ``n_blocks`` ascending starts, ``starts[0] == 0``, each a multiple of ``cf`` and < N.

    Raises
    ------
    ValueError
        Fewer multiples of ``cf`` below N than blocks (some block would hold no layer), or a bad
        argument (named with its value).
    """
    B = _positive_int("n_blocks", n_blocks)
    N, w, _ = _model(n_steps, cf, sizes, nrelax, skip, cycle, coarsest, work)
    cf = _positive_int("cf", cf)
    e0, e1 = _extra("extra_first", extra_first), _extra("extra_last", extra_last)
    K = -(-N // cf)  # groups of layers [k cf, (k + 1) cf): the units blocks are made of
    if K < B:
        raise ValueError(f"n_steps={N} layers with blocks starting on multiples of cf={cf} give "
                         f"{K} groups of layers, fewer than n_blocks={B}: every block must hold "
                         f"a layer (use at most {K} layer ranks, or a smaller cf)")
    if B == 1:
        return [0]
    c = np.concatenate(([0.0], np.cumsum(w)))
    S = c[np.minimum(np.arange(K + 1) * cf, N)].tolist()  # work of units [0, k)
    total = S[K]
    slack = 8 * np.finfo(float).eps * (total + e0 + e1)  # rounding of the prefix sums

    def reach(p, cap):
        """Largest q >= p with the units [p, q) within ``cap``."""
        return max(bisect.bisect_right(S, S[p] + cap + slack, p, K + 1) - 1, p)

    def back(q, cap):
        """Smallest p with the units [p, q) within ``cap``."""
        return bisect.bisect_left(S, S[q] - cap - slack, 0, q + 1)

    def greedy(T):
        """(largest block work, None) of a split into <= B blocks each within T (the longest last
        block, then greedy from the left), or (None, the least T at which this split changes)."""
        g = max(back(K, T - e1), 1)
        nxt = S[K] - S[g - 1] + e1 if g > 1 else math.inf
        worst, p, cap, blocks = S[K] - S[g] + e1, 0, T - e0, 1
        while p < g:
            if blocks == B:
                return None, nxt
            q = min(reach(p, cap), g)
            extra = e0 if p == 0 else 0.0
            if q < g:
                nxt = min(nxt, S[q + 1] - S[p] + extra)
            if q == p:
                return None, nxt
            worst = max(worst, S[q] - S[p] + extra)
            p, cap, blocks = q, T, blocks + 1
        return worst, None

    units = np.diff(S)
    lo = float(max(units.max(), units[0] + e0, units[-1] + e1, (total + e0 + e1) / B))
    hi, nxt = greedy(lo)  # T* >= lo; any T below a failed greedy's nxt fails alike
    if hi is None:
        lo, hi = max(nxt, lo), greedy(total + e0 + e1)[0]
        while lo < hi and hi - lo > 1e-13 * hi:
            mid = 0.5 * (lo + hi)
            got, nxt = greedy(mid)
            if got is None:
                lo = max(nxt, mid)
            else:
                hi = min(got, mid)
    T = hi
    # every cut q (units before block q) lies in [g[B - q], reach from the previous cut], where
    # g[k] is the start of the k blocks taken greedily from the right: pick it nearest equal shares
    g = [K, back(K, T - e1)]
    for _ in range(B - 2):
        g.append(back(g[-1], T))
    cuts, p, cap = [], 0, T - e0
    for q in range(1, B):
        lo_q = max(g[B - q], p + 1)
        hi_q = min(reach(p, cap), K - (B - q))
        share = q * (total + e0 + e1) / B - e0
        t = bisect.bisect_left(S, share, 0, K + 1)
        if t > 0 and (t > K or share - S[t - 1] <= S[t] - share):
            t -= 1
        p, cap = max(min(max(t, lo_q), hi_q), p + 1), T  # (p + 1: a guard against rounding)
        cuts.append(p)
    return [0] + [k * cf for k in cuts]


@dataclass(frozen=True)
class Partition:
    """Block distribution of fine indices 0..n_steps.

    Attributes
    ----------
    n_steps : int
        N (a NumPy integer is accepted).
    starts : tuple of int
        First fine index of each block, ascending, starts[0] == 0.
    ranks : tuple of int
        Communicator rank holding each block (same length as starts).
    """

    n_steps: int
    starts: tuple
    ranks: tuple

    def __post_init__(self):
        n = self.n_steps
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"Partition n_steps must be an int >= 1, got {n!r}")
        object.__setattr__(self, "n_steps", int(n))
        st, rk = tuple(self.starts), tuple(self.ranks)
        key = (int(n), st, rk)
        try:
            done = _VALIDATED.get(key)  # every virtual rank builds the same P-block partitions
        except TypeError:  # unhashable entries: checked (and refused) below, not kept
            done, key = None, None
        if done is None:
            done = _validated_blocks(int(n), st, rk)
            if key is not None:
                if len(_VALIDATED) >= 256:
                    _VALIDATED.clear()
                _VALIDATED[key] = done
        starts, ranks = done
        object.__setattr__(self, "starts", starts)
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "_block", _block_index(ranks))  # rank -> block

    @classmethod
    def serial(cls, n_steps):
        """Everything on rank 0."""
        return cls(n_steps, (0,), (0,))

    def block_of_rank(self, rank):
        """Index of the block held by ``rank`` (ValueError if it holds none)."""
        index, n = self._block, len(self.ranks)
        if index is None or index == "reversed":  # ranks 0..n-1 in order, or reversed
            ok = isinstance(rank, numbers.Integral) and 0 <= rank < n
            q = (int(rank) if index is None else n - 1 - int(rank)) if ok else None
        else:
            q = index.get(rank)
        if q is None:
            raise ValueError(f"rank {rank} holds no block of this partition")
        return q

    def fine_range(self, rank):
        """Fine indices [lo, hi) held by ``rank``."""
        q = self.block_of_rank(rank)
        hi = self.starts[q + 1] if q + 1 < len(self.starts) else self.n_steps + 1
        return self.starts[q], hi

    def owner(self, fine_index):
        """Rank owning ``fine_index``."""
        return self.ranks[bisect.bisect_right(self.starts, fine_index) - 1]

    def level_range(self, rank, spacing, n_level):
        """Level points [a, b) held by ``rank`` on a level whose point j is fine index j*spacing
        (n_level intervals); may be empty (a == b)."""
        lo, hi = self.fine_range(rank)
        a = -(-lo // spacing)
        b = min(-(-hi // spacing), n_level + 1)
        return a, max(a, b)

    def level_counts(self, spacing, n_level):
        """(counts, displacements) of the level points every rank holds, in rank order (as
        :meth:`level_range`; the layout of an allgather of a whole level), as tuples of int.
        Computed once per (partition, level) in a process."""
        return _level_counts(self, int(spacing), int(n_level))

    def mirrored(self):
        """The partition of reversed indices m = N - i with every point kept on its rank (for the
        adjoint solve): block order is reversed."""
        return _mirrored(self)

    def replica_counts(self, stride, n_rows, adjoint=False):
        """(counts, displacements) of the rows of a redundant coarsest level's layer copies that
        every rank owns (:func:`replica_rows` of its block), in rank order (the layout of their
        allgather), as tuples of int. Computed once per (partition, level, direction) in a
        process (virtual runs: thousands of ranks, one computation)."""
        return _replica_counts(self, int(stride), int(n_rows), bool(adjoint))


@functools.lru_cache(maxsize=64)
def _replica_counts(partition, stride, n_rows, adjoint):
    """:meth:`Partition.replica_counts`: :func:`replica_rows` of every block, once."""
    N, st = partition.n_steps, partition.starts
    counts, displs = [0] * len(st), [0] * len(st)
    for q, (lo, hi) in enumerate(zip(st, st[1:] + (N + 1,))):
        r0, r1 = replica_rows(lo, hi, N, stride, n_rows, adjoint)
        rank = partition.ranks[q]
        counts[rank], displs[rank] = r1 - r0, r0
    return tuple(counts), tuple(displs)


@functools.lru_cache(maxsize=64)
def _level_counts(partition, spacing, n_level):
    """:meth:`Partition.level_counts`, vectorised and shared by equal partitions (the ranks of
    one process -- virtual ranks -- build equal ones)."""
    st = np.array(partition.starts + (partition.n_steps + 1,), dtype=np.int64)
    a = -(-st[:-1] // spacing)
    b = np.minimum(-(-st[1:] // spacing), n_level + 1)
    b = np.maximum(a, b)
    blocks = [partition.block_of_rank(r) for r in range(len(partition.ranks))]  # rank order
    return tuple(int(v) for v in (b - a)[blocks]), tuple(int(v) for v in a[blocks])


_INTERNED = {}  # tuple -> the one equal tuple kept (virtual ranks build equal partitions)


def _validated_blocks(n, st, rk):
    """(starts, ranks) of a :class:`Partition` of ``n`` steps as shared int tuples, checked
    (ValueError naming the values)."""
    if len(st) != len(rk) or not st:
        raise ValueError(f"Partition needs one rank per block: starts {st}, ranks {rk}")
    if st[0] != 0 or not all(map(operator.lt, st, st[1:])) or st[-1] > n:
        raise ValueError(f"Partition starts {st} must begin at 0, increase strictly and stay "
                         f"<= n_steps={n}")
    if len(set(rk)) != len(rk):
        raise ValueError(f"Partition ranks {rk} hold more than one block each")
    return _interned(tuple(int(v) for v in st)), _interned(tuple(int(v) for v in rk))


#: (n_steps, starts, ranks) as given -> their checked tuples (at most 256 kept)
_VALIDATED = {}


def _interned(t):
    """One shared copy of each distinct tuple of starts / ranks (at most 256 kept)."""
    got = _INTERNED.get(t)
    if got is None:
        if len(_INTERNED) >= 256:
            _INTERNED.clear()
        got = _INTERNED[t] = t
    return got


@functools.lru_cache(maxsize=256)
def _block_index(ranks):
    """rank -> block of a tuple of ranks: None for 0..n-1 in order, 'reversed' for n-1..0, else
    a dict (shared by equal partitions)."""
    n = len(ranks)
    if ranks == tuple(range(n)):
        return None
    if ranks == tuple(range(n - 1, -1, -1)):
        return "reversed"
    return {r: q for q, r in enumerate(ranks)}


@functools.lru_cache(maxsize=64)
def _mirrored(partition):
    """:meth:`Partition.mirrored` (shared by equal partitions)."""
    N = partition.n_steps
    ends = list(partition.starts[1:]) + [N + 1]
    starts = tuple(N - (e - 1) for e in reversed(ends))
    return Partition(N, starts, tuple(reversed(partition.ranks)))
