"""The gradient guard: layer-parallel training that never silently trains on a wrong gradient.

Training runs MGRIT with a fixed, small cycle budget, so its gradients are inexact. On
contractive dynamics (ResNets, short-sequence GRUs) that error is a few tens of percent, noise
SGD tolerates; on dynamics MGRIT cannot resolve in a few cycles (trained long-sequence GRUs,
oscillators) the gradient is wrong by 100 % or more and training collapses. The guard tells the
two apart and, per training step, decides one of

``'accept'``
    use the MGRIT gradient (everything as without a guard);
``'iterate'``
    the fixed budget was not enough but more cycles with FCF relaxation are: use those options
    from now on (:attr:`GradientGuard.escalated`), until a later check finds the configured
    ones passing again;
``'fallback'``
    propagate exactly for this step (the sequential hand-off across ranks) and for the next
    ``backoff`` steps (``'exact'``), then try MGRIT again (doubling ``backoff`` after every
    failed retry, back to its start after a success).

What it reads:

* every step, for free, the residual histories the solves already have: a last cycle that does
  not contract (r_k >= r_{k-1}) or a last residual grown ``growth`` times over the one of the
  last check triggers a check this step;
* at the first MGRIT step, every ``check_every`` MGRIT steps and when triggered, a *check*: the
  exact gradient of the same batch (one exact step), the true relative error
  ``|g_mgrit - g_exact| / |g_exact|`` and the cosine of the angle between the two. With an
  error <= ``tol`` and a cosine >= ``min_cosine`` the MGRIT gradient is kept (so a check changes
  no bit of training); else the guard iterates further or falls back, using the exact gradient
  it already has.

Between checks ``error_estimate`` is the last measured error scaled by the growth of the
residuals since that check. This module holds the decisions only; :class:`mgnn.LayerParallel`
runs the solves and feeds it numbers that are already reduced over every rank, so every rank
takes the same branch.
"""
import dataclasses
import math
import numbers
import warnings


class GuardWarning(UserWarning):
    """The gradient guard fell back to exact propagation (issued once per guard)."""


def _number(name, value, lo, integer=False):
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"GradientGuard.{name} must be {'an int' if integer else 'a number'}, "
                        f"got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"GradientGuard.{name} must be finite, got {value!r}")
    if value < lo:
        raise ValueError(f"GradientGuard.{name} must be >= {lo}, got {value!r}")
    return value


