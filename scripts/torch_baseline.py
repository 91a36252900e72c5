"""Serial PyTorch against serial mgnn on the dense ResNet of ``bench scaling``: one training step
(loss and gradient), the same network, parameters and batch, timed side by side in one process.

PyTorch is never a dependency of mgnn: run this in a benchmark environment that has both, e.g.

    python -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch numpy numba scipy threadpoolctl greenlet
    /tmp/torchenv/bin/python scripts/torch_baseline.py --layers 256 --width 64 --batch-size 128 \\
        --activation relu --dtype float32

It first checks that both frameworks compute the same loss and gradient (so the times are of the
same network: u_0 = sigma(x A^T + a), u_{n+1} = u_n + h sigma(u_n W_n^T + b_n), h = 1 / N, logits
u_N C^T + c, mean softmax cross-entropy), then takes interleaved rounds of short samples of each
and reports the fastest and the median step time. The MGRIT numbers to set beside these come from
``mpiexec -n P python -m mgnn bench scaling`` with the same --layers, --width, --batch-size,
--dtype and --activation, all given: that study's defaults differ (B=64, float64, tanh); the
script prints the matching command.
"""
import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from mgnn.bench import time_samples  # noqa: E402
from mgnn.network import LayerParallel  # noqa: E402
from mgnn.scaling import _problem  # noqa: E402

#: Relative loss and gradient agreement that proves the two networks the same (float32: the
#: sums run in other orders; float64: round-off of a 256-layer chain).
GRAD_RTOL = {"float32": 1e-4, "float64": 1e-10}


def torch_network(model, torch):
    """A ``torch.nn.Module`` of ``model`` (a dense ResNet of mgnn) with a copy of its parameters;
    calling it on x (B, i) returns the logits (B, K)."""
    P = {k: torch.from_numpy(np.array(v)) for k, v in model.params.items()}
    act = {"tanh": torch.tanh, "relu": torch.relu}[model.config["activation"]]
    h = float(model.config["t_final"]) / model.n_layers

    dt = P["steps.weight"].dtype

    class DenseResNet(torch.nn.Module):
        """mgnn's dense ResNet as PyTorch modules: opening, N residual Linear layers, closing."""

        def __init__(self):
            super().__init__()
            self.opening = torch.nn.Linear(*P["opening.weight"].shape[::-1], dtype=dt)
            self.steps = torch.nn.ModuleList(
                torch.nn.Linear(*P["steps.weight"].shape[:0:-1], dtype=dt)
                for _ in range(model.n_layers))
            self.closing = torch.nn.Linear(*P["closing.weight"].shape[::-1], dtype=dt)
            with torch.no_grad():
                for lin, name in ((self.opening, "opening"), (self.closing, "closing")):
                    lin.weight.copy_(P[f"{name}.weight"])
                    lin.bias.copy_(P[f"{name}.bias"])
                for n, lin in enumerate(self.steps):
                    lin.weight.copy_(P["steps.weight"][n])
                    lin.bias.copy_(P["steps.bias"][n])

        def forward(self, x):
            u = act(self.opening(x))
            for lin in self.steps:
                u = u + h * act(lin(u))
            return self.closing(u)

    return DenseResNet()


def torch_grads(net):
    """The network's gradients under mgnn's parameter names, as float64 arrays."""
    g = {"opening.weight": net.opening.weight.grad, "opening.bias": net.opening.bias.grad,
         "closing.weight": net.closing.weight.grad, "closing.bias": net.closing.bias.grad}
    g["steps.weight"] = np.stack([lin.weight.grad.numpy() for lin in net.steps])
    g["steps.bias"] = np.stack([lin.bias.grad.numpy() for lin in net.steps])
    return {k: np.asarray(v, dtype=np.float64) for k, v in g.items()}


def compare(model, x, y, torch):
    """(relative loss difference, largest relative gradient error over the parameter groups) of
    one step of mgnn (serial) against PyTorch; the error of a group is max |g_torch - g_mgnn| /
    max |g_mgnn|."""
    loss, grads = LayerParallel(model).loss_and_grad(x, y)
    net = torch_network(model, torch)
    out = torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y))
    out.backward()
    tg = torch_grads(net)
    err = max(np.abs(tg[k] - np.asarray(grads[k], np.float64)).max()
              / max(np.abs(np.asarray(grads[k], np.float64)).max(), 1e-300) for k in tg)
    return abs(out.item() - float(loss)) / max(abs(float(loss)), 1e-300), float(err)


