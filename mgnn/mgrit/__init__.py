"""MGRIT across layers: options, hierarchy, relaxation, cycles, solver (to come)."""
