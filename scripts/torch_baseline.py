"""Serial PyTorch against serial mgnn: one training step (loss and gradient) of the same network,
parameters and batch, timed side by side in one process. ``--model dense`` (default) is the dense
ResNet of ``bench scaling``; ``--model conv`` a conv ResNet (relu or tanh, 3x3 convolutions on
--image x --image inputs, or 3x3x3 on --image^3 volumes with --conv3d, --batch-norm for
F = sigma(BN(conv(u)))), global average pooling and an affine closing; ``--model gru`` a stacked
GRU over sequence time (``torch.nn.GRU``, batch first, h0 = 0: --hidden, --seq-len, --gru-layers,
--features) with an affine map of the last hidden state to the logits.

PyTorch is never a dependency of mgnn: run this in a benchmark environment that has both, e.g.

    python -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch numpy numba scipy threadpoolctl greenlet
    /tmp/torchenv/bin/python scripts/torch_baseline.py --layers 256 --width 64 --batch-size 128 \\
        --activation relu --dtype float32
    /tmp/torchenv/bin/python scripts/torch_baseline.py --model conv --channels 16 --layers 16 \\
        --batch-size 32 --image 28 --threads 1
    /tmp/torchenv/bin/python scripts/torch_baseline.py --model gru --hidden 64 --seq-len 512 \\
        --gru-layers 2 --batch-size 32 --threads 1

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

from mgnn.studies.bench import time_samples  # noqa: E402
from mgnn.network import LayerParallel, conv_resnet, gru_classifier  # noqa: E402
from mgnn.studies.scaling import _problem  # noqa: E402

#: Relative loss and gradient agreement that proves the two networks the same (float32: the
#: sums run in other orders; float64: round-off of a 256-layer chain). Conv: a sum of 9 C terms
#: per output and of B H W per kernel gradient, and relu kinks that round either way; GRU: a
#: 512-step recurrence, gates summed in other orders.
GRAD_RTOL = {"float32": 1e-4, "float64": 1e-10}
CONV_GRAD_RTOL = {"float32": 1e-3, "float64": 1e-10}
#: Batch norm's backward subtracts batch means (cancellation): float32 kernel gradients through
#: it agree to ~5e-3 between any two summation orders.
BN_GRAD_RTOL = {"float32": 2e-2, "float64": 1e-10}


def torch_network(model, torch):
    """A ``torch.nn.Module`` of ``model`` (a dense or conv ResNet of mgnn) with a copy of its
    parameters; calling it on x (B, ...) returns the logits (B, K)."""
    if model.config["model"] == "conv":
        return torch_conv_network(model, torch)
    if model.config["model"] == "gru":
        return torch_gru_network(model, torch)
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


def torch_conv_network(model, torch):
    """The conv ResNet (2D or 3D, with or without batch norm in training mode) of ``model`` as
    PyTorch modules with a copy of its parameters: opening sigma(conv(x) + a), N steps
    u + h sigma([BN](conv(u) + b)), global average pooling (pool 1), affine closing."""
    cfg = model.config
    if cfg.get("pool", 1) != 1 or cfg.get("dropout"):
        raise ValueError("torch_conv_network covers pool=1 without dropout")
    P = {k: torch.from_numpy(np.array(v)) for k, v in model.params.items()}
    act = {"tanh": torch.tanh, "relu": torch.relu}[cfg["activation"]]
    h = float(cfg["t_final"]) / model.n_layers
    nd = len(cfg["image_size"])
    Conv = {2: torch.nn.Conv2d, 3: torch.nn.Conv3d}[nd]
    BN = {2: torch.nn.BatchNorm2d, 3: torch.nn.BatchNorm3d}[nd]
    dt, C, bn = P["steps.weight"].dtype, cfg["channels"], bool(cfg.get("batch_norm"))

    class ConvResNet(torch.nn.Module):
        """mgnn's conv ResNet as PyTorch modules."""

        def __init__(self):
            super().__init__()
            self.opening = Conv(cfg["in_channels"], C, 3, padding=1, dtype=dt)
            self.steps = torch.nn.ModuleList(Conv(C, C, 3, padding=1, dtype=dt)
                                             for _ in range(model.n_layers))
            self.bns = torch.nn.ModuleList(
                BN(C, eps=cfg["bn_eps"], momentum=cfg["bn_momentum"], dtype=dt)
                for _ in range(model.n_layers)) if bn else None
            self.closing = torch.nn.Linear(C, cfg["n_classes"], dtype=dt)
            with torch.no_grad():
                for mod, name in ((self.opening, "opening"), (self.closing, "closing")):
                    mod.weight.copy_(P[f"{name}.weight"])
                    mod.bias.copy_(P[f"{name}.bias"])
                for n, conv in enumerate(self.steps):
                    conv.weight.copy_(P["steps.weight"][n])
                    conv.bias.copy_(P["steps.bias"][n])
                    if bn:
                        self.bns[n].weight.copy_(P["steps.bn_weight"][n])
                        self.bns[n].bias.copy_(P["steps.bn_bias"][n])

        def forward(self, x):
            u = act(self.opening(x))
            for n, conv in enumerate(self.steps):
                z = conv(u)
                u = u + h * act(self.bns[n](z) if bn else z)
            return self.closing(u.mean(dim=tuple(range(2, 2 + nd))))

    return ConvResNet()


