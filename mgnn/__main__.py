"""Command line: ``python -m mgnn train ...`` and ``python -m mgnn bench kernels``."""
import argparse
import json
import os
import sys
import time
import warnings

import numpy as np

from .guard import GuardWarning


def _train_parser(sub):
    p = sub.add_parser("train", help="train a residual network",
                       description="Train a dense or conv ResNet; prints loss and test accuracy "
                                   "per epoch, the final test accuracy and the time per batch.")
    a = p.add_argument
    a("--model", choices=["dense", "conv", "gru", "rnn"], default="dense",
      help="network kind (default dense): residual dense / conv, or recurrent over sequence "
           "time (gru, rnn: MGRIT runs over the --seq-len time steps)")
    a("--layers", type=int, default=32, help="residual layers N (default 32)")
    a("--width", type=int, default=64, help="dense state width; gru/rnn hidden size (default 64)")
    a("--seq-len", type=int, default=None,
      help="gru/rnn: time steps L (default: image rows, e.g. 28 for row-sequential MNIST; 512 "
           "for --data sine); every sample is read as L steps of (pixels / L) features")
    a("--rnn-layers", type=int, default=1, help="gru/rnn: stacked recurrent layers (default 1)")
    a("--cell", choices=["gru", "implicit_gru"], default="gru",
      help="gru: PyTorch's GRU or the implicit GRU cell (default gru)")
    a("--coarse", choices=["implicit", "rediscretise"], default="implicit",
      help="gru: coarse MGRIT propagator over time (default implicit; docs/recurrent.md)")
    a("--channels", type=int, default=8, help="conv state channels (default 8)")
    a("--pool", type=int, default=1, help="conv closing: average pool grid p x p (default 1)")
    a("--t-final", type=float, default=1.0, help="T; step size h = T/N (default 1)")
    a("--activation", choices=["tanh", "relu"], default="tanh")
    a("--batch-norm", action="store_true",
      help="batch norm in every residual layer: F(u) = sigma(BN(affine(u))) (PyTorch semantics)")
    a("--sync-bn", action="store_true",
      help="batch-norm statistics over all data replicas (default: each replica's shard)")
    a("--dropout", type=float, default=0.0, metavar="P",
      help="dropout probability in every residual layer, in [0, 1) (default 0)")
    a("--epochs", type=int, default=10)
    a("--batch-size", type=int, default=32, help="samples per step, over all data replicas")
    a("--lr", type=float, default=None, help="learning rate (default 0.05 sgd, 0.003 adam)")
    a("--lr-schedule", choices=["constant", "cosine"], default="constant",
      help="constant --lr, or cosine decay from --lr to --lr-min over --lr-epochs")
    a("--lr-min", type=float, default=None, help="cosine: the rate at the end (default 0)")
    a("--lr-epochs", type=float, default=None, metavar="E",
      help="cosine: epochs the decay lasts, then --lr-min (default --epochs; give the planned "
           "total when a run will stop and --resume)")
    a("--optimizer", choices=["sgd", "adam"], default="adam")
    a("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    a("--weight-decay", type=float, default=0.0)
    a("--clip-grad", type=float, default=None, metavar="NORM",
      help="clip the gradient's global 2-norm (over all ranks) to NORM (default: no clipping)")
    a("--data", type=_data_arg, default="digits", metavar="{" + ",".join(DATA_SETS) + ",FILE.npz}",
      help="data set (default digits, embedded via scikit-learn; volumes: synthetic 3D shapes "
           "for --model conv, docs/data_volumes.md), or your own FILE.npz with arrays x_train "
           "(n, ...), y_train (n,) int, x_test, y_test (docs/user_guide.md)")
    a("--volume-size", type=int, default=16, metavar="S",
      help="volumes: edge of the S^3 volumes (default 16; 15/31 vertex-, 16/32 cell-centred)")
    a("--data-dir", default=None, help="folder with the MNIST IDX files (or $MGNN_MNIST_DIR)")
    a("--limit-train", type=int, default=None, help="use only the first n training samples")
    a("--limit-test", type=int, default=None, help="use only the first n test samples")
    a("--dtype", choices=["float32", "float64"], default="float32")
    a("--backend", choices=["numpy", "numba", "cuda", "cuda-emulated"], default="numba",
      help="numba (CPU), numpy (reference), cuda (GPU: CuPy + RawKernels + Numba CUDA), "
           "cuda-emulated (the GPU kernels compiled for the CPU: slow, for checking)")
    a("--seed", type=int, default=0, help="seeds the initial parameters and the shuffling")
    g = p.add_argument_group("MGRIT (layer-parallel propagation; --levels 1 = layer by layer)")
    g.add_argument("--levels", type=_levels_arg, default=1, metavar="{L,auto}",
                   help="MGRIT max levels (default 1: serial), or auto: the level count with "
                        "the shortest critical path for these layer ranks, from this machine's "
                        "step and message times (coarsening stops where the redundant coarsest "
                        "solve is cheaper than another level)")
    g.add_argument("--cf", type=int, default=4, help="coarsening factor (default 4)")
    g.add_argument("--nrelax", default="0,1",
                   help="(C,F) sweeps after the first F per level, comma list, last repeats; "
                        "default 0,1 = F on level 0, FCF below")
    g.add_argument("--fwd-iters", type=int, default=2, help="forward cycles (default 2)")
    g.add_argument("--bwd-iters", type=int, default=1, help="adjoint cycles (default 1)")
    g.add_argument("--fwd-tol", type=float, default=None,
                   help="forward abs. tolerance (default 1e-10 in float64, 1.2e-4 in float32; "
                        "0 = exactly --fwd-iters cycles)")
    g.add_argument("--bwd-tol", type=float, default=None,
                   help="adjoint abs. tolerance (as --fwd-tol)")
    g.add_argument("--cycle", choices=["V", "F"], default="V", help="cycle type (default V)")
    g.add_argument("--min-coarse", type=int, default=2, help="least intervals on a coarse level")
    g.add_argument("--skip-downcycle", action="store_true",
                   help="cycle 0 is a cascadic initial guess (XBraid's skip)")
    g.add_argument("--guard", choices=["auto", "off"], default="auto",
                   help="gradient guard (default auto): check MGRIT gradients against exact ones "
                        "now and then, iterate further or propagate exactly where MGRIT does not "
                        "converge (docs/design.md, 'When layer-parallel gradients are good "
                        "enough'); off: the fixed cycle budget, unwatched")
    g.add_argument("--warm-start", action="store_true",
                   help="start each forward solve from the previous batch's states")
    g.add_argument("--coarsest", choices=["redundant", "sequential"], default="redundant",
                   help="coarsest MGRIT level across layer ranks: solved by every rank after one "
                        "allgather (default) or passed along the ranks as a chain")
    g.add_argument("--spatial-levels", default="", metavar="L1,L2",
                   help="conv: coarsen the images in space below these MGRIT levels (level l "
                        "-> l + 1 at half the resolution per axis; e.g. 0 or 0,1; default none)")
    g.add_argument("--interp", choices=["linear", "nearest"], default="linear",
                   help="spatial coarsening: interpolation (default linear)")
    g.add_argument("--restrict", choices=["full", "injection"], default="full",
                   help="spatial coarsening: restriction (default full: the transpose of "
                        "--interp, scaled to keep constants)")
    m = p.add_argument_group("MPI (run under mpiexec -n P; P = layer ranks x data ranks)")
    m.add_argument("--layer-ranks", type=int, default=None,
                   help="ranks sharing the layers (default P / data ranks)")
    m.add_argument("--data-ranks", type=int, default=1, help="data-parallel replicas (default 1)")
    m.add_argument("--timings", action="store_true",
                   help="print per-rank time in step kernels, halo waits, allreduce and other")
    a("--checkpoint", default=None, help="write a checkpoint (.npz) here after every epoch")
    a("--resume", default=None,
      help="resume from this checkpoint: same model, data, optimizer, --lr, --batch-size, "
           "--lr-schedule, --lr-min, --lr-epochs, --momentum, --weight-decay, --seed and "
           "--warm-start (checked); --epochs is the new total; MGRIT, backend and MPI options may change")
    a("--json", action="store_true", help="print one machine-readable summary line on stdout")
    a("--no-progress", action="store_true", help="no progress bar")
    return p


def _bench_parser(sub):
    from .studies.scaling import FIELDS
    epilog = "scaling output fields (CSV/JSON):\n" + "\n".join(
        f"  {k:<20} {v}" for k, v in FIELDS.items())
    p = sub.add_parser("bench", help="benchmarks (ratios against baselines, same run)",
                       description="kernels: kernel speed against BLAS / the reference; mgrit: "
                                   "work per cycle against the cost model and overheads (dense; "
                                   "conv with and without spatial coarsening, work in fine-step "
                                   "equivalents); "
                                   "scaling: strong/weak scaling and sweeps of layer-parallel "
                                   "MGRIT against serial, layer-wise and pipeline training "
                                   "(run under mpiexec -n P, or it launches mpiexec itself), "
                                   "writing CSV, JSON and PNG plots.",
                       epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=["kernels", "mgrit", "scaling", "gpu-launches", "recurrent",
                                     "spatial", "spatial-step", "calibrate", "predict"],
                   help="which benchmark (gpu-launches: launches and host time of a GPU "
                        "training step, no GPU needed; spatial: MGRIT convergence and work per "
                        "cycle with and without spatial coarsening, 2D and 3D; spatial-step: "
                        "time per training step of a 3D conv ResNet, under mpiexec -n P too; "
                        "calibrate: this machine's kernel costs and MPI alpha/beta into --costs; "
                        "predict: time per training step on P virtual ranks from --costs, "
                        "docs/virtual_ranks.md)")
    p.add_argument("--quick", action="store_true", help="fewer cases / smaller sizes")
    p.add_argument("--json", action="store_true", help="kernels/mgrit: JSON lines")
    g = p.add_argument_group("scaling")
    g.add_argument("--ranks", default=None,
                   help="process counts P (default 1,2,4; predict: 1,2,4,...,4096)")
    g.add_argument("--model", choices=["dense", "gru", "conv"], default="dense",
                   help="scaling: dense ResNet over N layers, a GRU over N time steps "
                        "(hidden = --width, 4 input features; no pipeline baseline), or a conv "
                        "ResNet (--channels, 28 x 28 images; with --spatial-levels also MGRIT "
                        "with spatial coarsening); "
                        "calibrate/predict: dense, conv (MNIST-sized 28 x 28 images) or gru "
                        "(no pipeline)")
    g.add_argument("--layers", "--n-layers", dest="n_layers", type=int, default=256, metavar="N",
                   help="residual layers N (default 256)")
    g.add_argument("--width", type=int, default=64, help="state width (default 64)")
    g.add_argument("--activation", choices=["tanh", "relu"], default=None,
                   help="the dense network's sigma: scaling --model dense (default tanh), mgrit "
                        "(default relu)")
    g.add_argument("--batch-size", "--batch", dest="batch", type=int, default=64, metavar="B",
                   help="batch size (default 64)")
    g.add_argument("--levels", type=_levels_arg, default=3, metavar="{L,auto}",
                   help="MGRIT levels (default 3); calibrate/predict also auto: per P, the "
                        "count train --levels auto would pick from the cost table")
    g.add_argument("--cf", type=int, default=4, help="coarsening factor (default 4)")
    g.add_argument("--fwd-iters", type=int, default=2, help="forward cycles (default 2)")
    g.add_argument("--bwd-iters", type=int, default=1, help="adjoint cycles (default 1)")
    g.add_argument("--micro", default=None,
                   help="pipeline micro-batch counts M (default 1,2,4,8; predict: 4,16)")
    g.add_argument("--sweep", action="append", metavar="KEY=V1,V2",
                   help="also vary one of n_layers, width, batch, levels, cf, fwd_iters, "
                        "bwd_iters at the largest P (repeatable)")
    g.add_argument("--repeats", type=int, default=5, help="timed steps per point (median)")
    g.add_argument("--out", default=None,
                   help="output folder (default results/scaling; predict: results/predict)")
    g = p.add_argument_group("calibrate / predict (also --model, --layers, --width, --batch-size, "
                             "--levels, --cf, --fwd-iters, --bwd-iters, --micro, --ranks, "
                             "--channels, --repeats, --out)")
    g.add_argument("--costs", default=None, metavar="PATH",
                   help="cost table JSON: calibrate writes it, predict reads it (default "
                        "results/costs-<model>-<dtype>.json; predict calibrates it when missing)")
    g.add_argument("--dtype", choices=["float32", "float64"], default=None,
                   help="calibrate/predict and mgrit's dense solves: default float32; scaling "
                        "--model dense: default float64")
    g.add_argument("--in-features", type=int, default=None,
                   help="dense: input features (default the width)")
    g.add_argument("--network", choices=["calibrated", "shared", "ib-hdr", "nvlink"],
                   default="calibrated",
                   help="predict: message costs (default: the table's measured alpha/beta)")
    g.add_argument("--cores", type=int, default=None,
                   help="predict: cores the ranks share (P > cores stretches compute by "
                        "1 + (ceil(P / cores) - 1) u, u the compute share without sharing: an "
                        "oversubscribed single machine); default: a core each")
    g.add_argument("--oversubscribed-hop", type=float, default=None, metavar="US",
                   help="predict with --cores: microseconds each message waits for a core when "
                        "P > cores (default: the cost table's, 0 unless set; a fitted "
                        "parameter, docs/virtual_ranks.md)")
    g.add_argument("--coarsest", choices=["redundant", "sequential"], default="redundant",
                   help="predict: MGRIT's coarsest level (default redundant)")
    g.add_argument("--weak", action="store_true",
                   help="predict: also weak scaling (N = --layers x P / first P)")
    g.add_argument("--backend", choices=["auto", "numba", "numpy", "cuda", "cuda-emulated"],
                   default="auto", help="calibrate / --validate: the kernels measured (auto: "
                   "cuda where a GPU is present, else numba); predictions run the host code path "
                   "with the table's costs")
    g.add_argument("--validate", action="store_true",
                   help="predict: also measure the same steps under mpiexec -n P for P <= 8 of "
                        "--ranks and print predicted vs measured (cores = this machine's)")
    g.add_argument("--plan", action="store_true",
                   help="predict: search layer x data ranks, cf, levels, cycles and pipeline "
                        "micro-batches for the fastest predicted step at each P of --ranks, "
                        "MGRIT within --grad-tol; prints the best and the train command line")
    g.add_argument("--grad-tol", type=float, default=0.1,
                   help="predict --plan: the largest relative gradient error of an MGRIT setting "
                        "(one exact and one MGRIT step of the network per setting; default 0.1)")
    g.add_argument("--threads", type=int, default=1,
                   help="calibrate: Numba threads per rank while measuring (default 1)")
    g = p.add_argument_group("spatial-step (also --layers, --batch-size, --levels, --cf, "
                             "--fwd-iters, --bwd-iters, --repeats)")
    g.add_argument("--volume-size", type=int, default=31, metavar="S",
                   help="S^3 volumes (default 31, the peer's ModelNet setting)")
    g.add_argument("--channels", type=int, default=None,
                   help="state channels (default 4; predict/calibrate: 8)")
    g.add_argument("--spatial-levels", default=None, metavar="L1,L2",
                   help="levels coarsened in space below them ('' for none; spatial-step "
                        "default 0; scaling --model conv: adds an mgrit-spatial run)")
    return p


class _CLIError(ValueError):
    """Bad input found before training; the same one-line message on every rank."""


# flag bounds (dest: (least, most)); None: no bound (memory is checked separately)
_INT_BOUNDS = {"layers": (1, None), "n_layers": (1, None), "width": (1, None),
               "seq_len": (2, None), "rnn_layers": (1, None),
               "channels": (1, None), "pool": (1, None), "epochs": (1, 10**7),
               "batch_size": (1, None), "batch": (1, None), "limit_train": (1, None),
               "limit_test": (1, None), "seed": (0, 2**63 - 1), "levels": (1, 64),
               "cf": (2, None), "fwd_iters": (1, 10**4), "bwd_iters": (1, 10**4),
               "min_coarse": (1, None), "layer_ranks": (1, None), "data_ranks": (1, None),
               "repeats": (1, 10**6), "volume_size": (8, None), "in_features": (1, None),
               "cores": (1, None), "threads": (1, 4096)}
# (least, least is allowed, most, most is allowed)
_FLOAT_BOUNDS = {"t_final": (0.0, False, None, False), "lr": (0.0, False, None, False),
                 "momentum": (0.0, True, 1.0, False), "weight_decay": (0.0, True, None, False),
                 "fwd_tol": (0.0, True, None, False), "bwd_tol": (0.0, True, None, False),
                 "dropout": (0.0, True, 1.0, False), "clip_grad": (0.0, False, None, False),
                 "lr_min": (0.0, True, None, False), "lr_epochs": (0.0, False, None, False)}


def _default_lr(optimizer):
    return 0.05 if optimizer == "sgd" else 0.003


def _check_args(args, parser):
    """Bounds of every numeric flag of ``parser`` (ValueError naming the flag and the value)."""
    for action in parser._actions:
        flag, v = (action.option_strings or [action.dest])[0], getattr(args, action.dest, None)
        if v is None:
            continue
        if action.dest in _INT_BOUNDS and v != "auto":
            lo, hi = _INT_BOUNDS[action.dest]
            if v < lo or (hi is not None and v > hi):
                bound = f">= {lo}" if v < lo else f"<= {hi}"
                raise ValueError(f"{flag} must be {bound}, got {v}")
        elif action.dest in _FLOAT_BOUNDS:
            lo, lo_ok, hi, hi_ok = _FLOAT_BOUNDS[action.dest]
            if not np.isfinite(v) or v < lo or (v == lo and not lo_ok) or (
                    hi is not None and (v > hi or (v == hi and not hi_ok))):
                want = (f"{'>=' if lo_ok else '>'} {lo}" if hi is None
                        else f"in [{lo}, {hi}{']' if hi_ok else ')'}")
                raise ValueError(f"{flag} must be a finite number {want}, got {v}")
    if getattr(args, "command", None) == "train":
        _nrelax(args)
        lr = args.lr if args.lr is not None else _default_lr(args.optimizer)
        if args.lr_schedule != "cosine":
            for flag in ("lr_min", "lr_epochs"):
                if getattr(args, flag) is not None:
                    raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)} needs "
                                     "--lr-schedule cosine")
        elif args.lr_min is not None and args.lr_min > lr:
            raise ValueError(f"--lr-min {args.lr_min} is above --lr {lr}")
        _spatial_levels(args)
        if args.levels == "auto" and args.cycle != "V":
            raise ValueError(f"--levels auto models V-cycles, not --cycle {args.cycle}: give "
                             "--levels N")
        if args.batch_size < args.data_ranks:
            raise ValueError(f"--batch-size {args.batch_size} is smaller than --data-ranks "
                             f"{args.data_ranks}: every data replica needs a sample of each batch")


