"""Flat parameter and gradient buffers: named array views into one contiguous 1-D array."""
import numpy as np

from .backend import is_device_array, to_host


class ParamDict(dict):
    """Ordered name -> array, every array a view into the contiguous 1-D buffer :attr:`flat`.

    Optimizers and reductions (e.g. an Allreduce over replicas) work on :attr:`flat`; code that
    needs one tensor uses its name. Writing into a view writes into :attr:`flat` and vice versa.
    :attr:`flat` is a NumPy array, or a CuPy array for the GPU backend (:meth:`to`).
    """

    flat: np.ndarray

    @classmethod
    def allocate(cls, shapes, dtype, xp=np):
        """Zero-filled ParamDict for ``shapes`` (ordered dict name -> shape tuple) of ``dtype``,
        in the array module ``xp`` (numpy or cupy)."""
        sizes = [int(np.prod(s)) for s in shapes.values()]
        flat = xp.zeros(sum(sizes), dtype=dtype)
        out = cls()
        offset = 0
        out.offsets = {}
        for (name, shape), size in zip(shapes.items(), sizes):
            out[name] = flat[offset:offset + size].reshape(shape)
            out.offsets[name] = offset
            offset += size
        out.flat = flat
        return out

    @property
    def xp(self):
        """The array module of :attr:`flat` (numpy, or cupy for device parameters)."""
        if is_device_array(self.flat):
            import cupy
            return cupy
        return np

    def to(self, xp):
        """The same parameters in array module ``xp`` (``self`` if already there; else a copy)."""
        if xp is self.xp:
            return self
        out = ParamDict.allocate(self.shapes(), self.flat.dtype, xp)
        out.flat[...] = xp.asarray(self.flat) if xp is not np else to_host(self.flat)
        return out

    def flat_slice(self, name, first=0, stop=None):
        """The 1-D slice of :attr:`flat` holding ``self[name][first:stop]`` (leading axis)."""
        arr = self[name]
        row = int(np.prod(arr.shape[1:])) if arr.ndim > 1 else 1
        stop = arr.shape[0] if stop is None else stop
        if arr.ndim == 0:
            return self.flat[self.offsets[name]:self.offsets[name] + 1]
        return self.flat[self.offsets[name] + first * row:self.offsets[name] + stop * row]

    def group(self, prefix=None):
        """{'weight': ..., 'bias': ...}: views of the entries named ``prefix.<name>`` under
        ``<name>`` (every entry, its prefix dropped, when ``prefix`` is None)."""
        if prefix is None:
            return {k.split(".", 1)[1]: v for k, v in self.items()}
        head = prefix + "."
        return {k[len(head):]: v for k, v in self.items() if k.startswith(head)}

    def shapes(self):
        """Ordered dict name -> shape."""
        return {k: v.shape for k, v in self.items()}

    def zeros_like(self):
        """A new zero ParamDict with the same names, shapes and dtype."""
        return ParamDict.allocate(self.shapes(), self.flat.dtype, self.xp)

    def copy(self):
        """A deep copy (new flat buffer)."""
        out = self.zeros_like()
        out.flat[:] = self.flat
        return out
