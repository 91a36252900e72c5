"""Cost tables and cost-only models: mgnn's training code on virtual ranks without arithmetic.

A :class:`CostTable` holds, for every kernel method a training step calls (a step kind's
forward / vjp / stacked / batched / sweep methods, the opening, the closing and the loss), the
seconds of one call as ``a + b k`` (``k`` states per call), measured by :func:`record_step` on
this machine: the real training step runs once with every such call timed. It also holds the
Python overhead of each training method per kernel call (the step's wall time minus its
kernels, over its calls) and the network's ``alpha`` / ``beta``.

:func:`cost_model` turns a :class:`mgnn.network.Model` into a *cost-only* model: the same
shapes, parameters and step kind, but every kernel method charges its table time to the running
virtual rank (:func:`mgnn.comm.virtual.charge`) and returns zero placeholders of the right shape
instead of computing. ``LayerParallel``, ``PipelineParallel`` and the MGRIT solver run unchanged
on it: the messages, partitions, collectives and cycles are the real code's, so
:func:`mgnn.comm.virtual.run_virtual` gives the predicted time per training step.
"""
import json
import math
import os
import platform
import tempfile
import time

import numpy as np

from ..backend import tape as T
from ..comm.virtual import charge

__all__ = ["CostTable", "Recorder", "cost_model", "recording_model", "tape_seconds",
           "vector_samples", "STEP_METHODS"]

# step-kind methods a training step calls: name -> (index of the state argument (or of the
# stacked store / list of states), how the number of states k follows from the arguments)
STEP_METHODS = {
    "forward": (2, "one"), "forward_deriv": (2, "one"), "deriv": (2, "one"),
    "vjp_state": (4, "one"), "vjp": (4, "one"), "vjp_params": (0, "one"),
    "forward_batched": (2, "list"), "vjp_state_batched": (1, "list"),
    "deriv_batched": (2, "list"), "vjp_params_batched": (0, "list"),
    "chains_forward": (2, "chains4"), "chains_adjoint": (3, "chains5"),
    "points_forward": (2, "slots5"), "points_adjoint": (3, "slots6"),
    "deriv_stacked": (2, "count4"), "vjp_params_stacked": (0, "count6"),
    "sweep_forward": (3, "layers0"), "sweep_backward": (2, "layers0"),
    # the forward solve's final sweep keeping sigma' (k: its steps), the rows it did not keep
    "chains_forward_derivs": (2, "chains3"), "deriv_missing": (2, "missing"),
    # a captured cycle's replay (k: its rows; charged as its rows' kernels, :func:`tape_seconds`)
    "run_tape": (3, "tape"),
    # recurrent kinds (GRU / RNN over sequence time; states (B, layers, H), shared weights)
    "chains_forward_layers": (1, "chains3"), "chains_adjoint_layers": (1, "chains3"),
    "chains_forward_layers_keep": (1, "chains2"),
    "points_forward_layers": (1, "rslots4"), "points_adjoint_layers": (1, "rslots4"),
    "linearize_stacked": (1, "linearize"), "vjp_params_stacked_layers": (2, "lin"),
    "sweep_forward_layers": (1, "rsweep"), "sweep_backward_layers": (1, "rsweep_back"),
}
#: the op whose presence in a table says the calibrated backend kept a final sweep's
#: linearisation (:func:`_as_calibrated`), per kind's keep method
KEEP_OPS = {"chains_forward_derivs": "chains_forward_derivs",
            "chains_forward_layers_keep": "chains_forward_layers_keep"}
MODULE_METHODS = {"opening": ("forward", "vjp"), "closing": ("forward", "vjp"),
                  "loss": ("forward_grad",)}


