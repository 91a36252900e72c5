"""The only place that calls mpi4py: communicator layout, typed halo messages, reductions,
failure handling, per-phase timers and the BLAS/Numba threads of each rank. Serial runs
(``comm=None``) never import mpi4py.
"""
from .halo import Halo, SerialHalo, make_halo, wait_request
from .device import (DeviceHalo, cuda_aware_mpi, make_device_halo,  # noqa: F401 (re-export)
                     select_device)
from .layout import Layout, abort_on_error, abort_on_uncaught, agree_on_errors, polled_barrier
from .threads import (apply_threads, configure_threads, describe as describe_threads,  # noqa: F401
                      restore_threads, snapshot_threads)

__all__ = ["Halo", "SerialHalo", "make_halo", "Layout", "abort_on_error", "abort_on_uncaught",
           "agree_on_errors", "apply_threads", "configure_threads", "describe_threads",
           "polled_barrier", "wait_request"]