class GradientGuard:
    """Decisions of the gradient guard (see the module docstring); one per LayerParallel.

    Parameters
    ----------
    tol : float
        Largest relative gradient error accepted (default 1.0). What SGD tolerates is measured
        (docs/design.md): MNIST conv and dense ResNets with 2/1 cycles train as well as with
        exact gradients at errors up to 0.56 (cosines >= 0.84, the MGRIT gradient mostly
        shorter); trained long-sequence GRUs measure 1e2 to 1e7.
    min_cosine : float
        Least cosine between the MGRIT and the exact gradient accepted (default 0.5: a direction
        within 60 degrees; the oscillating GRU's is 0.3, with an error of 1.0).
    check_every : int
        An exact check every this many MGRIT steps (default 50: one exact step per 50, ~2 % of
        the time where an exact step costs what an MGRIT step does).
    growth : float
        A last residual this many times the one at the last check triggers a check (default 10).
    backoff : int
        Exact steps after the first fallback before MGRIT is tried again (default 8); doubled
        after every failed retry up to ``max_backoff`` (default 512).
    escalate : bool
        Try more cycles (twice the budget, FCF relaxation, no skipped down-cycle) on a failed
        check before falling back (default True).
    """

    def __init__(self, tol=1.0, min_cosine=0.5, check_every=50, growth=10.0, backoff=8,
                 max_backoff=512, escalate=True):
        self.tol = float(_number("tol", tol, 0))
        if self.tol <= 0:
            raise ValueError(f"GradientGuard.tol must be > 0, got {tol!r}")
        self.min_cosine = float(_number("min_cosine", min_cosine, -1))
        if self.min_cosine > 1:
            raise ValueError(f"GradientGuard.min_cosine must be <= 1, got {min_cosine!r}")
        self.check_every = int(_number("check_every", check_every, 1, integer=True))
        self.growth = float(_number("growth", growth, 1))
        self.backoff0 = int(_number("backoff", backoff, 1, integer=True))
        self.max_backoff = int(_number("max_backoff", max_backoff, self.backoff0, integer=True))
        if not isinstance(escalate, bool):
            raise TypeError(f"GradientGuard.escalate must be a bool, got {escalate!r}")
        self.escalate = escalate
        self.reset()

    def reset(self):
        """Forget every decision and count (e.g. after a warm-up step that trained nothing)."""
        self.escalated = False      # the escalated options are in use
        self.backoff = self.backoff0
        self.exact_left = 0         # exact steps before MGRIT is tried again
        self.retry = False          # the next MGRIT step follows a fallback: check it
        self.since_check = None     # MGRIT steps since the last check (None: never checked)
        self.reference = None       # (forward, adjoint) last residuals at the last check
        self.error = None           # the error measured at the last check
        self.warned = False
        self.counts = {"steps": 0, "accept": 0, "iterate": 0, "fallback": 0, "exact": 0,
                       "checks": 0}
        self.seconds = 0.0          # spent in checks (exact solves, escalated tries)

    def summary(self):
        """Counts over the run and the fraction of steps propagated exactly (fallbacks and the
        exact steps after them), for reports."""
        c = dict(self.counts)
        c["exact_fraction"] = (c["fallback"] + c["exact"]) / c["steps"] if c["steps"] else 0.0
        c["escalated"] = self.escalated
        c["seconds"] = self.seconds
        c["last_error"] = self.error
        return c

    def __repr__(self):
        return (f"GradientGuard(tol={self.tol}, min_cosine={self.min_cosine}, "
                f"check_every={self.check_every}, "
                f"growth={self.growth}, backoff={self.backoff0}, max_backoff={self.max_backoff}, "
                f"escalate={self.escalate})")

    # -------------------------------------------------------------------------- before a step
    def exact_now(self):
        """True while a fallback lasts: propagate exactly this step without trying MGRIT."""
        return self.exact_left > 0

    # -------------------------------------------------------------------------- after MGRIT
    def trigger(self, forward, adjoint):
        """Why this MGRIT step needs a check (a str), or None. ``forward``, ``adjoint``: the
        solves' residual histories (lists of float, reduced over every rank; empty where no
        residual was measured)."""
        if self.since_check is None:
            return "first MGRIT step"
        if self.retry:
            return "MGRIT again after a fallback"
        for name, res in (("forward", forward), ("adjoint", adjoint)):
            if any(not math.isfinite(r) for r in res):
                return f"{name} residual not finite"
            if len(res) >= 2 and res[-1] >= res[-2]:
                return f"{name} last cycle did not contract ({res[-2]:.3g} -> {res[-1]:.3g})"
        growth = self._growth(forward, adjoint)
        if growth > self.growth:
            return f"residual grew {growth:.3g}x since the last check"
        if self.since_check + 1 >= self.check_every:
            return f"periodic (every {self.check_every} MGRIT steps)"
        return None

    def _growth(self, forward, adjoint):
        """Largest ratio of a last residual to the one at the last check (1 where unknown)."""
        g = 1.0
        for res, ref in zip((forward, adjoint), self.reference or (None, None)):
            if res and ref:
                g = max(g, res[-1] / ref)
        return g

    def judge(self, error, cosine):
        """(passed, a sentence with the numbers) of a check's relative error and cosine."""
        bad = []
        if not error <= self.tol:  # (NaN fails)
            bad.append(f"error {error:.3g} > tol {self.tol}")
        if not cosine >= self.min_cosine:
            bad.append(f"cosine {cosine:.3g} < {self.min_cosine}")
        if bad:
            return False, "gradient " + " and ".join(bad)
        return True, f"gradient error {error:.3g} <= {self.tol}, cosine {cosine:.3g}"

    def estimate(self, forward, adjoint):
        """Estimated relative gradient error of an unchecked MGRIT step: the last check's error
        times the residuals' growth since (None before the first check)."""
        if self.error is None:
            return None
        return self.error * self._growth(forward, adjoint)

    def accepted(self, forward, adjoint, error=None):
        """Record an accepted MGRIT step (``error``: measured by a check this step)."""
        self.counts["steps"] += 1
        self.counts["accept"] += 1
        if error is None:
            self.since_check += 1
            return
        self._checked(forward, adjoint, error)

    def _checked(self, forward, adjoint, error):
        self.counts["checks"] += 1
        self.since_check = 0
        self.retry = False
        self.error = error
        self.reference = (forward[-1] if forward else None, adjoint[-1] if adjoint else None)
        self.backoff = self.backoff0

    def relaxed(self, forward, adjoint, error):
        """Record a passing check under the escalated options where the configured ones passed
        too (``forward``, ``adjoint``, ``error``: theirs): back to the configured options."""
        self.escalated = False
        self.accepted(forward, adjoint, error)

    def iterated(self, forward, adjoint, error):
        """Record a step whose check failed but whose escalated solve passed."""
        self.counts["steps"] += 1
        self.counts["iterate"] += 1
        self.escalated = True
        self._checked(forward, adjoint, error)

    def fell_back(self, error):
        """Record a failed check: this step used the exact gradient; the next ``backoff`` steps
        are exact. Returns the number of exact steps scheduled."""
        self.counts["steps"] += 1
        self.counts["fallback"] += 1
        self.counts["checks"] += 1
        self.error = error
        self.since_check = 0
        self.retry = True
        self.exact_left = self.backoff
        scheduled = self.backoff
        self.backoff = min(2 * self.backoff, self.max_backoff)
        return scheduled

    def exact_step(self):
        """Record an exact step of a fallback."""
        self.counts["steps"] += 1
        self.counts["exact"] += 1
        self.exact_left -= 1

    def warn_once(self, message, emit=True, stacklevel=4):
        """Issue ``message`` as a :class:`GuardWarning` the first time only (where ``emit``: one
        rank of a distributed run speaks for all); True the first time."""
        if self.warned:
            return False
        self.warned = True
        if emit:
            warnings.warn(message, GuardWarning, stacklevel=stacklevel)
        return True


def escalated_options(opts):
    """The guard's "iterate further" options for MGRITOptions ``opts``: twice the cycles, FCF
    relaxation on every level and no skipped down-cycle (what keeps trained and spatially
    coarsened solves convergent longest, docs/design.md); None for None."""
    if opts is None:
        return None
    return dataclasses.replace(opts, max_iter=2 * opts.max_iter, nrelax=1, skip_downcycle=False)


def make_guard(guard):
    """A :class:`GradientGuard` for LayerParallel's ``guard`` argument: 'auto' (the defaults),
    None or 'off' (no guard: returns None), or a GradientGuard (used as given)."""
    if guard is None or (isinstance(guard, str) and guard == "off"):
        return None
    if isinstance(guard, str) and guard == "auto":
        return GradientGuard()
    if isinstance(guard, GradientGuard):
        return guard
    if isinstance(guard, str):
        raise ValueError(f"guard must be 'auto', 'off', None or a GradientGuard, got {guard!r}")
    raise TypeError(f"guard must be 'auto', 'off', None or a GradientGuard, got {guard!r} "
                    f"({type(guard).__name__})")