def _call_shape(name, args, kwargs=None):
    """(op key, state shape, k) of one call of step method ``name`` with positional ``args``
    (and keyword ``kwargs``)."""
    pos, how = STEP_METHODS[name]
    a = args[pos]
    if how == "rslots4":  # (P, U, G, R, slots, out_slots, layer0, layer_step, h, mode, ...)
        return f"{name}:{int(args[9])}", tuple(a.shape[1:]), len(args[4])
    if how == "linearize":  # (P, U, first, count, t0, bk, ctx, scratch, done=None)
        done = args[8] if len(args) > 8 else (kwargs or {}).get("done")
        count = int(args[3])
        if done is None:
            return name, tuple(a.shape[1:]), count
        return f"{name}_missing", tuple(a.shape[1:]), \
            count - int(np.count_nonzero(np.asarray(done)[:count]))
    if how == "lin":  # (P, parts, lin, ...): every step of the linearisation
        return name, tuple(a.U.shape[1:]), int(a.D.shape[0])
    if how == "rsweep":  # (P, U (L + 1, ...), h, store, ...)
        return name if args[3] else f"{name}_nod", tuple(a.shape[1:]), int(a.shape[0]) - 1
    if how == "rsweep_back":  # (P, U, D (L, ...), lam, ...)
        return name, tuple(a.shape[1:]), int(args[2].shape[0])
    if how == "one":
        return name, tuple(a.shape), 1
    if how == "list":
        return name, tuple(a[0].shape), len(a)
    if how == "tape":  # (W, P, d0, stores, rows, hs, norms, adjoint, bk)
        return name, tuple(a[0].shape[1:]), len(args[4])
    shape = tuple(a.shape[1:])
    if how.startswith("chains"):
        chains = np.asarray(args[int(how[-1])])
        k = int(chains[:, 1].sum()) if chains.size else 0
        return name, shape, k
    if how.startswith("slots"):
        mode = args[-2]  # (..., mode, bk)
        return f"{name}:{int(mode)}", shape, len(args[int(how[-1])])
    if how.startswith("count"):
        return name, shape, int(args[int(how[-1])])
    if how == "missing":  # (W, b, U, first, count, layer0, D, done, bk): the unflagged rows
        count = int(args[4])
        return name, shape, count - int(np.count_nonzero(args[7][:count]))
    if name == "sweep_forward":  # W, b, U, h, D: stored sigma' or not
        key = "sweep_forward" if args[4].shape[0] else "sweep_forward_nod"
        return key, tuple(args[2].shape[1:]), int(args[0].shape[0])
    return name, tuple(args[2].shape[1:]), int(args[0].shape[0])


def _zero_rows(A, lo, hi):
    if A is not None:
        A[max(int(lo), 0):max(int(hi), 0)] = 0


def _zero_outputs(name, args):
    """Zeros into what an in-place step method writes (the states of a cost-only run stay
    finite, so the solver's own arithmetic on them never overflows)."""
    if name in ("chains_forward", "chains_adjoint"):
        return  # they write into the solver's stores, allocated zero and kept finite by it
    if name in ("points_forward", "points_adjoint"):
        R, outs = args[4 if name == "points_forward" else 5], args[6 if name == "points_forward"
                                                                   else 7]
        if R is not None:
            for o in outs:
                R[int(o)] = 0
    elif name == "deriv_stacked":
        _zero_rows(args[6], 0, args[4])
    elif name == "vjp_params_stacked":
        for g in args[9:11]:
            _zero_rows(g, args[7], args[7] + args[6])
    elif name == "vjp_params_batched":
        for g in args[5:7]:
            g[list(args[4])] = 0
    elif name == "chains_forward_derivs":  # flag the rows the real kernel keeps (layer l of
        # the step into slot i is layer0 + i layer_step; row l - d_lo): _linearize then charges
        # the others (deriv_missing) as in the real run
        chains, layer0, step, D, d_lo, done = (args[3], args[4], args[5], args[7], args[8],
                                               args[9])
        for first, n in np.asarray(chains).reshape(-1, 2).tolist():
            p = layer0 + np.arange(first, first + n) * step - d_lo
            done[p[(p >= 0) & (p < D.shape[0])]] = 1
    elif name in ("points_forward_layers", "points_adjoint_layers"):
        R = args[3]
        if R is not None:
            for o in args[5]:
                R[int(o)] = 0
    elif name == "chains_forward_layers_keep":  # flag the rows the kernel keeps (step t of
        # the chain's slot i is layer0 + i layer_step; row t - lo)
        chains, layer0, step, D, lo, done = (args[2], args[3], args[4], args[6][0], args[7],
                                             args[8])
        for first, n in np.asarray(chains).reshape(-1, 2).tolist():
            p = layer0 + np.arange(first, first + n) * step - lo
            done[p[(p >= 0) & (p < D.shape[0])]] = 1
    elif name == "sweep_forward_layers":
        _zero_rows(args[1], 1, args[1].shape[0])
    elif name == "sweep_backward_layers":
        for g in args[7].values():
            g[...] = 0
    elif name == "vjp_params_stacked_layers":
        for part in args[1]:  # a run that waits for a message still waits (and is charged)
            if callable(part):
                part()
        for g in args[5].values():
            g[...] = 0
    elif name == "sweep_forward":
        _zero_rows(args[2], 1, args[2].shape[0])
        _zero_rows(args[4], 0, args[4].shape[0])
    elif name == "sweep_backward":
        for g in args[6:8]:
            _zero_rows(g, 0, g.shape[0])


