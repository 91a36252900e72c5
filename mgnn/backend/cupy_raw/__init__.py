"""The GPU backend's RawKernels (CUDA C in ``kernels/*.cu``) and their launch code.

:class:`RawBackend` implements the kernel contract of :mod:`mgnn.backend.numpy_ref` (the
interval-batched kernels, and the stacked-state kernels of ``mgnn.backend.STACKED_KERNELS``: one
launch per relaxation wave, no pointer arrays) over a *launcher*: :class:`CupyLauncher`
(``cupy.RawModule`` on a GPU, CuPy arrays) or
:class:`mgnn.backend.host_emulation.EmulationLauncher` (the same CUDA C compiled for the host,
NumPy arrays). Grid and block shapes come from the launcher's geometry, which is
also compiled into the kernels (``-DMGNN_BM=...``), so both always agree.

One module per kernel family, as ``kernels/`` has one CUDA file per kind: ``launch`` (sources,
compile options, geometry, the CuPy launcher, cuBLAS helpers), ``plans`` (index plans of the
stacked launches), ``base`` (outputs, workspaces, launches), and the mixins ``dense``, ``conv``,
``conv3d``, ``vector``, ``stacked``, ``pool_loss``, ``batch_norm``, ``recurrent``, which
:class:`RawBackend` combines. Every name of ``launch`` and ``plans`` is re-exported here.

Importing this package needs neither CuPy nor a GPU.
"""
from . import launch, plans
from .base import RawBase
from .batch_norm import BatchNormKernels
from .conv import ConvKernels
from .conv3d import Conv3dKernels
from .dense import DenseKernels
from .pool_loss import PoolLossKernels
from .recurrent import RecurrentKernels
from .stacked import StackedKernels
from .vector import VectorKernels

globals().update((k, v) for module in (launch, plans) for k, v in vars(module).items()
                 if not k.startswith("__"))


class RawBackend(DenseKernels, ConvKernels, Conv3dKernels, VectorKernels, StackedKernels,
                 PoolLossKernels, BatchNormKernels, RecurrentKernels, RawBase):
    """The kernel contract of :mod:`mgnn.backend.numpy_ref` over a RawKernel launcher.

    Arrays are the launcher's (``self.xp``: CuPy on a GPU, NumPy under emulation), C-contiguous,
    all of one dtype. Outputs are new arrays of ``xp`` unless ``out`` is given, or the call runs
    inside :meth:`workspace` (then they are reused buffers). With ``poison_outputs`` (tests),
    every new output is filled with NaN before the launch, so an element a kernel fails to write
    shows up.
    """
