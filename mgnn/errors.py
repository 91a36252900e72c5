"""Exception types of mgnn.

Every error mgnn raises for bad input is a ``ValueError`` or ``TypeError`` (or a subclass), and its
message names the offending value, so callers can catch the standard types.
"""


class MGNNError(Exception):
    """Base class of mgnn's own (non-input) errors."""


class GradcheckError(MGNNError):
    """A vector-Jacobian product disagrees with finite differences or the dot-product identity."""


class DataFormatError(ValueError):
    """A data file (e.g. MNIST IDX) is corrupt, truncated or of the wrong kind."""


class CheckpointError(ValueError):
    """A checkpoint file is missing entries or does not match the model it is loaded into."""
