"""Vector operations of the MGRIT solver (FAS residual, restriction, correction), per backend.

:class:`GenericOps` uses array operators only, so it works for any array type (NumPy, CuPy,
complex states): it is the reference. :class:`NumbaOps` fuses each operation into one pass over
the data for C-contiguous float32/float64 NumPy arrays (and falls back to the generic code for
anything else). Every method returns new arrays unless it says "in place".
"""
import numpy as np
from .jit import njit


class GenericOps:
    """Reference vector operations through array operators."""

    name = "generic"

    def residual(self, phi, u, g):
        """(r = phi - u [+ g], ||r||^2 as a float); g may be None."""
        r = phi - u
        if g is not None:
            r += g
        return r, self.norm2(r)

    def fas_rhs(self, r, v, phi_c):
        """In place: r += v - phi_c (the coarse FAS right-hand side); returns r."""
        r += v
        r -= phi_c
        return r

    def correct(self, u, uc, v):
        """u + (uc - v): the coarse-grid correction of a C-point (a new array)."""
        return u + (uc - v)

    def add(self, a, b):
        """a + b (a new array)."""
        return a + b

    # batched forms: every point of a level at once (here: point by point, same arithmetic)
    def residual_batch(self, phis, us, gs):
        """([residual r_p], sum_p ||r_p||^2) of many points; ``gs`` a list or None."""
        rs, total = [], 0.0
        for p, (phi, u) in enumerate(zip(phis, us)):
            r, rr = self.residual(phi, u, None if gs is None else gs[p])
            rs.append(r)
            total += rr
        return rs, total

    def fas_rhs_batch(self, rs, vs, phis):
        """In place: rs[p] += vs[p] - phis[p]."""
        for r, v, phi in zip(rs, vs, phis):
            self.fas_rhs(r, v, phi)

    def correct_batch(self, us, ucs, vs):
        """[us[p] + (ucs[p] - vs[p])] (new arrays)."""
        return [self.correct(u, uc, v) for u, uc, v in zip(us, ucs, vs)]

    def add_batch(self, xs, ys, in_place=False):
        """[xs[p] + ys[p]]: new arrays, or added into xs when ``in_place``."""
        if in_place:
            for x, y in zip(xs, ys):
                x += y
            return xs
        return [self.add(x, y) for x, y in zip(xs, ys)]

    def correct_strided(self, Uf, fine0, stride, Uc, V, coarse0, k, tmp):
        """In place: Uf[fine0 + q stride] += Uc[coarse0 + q] - V[coarse0 + q], q < k (the
        corrections of a stacked level; ``tmp`` a (k, ...) scratch array)."""
        tmp[...] = Uc[coarse0:coarse0 + k]
        tmp -= V[coarse0:coarse0 + k]
        view = Uf[fine0:fine0 + (k - 1) * stride + 1:stride]
        view += tmp  # u + (uc - v) as ``correct``; in place (``Uf[...] +=`` would copy back)

    def norm2(self, a):
        """||a||^2 (spatial 2-norm squared, real or complex) as a Python float."""
        if isinstance(a, np.ndarray):
            flat = a.reshape(-1)
            return float(np.vdot(flat, flat).real)
        if a.dtype.kind == "c":
            return float((a.conj() * a).real.sum())
        return float((a * a).sum())


@njit(cache=True)
def _residual(phi, u, g, has_g, r):
    total = 0.0
    for i in range(phi.size):
        v = phi[i] - u[i]
        if has_g:
            v += g[i]
        r[i] = v
        total += v * v
    return total


@njit(cache=True)
def _fas_rhs(r, v, phi_c):
    for i in range(r.size):
        r[i] += v[i] - phi_c[i]


@njit(cache=True)
def _correct(u, uc, v, out):
    for i in range(u.size):
        out[i] = u[i] + (uc[i] - v[i])


