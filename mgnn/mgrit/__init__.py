"""MGRIT across layers: options, hierarchy (index maths), FAS V-cycle solver over a propagator.

Never imports :mod:`mgnn.blocks`: networks plug in through the propagator protocol.
"""
from .hierarchy import (auto_levels, chain_critical_path, cycle_critical_path, cycle_work,
                        intervals, level_sizes, solve_critical_path)
from .options import MGRITOptions
from .solver import (DivergenceError, MGRITResult, MGRITSolver, NotConvergedWarning,
                     hierarchy)

__all__ = ["MGRITOptions", "MGRITSolver", "MGRITResult", "DivergenceError",
           "NotConvergedWarning", "level_sizes",
           "intervals", "cycle_work", "hierarchy", "cycle_critical_path",
           "solve_critical_path", "chain_critical_path", "auto_levels"]
