#!/usr/bin/env python
"""The gradient guard's numbers (docs/design.md, "When layer-parallel gradients are good
enough"), one process, float64:

1. ``oscillator``: a GRU whose dynamics are a weakly damped oscillator (tests/guard_models.py,
   L = 256): the relative gradient error of MGRIT with the guard off and with the default guard
   (issue 35: within 5 %), and what more cycles, FCF relaxation, cf 2, more levels, the coarse
   model and F-cycles do to it (what "iterate further" could use);
2. ``estimate``: the guard's error estimate at unchecked steps against the true error of the
   step (an exact solve of the same batch) on dense, conv, batch-norm, GRU and spatially
   coarsened models, 2/1 cycles, cf 2, 3 levels (tests/test_guard.py asserts a factor 3);
3. with ``--sine-checkpoint`` / ``--volumes-epochs``: what keeps MGRIT converging on the
   trained sine GRU and on spatially coarsened volumes (warm start, FCF, F-cycle, more cycles,
   cf 2 on the finest level): gradient error and cosine of each setting.

    PYTHONPATH=. python scripts/guard_study.py [--sine-checkpoint CKPT] [--volumes-epochs 3]
        [--out results/guard_study.json]

Markdown tables on stdout; ``--out`` also writes the rows as JSON (atomically).
"""
import argparse
import json
import os
import sys
import tempfile
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rel(g, exact):
    return float(np.linalg.norm(g.flat - exact.flat) / np.linalg.norm(exact.flat))


def oscillator_rows(seq_len=256, batch=16):
    from mgnn import GradientGuard, LayerParallel, MGRITOptions
    from tests.guard_models import oscillator_gru, sequences
    x, y = sequences(batch, seq_len)
    rows = []
    exact = {}
    for coarse in ("implicit", "rediscretise"):
        model = oscillator_gru(seq_len, coarse=coarse)
        exact[coarse] = LayerParallel(model, threads=1).loss_and_grad(x, y)[1]
    settings = [  # (coarse, cf, levels, nrelax, cycle, fwd, bwd, skip)
        ("implicit", 4, 2, 0, "V", 2, 1, False), ("implicit", 4, 2, 0, "V", 2, 1, True),
        ("implicit", 2, 2, 0, "V", 4, 4, False), ("implicit", 4, 2, 1, "V", 4, 2, False),
        ("implicit", 4, 2, 1, "V", 8, 8, False), ("implicit", 2, 2, 1, "V", 8, 8, False),
        ("implicit", 2, 4, 1, "V", 8, 8, False), ("implicit", 4, 3, 1, "F", 4, 4, False),
        ("rediscretise", 4, 2, 1, "V", 8, 8, False), ("rediscretise", 2, 2, 1, "V", 8, 8, False),
    ]
    for coarse, cf, levels, nrelax, cycle, nf, nb, skip in settings:
        kw = dict(cf=cf, max_levels=levels, nrelax=nrelax, cycle=cycle, tol=0.0,
                  warn_not_converged=False, skip_downcycle=skip)
        f, b = MGRITOptions(max_iter=nf, **kw), MGRITOptions(max_iter=nb, **kw)
        row = dict(coarse=coarse, cf=cf, levels=levels, nrelax=nrelax, cycle=cycle, fwd=nf,
                   bwd=nb, skip=skip)
        for guard in (None, "auto"):
            model = oscillator_gru(seq_len, coarse=coarse)
            lp = LayerParallel(model, f, b, threads=1,
                               guard=None if guard is None else GradientGuard())
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _, g = lp.loss_and_grad(x, y)
            key = "off" if guard is None else "auto"
            row[f"error_{key}"] = _rel(g, exact[coarse])
            if guard is None:
                row["forward_residual"] = (lp.stats["forward"]["residuals"] or [None])[-1]
            else:
                row["guard_action"] = lp.stats["guard"]["action"]
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    return rows