@njit(cache=True)
def _correct_strided(Uf, fine0, stride, Uc, V, coarse0, k):
    for q in range(k):
        u, uc, v = Uf[fine0 + q * stride], Uc[coarse0 + q], V[coarse0 + q]
        for i in range(u.size):
            u[i] = u[i] + (uc[i] - v[i])


@njit(cache=True)
def _add(a, b, out):
    for i in range(a.size):
        out[i] = a[i] + b[i]


def _flat_ok(*arrays):
    a0 = arrays[0]
    return (isinstance(a0, np.ndarray) and a0.dtype in (np.float32, np.float64)
            and all(isinstance(a, np.ndarray) and a.dtype == a0.dtype and a.shape == a0.shape
                    and a.flags.c_contiguous for a in arrays))


class NumbaOps(GenericOps):
    """One fused pass per operation (serial: these are memory-bound, and idle worker threads
    would compete with BLAS) for contiguous float NumPy arrays."""

    name = "numba"

    def residual(self, phi, u, g):
        if not _flat_ok(phi, u, *(() if g is None else (g,))):
            return super().residual(phi, u, g)
        r = np.empty_like(phi)
        gf = g.reshape(-1) if g is not None else phi.reshape(-1)
        total = _residual(phi.reshape(-1), u.reshape(-1), gf, g is not None, r.reshape(-1))
        return r, float(total)

    def fas_rhs(self, r, v, phi_c):
        if not _flat_ok(r, v, phi_c):
            return super().fas_rhs(r, v, phi_c)
        _fas_rhs(r.reshape(-1), v.reshape(-1), phi_c.reshape(-1))
        return r

    def correct(self, u, uc, v):
        if not _flat_ok(u, uc, v):
            return super().correct(u, uc, v)
        out = np.empty_like(u)
        _correct(u.reshape(-1), uc.reshape(-1), v.reshape(-1), out.reshape(-1))
        return out

    def correct_strided(self, Uf, fine0, stride, Uc, V, coarse0, k, tmp):
        """One pass, no scratch (NumPy's strided in-place add buffers through the heap)."""
        if not _flat_ok(Uf[0], Uc[0], V[0]) or not (Uf.flags.c_contiguous and
                                                    Uc.flags.c_contiguous and
                                                    V.flags.c_contiguous):
            return super().correct_strided(Uf, fine0, stride, Uc, V, coarse0, k, tmp)
        n = Uf[0].size
        _correct_strided(Uf.reshape(-1, n), fine0, stride, Uc.reshape(-1, n), V.reshape(-1, n),
                         coarse0, k)

    def add(self, a, b):
        if not _flat_ok(a, b):
            return super().add(a, b)
        out = np.empty_like(a)
        _add(a.reshape(-1), b.reshape(-1), out.reshape(-1))
        return out


class BatchedOps(GenericOps):
    """The batched forms as one RawKernel launch each (a :class:`mgnn.backend.cupy_raw.RawBackend`:
    the GPU, or its host emulation); single-point operations go to ``single`` (Numba CUDA on a
    GPU, the generic reference under emulation)."""

    name = "batched"

    def __init__(self, raw, single):
        self.raw, self.single = raw, single

    def residual(self, phi, u, g):
        return self.single.residual(phi, u, g)

    def fas_rhs(self, r, v, phi_c):
        return self.single.fas_rhs(r, v, phi_c)

    def correct(self, u, uc, v):
        return self.single.correct(u, uc, v)

    def add(self, a, b):
        return self.single.add(a, b)

    def norm2(self, a):
        return self.single.norm2(a)

    def residual_batch(self, phis, us, gs):
        return self.raw.residual_batched(phis, us, gs)

    def fas_rhs_batch(self, rs, vs, phis):
        self.raw.combine_batched(0, rs, rs, vs, phis)

    def correct_batch(self, us, ucs, vs):
        return self.raw.combine_batched(1, None, us, ucs, vs)

    def add_batch(self, xs, ys, in_place=False):
        return self.raw.combine_batched(2, xs if in_place else None, xs, ys)
