"""The training loop, evaluation, progress output and atomic checkpoints.

One training step: batch -> ``LayerParallel.loss_and_grad`` (opening, residual propagation,
closing + loss, adjoint, parameter gradients) -> optimizer update of ``model.params.flat``.
"""
import json
import os
import sys
import time
import zipfile
import zlib

import numpy as np

from .backend import to_host
from .data import batches
from .errors import CheckpointError
from .mgrit import DivergenceError


# ------------------------------------------------------------------------------------ checkpoints
_HEADER = {"epoch": int, "step": int, "model_config": dict, "optimizer": str, "rng_state": dict}
_UNREADABLE = (KeyError, ValueError, TypeError, OSError, EOFError, zipfile.BadZipFile,
               NotImplementedError, zlib.error, AttributeError)


def _why(exc):
    """An OSError's reason without the (temporary) file name it carries."""
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def _tmp_path(path):
    """The one temporary name a checkpoint is written under: a writer killed half-way leaves this
    file, and the next save of the same checkpoint truncates and reuses it."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.tmp")


def _open_tmp(tmp):
    """Create ``tmp`` afresh for writing (mode 0666 less the umask): a leftover file is removed
    first, and the name is never followed if it is a symbolic link (``O_EXCL | O_NOFOLLOW``), so a
    planted link cannot redirect the write."""
    if os.path.lexists(tmp) and not os.path.isdir(tmp):
        os.unlink(tmp)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    return os.fdopen(os.open(tmp, flags, 0o666), "wb")


def check_checkpoint_path(path):
    """Raise :class:`CheckpointError` unless a checkpoint can be written at ``path``.

    Creates the folder, then creates and removes the temporary file; so an unwritable folder, a
    directory in the way or a read-only file system is reported before any training.
    """
    path = os.fspath(path)
    try:
        if os.path.isdir(path):
            raise IsADirectoryError(0, "a directory is in the way")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = _tmp_path(path)
        with _open_tmp(tmp):
            pass
        os.unlink(tmp)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {path}: {_why(exc)}") from exc


def save_checkpoint(path, model, optimizer, epoch, step, rng, meta=None, params=None,
                    optim_state=None, warm=None, buffers=None):
    """Write parameters, optimizer state, epoch/step and the shuffling RNG state to ``path`` (.npz).

    The file is written to ``.<name>.tmp`` in the same folder (the file mode follows the umask)
    and renamed over ``path``, so a crash never leaves a half-written checkpoint, and the leftover
    of a killed writer is reused by the next save. ``params`` / ``optim_state`` replace the
    model's and optimizer's own (a distributed run passes the gathered ones), so a checkpoint
    never depends on the number of ranks that wrote it. ``warm``: the warm-start states
    (:func:`warm_states`) or None. The model's buffers (batch norm's running statistics;
    ``buffers``: a gathered flat copy) and its training-step counter (dropout masks) are saved.
    """
    params = model.params if params is None else params
    optim_state = optimizer.state_dict() if optim_state is None else optim_state
    arrays = {f"params/{k}": to_host(v) for k, v in params.items()}
    arrays.update({f"optim/{k}": to_host(v) for k, v in optim_state.items()})
    flat = to_host(model.buffers.flat if buffers is None else buffers)
    arrays.update({f"buffers/{k}": flat[model.buffers.offsets[k]:][:v.size].reshape(v.shape)
                   for k, v in model.buffers.items()})
    header = {"epoch": int(epoch), "step": int(step), "model_config": model.config,
              "train_steps": int(model.train_steps),
              "optimizer": type(optimizer).__name__, "rng_state": rng.bit_generator.state,
              "meta": meta or {}}
    if warm is not None:
        header["warm_batch"] = int(warm["batch"])
        arrays.update({f"warm/{i}": v for i, v in warm["states"].items()})
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(0, "a directory is in the way")
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = _tmp_path(path)
    try:
        with _open_tmp(tmp) as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp) and not os.path.isdir(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(path):
    """Read a checkpoint: dict with 'path', 'header' (dict), 'params', 'optim' (dicts of arrays)
    and 'warm' (None or the warm-start states, see :func:`warm_states`).

    Raises FileNotFoundError if ``path`` does not exist and :class:`CheckpointError` naming it if
    it is empty, truncated, corrupt or not an mgnn checkpoint.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path} not found")
    bad = f"{path}: not a readable mgnn checkpoint"
    if os.path.isfile(path) and not zipfile.is_zipfile(path):
        size = os.path.getsize(path)
        raise CheckpointError(f"{bad} (" + ("empty file)" if size == 0 else
                                            f"{size} bytes, not an .npz archive: truncated or "
                                            "another kind of file)"))
    try:
        with np.load(path) as z:
            header = json.loads(bytes(z["header"]).decode())
            params = {k[7:]: z[k] for k in z.files if k.startswith("params/")}
            optim = {k[6:]: z[k] for k in z.files if k.startswith("optim/")}
            buffers = {k[8:]: z[k] for k in z.files if k.startswith("buffers/")}
            warm = {int(k[5:]): z[k] for k in z.files if k.startswith("warm/")}
        wrong = [k for k, t in _HEADER.items() if not isinstance(header.get(k), t)]
        if wrong:
            raise ValueError(f"header entries {wrong} missing or invalid")
    except _UNREADABLE as exc:
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise CheckpointError(f"{bad} (corrupt: {why})") from exc
    warm = {"batch": header["warm_batch"], "states": warm} if "warm_batch" in header else None
    return {"path": path, "header": header, "params": params, "optim": optim, "warm": warm,
            "buffers": buffers}