def _placeholder(name, kind, args, kwargs=None):
    """What the cost-only step method ``name`` returns: zeros of the real result's shapes."""
    _zero_outputs(name, args)
    pos, how = STEP_METHODS[name]
    a = args[pos]
    if name in ("forward", "deriv"):
        return np.zeros_like(a)
    if name == "forward_deriv":
        return np.zeros_like(a), np.zeros_like(a)
    if name == "vjp_state":
        return np.zeros_like(a)
    shapes = kind.param_shapes()
    if name == "vjp":
        return (np.zeros_like(a), np.zeros(shapes["weight"], a.dtype),
                np.zeros(shapes["bias"], a.dtype))
    if name == "vjp_params":
        return np.zeros(shapes["weight"], a.dtype), np.zeros(shapes["bias"], a.dtype)
    if name in ("forward_batched", "vjp_state_batched", "deriv_batched"):
        return [np.zeros_like(v) for v in a]
    if name.startswith("points"):
        return 0.0
    if name == "linearize_stacked":  # (P, U, first, count, t0, bk, ctx, scratch, ...)
        from ..blocks.recurrent import StackedLinearization
        U, first, count, t0, scratch = args[1], args[2], args[3], args[4], args[7]
        D, Y = kind.kept_arrays(U.shape[1:], count, U.dtype, scratch)
        D[...], Y[...] = 0, 0
        return StackedLinearization(U, first - t0, D, t0, Y, kind.cache_width)
    if name == "sweep_forward_layers":  # the caches (L or 0, layers, B, C H)
        U = args[1]
        return np.zeros((U.shape[0] - 1 if args[3] else 0, kind.n_layers, U.shape[1],
                         kind.cache_width * kind.hidden), U.dtype)
    if name == "sweep_backward_layers":
        return np.zeros_like(args[3])
    if name == "sweep_backward":
        return np.zeros_like(args[5])
    return None


class Recorder:
    """Collects (op, shape, dtype, k, seconds) samples of timed kernel calls."""

    def __init__(self, sync=None):
        #: a callable that waits for the device (GPU backends), or None
        self.samples, self.enabled, self.sync = [], True, sync
        #: replayed tapes: (state shape, rows, adjoint, store sizes, dtype, seconds)
        self.tapes = []

    def add(self, op, shape, dtype, k, seconds):
        if self.enabled:
            self.samples.append((op, tuple(shape), str(dtype), int(k), float(seconds)))

    def total(self):
        return sum(s[-1] for s in self.samples)


def _timed_step(name, base):
    def method(self, *args, **kwargs):
        sync = self._costs.sync if self._depth == 0 else None
        if sync is not None:
            sync()
        self._depth += 1  # a method calling another is timed once, as the outer one
        t0, ex0 = time.perf_counter(), self._excluded
        try:
            out = base(self, *args, **kwargs)
            if sync is not None:
                sync()
        finally:
            self._depth -= 1
        if self._depth == 0:  # (less what was timed as an op of its own inside it)
            seconds = time.perf_counter() - t0 - (self._excluded - ex0)
            op, shape, k = _call_shape(name, args, kwargs)
            self._costs.add(op, shape, self._dtype, k, seconds)
            if name == "run_tape" and self._costs.enabled:
                self._costs.tapes.append(_tape_call(args) + (self._dtype, seconds))
        return out
    method.__name__ = name
    return method


def _tape_call(args):
    """(state shape, rows, adjoint, store sizes) of a ``run_tape`` call's arguments (the sizes
    only where a COPY row needs them: reading a typed list's items is slow)."""
    stores, rows, adjoint = args[3], np.asarray(args[4]), bool(args[7])
    sizes = None
    if np.any(rows[:, T.OP] == T.COPY):
        sizes = [0 if s is None else int(s.shape[0]) for s in stores]
    return tuple(stores[0].shape[1:]), rows, adjoint, sizes


