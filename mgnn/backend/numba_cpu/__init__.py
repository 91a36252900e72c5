"""Numba CPU backend: ``@njit(cache=True)`` kernels with the signatures of :mod:`..numpy_ref`.

Matrix products go to BLAS through ``np.dot`` inside the kernels with fused bias, activation and
residual epilogues; convolutions are direct SIMD-tiled loops parallel over the batch (``prange``).
The layer sweeps run a whole block of residual steps in one call, so the per-layer cost of a small
network is a few microseconds instead of a Python dispatch per layer. The stacked-state kernels
(:data:`mgnn.backend.STACKED_KERNELS`) run every chain of a relaxation wave in one call, chains on
Numba's threads (``prange``) when it has more than one.

One module per layer kind, as ``kernels/`` has one CUDA file per kind:

==================  =============================================================================
``activations``     mgnn's ``njit`` (NumPy error model, cache-race safe), sigma and sigma'
``dense``           dense steps: forward, derivative, vjps, sweeps
``conv``            2D 3x3 convolution steps on the flat padded layout (SIMD tiles)
``conv3d``          3D 3x3x3 convolution steps (the conv core, 27 taps)
``pool_loss``       average pooling, softmax cross-entropy
``batch_norm``      batch norm + activation, dropout masks
``composed``        stacked chains, points, linearisation and gradients of the composed dense step
``recurrent``       GRU/RNN gates, sweeps, chains and points over sequence time
``grid_ops``        spatial coarsening's grid transfers: fixed windows, sparse rows along an axis
``stacked``         stacked-state chains, residuals and FAS points (the MGRIT engine's kernels)
``tapes``           captured MGRIT cycles replayed in one call
``stacked_grads``   sigma' and parameter gradients of every owned layer from the solver's stores
==================  =============================================================================

The backend is this package's namespace: every name of those modules is re-exported here (the
solver and the tests call ``numba_cpu.<kernel>``), plus the interval-batched loops of
:mod:`..batched_loops`. The vector/FAS operations are :class:`..fas_ops.NumbaOps`.
"""
import numpy as np

from . import (activations, batch_norm, composed, conv, conv3d, dense, grid_ops, pool_loss,
               recurrent, stacked, stacked_grads, tapes)

name = "numba"
xp = np  #: array module of this backend
batched_relaxation = False  #: batching gains nothing on the CPU (see numpy_ref)

_KINDS = (activations, dense, conv, conv3d, pool_loss, batch_norm, composed, recurrent, grid_ops,
          stacked, tapes, stacked_grads)


def _export():
    import sys
    from ..batched_loops import batched_kernels
    here = globals()
    for module in _KINDS:
        here.update((k, v) for k, v in vars(module).items()
                    if not k.startswith("__") and k not in here)
    here.update(batched_kernels(sys.modules[__name__]))


_export()