def restore(ckpt, model, optimizer, rng):
    """Load a :func:`load_checkpoint` dict into model, optimizer and rng; returns (epoch, step)."""
    h, where = ckpt["header"], ckpt.get("path", "checkpoint")
    if h["model_config"] != model.config:
        diff = {k: (h["model_config"].get(k), v) for k, v in model.config.items()
                if h["model_config"].get(k) != v}
        raise CheckpointError(f"checkpoint model differs from this model (checkpoint, now): {diff}")
    if h["optimizer"] != type(optimizer).__name__:
        raise CheckpointError(f"checkpoint optimizer {h['optimizer']} != {type(optimizer).__name__}")
    for k, v in model.params.items():
        if k not in ckpt["params"] or ckpt["params"][k].shape != v.shape:
            raise CheckpointError(f"checkpoint parameter {k!r} missing or of the wrong shape")
    saved = ckpt.get("buffers") or {}
    if set(saved) != set(model.buffers) or any(saved[k].shape != v.shape
                                               for k, v in model.buffers.items()):
        raise CheckpointError(f"{where}: checkpoint buffers "
                              f"{ {k: tuple(v.shape) for k, v in saved.items()} } do not match "
                              f"the model's { {k: tuple(v.shape) for k, v in model.buffers.items()} }")
    try:
        optimizer.load_state_dict(ckpt["optim"])
        rng.bit_generator.state = h["rng_state"]
    except (KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{where}: cannot restore the optimizer or shuffling state "
                              f"({type(exc).__name__}: {exc})") from exc
    for k, v in model.params.items():
        v[...] = model.params.xp.asarray(ckpt["params"][k])
    for k, v in model.buffers.items():
        v[...] = model.buffers.xp.asarray(saved[k])
    model.train_steps = int(h.get("train_steps", 0))
    return h["epoch"], h["step"]


def warm_states(lp):
    """Collective: the warm-start states of ``lp`` (the last forward solve's states, which start
    the next one) in a form independent of the rank count, or None (no warm start, or no solve
    yet). Returns ``{"batch": B, "states": {fine index: (B, ...) host array}}``: every fine
    index from its owner, the replicas' shards concatenated in replica order (the global batch);
    the dict on the first rank, None on the others of a distributed run."""
    prev = lp._previous_states if lp.warm_start else None  # set by LayerParallel's forward solve
    mine = None
    if prev is not None:
        states, batch = prev
        lo, hi = lp.partition.fine_range(lp.layout.layer_rank)
        mine = (batch, {i: to_host(states[i]) for i in range(lo, min(hi, len(states)))
                        if states[i] is not None})
    if not lp.distributed:
        return None if mine is None else {"batch": mine[0], "states": mine[1]}
    parts = lp.layout.comm.gather((lp.replica, mine), root=0)
    if parts is None or any(m is None for _, m in parts):
        return None
    by_replica = {}
    for r, (b, st) in parts:
        by_replica.setdefault(r, [b, {}])[1].update(st)
    reps = [by_replica[r] for r in sorted(by_replica)]
    return {"batch": sum(b for b, _ in reps),
            "states": {i: np.concatenate([st[i] for _, st in reps]) for i in reps[0][1]}}


def restore_warm_states(lp, warm):
    """Give ``lp`` the warm-start states of a checkpoint (``load_checkpoint(...)["warm"]``): this
    replica's part (``numpy.array_split`` of the global batch, as :func:`fit` splits batches).
    A no-op when ``warm`` is None or ``lp`` does not warm-start."""
    if warm is None or not lp.warm_start:
        lp._previous_states = None
        return
    states = [None] * (lp.model.n_layers + 1)
    batch = None
    for i, s in warm["states"].items():
        if 0 <= i < len(states):
            part = np.array_split(s, lp.layout.data_ranks)[lp.replica]
            states[i] = lp.xp.asarray(np.ascontiguousarray(part, dtype=lp.model.dtype))
            batch = part.shape[0]
    lp._previous_states = None if batch is None else (states, batch)


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


