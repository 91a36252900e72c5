"""The interval-batched kernels of the contract as loops over a CPU backend's single-step
kernels (batching gains nothing on a CPU; the GPU backend launches each batch at once).

:func:`batched_kernels` builds them for a backend module; :mod:`.numpy_ref` and :mod:`.numba_cpu`
export them. For a kind ``k`` in ('dense', 'conv'), with W the stacked parameters of every layer
(leading axis L) and ``layers[p]`` the layer of state p:

* ``k_forward_batched(xs, W, b, layers, h, act, store_deriv, gs=None) -> (ys, derivs or None)``,
  ``ys[p] = xs[p] + h sigma(z_p) [+ gs[p]]``, ``derivs[p] = sigma'(z_p)`` (new arrays);
* ``k_vjp_input_batched(gys, derivs, W, layers, h, gs=None) -> [gys[p] + h J_p^T gys[p]
  [+ gs[p]]]``;
* ``k_deriv_batched(xs, W, b, layers, act) -> [sigma'(z_p)]``;
* ``k_vjp_params_batched(gys, derivs, xs, layers, h, gW, gb)``: in place,
  ``(gW[l], gb[l]) = k_vjp_params(gys[p], derivs[p], xs[p], h)`` for l = layers[p] (distinct).
"""


def batched_kernels(bk):
    """{name: function} of the batched kernels over the single kernels of module ``bk``."""
    out = {}
    for kind in ("dense", "conv"):
        out.update(_kind(bk, kind))
    return out


def _plus(ys, gs):
    """ys[p] += gs[p] in place (the ys are new arrays); ys."""
    if gs is not None:
        for y, g in zip(ys, gs):
            y += g
    return ys


def _kind(bk, kind):
    def single(name):
        return getattr(bk, f"{kind}_{name}")

    def forward_batched(xs, W, b, layers, h, act, store_deriv, gs=None):
        if store_deriv:
            outs = [single("forward_deriv")(x, W[l], b[l], h, act, True)
                    for x, l in zip(xs, layers)]
            ys, ds = [y for y, _ in outs], [d for _, d in outs]
        else:
            ys = [single("forward")(x, W[l], b[l], h, act, True) for x, l in zip(xs, layers)]
            ds = None
        return _plus(ys, gs), ds

    def vjp_input_batched(gys, derivs, W, layers, h, gs=None):
        return _plus([single("vjp_input")(g, d, W[l], h, True)
                      for g, d, l in zip(gys, derivs, layers)], gs)

    def deriv_batched(xs, W, b, layers, act):
        return [single("deriv")(x, W[l], b[l], act) for x, l in zip(xs, layers)]

    def vjp_params_batched(gys, derivs, xs, layers, h, gW, gb):
        for g, d, x, l in zip(gys, derivs, xs, layers):
            gW[l], gb[l] = single("vjp_params")(g, d, x, h)

    fns = {"forward_batched": forward_batched, "vjp_input_batched": vjp_input_batched,
           "deriv_batched": deriv_batched, "vjp_params_batched": vjp_params_batched}
    named = {}
    for suffix, fn in fns.items():
        fn.__name__ = fn.__qualname__ = f"{kind}_{suffix}"
        fn.__doc__ = f"Loop form of ``{kind}_{suffix}`` (see :mod:`mgnn.backend.batched_loops`)."
        named[fn.__name__] = fn
    return named