#: recurrent methods that read the batch's input projection (computed once per batch, by
#: whichever comes first: :func:`_timed_projection` / charged once by :func:`_charged_step`)
PROJECTION_USERS = ("chains_forward_layers", "chains_forward_layers_keep",
                    "points_forward_layers", "linearize_stacked", "sweep_forward_layers")


def _context(args):
    from ..blocks.composed import StepContext
    return next((a for a in args if isinstance(a, StepContext)), None)


def _projected(ctx):
    """The shape (B, steps, I) of the inputs a rank projects: its block's steps
    (``ctx.steps``) or the whole sequence."""
    B, L, I = ctx.x.shape
    lo, hi = getattr(ctx, "steps", None) or (0, L)
    return (B, min(hi, L) - max(lo, 0), I)


def _timed_projection(base):
    """A recurrent kind's ``_input_projection`` (x W_ih0^T + b for the steps a rank owns,
    once per batch) timed as the op ``input_projection`` of the projected inputs' shape
    (B, steps, I), not as part of the method that first needs it."""
    def method(self, P, ctx):
        if "gi0" in ctx.memo:
            return base(self, P, ctx)
        t0 = time.perf_counter()
        out = base(self, P, ctx)
        seconds = time.perf_counter() - t0
        self._excluded += seconds
        self._costs.add("input_projection", _projected(ctx), self._dtype, 1, seconds)
        return out
    method.__name__ = "_input_projection"
    return method


def _charged_step(name):
    def method(self, *args, **kwargs):
        if name in PROJECTION_USERS:  # the batch's input projection, once per batch
            ctx = _context(args)
            if ctx is not None and "gi0" not in ctx.memo:
                ctx.memo["gi0"] = "charged"  # (values never matter in a cost-only run)
                charge(*self._costs.charges("input_projection", _projected(ctx), self._dtype,
                                            1, missing=0.0))
        op, shape, k = _call_shape(name, args, kwargs)
        if name == "run_tape":  # the replay's own cost (a + c rows) plus its rows' kernels
            seconds = self._costs.seconds(op, shape, self._dtype, k, self._method, missing=0.0)
            shape, rows, adjoint, sizes = _tape_call(args)
            bound = tape_seconds(self._costs, rows, shape, self._dtype, adjoint, sizes)
            seconds += bound
        else:
            seconds, bound = self._costs.charges(op, shape, self._dtype, k, self._method)
        if name == "vjp_params_stacked_layers":  # the steps whose cotangents are ready, then
            # the wait for a run behind a message (the placeholder calls it), then the rest
            parts, steps = args[1], max(int(args[2].D.shape[0]), 1)
            ready = 0
            for part in parts:
                if callable(part):
                    break
                ready += int(part[3])
            f = min(ready / steps, 1.0)
            charge(seconds * f, bound * f)
            out = _placeholder(name, self, args, kwargs)
            charge(seconds * (1.0 - f), bound * (1.0 - f))
            return out
        charge(seconds, bound)  # the shadow clock: the critical-path bound
        return _placeholder(name, self, args, kwargs)
    method.__name__ = name
    return method


def _as_calibrated(base, op):
    def method(self, bk):
        return base(self, bk) and self._costs.has(op, self._dtype)
    method.__name__ = base.__name__
    return method


def _no_replay(self, bk):
    """No captured cycles (calibrated and predicted as the engine's calls)."""
    return False


def _wrap_kind(kind, costs, dtype, method, record):
    """A copy of step kind ``kind`` (same class, via a subclass) whose kernel methods are timed
    into ``costs`` (record) or charged from it without computing (cost-only)."""
    cls = type(kind)
    body = {}
    for name in STEP_METHODS:
        if hasattr(cls, name):
            body[name] = _timed_step(name, getattr(cls, name)) if record else _charged_step(name)
    if record and hasattr(cls, "_input_projection"):
        body["_input_projection"] = _timed_projection(cls._input_projection)
    if not record:  # the calibrated backend's paths: keep sigma' / replay cycles where it did
        keep = next((op for m, op in KEEP_OPS.items() if hasattr(cls, m)), None)
        for query, op in (("can_keep_derivs", keep), ("can_replay", "run_tape")):
            if hasattr(cls, query):
                body[query] = _as_calibrated(getattr(cls, query), op)
    if hasattr(cls, "run_tape_layers"):  # composed and recurrent kinds replay captured cycles
        body["can_replay"] = _no_replay  # through methods not timed here: priced uncaptured
    new = object.__new__(type(("Recorded" if record else "CostOnly") + cls.__name__, (cls,),
                              body))
    new.__dict__.update(kind.__dict__)
    new._costs, new._dtype, new._method, new._depth = costs, str(dtype), method, 0
    new._excluded = 0.0  # seconds timed as ops of their own inside a timed method
    return new


