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
        out.offsets = {}
        for (name, shape), size in zip(shapes.items(), sizes):
            out[name] = flat[offset:offset + size].reshape(shape)
            out.offsets[name] = offset
            offset += size
        out.flat = flat
        return out

    def flat_slice(self, name, first=0, stop=None):
        """The 1-D slice of :attr:`flat` holding ``self[name][first:stop]`` (leading axis)."""
        arr = self[name]
        row = int(np.prod(arr.shape[1:])) if arr.ndim > 1 else 1
        stop = arr.shape[0] if stop is None else stop
        if arr.ndim == 0:
            return self.flat[self.offsets[name]:self.offsets[name] + 1]
        return self.flat[self.offsets[name] + first * row:self.offsets[name] + stop * row]

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
