#!/usr/bin/env python
"""MGRIT over sequence time on a *trained* recurrent model: how far a fixed number of cycles is
from the exact (serial) forward states, loss and gradient.

The coarse-propagator table of docs/recurrent.md is measured at PyTorch's initialisation, where a
GRU's dynamics contract. Training can change that; this script takes a GRU checkpoint of
``python -m mgnn train --model gru --data sine ... --checkpoint CKPT`` and reports, for several
MGRIT settings and cycle counts (the same count forward and adjoint, float64, one process):

* ``res``: the forward residual after the last cycle (XBraid's r_k, summed over the C-points);
* ``loss``: the MGRIT loss (the serial loss is printed first);
* ``grad err``: ||g_MGRIT - g_serial|| / ||g_serial||;

and the same at the untrained initial weights (``--seed``) for contrast::

    python scripts/recurrent_trained_convergence.py --checkpoint results/sine/ckpt.npz

Output: a Markdown table on stdout (and ``--out FILE.json`` rows, written atomically).
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np


def _model(config, params=None, coarse=None, seed=0):
    import mgnn
    c = dict(config)
    kind = c.pop("model")
    if kind != "gru":
        raise ValueError(f"the checkpoint holds a {kind!r} model; this study takes a GRU")
    c["coarse"] = coarse or c.get("coarse", "implicit")
    c["dtype"] = "float64"
    m = mgnn.gru_classifier(c.pop("in_features"), c.pop("hidden"), c.pop("n_classes"),
                            c.pop("seq_len"), seed=seed, **c)
    if params is not None:
        for k in m.params.keys():
            m.params[k][...] = params[k]
    return m


def study(config, params, x, y, settings, cycles, seed=0):
    """Rows of the study (dicts) for the trained ``params`` and for the initial weights."""
    import warnings
    from mgnn import LayerParallel, MGRITOptions
    rows = []
    for weights in ("trained", "initial"):
        p = params if weights == "trained" else None
        serial = LayerParallel(_model(config, p, seed=seed))
        loss0, g0 = serial.loss_and_grad(x, y)
        acc = float((serial.predict(x) == y).mean())
        for coarse, cf, nrelax, levels in settings:
            o = dict(cf=cf, max_levels=levels, nrelax=nrelax, tol=0.0, warn_not_converged=False)
            for k in cycles:
                lp = LayerParallel(_model(config, p, coarse, seed=seed),
                                   fwd=MGRITOptions(max_iter=k, **o),
                                   bwd=MGRITOptions(max_iter=k, **o), guard=None)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    loss, g = lp.loss_and_grad(x, y)
                err = float(np.linalg.norm(g.flat - g0.flat) / np.linalg.norm(g0.flat))
                rows.append(dict(weights=weights, serial_loss=float(loss0), serial_acc=acc,
                                 coarse=coarse, cf=cf, nrelax=list(nrelax), levels=levels,
                                 cycles=k, residual=float(lp.stats["forward"]["residuals"][-1]),
                                 loss=float(loss), grad_err=err))
                print(f"{weights} {coarse} cf {cf} nrelax {nrelax} levels {levels} cycles {k}: "
                      f"res {rows[-1]['residual']:.1e} loss {loss:.3g} (serial {loss0:.3g}) "
                      f"grad err {err:.1e}", file=sys.stderr, flush=True)
    return rows


def markdown(rows):
    out = ["| weights | coarse | cf | nrelax | levels | " +
           " | ".join(f"{k} cycles: res / loss / grad err" for k in
                      sorted({r['cycles'] for r in rows})) + " |"]
    out.append("|" + "---|" * (5 + len({r["cycles"] for r in rows})))
    key = lambda r: (r["weights"], r["coarse"], r["cf"], tuple(r["nrelax"]), r["levels"])  # noqa: E731
    groups = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    for (w, coarse, cf, nrelax, levels), rs in groups.items():
        by_cycles = {r["cycles"]: r for r in rs}  # columns in the header's (sorted) order
        cells = [f"{r['residual']:.1e} / {r['loss']:.3g} / {r['grad_err']:.1e}" if r else "-"
                 for r in (by_cycles.get(k) for k in sorted({q['cycles'] for q in rows}))]
        out.append(f"| {w} (serial loss {rs[0]['serial_loss']:.3g}) | {coarse} | {cf} | "
                   f"{','.join(map(str, nrelax))} | {levels} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a GRU checkpoint of mgnn train")
    p.add_argument("--samples", type=int, default=64, help="test samples (default 64)")
    p.add_argument("--cycles", default="1,2,4,8", help="cycle counts (default 1,2,4,8)")
    p.add_argument("--seed", type=int, default=0, help="initial weights of the contrast rows")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    a = p.parse_args(argv)
    from mgnn.data import load_sine
    from mgnn.train import load_checkpoint
    ckpt = load_checkpoint(a.checkpoint)
    config = ckpt["header"]["model_config"]
    if config.get("model") != "gru":
        raise ValueError(f"the checkpoint holds a {config.get('model')!r} model; this study "
                         "takes a GRU (mgnn train --model gru)")
    if a.samples < 1:
        raise SystemExit(f"--samples must be >= 1, got {a.samples}")
    ds = load_sine(config["seq_len"], seed=ckpt["header"]["meta"].get("seed", 0))
    n = min(a.samples, len(ds.y_test))
    x = ds.x_test[:n].reshape(n, config["seq_len"], 1).astype(np.float64)
    y = ds.y_test[:n]
    cycles = [int(c) for c in a.cycles.split(",")]
    settings = [("implicit", 4, (0, 1), 2), ("implicit", 4, (1,), 2), ("implicit", 2, (1,), 2),
                ("implicit", 2, (1,), 4), ("implicit", 8, (1,), 2),
                ("rediscretise", 4, (1,), 2), ("rediscretise", 2, (1,), 2)]
    rows = study(config, ckpt["params"], x, y, settings, cycles, a.seed)
    print(markdown(rows))
    if a.out:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(a.out)) or ".",
                                   suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(rows, f, indent=1)
        os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