class _Module:
    """Opening / closing / loss wrapper: timed (record) or charged with memoised outputs."""

    def __init__(self, inner, role, costs, dtype, method, record):
        self._inner, self._role, self._costs = inner, role, costs
        self._dtype, self._method, self._record = str(dtype), method, record
        self._memo = {}
        for name in MODULE_METHODS[role]:
            setattr(self, name, self._make(name))

    def __getattr__(self, name):
        if name.startswith("_"):  # not set yet (copy, unpickling): no recursion through _inner
            raise AttributeError(name)
        return getattr(self._inner, name)

    def _make(self, name):
        real = getattr(self._inner, name)
        op = f"{self._role}.{name}"
        arg = 1 if self._role in ("opening", "closing") else 0  # the batch-carrying argument

        def method(*args):
            shape = tuple(np.shape(args[arg]))
            if self._record:
                sync = self._costs.sync
                if sync is not None:
                    sync()
                t0 = time.perf_counter()
                out = real(*args)
                if sync is not None:
                    sync()
                self._costs.add(op, shape, self._dtype, 1, time.perf_counter() - t0)
                return out
            charge(*self._costs.charges(op, shape, self._dtype, 1, self._method))
            key = (name, shape)
            if key not in self._memo:  # real outputs once per shape (values never matter), by
                # the NumPy reference: no Numba threads (a forked child must not start OpenMP)
                from ..backend import get_backend
                self._memo[key] = real(*args[:-1], get_backend("numpy"))
            return self._memo[key]
        return method


def _wrapped(model, costs, method, record):
    import copy
    out = copy.copy(model)
    out.step = _wrap_kind(model.step, costs, model.dtype, method, record)
    for role in MODULE_METHODS:
        setattr(out, role, _Module(getattr(model, role), role, costs, model.dtype, method,
                                   record))
    return out


def recording_model(model, recorder):
    """``model`` with every kernel call timed into ``recorder`` (shares the parameters)."""
    return _wrapped(model, recorder, None, True)


def cost_model(model, table, method="mgrit"):
    """A cost-only copy of ``model`` (shares the parameters): its kernel calls charge
    ``table``'s seconds (plus ``method``'s Python overhead per call) to the running virtual
    rank and return zero placeholders. Fused step kinds (dense, conv 2D/3D) and recurrent ones (GRU, RNN)."""
    if not (getattr(model.step, "fused", False) or getattr(model.step, "shared", False)):
        raise ValueError("cost-only models need a fused step kind (dense or conv) or a "
                         "recurrent one (GRU, RNN); not batch norm, dropout or conv 3D")
    if not isinstance(table, CostTable):
        raise TypeError(f"table must be a CostTable, got {type(table).__name__}")
    return _wrapped(model, table, method, False)


def _fit(points):
    """(a, b) >= 0 with seconds ~ a + b k from [(k, seconds)]: least squares of the relative
    errors over the medians of each k (a call of a few states as well priced as one of
    hundreds); one k only: a = 0."""
    by_k = {}
    for k, t in points:
        by_k.setdefault(k, []).append(t)
    ks = np.array(sorted(by_k), dtype=float)
    ts = np.array([np.median(by_k[k]) for k in sorted(by_k)])
    if len(ks) == 1 or np.ptp(ks) == 0:
        return 0.0, float(ts[0] / max(ks[0], 1.0))
    w = 1.0 / np.maximum(ts, 0.05 * ts.max() + 1e-300)  # (a zero median: no runaway weight)
    b, a = np.polyfit(ks, ts, 1, w=w)
    if a < 0:
        a, b = 0.0, float(np.sum(ks * ts * w * w) / np.sum(ks * ks * w * w))
    if b < 0:
        a, b = float(np.median(ts)), 0.0
    return float(a), float(b)