def estimate_rows(steps=6):
    import mgnn
    from mgnn import GradientGuard, LayerParallel, MGRITOptions
    cases = {
        "dense N32 relu": (lambda: mgnn.dense_resnet(6, 8, 3, 32, activation="relu"), (6,), {}),
        "conv N16 C3 6x6": (lambda: mgnn.conv_resnet(1, 3, (6, 6), 3, 16, activation="relu"),
                            (1, 6, 6), {}),
        "batch norm N16": (lambda: mgnn.dense_resnet(6, 8, 3, 16, activation="relu",
                                                     batch_norm=True), (6,), {}),
        "GRU L32 H6": (lambda: mgnn.gru_classifier(3, 6, 3, 32), (32, 3), {}),
        "conv 9x9, spatial level 0": (lambda: mgnn.conv_resnet(1, 2, (9, 9), 3, 16,
                                                               activation="relu"),
                                      (1, 9, 9), {"spatial_levels": (0,)}),
    }
    kw = dict(cf=2, max_levels=3, tol=0.0, warn_not_converged=False, skip_downcycle=True)
    f, b = MGRITOptions(max_iter=2, **kw), MGRITOptions(max_iter=1, **kw)
    rows = []
    for name, (make, shape, extra) in cases.items():
        model = make()
        lp = LayerParallel(model, f, b, guard=GradientGuard(tol=1e3, check_every=1000),
                           threads=1, **extra)
        exact_lp = LayerParallel(model, threads=1)
        true, est = [], []
        for step in range(steps):
            rng = np.random.default_rng(step)
            x, y = rng.standard_normal((16,) + shape), rng.integers(0, 3, 16)
            _, g = lp.loss_and_grad(x, y)
            _, exact = exact_lp.loss_and_grad(x, y)
            true.append(_rel(g, exact))
            est.append(lp.stats["guard"]["error_estimate"])
        ratios = [e / t for e, t in zip(est[1:], true[1:])]
        rows.append(dict(model=name, true_errors=true, estimates=est,
                         ratio_min=min(ratios), ratio_max=max(ratios)))
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def _settings_rows(model_fn, x, y, settings, extra=None, label=""):
    """Relative gradient error and cosine of each MGRIT setting against the exact gradient.
    settings: (name, dict of MGRITOptions keywords, forward cycles, adjoint cycles, warm)."""
    from mgnn import LayerParallel, MGRITOptions
    extra = extra or {}
    half = len(y) // 2
    rows = []
    model = model_fn()
    _, exact = LayerParallel(model, threads=1).loss_and_grad(x[half:], y[half:])
    e = exact.flat.astype(np.float64)
    for name, kw, nf, nb, warm in settings:
        o = dict(tol=0.0, warn_not_converged=False, **kw)
        lp = LayerParallel(model_fn(), MGRITOptions(max_iter=nf, **o),
                           MGRITOptions(max_iter=nb, **o), threads=1, guard=None,
                           warm_start=warm, **extra)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if warm:  # the previous batch's states as the initial guess (same batch size)
                lp.loss_and_grad(x[:half], y[:half])
            _, g = lp.loss_and_grad(x[half:], y[half:])
        g = g.flat.astype(np.float64)
        rows.append(dict(case=label, setting=name, error=float(np.linalg.norm(g - e) /
                                                               np.linalg.norm(e)),
                         cosine=float(g @ e / (np.linalg.norm(g) * np.linalg.norm(e))),
                         forward_residual=(lp.stats["forward"]["residuals"] or [None])[-1]))
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def _common_settings(cf, levels):
    base = dict(cf=cf, max_levels=levels, nrelax=[0, 1])
    fcf = dict(cf=cf, max_levels=levels, nrelax=1)
    return [
        ("configured: F then FCF, 2/1 V", base, 2, 1, False),
        ("warm start, 2/1", base, 2, 1, True),
        ("FCF on level 0, 2/1", fcf, 2, 1, False),
        ("F-cycle, FCF, 2/1", dict(fcf, cycle="F"), 2, 1, False),
        ("guard's iterate: FCF, 4/2", fcf, 4, 2, False),
        ("cf 2, one level more, FCF, 4/2", dict(fcf, cf=2, max_levels=levels + 1), 4, 2,
         False),
        ("FCF, 8/8", fcf, 8, 8, False),
    ]


def sine_rows(checkpoint, samples=64):
    """The sine task's trained GRU (a checkpoint of mgnn train --data sine) and its initial
    weights: gradient error of each setting (cf 4, 2 levels as in the issue)."""
    import mgnn
    from mgnn.data import load_sine
    from mgnn.train import load_checkpoint
    ckpt = load_checkpoint(checkpoint)
    c = dict(ckpt["header"]["model_config"])
    L = c["seq_len"]
    ds = load_sine(L, seed=ckpt["header"]["meta"].get("seed", 0))
    x = ds.x_test[:samples].reshape(-1, L, 1).astype(np.float64)
    y = ds.y_test[:samples]

    def make(trained):
        def fn():
            m = mgnn.gru_classifier(c["in_features"], c["hidden"], c["n_classes"], L,
                                    n_layers=c.get("n_layers", 1), coarse=c.get("coarse",
                                                                                "implicit"),
                                    dtype="float64", seed=0)
            if trained:
                for k in m.params.keys():
                    m.params[k][...] = ckpt["params"][k]
            return m
        return fn
    rows = []
    for trained in (True, False):
        rows += _settings_rows(make(trained), x, y, _common_settings(4, 2),
                               label=f"sine L={L} {'trained' if trained else 'initial'}")
    return rows


