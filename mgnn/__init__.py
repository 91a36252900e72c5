"""mgnn: layer-parallel training of deep residual networks with MGRIT.

Public API (docs/design.md, "Public API"): models (:func:`dense_resnet`, :func:`conv_resnet`),
:class:`LayerParallel`, :class:`MGRITSolver` over any propagator, optimizers, data loaders and
:func:`gradcheck`.
"""
from . import _numba_cache  # noqa: F401 -- first: sets NUMBA_CACHE_DIR before Numba is imported
from . import _moved
from .blocks import gradcheck
from .data import load_dataset, load_digits, load_mnist, load_npz, load_synthetic, read_idx
from .mgrit import (DivergenceError, MGRITOptions, MGRITResult, MGRITSolver,
                    NotConvergedWarning)
from .guard import GradientGuard, GuardWarning
from .errors import CheckpointError, DataFormatError, GradcheckError, MGNNError
from .models import Model, conv_resnet, dense_resnet, gru_classifier, rnn_classifier
from .network import LayerParallel
from .optim import SGD, Adam
from .params import ParamDict
from .train import fit, load_checkpoint, save_checkpoint

__version__ = "0.1.0"

__all__ = ["MGRITOptions", "MGRITSolver", "MGRITResult", "dense_resnet", "conv_resnet", "gru_classifier",
           "rnn_classifier", "Model", "LayerParallel", "ParamDict",
           "SGD", "Adam", "gradcheck", "fit", "save_checkpoint", "load_checkpoint", "read_idx",
           "load_dataset", "load_digits", "load_mnist", "load_npz", "load_synthetic", "MGNNError",
           "GradcheckError", "DataFormatError", "CheckpointError", "DivergenceError",
           "NotConvergedWarning", "GradientGuard", "GuardWarning"]

_moved.install()  # the old paths mgnn.bench, mgnn.scaling, ... import mgnn.studies.* (mgnn/_moved.py)