class CostTable:
    """Seconds per kernel call, Python overhead per training method and the network.

    Parameters
    ----------
    entries : dict
        ``"op|shape|dtype"`` -> (a, b): a call with k states costs ``a + b k`` seconds.
    overhead : dict
        training method ('serial', 'layerwise', 'pipeline', 'mgrit') -> (a_o, b_o): seconds of
        Python work outside the kernels per kernel call, ``a_o + b_o k`` for a call handling k
        states (a plain number: per call).
    alpha, beta : float
        Message latency (s) and bandwidth (bytes/s).
    meta : dict
        Where and how it was measured.
    """

    def __init__(self, entries, overhead=None, alpha=1e-6, beta=1e10, meta=None):
        self.entries = {k: (float(a), float(b)) for k, (a, b) in entries.items()}
        self.overhead = {m: ([float(v) for v in o] if isinstance(o, (list, tuple)) else
                             float(o)) for m, o in dict(overhead or {}).items()}
        self.alpha, self.beta, self.meta = float(alpha), float(beta), dict(meta or {})
        #: ops looked up at a shape the table does not hold (scaled from another shape)
        self.inexact = set()
        self._index = {}
        for key, ab in self.entries.items():
            op, shape, dtype = key.split("|")
            self._index.setdefault((op, dtype), []).append((json.loads(shape), ab))
        self._cache = {}
        self._tape_prices = {}  # :func:`tape_seconds` of captured cycles, by what rows cost

    @staticmethod
    def key(op, shape, dtype):
        return f"{op}|{json.dumps(list(shape))}|{dtype}"

    @classmethod
    def from_samples(cls, samples, **kw):
        groups = {}
        for op, shape, dtype, k, t in samples:
            groups.setdefault(cls.key(op, shape, dtype), []).append((k, t))
        return cls({key: _fit(pts) for key, pts in groups.items()}, **kw)

    def seconds(self, op, shape, dtype, k, method=None, missing=None):
        """Seconds of one call of ``op`` with ``k`` states of ``shape``: the table's ``a + b k``
        (for a shape not measured: the entry of the same op with the nearest number of elements,
        b scaled by the ratio of elements), plus ``method``'s overhead. ``missing``: the
        ``a + b k`` of an op the table lacks (None: KeyError)."""
        return self.charges(op, shape, dtype, k, method, missing)[0]

    def charges(self, op, shape, dtype, k, method=None, missing=None):
        """(:meth:`seconds`, the bound's part ``b k``: the call's work without its per-call
        ``a`` and the Python overhead; see :meth:`without_orchestration`)."""
        a, b = self._ab(op, tuple(shape), dtype, missing)
        return (a + b * k + (self.overhead_seconds(method, k) if method else 0.0), b * k)

    def overhead_seconds(self, method, k):
        """``method``'s Python overhead of a call handling ``k`` states: ``a_o + b_o k`` (an
        older table's single number: per call)."""
        o = self.overhead.get(method, 0.0)
        if isinstance(o, (list, tuple)):
            return o[0] + o[1] * k
        return o

    def has(self, op, dtype):
        """Whether the table holds ``op`` in ``dtype`` at any shape (the calibrated backend
        called it)."""
        return (op, str(dtype)) in self._index

    def per_state(self, op, shape, dtype, missing=None):
        """The seconds per state (``b``) of ``op`` at ``shape``: what a row of ``op`` costs
        inside a captured cycle (no call of its own)."""
        return self._ab(op, tuple(shape), dtype, missing)[1]

    def _ab(self, op, shape, dtype, missing):
        ck = (op, shape, dtype)
        ab = self._cache.get(ck)
        if ab is None:
            cands = self._index.get((op, dtype))
            if not cands and ":" in op:  # another mode of the same points kernel (one pass)
                base = op.split(":")[0] + ":"
                cands = [c for (o, d), cs in sorted(self._index.items())
                         if d == dtype and o.startswith(base) for c in cs]
            if not cands and op.startswith("points_"):  # a point is a step and a combination
                cands = self._index.get(("chains_" + op.split("_")[1].split(":")[0], dtype))
                if cands:
                    self.inexact.add(f"{op} priced as a chain step")
            if not cands and missing is not None:
                return missing, missing
            if not cands:
                raise KeyError(f"the cost table has no entry for {op!r} in {dtype} (calibrate "
                               f"it with the same --model and --dtype: python -m mgnn bench "
                               f"calibrate)")
            size = math.prod(shape)
            exact = [ab for s, ab in cands if tuple(s) == tuple(shape)]
            if exact:
                ab = exact[0]
            else:
                self.inexact.add(f"{op} at {tuple(shape)}")
                s, (a, b) = min(cands, key=lambda c: (abs(math.log(max(math.prod(c[0]), 1)
                                                                  / max(size, 1))), c[0]))
                ab = (a, b * size / max(math.prod(s), 1))
            self._cache[ck] = ab
        return ab

    def to_dict(self):
        return {"format": "mgnn-costs-1", "alpha": self.alpha, "beta": self.beta,
                "overhead": self.overhead, "meta": self.meta,
                "entries": {k: list(v) for k, v in sorted(self.entries.items())}}

    @classmethod
    def from_dict(cls, d):
        if not isinstance(d, dict) or d.get("format") != "mgnn-costs-1":
            raise ValueError("not an mgnn cost table (format 'mgnn-costs-1')")
        return cls({k: tuple(v) for k, v in d["entries"].items()}, d.get("overhead"),
                   d["alpha"], d["beta"], d.get("meta"))

    @classmethod
    def median(cls, tables):
        """The median of several calibrations of one configuration, number by number (each
        entry's a and b, each method's overhead, alpha and beta): one calibration taken while
        the machine was slow does not move it. The meta of the first, with ``calibrations``
        (their count). ValueError unless every table prices the same ops and methods."""
        tables = list(tables)
        if not tables or not all(isinstance(t, CostTable) for t in tables):
            raise TypeError(f"median of cost tables: CostTables expected, got {tables!r}")
        first = tables[0]
        for t in tables[1:]:
            if set(t.entries) != set(first.entries) or set(t.overhead) != set(first.overhead) \
                    or any(np.shape(t.overhead[m]) != np.shape(first.overhead[m])
                           for m in first.overhead):
                raise ValueError("median of cost tables: they price different ops or methods "
                                 "(calibrations of one configuration expected)")

        def mid(values):
            m = np.median(np.asarray(values, dtype=np.float64), axis=0)
            return float(m) if m.ndim == 0 else [float(v) for v in m]
        entries = {k: tuple(mid([t.entries[k] for t in tables])) for k in first.entries}
        overhead = {m: mid([t.overhead[m] for t in tables]) for m in first.overhead}
        return cls(entries, overhead, mid([t.alpha for t in tables]),
                   mid([t.beta for t in tables]), dict(first.meta, calibrations=len(tables)))

    def save(self, path):
        """Write as JSON, atomically (a temporary file renamed into place)."""
        path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".costs-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_dict(), f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path):
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not JSON ({exc})") from None
        try:
            return cls.from_dict(d)
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"{path}: {exc}") from None

    def without_orchestration(self):
        """The table of the critical-path bound: every kernel call its per-state work only
        (``b k``; no per-call ``a``), no Python overhead, a replay free but its rows
        (``run_tape`` 0); the same network. A run charged from it is MGRIT's dependency chain of steps and messages
        with zero orchestration cost; a cost-only run charges the same to its shadow clock
        (:mod:`mgnn.comm.virtual`), so one run gives both."""
        entries = {k: (0.0, 0.0 if k.startswith("run_tape|") else b)
                   for k, (a, b) in self.entries.items()}  # (still replayed: a free replay)
        return CostTable(entries, {}, self.alpha, self.beta,
                         dict(self.meta, bound="without orchestration"))

    def with_network(self, alpha, beta, name=None):
        """The same kernel costs on another network."""
        meta = dict(self.meta, network=name or "custom")
        return CostTable(self.entries, self.overhead, alpha, beta, meta)