def torch_gru_network(model, torch):
    """The GRU classifier of ``model`` (:func:`mgnn.network.gru_classifier`, cell 'gru') as
    ``torch.nn.GRU`` (batch first, h0 = 0) and ``torch.nn.Linear`` on the last layer's last
    hidden state, with a copy of its parameters (the same names and layouts)."""
    cfg = model.config
    P = {k: torch.from_numpy(np.array(v)) for k, v in model.params.items()}
    dt = P["closing.weight"].dtype

    class GRUClassifier(torch.nn.Module):
        """mgnn's GRU classifier as PyTorch modules."""

        def __init__(self):
            super().__init__()
            self.gru = torch.nn.GRU(cfg["in_features"], cfg["hidden"], cfg["n_layers"],
                                    batch_first=True, dtype=dt)
            self.closing = torch.nn.Linear(cfg["hidden"], cfg["n_classes"], dtype=dt)
            with torch.no_grad():
                for name, v in self.named_parameters():
                    v.copy_(P[name])

        def forward(self, x):
            return self.closing(self.gru(x)[0][:, -1])

    return GRUClassifier()


def torch_grads(net):
    """The network's gradients under mgnn's parameter names, as float64 arrays."""
    if hasattr(net, "gru"):
        return {k: np.asarray(v.grad, dtype=np.float64) for k, v in net.named_parameters()}
    g = {"opening.weight": net.opening.weight.grad, "opening.bias": net.opening.bias.grad,
         "closing.weight": net.closing.weight.grad, "closing.bias": net.closing.bias.grad}
    g["steps.weight"] = np.stack([lin.weight.grad.numpy() for lin in net.steps])
    g["steps.bias"] = np.stack([lin.bias.grad.numpy() for lin in net.steps])
    if getattr(net, "bns", None) is not None:
        g["steps.bn_weight"] = np.stack([bn.weight.grad.numpy() for bn in net.bns])
        g["steps.bn_bias"] = np.stack([bn.bias.grad.numpy() for bn in net.bns])
    return {k: np.asarray(v, dtype=np.float64) for k, v in g.items()}


def compare(model, x, y, torch):
    """(relative loss difference, largest relative gradient error over the parameter groups) of
    one step of mgnn (serial) against PyTorch; the error of a group is max |g_torch - g_mgnn| /
    max(max |g_mgnn|, 1e-3 max over all groups): a group whose gradient vanishes in exact
    arithmetic (a bias before batch norm) is measured against the gradient's scale, not its own
    round-off."""
    loss, grads = LayerParallel(model).loss_and_grad(x, y)
    net = torch_network(model, torch)
    out = torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y))
    out.backward()
    tg = torch_grads(net)
    mine = {k: np.asarray(grads[k], np.float64) for k in tg}
    floor = 1e-3 * max(np.abs(v).max() for v in mine.values())
    err = max(np.abs(tg[k] - mine[k]).max() / max(np.abs(mine[k]).max(), floor, 1e-300)
              for k in tg)
    return abs(out.item() - float(loss)) / max(abs(float(loss)), 1e-300), float(err)


def timed(candidates, rounds, min_time):
    """{name: (fastest, median)} seconds per call: ``rounds`` rounds, each one sample (a loop of
    at least ``min_time`` seconds, :func:`mgnn.studies.bench.time_samples`) of every candidate in turn
    (interleaved, so a slow phase of the machine hits all alike); two warm-up calls each first."""
    times = {k: [] for k in candidates}
    for r in range(rounds):
        for k, fn in candidates.items():
            times[k] += time_samples(fn, repeats=1, warmup=2 if r == 0 else 0, min_time=min_time)
    return {k: (min(v), float(np.median(v))) for k, v in times.items()}


