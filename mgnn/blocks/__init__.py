"""mgnn's own autodiff: layer kinds with forward and vjp side by side, losses, gradcheck."""
from .gradcheck import GradcheckResult, gradcheck
from .layers import (Conv3dOpening, ConvOpening, ConvStep, DenseClosing, DenseOpening, DenseStep, PoolClosing,
                     SoftmaxCrossEntropy)

__all__ = ["gradcheck", "GradcheckResult", "DenseStep", "ConvStep", "DenseOpening", "ConvOpening", "Conv3dOpening",
           "DenseClosing", "PoolClosing", "SoftmaxCrossEntropy"]
