"""Validate ``bench predict`` where large P lives: a few layers per rank, several levels.

For every runnable (P, layers per rank, levels) of the grid, a real ``mpiexec -n P`` MGRIT
training step (median of ``--repeats``, one thread per rank; the fastest of ``--launches``
separate runs) against the prediction of the same
setting on virtual ranks, with the critical-path bound (zero orchestration cost) beside both.
One cost table serves every point: calibrated at ``--calibration-layers`` (two depths, see
:func:`mgnn.studies.predict.calibrate`), as a user calibrates before predicting P = 4096; the
median of ``--calibrations`` of them (:meth:`mgnn.studies.costs.CostTable.median`).

    python scripts/validate_predictor.py --out results/validate_grid

writes ``validate_grid.json`` and ``validate_grid.md`` (the table) under ``--out``, again
after every point (a run ended early keeps what it measured); ``--budget S`` starts no point
after S seconds. ``scripts/gpu_check.py`` runs it on the GPU machine's 16 cores.
"""
import argparse
import json
import os
import sys
import time

from mgnn.comm import configure_threads
from mgnn.studies.costs import CostTable
from mgnn.studies.predict import (_cores, _write_text, calibrate, check_hop, default_config,
                                  format_validation_grid, validate_grid, validation_points)


def _ints(text):
    return tuple(int(v) for v in text.split(","))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=_ints, default=(1, 2, 3, 4))
    ap.add_argument("--per-rank", type=_ints, default=(1, 2, 4, 8, 16),
                    help="layers per rank (16: the only way to 6 levels at P <= 4, cf 2)")
    ap.add_argument("--levels", type=_ints, default=(3, 4, 5, 6))
    ap.add_argument("--cf", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--fwd-iters", type=int, default=2)
    ap.add_argument("--bwd-iters", type=int, default=1)
    ap.add_argument("--calibration-layers", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--calibrations", type=int, default=3,
                    help="calibrations (~5 s each), their median table predicts (default 3: "
                         "one taken in a slow phase of the machine moved every prediction by "
                         "up to 16 %%)")
    ap.add_argument("--launches", type=int, default=3,
                    help="mpiexec runs per point, the fastest run's median counts (default 3: "
                         "on 2 cores about one run of 4 ranks in 3 is 2-6x slow throughout)")
    ap.add_argument("--costs", default=None, help="a cost table to use instead of calibrating")
    ap.add_argument("--oversubscribed-hop", type=float, default=None, metavar="US",
                    help="microseconds each message waits for a core when P > cores (the "
                         "predictor's fitted parameter; default: the table's, 0 unless set)")
    ap.add_argument("--out", default="results/validate_grid")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds: start no point after them (default: every point)")
    args = ap.parse_args(argv)
    if args.calibrations < 1:
        ap.error(f"--calibrations {args.calibrations}: a positive integer expected")
    if args.launches < 1:
        ap.error(f"--launches {args.launches}: a positive integer expected")
    if args.oversubscribed_hop is not None:
        try:
            check_hop(args.oversubscribed_hop)
        except ValueError as exc:
            ap.error(str(exc))
    configure_threads(None, 1)  # as the measured ranks (NUMBA_NUM_THREADS=1)
    cfg = default_config(n_layers=args.calibration_layers, width=args.width, batch=args.batch,
                         levels=max(args.levels), cf=args.cf, fwd_iters=args.fwd_iters,
                         bwd_iters=args.bwd_iters, micro=(4,))
    t0 = time.perf_counter()
    if args.costs:
        table = CostTable.load(args.costs)
    else:
        print(f"calibrating at {args.calibration_layers} layers (and the hierarchy's least), "
              f"{args.calibrations} time(s)")
        tables = [calibrate(cfg, repeats=5, layers=args.calibration_layers,
                            log=print if k == 0 else None) for k in range(args.calibrations)]
        table = tables[0] if len(tables) == 1 else CostTable.median(tables)
        table.save(os.path.join(args.out, "costs.json"))
    if args.oversubscribed_hop is not None:
        table.meta["oversubscribed_hop_s"] = args.oversubscribed_hop * 1e-6
    hop = table.meta.get("oversubscribed_hop_s")
    args.oversubscribed_hop = None if hop is None else hop * 1e6  # the summary names it
    points = validation_points(args.ranks, args.per_rank, args.levels, args.cf)
    for P, n, L, why in points:
        if why:
            print(f"  not runnable: P={P}, {n} layers/rank, {L} levels: {why}")
    rows, left, failed = [], [p for p in points if not p[3]], []
    while left:
        if args.budget is not None and time.perf_counter() - t0 > args.budget:
            print(f"budget of {args.budget:.0f} s used: {len(left)} points not measured")
            break
        point = left.pop(0)
        try:
            rows += validate_grid(cfg, table, [point], repeats=args.repeats,
                                  launches=args.launches)
        except Exception as exc:  # noqa: BLE001 -- one failed point: recorded, the rest runs
            print(f"  P={point[0]} {point[1]} layers/rank {point[2]} levels failed: "
                  f"{type(exc).__name__}: {exc}")
            failed.append({"point": list(point[:3]), "error": f"{type(exc).__name__}: {exc}"})
        _write(args, rows, points, left, t0, failed, quiet=True)
    _write(args, rows, points, left, t0, failed)
    return rows if not failed else None


def _write(args, rows, points, left, t0, failed, quiet=False):
    """The table (printed unless ``quiet``) and the JSON under ``args.out``, atomically."""
    text = format_validation_grid(rows)
    worst = max((abs(r["error"]) for r in rows), default=0.0)
    worst_free = max((abs(r["error"]) for r in rows if not r["oversubscribed"]), default=0.0)
    runs = [(t, r["measured_s"]) for r in rows for t in r.get("launches_s", ())]
    slow = sum(t > 1.5 * best for t, best in runs)
    summary = (f"dense w={args.width}, B={args.batch}, cf {args.cf}, {args.fwd_iters}/"
               f"{args.bwd_iters} cycles, {_cores()} cores; largest error {100 * worst:.1f}% "
               f"(not oversubscribed: {100 * worst_free:.1f}%); {args.launches} mpiexec "
               f"run(s) a point, {slow} of {len(runs)} runs over 1.5x their point's fastest"
               + ("" if args.oversubscribed_hop is None else
                  f"; oversubscribed hop {args.oversubscribed_hop:g} us (fitted)"))
    if not quiet:
        print(text)
        print(summary)
    _write_text(os.path.join(args.out, "validate_grid.md"), text + "\n\n" + summary + "\n")
    _write_text(os.path.join(args.out, "validate_grid.json"), json.dumps(
        {"args": vars(args), "cores": _cores(), "rows": rows,
         "skipped": [p for p in points if p[3]], "not_measured": [list(p) for p in left],
         "failed": failed,
         "seconds": time.perf_counter() - t0}, indent=1))
    if not quiet:
        print(f"wrote {args.out}/validate_grid.md, validate_grid.json")


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