def _spatial_levels(args):
    """--spatial-levels as a tuple of ints (ValueError naming the flag)."""
    text = (args.spatial_levels or "").strip()
    if not text:
        return ()
    try:
        levels = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--spatial-levels must be comma-separated ints, got {text!r}") from None
    if args.model != "conv":
        raise ValueError(f"--spatial-levels {text} needs --model conv, got --model {args.model}")
    return levels


def _levels_arg(text):
    """--levels: an int, or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int or 'auto', got {text!r}") from None


def _nrelax(args):
    try:
        nrelax = [int(v) for v in args.nrelax.split(",")]
    except ValueError:
        raise ValueError(f"--nrelax must be a comma list of ints, got {args.nrelax!r}") from None
    if any(not 0 <= n <= 100 for n in nrelax):
        raise ValueError(f"--nrelax entries must be between 0 and 100, got {args.nrelax!r}")
    return nrelax


DATA_SETS = ("digits", "mnist", "synthetic", "sine", "volumes")


def _data_arg(value):
    """--data: a built-in set's name or a path ending in .npz."""
    if value in DATA_SETS or value.endswith(".npz"):
        return value
    raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from "
                                     f"{', '.join(DATA_SETS)} or a FILE.npz)")


def _check_model_input(args, ds):
    """A user's --data FILE.npz must fit --model: conv needs (C, H, W) or (C, D, H, W) samples,
    a recurrent model L x features (--seq-len L, default the first sample axis)."""
    shape = ds.image_shape
    if args.model == "conv" and len(shape) not in (3, 4):
        raise ValueError(f"--model conv needs samples of shape (C, H, W) or (C, D, H, W); "
                         f"{args.data} has samples of shape {shape}")
    if args.model in ("gru", "rnn") and int(np.prod(shape)) % args.layers:
        raise ValueError(f"--seq-len {args.layers} does not divide the {int(np.prod(shape))} "
                         f"values of a sample of {args.data} (shape {shape})")


