"""The only place that calls mpi4py: layout, halo exchange, device staging (to come)."""