def machine_meta():
    """Where a table was measured."""
    return {"host": platform.node(), "machine": platform.machine(),
            "processor": platform.processor(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "numpy": np.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def tape_seconds(table, rows, shape, dtype, adjoint, store_sizes):
    """Seconds of the kernel work in the rows of a captured cycle (:mod:`mgnn.backend.tape`) of
    states ``shape``: each row charged what the engine call it replaces costs per state in
    ``table`` (no call of its own): a chain step ``chains_{forward,adjoint}``, a point or a
    chain's tail ``points_*:MODE``, a shared coarse step and a correction one
    ``vector:correct`` pass, an injection or a copy one ``vector:copy`` pass per store written.
    The replay's own cost (dispatch, per row) is the table's ``run_tape`` entry."""
    rows = np.asarray(rows).reshape(-1, T.COLS)
    # ranks replay tapes that differ in slots and layers only: price each distinct sequence of
    # what a row costs once per table
    what = np.concatenate([rows[:, [T.OP, T.N, T.MODE, T.LEN]],
                           rows[:, [T.R, T.G, T.SHARE_R, T.CORR_SLOT, T.INJ_SLOT, T.INJ_G]] >= 0],
                          axis=1)
    copies = rows[rows[:, T.OP] == T.COPY, T.R]  # (a COPY row's price: its store's size)
    key = (what.tobytes(), copies.tobytes(), tuple(shape), str(dtype), bool(adjoint),
           None if store_sizes is None else tuple(store_sizes))
    cache = table._tape_prices
    if key not in cache:
        cache[key] = _tape_seconds(table, rows, shape, dtype, adjoint, store_sizes)
    return cache[key]


def _tape_seconds(table, rows, shape, dtype, adjoint, store_sizes):
    d = "adjoint" if adjoint else "forward"
    op = rows[:, T.OP]

    def b(name):
        return table.per_state(name, shape, dtype, missing=0.0 if name.startswith("vector")
                               else None)

    def points(modes):
        m, n = np.unique(modes, return_counts=True)
        return sum(b(f"points_{d}:{int(mode)}") * int(c) for mode, c in zip(m, n))

    copy, correct = b("vector:copy"), b("vector:correct")
    chain = rows[op == T.CHAIN]
    t = b(f"chains_{d}") * float(chain[:, T.N].sum())
    t += points(chain[chain[:, T.R] >= 0, T.MODE]) + points(rows[op == T.POINT, T.MODE])
    t += correct * float(np.count_nonzero(chain[:, T.SHARE_R] >= 0)
                         + np.count_nonzero(chain[:, T.CORR_SLOT] >= 0))
    inj = chain[chain[:, T.INJ_SLOT] >= 0]
    t += copy * float(len(inj) + np.count_nonzero(inj[:, T.INJ_G] >= 0))
    for r in rows[op == T.INJECT]:
        t += copy * float(r[T.LEN] * (1 + (r[T.G] >= 0)))
    t += correct * float(rows[op == T.CORRECT, T.LEN].sum())
    for r in rows[op == T.COPY]:
        t += copy * float(store_sizes[r[T.R]])
    return float(t)


def vector_samples(shape, dtype, ks=(1, 4, 16), repeats=20):
    """(op, shape, dtype, k, seconds) samples of the engine's vector passes over ``k`` states
    of ``shape``: ``vector:copy`` (an injection) and ``vector:correct`` (u + (v - w), a FAS
    correction), the fastest of ``repeats`` each."""
    out = []
    for k in ks:
        a, c, d = (np.ones((k,) + tuple(shape), dtype) for _ in range(3))
        e = np.empty_like(a)
        for op, fn in (("vector:copy", lambda: np.copyto(e, a)),
                       ("vector:correct", lambda: np.add(a, np.subtract(c, d, out=e), out=a))):
            best = math.inf
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            out.append((op, tuple(shape), str(np.dtype(dtype)), k, best))
    return out


def with_tape_entries(table, tapes):
    """``table`` with a ``run_tape`` entry per state shape fitted to the replays ``tapes``
    (:attr:`Recorder.tapes`): a replay's measured seconds less its rows' kernels
    (:func:`tape_seconds`) as ``a + c rows``."""
    groups = {}
    for shape, rows, adjoint, sizes, dtype, seconds in tapes:
        extra = seconds - tape_seconds(table, rows, shape, dtype, adjoint, sizes)
        groups.setdefault(CostTable.key("run_tape", shape, dtype), []).append(
            (len(rows), max(extra, 0.0)))
    entries = dict(table.entries)
    entries.update({key: _fit(pts) for key, pts in groups.items()})
    return CostTable(entries, table.overhead, table.alpha, table.beta, table.meta)
