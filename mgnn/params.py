"""Flat parameter and gradient buffers: named array views into one contiguous 1-D array."""
import numpy as np


class ParamDict(dict):
    """Ordered name -> array, every array a view into the contiguous 1-D buffer :attr:`flat`.

    Optimizers and reductions (e.g. an Allreduce over replicas) work on :attr:`flat`; code that
    needs one tensor uses its name. Writing into a view writes into :attr:`flat` and vice versa.
    """

    flat: np.ndarray

    @classmethod
    def allocate(cls, shapes, dtype):
        """Zero-filled ParamDict for ``shapes`` (ordered dict name -> shape tuple) of ``dtype``."""
        sizes = [int(np.prod(s)) for s in shapes.values()]
        flat = np.zeros(sum(sizes), dtype=dtype)
        out = cls()
        offset = 0
        for (name, shape), size in zip(shapes.items(), sizes):
            out[name] = flat[offset:offset + size].reshape(shape)
            offset += size
        out.flat = flat
        return out

    def shapes(self):
        """Ordered dict name -> shape."""
        return {k: v.shape for k, v in self.items()}

    def zeros_like(self):
        """A new zero ParamDict with the same names, shapes and dtype."""
        return ParamDict.allocate(self.shapes(), self.flat.dtype)

    def copy(self):
        """A deep copy (new flat buffer)."""
        out = self.zeros_like()
        out.flat[:] = self.flat
        return out