#: --seq-len of a recurrent model when not given: the image rows (row-sequential), or sine's 512
_DEFAULT_SEQ_LEN = {"mnist": 28, "digits": 8, "synthetic": 8, "sine": 512, "volumes": 16}


def _default_seq_len(args):
    """A recurrent model's sequence length when --seq-len is not given: per data set, or for a
    FILE.npz the first axis of a sample (samples (L, F): L steps of F features)."""
    if args.data in _DEFAULT_SEQ_LEN:
        return _DEFAULT_SEQ_LEN[args.data]
    from .data import load_npz
    return load_npz(args.data).image_shape[0]


def _check_layer_ranks(args, layer_ranks):
    """Every layer rank must own a layer that starts a coarse interval (said in layers/ranks)."""
    align = args.cf if args.levels != 1 else 1  # (auto: possibly several levels)
    most = -(-args.layers // align)
    if layer_ranks > most:
        why = f" with --cf {args.cf}" if align > 1 else ""
        raise ValueError(f"{layer_ranks} layer ranks but --layers {args.layers}{why} allow at most "
                         f"{most} (every layer rank needs a layer" +
                         (f" at a multiple of --cf {args.cf})" if align > 1 else ")"))


def _check_memory(args, ds, layer_ranks):
    """A clear error when parameters, optimizer state and a batch's stored states would not fit
    in this machine's memory (an estimate, per rank), instead of an allocation failure."""
    N, B, K = args.layers, args.batch_size, ds.n_classes
    C, *spatial = ds.image_shape
    pixels = int(np.prod(spatial))
    if args.model in ("gru", "rnn"):
        w, k = args.width, args.rnn_layers
        n_params, state = 3 * (C * pixels + 2 * w * w * k + 2 * w * k) + w * K + K, 8 * w * k
    elif args.model == "dense":
        w = args.width
        n_params, state = C * pixels * w + w + N * (w * w + w) + w * K + K, w
    else:
        c, taps = args.channels, 3 ** len(spatial)
        n_params = (C * c * taps + c + N * (c * c * taps + c)
                    + c * args.pool ** len(spatial) * K)
        state = c * pixels
    itemsize = np.dtype(args.dtype).itemsize
    need = itemsize * (5 * n_params + 3 * (N // layer_ranks + 2) * B * state)
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if need > have:
        size = (f"--width {args.width}" if args.model == "dense" else
                f"--channels {args.channels}")
        raise ValueError(f"--layers {N} with {size} and --batch-size {B} ({args.dtype}) need about "
                         f"{need / 2**30:.3g} GiB per rank (parameters, optimizer state and the "
                         f"states of a batch), more than the {have / 2**30:.3g} GiB of this "
                         "machine")


# options that change how a resumed run continues: checked against the checkpoint
_RESUME_KEYS = ("lr", "lr_schedule", "lr_min", "lr_epochs", "batch_size", "momentum",
                "weight_decay", "data", "volume_size", "limit_train", "seed", "warm_start",
                "sync_bn", "clip_grad")


def _resume_meta(args, lr):
    """The checkpoint's 'meta': the options a resumed run must repeat."""
    meta = {k: getattr(args, k) for k in _RESUME_KEYS}
    meta["lr"] = lr
    if args.lr_schedule == "constant":
        meta.pop("lr_min"), meta.pop("lr_epochs")
    else:
        meta["lr_min"] = args.lr_min or 0.0
        meta["lr_epochs"] = float(args.lr_epochs if args.lr_epochs is not None else args.epochs)
    if args.optimizer != "sgd":
        meta.pop("momentum")
    return meta


def _check_resume(ckpt, meta):
    """CheckpointError when an option that changes the continuation differs from the saved one."""
    from .errors import CheckpointError
    saved = ckpt["header"].get("meta", {})
    for k, v in meta.items():
        if k in saved and saved[k] != v:
            flag = "--" + k.replace("_", "-")
            raise CheckpointError(f"--resume {ckpt['path']}: {flag} {v} differs from the "
                                  f"checkpoint's {saved[k]} (a resumed run continues with the "
                                  f"saved value: pass {flag} {saved[k]}, or start a new run)")


def _compile_on_rank_zero_first(comm, lp, make_serial, x, y, log):
    """Under MPI with the Numba backend, rank 0 first compiles the kernels into Numba's cache
    (one small batch through ``make_serial()``, a single-process replica of the run) while the
    other ranks wait without spinning; then every rank's compile step mostly loads them. Numba's
    cache is not safe against several processes compiling the same kernels into it at once (a
    rank can die with a spurious TypingError: numba issues 4807, 10128). A failure here is only
    reported: the collective compile step that follows raises it on every rank."""
    from .comm import polled_barrier
    if comm is None or comm.Get_size() == 1 or getattr(lp.bk, "name", None) != "numba":
        return
    if comm.Get_rank() == 0:
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", GuardWarning)
                make_serial().loss_and_grad(x, y)
        except Exception as exc:  # noqa: BLE001 -- reported by the collective step after this
            log(f"kernel warm-up on rank 0 failed ({type(exc).__name__}: {exc}); every rank "
                "compiles")
        else:
            log(f"kernels compiled (or loaded) on rank 0 in {time.perf_counter() - t0:.1f} s; "
                "the other ranks load them")
    polled_barrier(comm)


def _agreed(comm, fn, *a):
    """``fn(*a)``; an input error (on any rank) becomes the same :class:`_CLIError` on every rank:
    the first failing rank's message (prefixed with its rank when it is not the first rank and
    other ranks did not fail).
    Collective under MPI."""
    try:
        out, err = fn(*a), None
    except _INPUT_ERRORS as exc:
        out, err = None, exc
    msgs = [None if err is None else _message(err)]
    if comm is not None:
        from .comm import agree_on_errors
        msgs = agree_on_errors(comm, None, msgs[0])  # (an allgather of the messages)
    failed = [(r, m) for r, m in enumerate(msgs) if m is not None]
    if failed:
        r, m = failed[0]
        raise _CLIError(m if r == 0 or len(failed) == len(msgs) else f"rank {r}: {m}") from err
    return out


_INPUT_ERRORS = (ValueError, TypeError, OSError, MemoryError)


def _message(exc):
    if isinstance(exc, MemoryError):
        return f"out of memory: {exc}"
    if isinstance(exc, OSError) and exc.filename and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc)


def _mgrit_options(args):
    """(fwd, bwd) MGRITOptions from the CLI, or (None, None) for --levels 1 (and for --levels
    auto until :func:`_auto_levels` has chosen)."""
    from .mgrit import MGRITOptions
    if args.levels in (1, "auto"):
        return None, None
    common = dict(cf=args.cf, max_levels=args.levels, nrelax=_nrelax(args),
                  skip_downcycle=args.skip_downcycle, min_coarse=args.min_coarse,
                  cycle=args.cycle)
    out = []
    for flag, tol, iters in (("--fwd-tol", args.fwd_tol, args.fwd_iters),
                             ("--bwd-tol", args.bwd_tol, args.bwd_iters)):
        # a fixed cycle budget whose residuals are printed: no not-converged warnings
        opts = MGRITOptions(max_iter=iters, warn_not_converged=False, **common,
                            **({} if tol is None else {"tol": tol}))
        try:
            opts.for_dtype(args.dtype)
        except ValueError as exc:
            raise ValueError(f"{flag} {tol}: {exc}") from None
        out.append(opts)
    return tuple(out)


def _step_seconds(args, model, x):
    """(seconds of one forward step of the batch ``x``, seconds of one of a single sample: a
    call's overhead) on this rank, with ``args.backend``; the model's buffers and step count
    are left as they were. CPU backends only."""
    from .backend import get_backend
    from .propagators import ForwardPropagator
    if args.backend not in ("numpy", "numba"):
        raise ValueError(f"--levels auto times steps on the CPU backends (numba, numpy), not "
                         f"--backend {args.backend}: give --levels N (python -m mgnn bench "
                         "predict --plan picks one)")
    bk = get_backend(args.backend)
    kept = model.buffers.flat.copy(), model.train_steps
    prop = ForwardPropagator(model, bk)

    def timed(xb):
        prop.ctx.begin(xb)  # (sequence models read their per-step inputs from it)
        u, _ = model.opening.forward(model.group("opening"), xb, bk)
        prop.step(u, 0, 1, 0)  # (compiles, or loads the cache)
        reps, t0 = 0, time.perf_counter()
        while reps < 5 or time.perf_counter() - t0 < 0.05:
            prop.step(u, 0, 1, 0)
            reps += 1
        return (time.perf_counter() - t0) / reps

    try:
        return timed(x), timed(x[:1])
    finally:
        model.buffers.flat[...], model.train_steps = kept


def _auto_levels(args, model, x, comm, layer_ranks, log):
    """--levels auto: the level count of :func:`mgnn.mgrit.hierarchy.auto_levels` for
    ``layer_ranks``, from this machine's forward step (batch ``x``), a call's overhead and a
    message of a state (ping-pong between ranks 0 and 1); the same on every rank (the slowest
    rank's times). A step's work is the batch's step less a call's overhead (the one-sample
    step), as a cost table's per-state part. Collective under MPI."""
    from .comm import polled_barrier
    from .mgrit.hierarchy import auto_levels
    if layer_ranks == 1:
        log("--levels auto: 1 (one layer rank: layer by layer is the shortest path)")
        return 1
    if comm.Get_rank() == 0:  # compiles into Numba's cache alone first (as the training step)
        try:
            _step_seconds(args, model, x)
        except Exception:  # noqa: BLE001 -- raised on every rank by the collective call below
            pass
    polled_barrier(comm)
    t_step, t_call = _agreed(comm, _step_seconds, args, model, x)
    state = np.zeros(int(np.prod(model.step.state_shape(x.shape[0]))), model.dtype)
    recv = np.empty_like(state)
    from mpi4py import MPI
    from .comm.halo import ping_pong
    comm.Barrier()
    ping_pong(comm, state, recv, 3)  # (warm)
    t_msg = ping_pong(comm, state, recv, 20)
    times = np.array([t_step, t_call, t_msg])
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    t_step, t_call, t_msg = times.tolist()
    work = max(t_step - t_call, 0.05 * t_step, 1e-12)
    message_steps = (t_msg + t_call) / work
    nrelax = _nrelax(args)
    # as LayerParallel runs it: redundant only for fused kinds without spatial coarsening
    coarsest = args.coarsest if model.step.fused and not _spatial_levels(args) else "sequential"
    levels, costs = auto_levels(
        args.layers, args.cf, layer_ranks, (args.fwd_iters, args.bwd_iters),
        lambda lev: nrelax[min(lev, len(nrelax) - 1)], args.skip_downcycle, args.min_coarse,
        message_steps, coarsest=coarsest)
    log(f"--levels auto: {levels} (critical path in forward steps per level count: "
        + ", ".join(f"{L}: {c:.0f}" for L, c in costs.items())
        + f"; a step's work {1e6 * work:.1f} us, a message and call "
        f"{1e6 * (t_msg + t_call):.1f} us, {layer_ranks} layer ranks, coarsest {coarsest})")
    return levels


def _mpi_size_from_env():
    """Process count announced by the MPI launcher (MPICH/Hydra, Open MPI), or 1."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def _launched_world():
    """COMM_WORLD when this process was started by ``mpiexec -n P`` with P > 1, else None
    (the bench suites that run on every rank of the launch)."""
    if _mpi_size_from_env() == 1:
        return None
    from mpi4py import MPI
    return MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() > 1 else None


def _world(args):
    """COMM_WORLD when launched on several ranks (or ranks were asked for), else None."""
    if _mpi_size_from_env() == 1 and args.layer_ranks in (None, 1) and args.data_ranks == 1:
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        raise ValueError("--layer-ranks/--data-ranks or mpiexec need mpi4py "
                         "(pip install 'mgnn[mpi]')") from None
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    layer = args.layer_ranks if args.layer_ranks is not None else size // max(args.data_ranks, 1)
    if layer < 1 or args.data_ranks < 1 or layer * args.data_ranks != size:
        raise ValueError(f"--layer-ranks {layer} x --data-ranks {args.data_ranks} != "
                         f"{size} MPI processes")
    return comm if size > 1 else None


def cmd_train(args, comm=None):
    """Run ``train`` (every rank of ``comm``); returns the summary dict."""
    from functools import partial

    from . import (LayerParallel, conv_resnet, dense_resnet, gru_classifier, load_dataset,
                   rnn_classifier)
    from .optim import make_lr_schedule, make_optimizer
    from .train import check_checkpoint_path, fit, load_checkpoint, restore, restore_warm_states

    out = sys.stderr if args.json else sys.stdout
    rank = 0 if comm is None else comm.Get_rank()

    def log(line):
        if rank == 0:
            print(line, file=out, flush=True)

    t_setup = time.perf_counter()
    lr = args.lr if args.lr is not None else _default_lr(args.optimizer)
    meta = _resume_meta(args, lr)
    layer_ranks = 1 if comm is None else comm.Get_size() // args.data_ranks
    recurrent = args.model in ("gru", "rnn")

    def prepare():  # every input error before any collective or kernel
        if recurrent:  # MGRIT runs over the time steps
            args.layers = args.seq_len or _default_seq_len(args)
        _check_layer_ranks(args, layer_ranks)
        fwd_bwd = _mgrit_options(args)
        ds = load_dataset(args.data, args.data_dir, seed=args.seed,
                          limit_train=args.limit_train, limit_test=args.limit_test,
                          seq_len=args.layers, volume_size=args.volume_size)
        _check_model_input(args, ds)
        if len(ds.y_train) < args.data_ranks:
            raise ValueError(f"{len(ds.y_train)} training samples (--limit-train) are fewer than "
                             f"--data-ranks {args.data_ranks}")
        _check_memory(args, ds, layer_ranks)
        C, *spatial = ds.image_shape
        if recurrent:
            x_size = ds.as_model_input(ds.x_train[:1], args.model, "float64",
                                       seq_len=args.layers).shape[2]
            make = (rnn_classifier if args.model == "rnn" else
                    partial(gru_classifier, cell=args.cell, coarse=args.coarse))
            model = make(x_size, args.width, ds.n_classes, args.layers,
                         n_layers=args.rnn_layers, dtype=args.dtype, seed=args.seed)
        elif args.model == "dense":
            model = dense_resnet(int(np.prod(ds.image_shape)), args.width, ds.n_classes, args.layers, args.t_final,
                                 args.activation, args.dtype, args.seed,
                                 batch_norm=args.batch_norm, dropout=args.dropout)
        else:
            model = conv_resnet(C, args.channels, tuple(spatial), ds.n_classes, args.layers,
                                args.t_final, args.activation, args.dtype, args.seed,
                                pool=args.pool, batch_norm=args.batch_norm,
                                dropout=args.dropout)
        ckpt = load_checkpoint(args.resume) if args.resume else None
        if ckpt is not None:
            _check_resume(ckpt, meta)
        if args.checkpoint and rank == 0:
            check_checkpoint_path(args.checkpoint)
        return fwd_bwd, ds, model, ckpt

    (fwd, bwd), ds, model, ckpt = _agreed(comm, prepare)
    xtr = ds.as_model_input(ds.x_train, args.model, model.dtype, seq_len=args.layers)
    xte = ds.as_model_input(ds.x_test, args.model, model.dtype, seq_len=args.layers)
    if args.levels == "auto":
        args.levels = _auto_levels(args, model, xtr[:args.batch_size // args.data_ranks], comm,
                                   layer_ranks, log)
        fwd, bwd = _agreed(comm, _mgrit_options, args)
    if args.backend == "cuda" and comm is not None:
        from .backend import gpu_available
        if gpu_available():  # else LayerParallel reports the missing GPU on every rank
            from .comm import select_device
            gpu = select_device(comm)
            log(f"GPUs: rank 0 on device {gpu}; every rank takes node-local rank mod GPU count")
    lp = _agreed(comm, lambda: LayerParallel(model, fwd=fwd, bwd=bwd, backend=args.backend,
                                             warm_start=args.warm_start, comm=comm,
                                             data_ranks=args.data_ranks,
                                             coarsest=args.coarsest, sync_bn=args.sync_bn,
                                             spatial_levels=_spatial_levels(args),
                                             interp=args.interp, restrict=args.restrict,
                                             guard=args.guard))
    # after LayerParallel: the cuda backend has moved the parameters to the GPU
    opt = make_optimizer(args.optimizer, model.params.flat, lr, args.momentum, args.weight_decay)
    schedule = make_lr_schedule(args.lr_schedule, lr, meta.get("lr_epochs"),
                                meta.get("lr_min", 0.0))
    rng = np.random.default_rng(args.seed)
    start, step = 0, 0
    if ckpt is not None:
        start, step = _agreed(comm, restore, ckpt, model, opt, rng)
        log(f"resumed from {args.resume} at epoch {start}, step {step}")
    n_params = model.params.flat.size
    log(f"mgnn train: {args.model} " + (f"over L={args.layers} time steps" if recurrent else
                                         f"ResNet, N={args.layers} layers") + f", {n_params} parameters, "
        f"{args.dtype}, backend {args.backend}; data {ds.name}: {len(ds.y_train)} train / "
        f"{len(ds.y_test)} test; {args.optimizer} lr {lr}"
        + (f" (cosine to {schedule.lr_min:g} over {schedule.epochs:g} epochs)" if schedule
           else "") + f", batch {args.batch_size}, "
        f"{args.epochs} epochs")
    if comm is not None:
        log(f"MPI: {lp.layout.size} ranks = {lp.layout.layer_size} layer ranks x "
            f"{lp.layout.data_ranks} data replicas; layer blocks start at "
            f"{list(lp.partition.starts)} (balanced: modelled layer evaluations per step "
            f"{[round(w) for w in lp.block_work]}); messages: {lp.message_path()}")
    if fwd is not None:
        from .mgrit import level_sizes
        sizes = level_sizes(args.layers, args.cf, args.levels, args.min_coarse)
        log(f"MGRIT: levels {sizes} (intervals), cf {args.cf}, nrelax {args.nrelax}, "
            f"{args.fwd_iters} forward / {args.bwd_iters} adjoint {args.cycle}-cycles, "
            f"skip_downcycle {args.skip_downcycle}, warm start {args.warm_start}, "
            f"guard {lp.guard if lp.guard is not None else 'off'}")
    tj = time.perf_counter()
    kept = model.buffers.flat.copy(), model.train_steps  # the compile steps train nothing
    _compile_on_rank_zero_first(comm, lp, lambda: LayerParallel(
        model, fwd=fwd, bwd=bwd, backend=args.backend, threads=None, coarsest=args.coarsest,
        spatial_levels=_spatial_levels(args), interp=args.interp, restrict=args.restrict,
        guard=args.guard), xtr[:2], ds.y_train[:2], log)
    with warnings.catch_warnings():  # the guard's verdict on a 2-sample batch is no news
        warnings.simplefilter("ignore", GuardWarning)
        lp.loss_and_grad(xtr[:2], ds.y_train[:2])  # compile (or load cached) kernels first
    model.buffers.flat[...], model.train_steps = kept
    if lp.guard is not None:  # the warm-up step's check trained nothing
        lp.guard.reset()
    opt.warm_up()  # the optimizer's update kernel too (Numba CUDA on the GPU)
    restore_warm_states(lp, ckpt and ckpt["warm"])  # not the compile batch's states
    timings = {}
    log(f"kernels ready in {time.perf_counter() - tj:.1f} s")
    t0 = time.perf_counter()
    hist = fit(lp, opt, xtr, ds.y_train, xte, ds.y_test, epochs=args.epochs,
               batch_size=args.batch_size, rng=rng, start_epoch=start, step=step,
               checkpoint=args.checkpoint, log=log, progress=not args.no_progress and rank == 0,
               meta=meta, timings=timings, clip_grad=args.clip_grad, lr_schedule=schedule)
    train_s = time.perf_counter() - t0
    from .train import evaluate
    acc = hist[-1]["test_accuracy"] if hist else evaluate(lp, xte, ds.y_test)
    summary = {"model": args.model, "layers": args.layers, "levels": args.levels, "data": ds.name, "dtype": args.dtype,
               "backend": args.backend, "epochs": args.epochs, "test_accuracy": acc,
               "final_loss": hist[-1]["loss"] if hist else None,
               "ms_per_batch": float(np.mean([h["ms_per_batch"] for h in hist])) if hist else None,
               "train_seconds": train_s, "total_seconds": time.perf_counter() - t_setup,
               "params": n_params}
    log(f"final test accuracy {100 * acc:.2f}%  ({train_s:.1f} s training, "
        f"{summary['ms_per_batch'] or 0:.2f} ms/batch)")
    summary["ranks"] = lp.layout.size
    if lp.guard is not None and (fwd is not None or bwd is not None):
        summary["guard"] = lp.guard.summary()
        g = summary["guard"]
        log(f"gradient guard: {g['steps']} steps, {g['accept']} accepted MGRIT, {g['iterate']} "
            f"iterated further, {g['fallback']} fallbacks + {g['exact']} exact steps "
            f"({100 * g['exact_fraction']:.1f} % exact), {g['checks']} checks taking "
            f"{g['seconds']:.2f} s ({100 * g['seconds'] / max(train_s, 1e-9):.1f} % of training)")
    if args.timings:
        _print_timings(comm, lp, timings, train_s, log)
    if args.json and rank == 0:
        print(json.dumps(summary), flush=True)
    return summary


def _print_timings(comm, lp, timings, train_s, log):
    """Gather every rank's per-phase seconds and print one table on rank 0."""
    from .comm import describe_threads
    phases = ("steps", "vector", "halo_wait", "allreduce", "staging")
    other = train_s - sum(timings.get(k, 0.0) for k in phases)
    row = (lp.layout.rank, lp.layout.layer_rank, lp.layout.replica,
           *(timings.get(k, 0.0) for k in phases), other, train_s,
           lp.threads["blas"], lp.threads["numba"], lp.block_work[lp.layout.layer_rank],
           timings.get("bn_sync", 0.0))
    rows = [row] if comm is None else comm.gather(row, root=0)
    if rows is None:
        return
    log("timings (s, whole training; steps = layer step kernels, vector = MGRIT FAS vector "
        "kernels, staging = device<->host copies for MPI, other = Python, loss, optimizer, "
        f"evaluation); MPI path: {lp.message_path()}"
        + ("; on the GPU, kernel columns time the (asynchronous) launches and waits land in "
           "halo wait / other" if lp.xp is not np else ""))
    log(f"{'rank':>5} {'layer':>5} {'replica':>7} {'steps':>9} {'vector':>9} {'halo wait':>10} "
        f"{'allreduce':>10} {'staging':>9} {'other':>9} {'total':>9} {'BLAS thr':>8} "
        f"{'Numba thr':>9} {'work/step':>9}")
    for r in rows:
        log(f"{r[0]:>5} {r[1]:>5} {r[2]:>7} {r[3]:9.3f} {r[4]:9.3f} {r[5]:10.3f} {r[6]:10.3f} "
            f"{r[7]:9.3f} {r[8]:9.3f} {r[9]:9.3f} {r[10]!s:>8} {r[11]!s:>9} {r[12]:9.0f}")
    if "guard" in timings:
        log(f"gradient guard checks (inside other): {timings['guard']:.3f} s on rank 0")
    log("work/step: modelled layer evaluations per training step of the rank's layer block "
        "(the balanced partition's cost model, docs/design.md)")
    if "bn_sync" in timings:
        log("sync_bn: the batch-norm statistics' allgathers over the replicas (inside steps): "
            + ", ".join(f"rank {r[0]} {r[13]:.3f} s ({100 * r[13] / max(r[9], 1e-12):.1f} %)"
                        for r in rows))
    log(f"rank 0 {describe_threads(lp.threads)}")


#: The bench suites that take --dtype and --activation (the others have their own settings).
_DTYPE_SUITES = ("calibrate", "predict", "scaling", "mgrit")
_ACTIVATION_SUITES = ("scaling", "mgrit")


def cmd_bench(args):
    """Run ``bench``; returns the list of results."""
    from .studies.bench import bench_mgrit, format_mgrit, format_results, run_kernels
    for flag, suites in (("dtype", _DTYPE_SUITES), ("activation", _ACTIVATION_SUITES)):
        v = getattr(args, flag, None)
        if v is not None and args.suite not in suites:
            raise ValueError(f"bench {args.suite} --{flag} {v}: --{flag} is for bench "
                             f"{', '.join(suites)} only")
    if args.levels == "auto" and args.suite not in ("calibrate", "predict"):
        raise ValueError(f"bench {args.suite} --levels auto: auto is for bench calibrate and "
                         "predict (and train) only")
    if args.suite in ("calibrate", "predict"):
        from .studies.predict import main
        return main(args)
    if args.suite == "scaling":
        from .studies.scaling import main as scaling_main
        args.ranks = args.ranks or "1,2,4"
        args.micro = args.micro or "1,2,4,8"
        args.out = args.out or "results/scaling"
        return scaling_main(args)
    if args.suite in ("spatial", "spatial-step"):
        return _bench_spatial(args)
    if args.suite == "recurrent":  # prints its table row by row (long at full size)
        from .studies.bench import bench_gru_coarse
        results = bench_gru_coarse(seq_lens=(64, 128) if args.quick else (128, 512, 1024),
                                   log=None if args.json else print)
        text = None
    elif args.suite == "kernels":
        results = run_kernels(quick=args.quick)
        text = format_results(results)
        if not args.json:
            from .backend.blas_threads import blas_advice, blas_kernels
            text = "\n".join([f"BLAS: {lib} {ver} ({arch} kernels)"
                              for lib, ver, arch, _ in blas_kernels()]
                             + ["warning: " + a for a in [blas_advice()] if a] + [text])
    elif args.suite == "gpu-launches":
        from .studies.bench import bench_gpu_launches, format_gpu_launches
        comm = _launched_world()  # under mpiexec: every method on the processes' layer ranks
        results = bench_gpu_launches(n_layers=128 if args.quick else 1024, comm=comm)
        if comm is not None and comm.Get_rank() != 0:
            return results  # rank 0 reports
        text = format_gpu_launches(results)
    else:
        from .studies.bench_spatial import format_mgrit_comparison, mgrit_comparison
        # pinned to one thread (work efficiency) and as LayerParallel sets threads by default
        results = [r for threads in (1, "auto") for w in (16, 64)
                   for r in bench_mgrit(n_layers=64 if args.quick else args.n_layers, width=w,
                                        dtype=args.dtype or "float32",
                                        activation=args.activation or "relu", threads=threads)]
        # the conv ResNet's solves (28 x 28, B 32, C 8 and 16; fewer samples: each is ms long)
        results += [r for threads in (1, "auto") for c in (8, 16)
                    for r in bench_mgrit(n_layers=16 if args.quick else 32, width=c, batch=32,
                                         model="conv", image=12 if args.quick else 28,
                                         dtype=args.dtype or "float32",
                                         activation=args.activation or "relu",
                                         threads=threads, repeats=3, rounds=3)]
        text = format_mgrit(results)
        # whole training steps of every model kind against their algorithmic work
        from .studies.bench import bench_training_steps, format_training_steps
        rows = bench_training_steps(quick=args.quick, repeats=3 if args.quick else 5)
        results += rows
        text += "\n" + format_training_steps(rows)
        # conv ResNets with and without spatial coarsening: work in fine-step equivalents
        for size, n in (((16, 16), 16), ((8, 8, 8), 8)) if args.quick else \
                (((28, 28), 32), ((16, 16, 16), 16)):
            rows = mgrit_comparison(size=size, n_layers=n, repeats=3 if args.quick else 5)
            results += rows
            text += "\n" + format_mgrit_comparison(rows)
    if args.json:
        for r in results:
            print(json.dumps(r))
    elif text is not None:
        print(text)
    return results


def _bench_spatial(args):
    """``bench spatial`` (the convergence table) and ``bench spatial-step`` (every rank of
    ``mpiexec -n P`` takes part; rank 0 prints)."""
    from .studies import bench_spatial as bs
    if args.suite == "spatial":
        rows = bs.convergence_table(quick=args.quick)
        print("\n".join(json.dumps(r) for r in rows) if args.json else bs.format_convergence(rows))
        return rows
    text = ("0" if args.spatial_levels is None else args.spatial_levels).strip()
    try:
        spatial = tuple(int(v) for v in text.split(",")) if text else ()
    except ValueError:
        raise ValueError(f"--spatial-levels must be comma-separated ints, got {text!r}") from None
    comm = _launched_world()
    row = bs.training_step(size=(args.volume_size,) * 3, n_layers=args.n_layers,
                           channels=args.channels or 4, batch=args.batch, cf=args.cf,
                           levels=args.levels, spatial=spatial, fwd_iters=args.fwd_iters,
                           bwd_iters=args.bwd_iters, repeats=args.repeats, comm=comm)
    if comm is None or comm.Get_rank() == 0:
        if args.json:
            print(json.dumps(row))
        else:
            print(f"{row['size']} volumes, N={row['layers']}, C={row['channels']}, "
                  f"B={row['batch']}, spatial levels {row['spatial']}, {row['ranks']} rank(s): "
                  f"{row['seconds_per_step']:.3f} s per training step")
            for part in ("forward", "adjoint"):
                print(f"  {part} residuals " + " ".join(f"{r:.3e}" for r in row[part]))
    return [row]


def _tune_malloc():
    """Application-level allocator setting of the command line (never done by the library):
    keep freed memory in the process instead of returning it to the OS at every free, so the
    solver's per-step state arrays are not page-faulted in again each time (measured here: the
    time outside the step kernels of an MGRIT solve drops by about 40%). Same effect as
    MALLOC_TRIM_THRESHOLD_/MALLOC_MMAP_THRESHOLD_/MALLOC_TOP_PAD_; a no-op off glibc."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    mallopt(m_trim_threshold, 256 << 20)
    mallopt(m_top_pad, 64 << 20)
    mallopt(m_mmap_threshold, 32 << 20)


def _parsers():
    """(the ``python -m mgnn`` parser, {command: its subparser})."""
    parser = argparse.ArgumentParser(prog="python -m mgnn",
                                     description="Layer-parallel training of ResNets with MGRIT.")
    sub = parser.add_subparsers(dest="command", required=True)
    return parser, {"train": _train_parser(sub), "bench": _bench_parser(sub)}


def parse_args(argv=None):
    """The command line as a Namespace; argparse's usage error (exit 2) names the command whose
    flag is unknown."""
    parser, subs = _parsers()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the usage of the command, not of `python -m mgnn`
        subs[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv=None):
    """Entry point; returns the process exit code.

    Bad input (flags, data, checkpoints, rank counts) is one line ``mgnn: error: ...`` on stderr
    and exit code 2, on every rank of an MPI run; failures during training under MPI end every
    rank (``MPI_Abort``) with the failing rank's traceback.
    """
    _tune_malloc()
    args = parse_args(argv)
    comm = None
    try:
        _check_args(args, _parsers()[1][args.command])
        if args.command == "train":
            comm = _world(args)  # the same on every rank: a clean exit everywhere
    except ValueError as exc:
        print(f"mgnn: error: {exc}", file=sys.stderr)
        return 2
    if args.command == "bench" and args.suite == "scaling" and _mpi_size_from_env() > 1:
        from mpi4py import MPI

        from .comm import abort_on_error
        with abort_on_error(MPI.COMM_WORLD, "mgnn bench"):
            cmd_bench(args)
        return 0
    if comm is not None:  # any failure on any rank ends every rank (MPI_Abort), never a hang
        from .comm import abort_on_error
        from .errors import CheckpointError
        from .mgrit import DivergenceError
        with abort_on_error(comm, "mgnn"):
            try:
                cmd_train(args, comm)
            except (_CLIError, CheckpointError, DivergenceError) as exc:  # on every rank alike
                print(f"mgnn: error: {exc}", file=sys.stderr, flush=True)
                return 2
        return 0
    from .comm import abort_on_error
    try:
        with abort_on_error(None, "mgnn"):  # a Ctrl-C inside a Numba kernel: KeyboardInterrupt
            if args.command == "train":
                cmd_train(args)
            else:
                cmd_bench(args)
    except (ValueError, TypeError, FileNotFoundError, FloatingPointError) as exc:
        print(f"mgnn: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
