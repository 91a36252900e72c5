"""NumPy reference backend: slow, obvious, the test oracle for every other backend.

Conventions shared by every backend (see :mod:`mgnn.backend`):

* arrays are C-contiguous float32 or float64, all of one dtype; ``h`` is a scalar of that dtype;
* ``act`` is an integer activation code (0 tanh, 1 relu, 2 identity; see ``mgnn._config``);
* ``residual`` selects ``y = x + h sigma(z)`` (a residual step) or ``y = h sigma(z)`` (opening
  layers and affine closings use ``h = 1``);
* ``deriv`` is ``sigma'(z)`` at the pre-activation ``z``, shape of ``y``.

One module per layer kind, as :mod:`..numba_cpu` and ``kernels/``: ``activations``, ``dense``,
``conv``, ``conv3d``, ``pool_loss``, ``batch_norm``, ``recurrent``, and the contracts, checks and
reference loops of the engine's kernels, ``stacked`` and ``stacked_grads``. The backend is this
package's namespace: every name of those modules is re-exported here, plus the interval-batched,
stacked and stacked-gradient loops built over the single kernels.
"""
import numpy as np

from . import (activations, batch_norm, conv, conv3d, dense, pool_loss, recurrent, stacked,
               stacked_grads)

name = "numpy"
xp = np  #: array module of this backend
batched_relaxation = False  #: MGRIT advances F-intervals one by one here
stacked_states = True  #: has the stacked-state kernels (:data:`mgnn.backend.STACKED_KERNELS`)

_KINDS = (activations, dense, conv, conv3d, pool_loss, batch_norm, recurrent, stacked,
          stacked_grads)


def _export():
    import sys
    from ..batched_loops import batched_kernels
    here, me = globals(), sys.modules[__name__]
    for module in _KINDS:
        here.update((k, v) for k, v in vars(module).items()
                    if not k.startswith("__") and k not in here)
    here.update(batched_kernels(me))
    here.update(stacked.stacked_loops(me))
    here.update(stacked_grads.stacked_grad_loops(me))


_export()
