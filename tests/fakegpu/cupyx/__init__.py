"""Fake ``cupyx`` (tests only): pinned host buffers are plain NumPy arrays."""
import numpy as np


def empty_pinned(shape, dtype=np.float64):
    return np.empty(shape, dtype=dtype)
