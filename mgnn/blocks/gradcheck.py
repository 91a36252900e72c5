"""Finite-difference checks of vector-Jacobian products, usable on user-defined layer kinds."""
from dataclasses import dataclass, field

import numpy as np

from .. import _config
from ..errors import GradcheckError


@dataclass
class GradcheckResult:
    """Outcome of :func:`gradcheck`.

    Attributes
    ----------
    ok : bool
        Every probed entry and the dot-product identity are within tolerance.
    max_rel_error : dict
        Per input name, the largest ``|fd - vjp| / max(|fd|, |vjp|, atol/rtol)`` over probed entries.
    dot_identity : tuple of float
        ``(<J v, w>, <v, J^T w>)`` for random directions v, w.
    failures : list of str
        Human-readable descriptions of the failing checks.
    """

    ok: bool
    max_rel_error: dict = field(default_factory=dict)
    dot_identity: tuple = (0.0, 0.0)
    failures: list = field(default_factory=list)


def _dot(a, b):
    return float(np.vdot(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)))


def gradcheck(forward, vjp, inputs, *, eps=_config.GRADCHECK_EPS, rtol=_config.GRADCHECK_RTOL,
              atol=_config.GRADCHECK_ATOL, max_entries=_config.GRADCHECK_MAX_ENTRIES, seed=0,
              raise_on_fail=True):
    """Check ``vjp`` against central finite differences of ``forward`` (float64 inputs).

    Parameters
    ----------
    forward : callable
        ``forward(inputs) -> y``: inputs a dict name -> float64 array, y an array (or scalar).
    vjp : callable
        ``vjp(inputs, gy) -> dict`` name -> gradient of ``<gy, y>`` with respect to that input
        (same shape); every name of ``inputs`` must be present.
    inputs : dict of str -> ndarray (float64)
        The point at which to check; not modified.
    eps, rtol, atol : float
        Central-difference step and tolerances (entrywise: ``|fd - g| <= atol + rtol * max(|fd|, |g|)``).
    max_entries : int
        Entries probed per input (all if fewer, else a random subset).
    raise_on_fail : bool
        Raise :class:`mgnn.errors.GradcheckError` when a check fails (default) or just report.

    Returns
    -------
    GradcheckResult
    """
    if not isinstance(inputs, dict) or not inputs:
        raise TypeError(f"inputs must be a non-empty dict of arrays, got {type(inputs).__name__}")
    for k, a in inputs.items():
        if not isinstance(a, np.ndarray) or a.dtype != np.float64:
            raise TypeError(f"gradcheck input {k!r} must be a float64 ndarray, got "
                            f"{getattr(a, 'dtype', type(a).__name__)}")
    rng = np.random.default_rng(seed)
    x = {k: a.copy() for k, a in inputs.items()}
    y0 = np.asarray(forward(x))
    w = rng.standard_normal(y0.shape)
    grads = vjp({k: a.copy() for k, a in x.items()}, w if y0.ndim else float(w))
    missing = set(x) - set(grads)
    if missing:
        raise ValueError(f"vjp returned no gradient for {sorted(missing)}")
    result = GradcheckResult(ok=True)

    def f_dot_w(arrs):
        return _dot(forward(arrs), w)

    for k, a in x.items():
        g = np.asarray(grads[k])
        if g.shape != a.shape:
            raise ValueError(f"vjp gradient of {k!r} has shape {g.shape}, expected {a.shape}")
        flat = a.reshape(-1)
        idx = np.arange(flat.size)
        if flat.size > max_entries:
            idx = rng.choice(flat.size, size=max_entries, replace=False)
        worst = 0.0
        for i in idx:
            old = flat[i]
            flat[i] = old + eps
            fp = f_dot_w(x)
            flat[i] = old - eps
            fm = f_dot_w(x)
            flat[i] = old
            fd = (fp - fm) / (2 * eps)
            gi = float(g.reshape(-1)[i])
            err = abs(fd - gi)
            worst = max(worst, err / max(abs(fd), abs(gi), atol / rtol))
            if err > atol + rtol * max(abs(fd), abs(gi)):
                result.ok = False
                where = tuple(int(j) for j in np.unravel_index(i, a.shape))
                result.failures.append(f"{k}[{where}]: finite difference {fd:.10g} vs vjp {gi:.10g}")
        result.max_rel_error[k] = worst

    v = {k: rng.standard_normal(a.shape) for k, a in x.items()}
    plus = {k: a + eps * v[k] for k, a in x.items()}
    minus = {k: a - eps * v[k] for k, a in x.items()}
    jv_w = (f_dot_w(plus) - f_dot_w(minus)) / (2 * eps)
    v_jtw = sum(_dot(v[k], grads[k]) for k in x)
    result.dot_identity = (jv_w, v_jtw)
    if abs(jv_w - v_jtw) > atol + rtol * max(abs(jv_w), abs(v_jtw)):
        result.ok = False
        result.failures.append(f"dot-product identity: <J v, w> = {jv_w:.12g} but "
                               f"<v, J^T w> = {v_jtw:.12g}")
    if raise_on_fail and not result.ok:
        raise GradcheckError("gradcheck failed:\n  " + "\n  ".join(result.failures[:20]))
    return result