def timed(candidates, rounds, min_time):
    """{name: (fastest, median)} seconds per call: ``rounds`` rounds, each one sample (a loop of
    at least ``min_time`` seconds, :func:`mgnn.bench.time_samples`) of every candidate in turn
    (interleaved, so a slow phase of the machine hits all alike); two warm-up calls each first."""
    times = {k: [] for k in candidates}
    for r in range(rounds):
        for k, fn in candidates.items():
            times[k] += time_samples(fn, repeats=1, warmup=2 if r == 0 else 0, min_time=min_time)
    return {k: (min(v), float(np.median(v))) for k, v in times.items()}


def run(args, torch, log=print):
    """Check, time and report; returns the result dict (also written to ``args.json``)."""
    cfg = dict(model="dense", n_layers=args.layers, width=args.width, batch=args.batch_size,
               dtype=args.dtype, activation=args.activation)
    model, x, y = _problem(cfg)
    y = y.astype(np.int64)
    dloss, gerr = compare(model, x, y, torch)
    log(f"dense ResNet N={args.layers} w={args.width} B={args.batch_size} {args.dtype} "
        f"{args.activation}: relative loss difference {dloss:.2e}, largest relative gradient "
        f"error {gerr:.2e} (tolerance {GRAD_RTOL[args.dtype]:g})")
    if not (dloss <= GRAD_RTOL[args.dtype] and gerr <= GRAD_RTOL[args.dtype]):
        raise RuntimeError(f"PyTorch and mgnn disagree (relative loss difference {dloss:.3g}, "
                           f"gradient error {gerr:.3g}): the times would not be of the same "
                           "network")
    log(f"MGRIT on P ranks, same network: mpiexec -n P python -m mgnn bench scaling --ranks P "
        f"--layers {args.layers} --width {args.width} --batch-size {args.batch_size} --dtype "
        f"{args.dtype} --activation {args.activation}")
    lp = LayerParallel(model)  # as a user builds it (threads='auto'; the serial path is one
    # thread of kernels either way: the dense sweeps have no parallel loop)
    grads = model.params.zeros_like()
    net = torch_network(model, torch)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)

    def torch_step():
        net.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(net(xt), yt).backward()

    default_threads = torch.get_num_threads()
    result = {"config": cfg, "loss_rel_difference": dloss, "grad_rel_error": gerr,
              "cores": os.cpu_count(), "torch": torch.__version__,
              "mgnn_threads": {k: lp.threads.get(k) for k in ("numba", "blas")},
              "times_s": {}}
    for threads in sorted({1, default_threads}):
        torch.set_num_threads(threads)
        cand = {f"pytorch ({threads} thread{'s' if threads > 1 else ''})": torch_step,
                "mgnn serial": lambda: lp.loss_and_grad(x, y, out=grads)}
        for k, (fast, med) in timed(cand, args.rounds, args.min_time).items():
            key = k if k.startswith("pytorch") else f"{k} (beside pytorch {threads})"
            result["times_s"][key] = {"fastest": fast, "median": med}
            log(f"    {key:36s} fastest {1e3 * fast:8.2f} ms   median {1e3 * med:8.2f} ms")
    torch.set_num_threads(default_threads)
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.json)
    return result


def parse_args(argv=None):
    """The command line (defaults: the performance issue's N=256, w=64, B=128, float32 relu)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=256)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--activation", choices=["tanh", "relu"], default="relu")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    p.add_argument("--min-time", type=float, default=0.2,
                   help="seconds per sample (default 0.2)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    for flag in ("layers", "width", "batch_size", "rounds"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not args.min_time > 0:
        p.error(f"--min-time must be > 0, got {args.min_time}")
    return args


def main(argv=None):
    """Parse, import PyTorch (a clear exit without it), run."""
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        sys.exit("scripts/torch_baseline.py needs PyTorch in this environment (a benchmark "
                 "environment: PyTorch is never a dependency of mgnn)")
    run(args, torch)


if __name__ == "__main__":
    main()