def _network(args):
    """(model, x, y int64, config, description) of the command line's network."""
    if args.model == "dense":
        cfg = dict(model="dense", n_layers=args.layers, width=args.width,
                   batch=args.batch_size, dtype=args.dtype, activation=args.activation)
        model, x, y = _problem(cfg)
        return (model, x, y.astype(np.int64), cfg,
                f"dense ResNet N={args.layers} w={args.width} B={args.batch_size} "
                f"{args.dtype} {args.activation}")
    if args.model == "gru":
        model = gru_classifier(args.features, args.hidden, 10, args.seq_len,
                               n_layers=args.gru_layers, dtype=args.dtype, seed=0)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((args.batch_size, args.seq_len, args.features))
        y = rng.integers(0, 10, args.batch_size).astype(np.int64)
        return (model, x.astype(args.dtype), y, dict(model.config, batch=args.batch_size),
                f"GRU H={args.hidden} L={args.seq_len} layers={args.gru_layers} "
                f"I={args.features} B={args.batch_size} {args.dtype}")
    image = (args.image,) * (3 if args.conv3d else 2)
    cfg = dict(model="conv", n_layers=args.layers, channels=args.channels, image=list(image),
               batch=args.batch_size, dtype=args.dtype, activation=args.activation,
               batch_norm=args.batch_norm)
    model = conv_resnet(1, args.channels, image, 10, args.layers, activation=args.activation,
                        dtype=args.dtype, seed=0, batch_norm=args.batch_norm)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch_size, 1) + image).astype(args.dtype)
    y = rng.integers(0, 10, args.batch_size).astype(np.int64)
    desc = (f"conv{'3d' if args.conv3d else ''} ResNet C={args.channels} N={args.layers} "
            f"{'x'.join(map(str, image))} B={args.batch_size} {args.dtype} {args.activation}"
            f"{' batch norm' if args.batch_norm else ''}")
    return model, x, y, cfg, desc