def _agree(lp, err):
    """Collective: every rank raises the same :class:`CheckpointError` (the first failing rank's
    message) if any rank passes one; serial: raise ``err``."""
    if lp.distributed:
        from .comm import agree_on_errors
        msgs = agree_on_errors(lp.layout.comm, None, None if err is None else str(err))
        err = next((CheckpointError(m) for m in msgs if m is not None), None)
    if err is not None:
        raise err


def check_checkpoint_writable(path, lp):
    """Collective :func:`check_checkpoint_path` (on the first rank, which writes checkpoints)."""
    err = None
    if lp.layout.rank == 0:
        try:
            check_checkpoint_path(path)
        except CheckpointError as exc:
            err = exc
    _agree(lp, err)


def distributed_checkpoint(path, lp, optimizer, epoch, step, rng, meta=None):
    """Collective: gather the parameters, optimizer state and warm-start states from their
    owners; the first rank writes the checkpoint (atomically); every rank returns once it is on
    disk. A failed write raises :class:`CheckpointError` naming the file on every rank."""
    warm = warm_states(lp)
    params, state, buffers = None, None, None
    if lp.distributed:
        params = lp.model.params.zeros_like()
        params.flat[:] = lp.gather_params()
        buffers = lp.gather_buffers()
        n = params.flat.size
        state = {k: (lp.gather_params(v) if getattr(v, "shape", None) == (n,) else v)
                 for k, v in optimizer.state_dict().items()}
    err = None
    if lp.layout.rank == 0:
        try:
            save_checkpoint(path, lp.model, optimizer, epoch, step, rng, meta, params, state, warm,
                            buffers)
        except (OSError, ValueError, TypeError) as exc:
            err = CheckpointError(f"cannot write checkpoint {path}: {_why(exc)}")
    _agree(lp, err)  # also the barrier: every rank returns once the file is on disk


def _normalisable(lp, batch):
    """Whether a training batch of ``batch`` samples (split over the replicas) passes the step
    kind's train-mode check (batch norm: more than one value per channel)."""
    shards = [len(s) for s in np.array_split(np.arange(batch), lp.layout.data_ranks)]
    try:
        lp.model.step.check_batch(batch if lp.ctx.replicas is not None else min(shards))
    except ValueError:
        return False
    return True


def _add_timings(total, stats):
    for k, v in stats.get("timings", {}).items():
        total[k] = total.get(k, 0.0) + v


def _scheduled_rate(schedule, epochs_done):
    """``schedule(epochs_done)`` as a float, ValueError unless finite and >= 0."""
    lr = schedule(epochs_done)
    try:
        ok = np.isfinite(float(lr)) and float(lr) >= 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"lr_schedule({epochs_done:g}) returned {lr!r}: a learning rate must be "
                         "a finite number >= 0")
    return float(lr)