def volumes_rows(epochs=3, batch=32):
    """Volumes (docs/spatial.md's model, 16^3, N 8, C 4, pool 4) trained serially for
    ``epochs`` epochs, then the spatially coarsened (level 0) gradient error of each setting
    (cf 2, 3 levels as in docs/spatial.md), and coarsening below level 1 for contrast."""
    import mgnn
    from mgnn.data import load_dataset
    ds = load_dataset("volumes", None, seed=0, volume_size=16)
    x = ds.as_model_input(ds.x_train, "conv", "float64")
    y = ds.y_train
    model = mgnn.conv_resnet(x.shape[1], 4, tuple(x.shape[2:]), ds.n_classes, 8, pool=4,
                             dtype="float64", seed=0)
    lp = mgnn.LayerParallel(model, threads=1)
    opt = mgnn.Adam(model.params.flat, lr=0.003)
    rng = np.random.default_rng(0)
    for _ in range(epochs):
        for b in np.array_split(rng.permutation(len(y)), len(y) // batch):
            _, g = lp.loss_and_grad(x[b], y[b])
            opt.step(g.flat)
    params = model.params.flat.copy()

    def fn():
        m = mgnn.conv_resnet(x.shape[1], 4, tuple(x.shape[2:]), ds.n_classes, 8, pool=4,
                             dtype="float64", seed=0)
        m.params.flat[...] = params
        return m
    xb, yb = x[-2 * batch:], y[-2 * batch:]
    rows = _settings_rows(fn, xb, yb, _common_settings(2, 3), {"spatial_levels": (0,)},
                          label=f"volumes after {epochs} epochs, spatial level 0")
    rows += _settings_rows(fn, xb, yb, _common_settings(2, 3)[:1], {"spatial_levels": (1,)},
                           label=f"volumes after {epochs} epochs, spatial level 1")
    return rows


def settings_markdown(rows):
    out = ["| case | setting | fwd residual | grad error | cosine |", "|---|---|---|---|---|"]
    for r in rows:
        res = "-" if r["forward_residual"] is None else f"{r['forward_residual']:.2g}"
        out.append(f"| {r['case']} | {r['setting']} | {res} | {r['error']:.3g} | "
                   f"{r['cosine']:.3f} |")
    return "\n".join(out)


def markdown(osc, est):
    out = ["| coarse | cf | levels | nrelax | cycle | fwd / bwd cycles | skip | fwd residual | "
           "grad error, guard off | guard auto: action, error |", "|" + "---|" * 10]
    for r in osc:
        res = "-" if r["forward_residual"] is None else f"{r['forward_residual']:.2g}"
        out.append(f"| {r['coarse']} | {r['cf']} | {r['levels']} | {r['nrelax']} | "
                   f"{r['cycle']} | {r['fwd']} / {r['bwd']} | {r['skip']} | {res} | "
                   f"{r['error_off']:.3g} | {r['guard_action']}, {r['error_auto']:.2g} |")
    out += ["", "| model | true error (steps 1-5) | estimate / true (min - max) |",
            "|---|---|---|"]
    for r in est:
        out.append(f"| {r['model']} | {min(r['true_errors'][1:]):.3g} - "
                   f"{max(r['true_errors'][1:]):.3g} | {r['ratio_min']:.2f} - "
                   f"{r['ratio_max']:.2f} |")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    p.add_argument("--sine-checkpoint", default=None,
                   help="a checkpoint of mgnn train --model gru --data sine: also the settings "
                        "table on its trained and initial weights")
    p.add_argument("--volumes-epochs", type=int, default=0,
                   help="also the settings table of spatially coarsened volumes after this many "
                        "serial epochs (0: skip)")
    a = p.parse_args(argv)
    osc, est = oscillator_rows(), estimate_rows()
    print(markdown(osc, est))
    settings = []
    if a.sine_checkpoint:
        settings += sine_rows(a.sine_checkpoint)
    if a.volumes_epochs:
        settings += volumes_rows(a.volumes_epochs)
    if settings:
        print()
        print(settings_markdown(settings))
    if a.out:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(a.out)) or ".",
                                   suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"oscillator": osc, "estimate": est, "settings": settings}, f, indent=1)
        os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
