"""MGRIT options (XBraid's meanings; docs/design.md, "MGRIT"), validated on construction."""
import dataclasses
import math
import numbers
from dataclasses import dataclass, field

#: The default ``tol``, meant for float64 states (others: :meth:`MGRITOptions.for_dtype`).
DEFAULT_TOL = 1e-10


class _DefaultTol(float):
    """The default ``tol`` (1e-10, compares and prints as that float); marks it as not chosen by
    the user, so :meth:`MGRITOptions.for_dtype` may adapt it to the precision of the states."""

    __slots__ = ()


def tol_limits(dtype):
    """(floor, default) absolute tolerances for states of ``dtype``.

    floor = 10 eps: a smaller ``tol > 0`` cannot be resolved (float32: 1.2e-6, float64: 2.2e-15);
    default = max(1e-10, 1000 eps) (float32: 1.2e-4, float64: 1e-10). (0, 1e-10) for dtypes that
    are not inexact (or not NumPy-like).
    """
    import numpy as np
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return 0.0, DEFAULT_TOL
    if dt.kind not in "fc":
        return 0.0, DEFAULT_TOL
    eps = float(np.finfo(dt).eps)
    return 10 * eps, max(DEFAULT_TOL, 1000 * eps)


def _int(name, v, lo):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"MGRITOptions.{name} must be an int, got {v!r}")
    if v < lo:
        raise ValueError(f"MGRITOptions.{name} must be >= {lo}, got {v!r}")
    return int(v)


@dataclass(frozen=True)
class MGRITOptions:
    """Options of an MGRIT solve.

    Parameters
    ----------
    cf : int
        Coarsening factor (>= 2).
    max_levels : int
        Most levels (1 = sequential stepping).
    nrelax : int or sequence of int
        (F, C) sweeps after the first F per level: 0 = F-relaxation, 1 = FCF. A sequence gives one
        value per level (the last repeats).
    tol : float
        Absolute stopping tolerance on the XBraid residual norm (0 disables it: a fixed number of
        cycles). The default 1e-10 is adapted to the states' precision when a solve starts
        (float32: 1.2e-4, see :meth:`for_dtype`); an explicit ``0 < tol < 10 eps`` of the states'
        dtype (float32: 1.2e-6) is rejected with a ValueError.
    max_iter : int
        Cycle budget.
    skip_downcycle : bool
        XBraid's skip: cycle 0 is a cascadic initial guess without relaxation and without r_0.
    min_coarse : int
        A level is added only if it keeps at least this many intervals.
    cycle : {'V', 'F'}
        Cycle type (an F-cycle gives each coarse problem an F-cycle and then a V-cycle).
    warn_not_converged : bool
        Warn (:class:`mgnn.mgrit.solver.NotConvergedWarning`, on the first rank of the layer
        communicator) when ``tol > 0`` and ``max_iter`` cycles did not reach it;
        :attr:`MGRITResult.converged` says so on every rank either way. Set it False for a
        deliberately small cycle budget (training with 2 forward / 1 adjoint cycles).
    """

    cf: int = 2
    max_levels: int = 2
    nrelax: object = 1
    tol: float = _DefaultTol(DEFAULT_TOL)
    max_iter: int = 20
    skip_downcycle: bool = False
    min_coarse: int = 2
    cycle: str = "V"
    warn_not_converged: bool = True
    _nrelax: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        _int("cf", self.cf, 2)
        _int("max_levels", self.max_levels, 1)
        _int("max_iter", self.max_iter, 1)
        _int("min_coarse", self.min_coarse, 1)
        nr = self.nrelax if isinstance(self.nrelax, (list, tuple)) else (self.nrelax,)
        if not nr:
            raise ValueError("MGRITOptions.nrelax must not be empty")
        object.__setattr__(self, "_nrelax", tuple(_int("nrelax", v, 0) for v in nr))
        if (isinstance(self.tol, bool) or not isinstance(self.tol, numbers.Real)
                or not math.isfinite(self.tol) or self.tol < 0):
            raise ValueError(f"MGRITOptions.tol must be a finite number >= 0, got {self.tol!r}")
        for name in ("skip_downcycle", "warn_not_converged"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"MGRITOptions.{name} must be a bool, got "
                                f"{getattr(self, name)!r}")
        if self.cycle not in ("V", "F"):
            raise ValueError(f"MGRITOptions.cycle must be 'V' or 'F', got {self.cycle!r}")

    def for_dtype(self, dtype):
        """These options for states of ``dtype`` (what a solve uses).

        The default ``tol`` becomes max(1e-10, 1000 eps) of ``dtype`` (float32: 1.2e-4); an
        explicit ``0 < tol < 10 eps`` (float32: 1.2e-6) raises ValueError naming both. Returns
        ``self`` when nothing changes.
        """
        floor, default = tol_limits(dtype)
        if isinstance(self.tol, _DefaultTol):
            return self if default == self.tol else dataclasses.replace(self, tol=default)
        if 0 < self.tol < floor:
            import numpy as np
            raise ValueError(f"MGRITOptions.tol={self.tol!r} is below what {np.dtype(dtype).name} "
                             f"states resolve "
                             f"(10 eps = {floor:.2g}): use tol >= {floor:.2g}, or tol=0 for a "
                             f"fixed number of cycles (max_iter)")
        return self

    def nrelax_on(self, level):
        """Number of (C, F) sweeps after the first F on ``level``."""
        return self._nrelax[min(level, len(self._nrelax) - 1)]