def fit(lp, optimizer, x_train, y_train, x_test, y_test, *, epochs, batch_size, rng,
        start_epoch=0, step=0, checkpoint=None, log=None, progress=True, meta=None,
        timings=None, clip_grad=None, lr_schedule=None):
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
        replicas is skipped, and so is one that batch norm cannot normalise in train mode (one
        value per channel: a dense model's batch, or without ``sync_bn`` a replica's shard,
        of one sample).
    checkpoint : str or None
        Path written (atomically) after every epoch; checked writable before the first epoch.
    log : callable(str) or None
        Receives one line per epoch.
    timings : dict or None
        If given, the per-phase seconds of every step (``lp.stats['timings']``) are summed in.
    clip_grad : float or None
        Scale every gradient whose global 2-norm (:meth:`LayerParallel.grad_norm`, over all
        ranks) exceeds this down to it (PyTorch's ``clip_grad_norm_``): recurrent networks over
        long sequences need it.
    lr_schedule : callable(float) -> float, or None
        Sets ``optimizer.lr`` before every step from the epochs done, ``epoch + j / batches``
        before batch ``j`` (e.g. :class:`mgnn.optim.CosineLR`), so a resumed run continues on
        the same curve. None keeps ``optimizer.lr``.

    Returns
    -------
    list of dict
        Per epoch: epoch, loss (mean over batches), test_accuracy, seconds, ms_per_batch, the
        last batch's forward_residual / adjoint_residual (MGRIT runs), and with a gradient
        guard ``guard``: the epoch's decisions (accept, iterate, fallback, exact, checks), the
        fraction of exact steps, the largest error measured by a check and the last estimate.
    """
    if clip_grad is not None and not (isinstance(clip_grad, (int, float)) and clip_grad > 0
                                      and np.isfinite(clip_grad)):
        raise ValueError(f"clip_grad must be a positive number or None, got {clip_grad!r}")
    history = []
    x_train, y_train = lp.to_device(x_train), lp.to_device(y_train)  # moved once, not per batch
    x_test, y_test = lp.to_device(x_test), lp.to_device(y_test)
    replicas = lp.layout.data_ranks
    if batch_size < replicas:
        raise ValueError(f"batch_size={batch_size} is smaller than the {replicas} data replicas")
    if lr_schedule is not None and not callable(lr_schedule):
        raise TypeError(f"lr_schedule must be a callable(epochs done) -> lr or None, got "
                        f"{type(lr_schedule).__name__}")
    if checkpoint:
        check_checkpoint_writable(checkpoint, lp)
    grads = None  # one gradient buffer, filled by every step (loss_and_grad's out)
    for epoch in range(start_epoch, epochs):
        t0 = time.perf_counter()
        idx = [b for b in batches(len(y_train), batch_size, rng)
               if len(b) >= replicas and _normalisable(lp, len(b))]
        if not idx:
            raise ValueError(f"no training batch: {len(y_train)} samples, batch_size "
                             f"{batch_size}, {replicas} replicas")
        bar = Progress(len(idx), f"epoch {epoch + 1}/{epochs}", enabled=progress)
        total = 0.0
        guard = _GuardTally()
        for j, b in enumerate(idx):
            if replicas > 1:
                b = np.array_split(b, replicas)[lp.replica]
            b = lp.xp.asarray(b)
            try:
                loss, grads = lp.loss_and_grad(x_train[b], y_train[b], out=grads)
            except DivergenceError as exc:
                raise DivergenceError(f"{exc} at epoch {epoch + 1}, batch {j + 1} of {len(idx)}") from exc
            if timings is not None:
                _add_timings(timings, lp.stats)
            guard.add(lp.stats.get("guard"))
            if not np.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at epoch {epoch + 1}, batch {j + 1} of "
                                         f"{len(idx)}")
            if clip_grad is not None:
                norm = lp.grad_norm(grads)
                if norm > clip_grad:
                    grads.flat *= grads.flat.dtype.type(clip_grad / norm)
            if lr_schedule is not None:
                optimizer.lr = _scheduled_rate(lr_schedule, epoch + j / len(idx))
            optimizer.step(grads.flat)
            total += loss
            step += 1
            bar.update(j + 1, f"loss {total / (j + 1):.4f}" + guard.progress())
        train_s = time.perf_counter() - t0
        if lp.distributed:  # every rank holds the current model again (others' layers included)
            lp.model.params.flat[:] = lp.gather_params()
            if len(lp.model.buffers):
                lp.model.buffers.flat[:] = lp.gather_buffers()
        acc = evaluate(lp, x_test, y_test)
        rec = {"epoch": epoch + 1, "loss": total / len(idx), "test_accuracy": acc,
               "seconds": time.perf_counter() - t0, "ms_per_batch": 1e3 * train_s / len(idx)}
        rec.update(_stats_summary(lp.stats))
        if guard.steps:
            rec["guard"] = guard.record()
        history.append(rec)
        if checkpoint:
            distributed_checkpoint(checkpoint, lp, optimizer, epoch + 1, step, rng, meta)
        if log:
            log(format_epoch(rec, epochs))
    return history


class _GuardTally:
    """One epoch's gradient-guard decisions (``lp.stats['guard']`` of every step)."""

    def __init__(self):
        self.steps = 0
        self.counts = {"accept": 0, "iterate": 0, "fallback": 0, "exact": 0, "checks": 0}
        self.max_error, self.estimate = None, None

    def add(self, report):
        if not report:
            return
        self.steps += 1
        self.counts[report["action"]] += 1
        err = report["error"]
        if err is not None:
            self.counts["checks"] += 1
            self.max_error = err if self.max_error is None else max(self.max_error, err)
        self.estimate = report["error_estimate"]

    def exact(self):
        return self.counts["fallback"] + self.counts["exact"]

    def progress(self):
        """Text for the progress line: nothing while every step is accepted MGRIT."""
        n = self.exact() + self.counts["iterate"]
        return f"  guard {self.exact()} exact / {self.counts['iterate']} iterated" if n else ""

    def record(self):
        return dict(self.counts, steps=self.steps, exact_fraction=self.exact() / self.steps,
                    max_error=self.max_error, error_estimate=self.estimate)


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
    g = rec.get("guard")
    if g:
        err = "n/a" if g["max_error"] is None else f"{g['max_error']:.2g}"
        s += (f"  guard: {g['exact'] + g['fallback']} exact, {g['iterate']} iterated, "
              f"{g['checks']} checks (max err {err})")
    return s
