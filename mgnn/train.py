"""The training loop, evaluation, progress output and atomic checkpoints.

One training step: batch -> ``LayerParallel.loss_and_grad`` (opening, residual propagation,
closing + loss, adjoint, parameter gradients) -> optimizer update of ``model.params.flat``.
"""
import json
import os
import sys
import tempfile
import time

import numpy as np

from .backend import to_host
from .data import batches
from .errors import CheckpointError


# ------------------------------------------------------------------------------------ checkpoints
def save_checkpoint(path, model, optimizer, epoch, step, rng, meta=None, params=None,
                    optim_state=None):
    """Write parameters, optimizer state, epoch/step and the shuffling RNG state to ``path`` (.npz).

    The file is written to a temporary file in the same folder and renamed over ``path``, so a
    crash never leaves a half-written checkpoint. ``params`` / ``optim_state`` replace the
    model's and optimizer's own (a distributed run passes the gathered ones), so a checkpoint
    never depends on the number of ranks that wrote it.
    """
    params = model.params if params is None else params
    optim_state = optimizer.state_dict() if optim_state is None else optim_state
    arrays = {f"params/{k}": to_host(v) for k, v in params.items()}
    arrays.update({f"optim/{k}": to_host(v) for k, v in optim_state.items()})
    header = {"epoch": int(epoch), "step": int(step), "model_config": model.config,
              "optimizer": type(optimizer).__name__, "rng_state": rng.bit_generator.state,
              "meta": meta or {}}
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".ckpt-", suffix=".npz.tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(path):
    """Read a checkpoint: dict with 'header' (dict), 'params' and 'optim' (dicts of arrays)."""
    try:
        with np.load(path) as z:
            header = json.loads(bytes(z["header"]).decode())
            params = {k[7:]: z[k] for k in z.files if k.startswith("params/")}
            optim = {k[6:]: z[k] for k in z.files if k.startswith("optim/")}
    except FileNotFoundError:
        raise
    except (KeyError, ValueError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable mgnn checkpoint ({exc})") from exc
    return {"header": header, "params": params, "optim": optim}


def restore(ckpt, model, optimizer, rng):
    """Load a :func:`load_checkpoint` dict into model, optimizer and rng; returns (epoch, step)."""
    h = ckpt["header"]
    if h["model_config"] != model.config:
        diff = {k: (h["model_config"].get(k), v) for k, v in model.config.items()
                if h["model_config"].get(k) != v}
        raise CheckpointError(f"checkpoint model differs from this model (checkpoint, now): {diff}")
    if h["optimizer"] != type(optimizer).__name__:
        raise CheckpointError(f"checkpoint optimizer {h['optimizer']} != {type(optimizer).__name__}")
    for k, v in model.params.items():
        if k not in ckpt["params"] or ckpt["params"][k].shape != v.shape:
            raise CheckpointError(f"checkpoint parameter {k!r} missing or of the wrong shape")
        v[...] = model.params.xp.asarray(ckpt["params"][k])
    optimizer.load_state_dict(ckpt["optim"])
    rng.bit_generator.state = h["rng_state"]
    return h["epoch"], h["step"]


# ------------------------------------------------------------------------------------- progress
class Progress:
    """A one-line progress bar on a terminal; on a pipe, a line every ``every`` fraction once the
    loop has run for more than 5 s."""

    def __init__(self, total, label, stream=None, enabled=True, every=0.25):
        self.total, self.label = total, label
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and getattr(self.stream, "isatty", lambda: False)()
        self.next_mark = every
        self.every = every
        self.t0 = time.perf_counter()

    def update(self, done, text=""):
        """Report ``done`` of ``total`` items with an optional suffix ``text``."""
        if not self.enabled:
            return
        frac = done / max(self.total, 1)
        el = time.perf_counter() - self.t0
        if self.tty:
            bar = "#" * int(30 * frac)
            self.stream.write(f"\r{self.label} [{bar:<30}] {done}/{self.total} {el:6.1f}s {text}")
            if done >= self.total:
                self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()
        elif frac >= self.next_mark and done < self.total and el > 5.0:
            self.stream.write(f"{self.label} {done}/{self.total} ({100 * frac:.0f}%) "
                              f"{el:.1f}s {text}\n")
            self.stream.flush()
            self.next_mark += self.every


# ------------------------------------------------------------------------------------- training
def evaluate(lp, x, y, batch_size=1000):
    """Accuracy (fraction) of ``lp.predict`` on (x, y), in batches."""
    correct = 0
    x, y = lp.to_device(x), lp.to_device(y)
    xp = lp.xp
    for i in range(0, len(y), batch_size):
        correct += int(xp.count_nonzero(lp.predict(x[i:i + batch_size]) == y[i:i + batch_size]))
    return correct / max(len(y), 1)


def distributed_checkpoint(path, lp, optimizer, epoch, step, rng, meta=None):
    """Collective: gather the parameters and optimizer state from their owners; the first rank
    writes the checkpoint (atomically); every rank returns once it is on disk."""
    if not lp.distributed:
        save_checkpoint(path, lp.model, optimizer, epoch, step, rng, meta)
        return
    params = lp.model.params.zeros_like()
    params.flat[:] = lp.gather_params()
    n = params.flat.size
    state = {k: (lp.gather_params(v) if getattr(v, "shape", None) == (n,) else v)
             for k, v in optimizer.state_dict().items()}
    comm = lp.layout.comm
    err = None
    if comm.Get_rank() == 0:
        try:
            save_checkpoint(path, lp.model, optimizer, epoch, step, rng, meta, params, state)
        except (OSError, ValueError, TypeError) as exc:
            err = ValueError(f"cannot write checkpoint {path}: {exc}")
    from .comm import agree_on_errors
    agree_on_errors(comm, err)  # also the barrier: every rank returns once the file is on disk


def _add_timings(total, stats):
    for k, v in stats.get("timings", {}).items():
        total[k] = total.get(k, 0.0) + v


def fit(lp, optimizer, x_train, y_train, x_test, y_test, *, epochs, batch_size, rng,
        start_epoch=0, step=0, checkpoint=None, log=None, progress=True, meta=None,
        timings=None):
    """Train ``lp.model`` for epochs ``start_epoch .. epochs-1``.

    Parameters
    ----------
    lp : LayerParallel
    optimizer : mgnn.optim.Optimizer over ``lp.model.params.flat``
    x_train, y_train, x_test, y_test : arrays already shaped and typed for the model
    rng : numpy.random.Generator
        Shuffles every epoch; its state is checkpointed so a resumed run repeats the same batches.
        In a data-parallel run every rank draws the same permutation and replica r trains on
        part r of each batch (``numpy.array_split``); a final batch smaller than the number of
        replicas is skipped.
    checkpoint : str or None
        Path written (atomically) after every epoch.
    log : callable(str) or None
        Receives one line per epoch.
    timings : dict or None
        If given, the per-phase seconds of every step (``lp.stats['timings']``) are summed in.

    Returns
    -------
    list of dict
        Per epoch: epoch, loss (mean over batches), test_accuracy, seconds, ms_per_batch.
    """
    history = []
    x_train, y_train = lp.to_device(x_train), lp.to_device(y_train)  # moved once, not per batch
    x_test, y_test = lp.to_device(x_test), lp.to_device(y_test)
    replicas = lp.layout.data_ranks
    if batch_size < replicas:
        raise ValueError(f"batch_size={batch_size} is smaller than the {replicas} data replicas")
    for epoch in range(start_epoch, epochs):
        t0 = time.perf_counter()
        idx = [b for b in batches(len(y_train), batch_size, rng) if len(b) >= replicas]
        if not idx:
            raise ValueError(f"no training batch: {len(y_train)} samples, batch_size "
                             f"{batch_size}, {replicas} replicas")
        bar = Progress(len(idx), f"epoch {epoch + 1}/{epochs}", enabled=progress)
        total = 0.0
        for j, b in enumerate(idx):
            if replicas > 1:
                b = np.array_split(b, replicas)[lp.replica]
            b = lp.xp.asarray(b)
            loss, grads = lp.loss_and_grad(x_train[b], y_train[b])
            if timings is not None:
                _add_timings(timings, lp.stats)
            if not np.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at epoch {epoch + 1}, batch {j}")
            optimizer.step(grads.flat)
            total += loss
            step += 1
            bar.update(j + 1, f"loss {total / (j + 1):.4f}")
        train_s = time.perf_counter() - t0
        if lp.distributed:  # every rank holds the current model again (others' layers included)
            lp.model.params.flat[:] = lp.gather_params()
        acc = evaluate(lp, x_test, y_test)
        rec = {"epoch": epoch + 1, "loss": total / len(idx), "test_accuracy": acc,
               "seconds": time.perf_counter() - t0, "ms_per_batch": 1e3 * train_s / len(idx)}
        rec.update(_stats_summary(lp.stats))
        history.append(rec)
        if checkpoint:
            distributed_checkpoint(checkpoint, lp, optimizer, epoch + 1, step, rng, meta)
        if log:
            log(format_epoch(rec, epochs))
    return history


def _stats_summary(stats):
    """Last forward/adjoint MGRIT residual of the epoch's last batch (None: cycles ran but none
    measured a residual, e.g. a single skipped down-cycle)."""
    out = {}
    for key in ("forward", "adjoint"):
        st = stats.get(key, {})
        if st.get("iterations"):
            res = st.get("residuals") or []
            out[f"{key}_residual"] = res[-1] if res else None
    return out


def format_epoch(rec, epochs):
    """One human-readable line for an epoch record of :func:`fit`."""
    s = (f"epoch {rec['epoch']:>3}/{epochs}  loss {rec['loss']:.4f}  "
         f"test acc {100 * rec['test_accuracy']:6.2f}%  {rec['ms_per_batch']:8.2f} ms/batch  "
         f"{rec['seconds']:7.1f} s")
    for key in ("forward_residual", "adjoint_residual"):
        if key in rec:
            val = "n/a" if rec[key] is None else f"{rec[key]:.2e}"
            s += f"  {key.split('_')[0][:3]} res {val}"
    return s