def run(args, torch, log=print):
    """Check, time and report; returns the result dict (also written to ``args.json``)."""
    model, x, y, cfg, name = _network(args)
    dloss, gerr = compare(model, x, y, torch)
    tol = (BN_GRAD_RTOL if args.batch_norm else CONV_GRAD_RTOL if args.model in ("conv", "gru")
           else GRAD_RTOL)[args.dtype]
    log(f"{name}: relative loss difference {dloss:.2e}, largest relative gradient "
        f"error {gerr:.2e} (tolerance {tol:g})")
    if not (dloss <= tol and gerr <= tol):
        raise RuntimeError(f"PyTorch and mgnn disagree (relative loss difference {dloss:.3g}, "
                           f"gradient error {gerr:.3g}): the times would not be of the same "
                           "network")
    if args.model == "dense":
        log(f"MGRIT on P ranks, same network: mpiexec -n P python -m mgnn bench scaling "
            f"--ranks P --layers {args.layers} --width {args.width} --batch-size "
            f"{args.batch_size} --dtype {args.dtype} --activation {args.activation}")
    grads = model.params.zeros_like()
    net = torch_network(model, torch)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)

    def torch_step():
        net.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(net(xt), yt).backward()

    default_threads = torch.get_num_threads()
    result = {"config": cfg, "loss_rel_difference": dloss, "grad_rel_error": gerr,
              "cores": os.cpu_count(), "torch": torch.__version__, "times_s": {}}
    for threads in args.threads or sorted({1, default_threads}):
        torch.set_num_threads(threads)
        # mgnn as a user builds it: threads='auto' beside PyTorch's default count, else the
        # same count as PyTorch (threads=t sets Numba's and BLAS's)
        lp = LayerParallel(model, threads="auto" if args.threads is None
                           and threads == default_threads else threads)
        tag = f"{threads} thread{'s' if threads > 1 else ''}"
        result.setdefault("mgnn_threads", {})[tag] = {k: lp.threads.get(k)
                                                      for k in ("numba", "blas")}

        def mgnn_step(lp=lp):
            return lp.loss_and_grad(x, y, out=grads)
        cand = {f"pytorch ({tag})": torch_step, f"mgnn serial ({tag})": mgnn_step}
        for k, (fast, med) in timed(cand, args.rounds, args.min_time).items():
            result["times_s"][k] = {"fastest": fast, "median": med}
            log(f"    {k:36s} fastest {1e3 * fast:8.2f} ms   median {1e3 * med:8.2f} ms")
        ratio = (result["times_s"][f"mgnn serial ({tag})"]["fastest"]
                 / result["times_s"][f"pytorch ({tag})"]["fastest"])
        result.setdefault("mgnn_over_pytorch", {})[tag] = ratio
        log(f"    mgnn / pytorch ({tag}, fastest): {ratio:.2f}")
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
    p.add_argument("--model", choices=["dense", "conv", "gru"], default="dense")
    p.add_argument("--layers", type=int, default=256)
    p.add_argument("--width", type=int, default=64, help="dense: state width")
    p.add_argument("--channels", type=int, default=16, help="conv: state channels")
    p.add_argument("--image", type=int, default=28, help="conv: image (or volume) side")
    p.add_argument("--conv3d", action="store_true", help="conv: 3x3x3 on --image^3 volumes")
    p.add_argument("--batch-norm", action="store_true", help="conv: sigma(BN(conv(u)))")
    p.add_argument("--hidden", type=int, default=64, help="gru: hidden size")
    p.add_argument("--seq-len", type=int, default=512, help="gru: time steps")
    p.add_argument("--gru-layers", type=int, default=2, help="gru: stacked layers")
    p.add_argument("--features", type=int, default=1, help="gru: input features per step")
    p.add_argument("--threads", default=None,
                   help="comma-separated thread counts to time, each for both (default: 1 "
                        "and PyTorch's default count beside mgnn's threads='auto')")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--activation", choices=["tanh", "relu"], default="relu")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    p.add_argument("--min-time", type=float, default=0.2,
                   help="seconds per sample (default 0.2)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--conv-parts", action="store_true",
                   help="instead: each conv kernel of `bench kernels` (forward, input vjp, "
                        "kernel gradient) beside PyTorch's at the same shapes and threads")
    args = p.parse_args(argv)
    if args.model != "conv" and (args.conv3d or args.batch_norm):
        p.error("--conv3d and --batch-norm are for --model conv")
    if args.threads is not None:
        try:
            args.threads = sorted({int(t) for t in args.threads.split(",")})
        except ValueError:
            p.error(f"--threads must be comma-separated integers, got {args.threads!r}")
        if not args.threads or args.threads[0] < 1:
            p.error(f"--threads must be >= 1, got {args.threads}")
    for flag in ("layers", "width", "channels", "image", "batch_size", "rounds", "hidden",
                 "gru_layers", "features"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.seq_len < 2:
        p.error(f"--seq-len must be >= 2 (a sequence), got {args.seq_len}")
    if not args.min_time > 0:
        p.error(f"--min-time must be > 0, got {args.min_time}")
    return args


def torch_conv_parts(torch):
    """``parts(u, K, s)`` for :func:`mgnn.studies.bench.bench_conv_parts`: PyTorch's forward
    convolution, input gradient and kernel gradient at the shapes of u (B, C, *spatial), K and
    s (the output cotangent), on as many threads as Numba."""
    from mgnn.studies.bench import numba_threads

    def parts(u, K, s):
        tu, tK, ts = (torch.from_numpy(np.ascontiguousarray(a)) for a in (u, K, s))
        tb = torch.zeros(K.shape[0], dtype=tu.dtype)
        nd = u.ndim - 2
        conv = (torch.nn.functional.conv2d, torch.nn.functional.conv3d)[nd - 2]
        grad_in = (torch.nn.grad.conv2d_input, torch.nn.grad.conv3d_input)[nd - 2]
        grad_w = (torch.nn.grad.conv2d_weight, torch.nn.grad.conv3d_weight)[nd - 2]
        torch.set_num_threads(max(1, numba_threads()))
        return {"forward": lambda: conv(tu, tK, tb, padding=1),
                "input vjp": lambda: grad_in(tu.shape, tK, ts, padding=1),
                "kernel grad": lambda: grad_w(tu, tK.shape, ts, padding=1)}
    return parts


def conv_parts(torch, log=print):
    """The per-kernel conv rows of ``bench kernels`` (``CONV_PARTS`` shapes) beside PyTorch's
    time for the same convolution; returns the rows."""
    from mgnn.studies.bench import CONV_PARTS, bench_conv_parts, format_results
    rows = [r for C, B, S, nd in CONV_PARTS
            for r in bench_conv_parts(C, B, S, nd, baseline=("pytorch", torch_conv_parts(torch)))]
    log(format_results(rows))
    return rows


def main(argv=None):
    """Parse, import PyTorch (a clear exit without it), run."""
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        sys.exit("scripts/torch_baseline.py needs PyTorch in this environment (a benchmark "
                 "environment: PyTorch is never a dependency of mgnn)")
    if args.conv_parts:
        conv_parts(torch)
        return
    run(args, torch)


if __name__ == "__main__":
    main()
