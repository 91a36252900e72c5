"""MGRIT options (XBraid's meanings; DESIGN.md section 2), validated on construction."""
import math
import numbers
from dataclasses import dataclass, field


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
        Absolute stopping tolerance on the XBraid residual norm (0 disables it).
    max_iter : int
        Cycle budget.
    skip_downcycle : bool
        XBraid's skip: cycle 0 is a cascadic initial guess without relaxation and without r_0.
    min_coarse : int
        A level is added only if it keeps at least this many intervals.
    cycle : {'V', 'F'}
        Cycle type (an F-cycle gives each coarse problem an F-cycle and then a V-cycle).
    """

    cf: int = 2
    max_levels: int = 2
    nrelax: object = 1
    tol: float = 1e-10
    max_iter: int = 20
    skip_downcycle: bool = False
    min_coarse: int = 2
    cycle: str = "V"
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
        if not isinstance(self.skip_downcycle, bool):
            raise TypeError(f"MGRITOptions.skip_downcycle must be a bool, got "
                            f"{self.skip_downcycle!r}")
        if self.cycle not in ("V", "F"):
            raise ValueError(f"MGRITOptions.cycle must be 'V' or 'F', got {self.cycle!r}")

    def nrelax_on(self, level):
        """Number of (C, F) sweeps after the first F on ``level``."""
        return self._nrelax[min(level, len(self._nrelax) - 1)]
