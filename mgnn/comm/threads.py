"""Threads per rank: BLAS and Numba threads sized to the cores each node-local rank may use.

Under MPI every rank would otherwise start one BLAS (OpenBLAS/MKL/BLIS) thread and one Numba
thread per core of the node, so P ranks on a node run P x cores threads and a training step can
be ten times slower than with one thread per rank. :func:`configure_threads` counts the ranks of
the user's communicator that share this node (``Split_type(COMM_TYPE_SHARED)``) and the cores in
this rank's CPU affinity, and gives each rank ``cores // ranks sharing them`` Numba threads (at
least one) and ONE BLAS thread, through ``numba.set_num_threads`` and ``threadpoolctl``, in a
single process too: mgnn's per-layer GEMMs are small (a batch times a width), BLAS threads make
them slower, not faster (serial training step, dense w=64, B=128, 256 layers, 2 cores: 104 ms
with 2 OpenBLAS threads, 38 ms with 1), and inside Numba's parallel loops they oversubscribe
the cores (MGRIT step 583 ms against 79 ms); Numba's threads run the intervals of a relaxation
sweep and the samples of a convolution in parallel instead.

The limits are process-wide (every BLAS call of the process, not only mgnn's, sees them) and
stay after the call; :func:`apply_threads` puts a configuration back (LayerParallel does at the
start of every step, so that a second model built in the same process -- a single-process
evaluation model on one rank of an MPI job, a scaling study's serial baseline -- does not leave
its counts to the first: a 2-rank MGRIT step ran 3.5x slower with the node's 2 Numba threads
per rank). Explicit settings win: a thread variable in the environment
(``OPENBLAS_NUM_THREADS``/``GOTO_NUM_THREADS``/``OMP_NUM_THREADS`` for OpenBLAS,
``MKL_NUM_THREADS``/``OMP_NUM_THREADS`` for MKL, ``BLIS_NUM_THREADS``/``OMP_NUM_THREADS`` for
BLIS, ``NUMBA_NUM_THREADS`` or else ``OMP_NUM_THREADS`` for Numba) leaves that library as the
user set it, an int ``threads`` sets every library to that count, and ``threads=None`` changes
nothing.
"""
import functools
import numbers
import os
import sys

from ..backend import blas_threads as _blas
from ..backend.blas_threads import blas_controllers as _blas_controllers
from .layout import agree_on_errors

# the variables each BLAS family reads when it loads (OpenBLAS: openblas_read_env)
BLAS_VARS = {"openblas": ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"),
             "mkl": ("MKL_NUM_THREADS", "OMP_NUM_THREADS"),
             "blis": ("BLIS_NUM_THREADS", "OMP_NUM_THREADS")}
NUMBA_VARS = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS")


def check_threads(threads):
    """``threads`` validated: None, 'auto' or an int >= 1 (TypeError/ValueError otherwise)."""
    if threads is None or (isinstance(threads, str) and threads == "auto"):
        return threads
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral):
        raise TypeError(f"threads must be None, 'auto' or an int >= 1, got {threads!r}")
    if threads < 1:
        raise ValueError(f"threads must be None, 'auto' or an int >= 1, got {threads!r}")
    return int(threads)


def affinity():
    """The set of CPUs this process may run on (``os.sched_getaffinity``, else all CPUs)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def node_share(comm):
    """Collective over ``comm``: (node-local ranks, ranks whose CPU affinity overlaps this
    rank's, CPUs in this rank's affinity). Ranks bound to disjoint cores do not share them."""
    mine = frozenset(affinity())
    if comm is None or comm.Get_size() == 1:
        return 1, 1, len(mine)
    from mpi4py import MPI
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        masks = local.allgather(mine)
    finally:
        local.Free()
    return len(masks), _overlapping(tuple(masks), mine) or 1, len(mine)


@functools.lru_cache(maxsize=64)
def _overlapping(masks, mine):
    """How many of ``masks`` (CPU sets) share a CPU with ``mine``; kept per arguments (the
    virtual ranks of one node pass the same masks: a count each would be O(P^2))."""
    from collections import Counter
    return sum(n for m, n in Counter(masks).items() if m & mine)


def _env_int(environ, names):
    """(name, count) of the first of ``names`` that ``environ`` sets to a count >= 1 (its leading
    int, as the libraries read it: OMP_NUM_THREADS='4,2' is 4); (None, None) if none does."""
    for name in names:
        try:
            n = int(environ.get(name, "").split(",")[0])
        except ValueError:
            continue
        if n >= 1:
            return name, n
    return None, None


def _numba(n=None, why=None, environ=None):
    """Numba's thread count now and why, after setting it to ``n`` (capped at the
    NUMBA_NUM_THREADS fixed at import) unless ``environ`` sets it; ``n`` None only reports
    (None if Numba is not imported). Numba's count belongs to the calling thread."""
    if n is None:
        numba = sys.modules.get("numba")
        return (None if numba is None else numba.get_num_threads()), why
    import numba
    var, value = _env_int(environ, NUMBA_VARS)
    if var == "NUMBA_NUM_THREADS":
        return numba.get_num_threads(), f"{var}={environ[var]}"
    if var is not None:
        n, why = value, f"{var}={environ[var]}"
    top = numba.config.NUMBA_NUM_THREADS
    if n > top:
        n, why = top, f"{why}, capped at NUMBA_NUM_THREADS={top} fixed at import"
    numba.set_num_threads(n)
    return numba.get_num_threads(), why


def configure_threads(comm=None, threads="auto", environ=None):
    """Set this process's BLAS and Numba thread counts for a run on ``comm``.

    Collective over ``comm`` when it has more than one rank (a bad ``threads`` raises on every
    rank).

    Parameters
    ----------
    comm : mpi4py communicator or None
        The user's communicator; None or size 1 is a single process.
    threads : None, 'auto' or int
        'auto': ``max(1, cores // ranks sharing them)`` Numba threads per rank (a single process:
        its cores) and 1 BLAS thread, for every library the environment does not set. int: that
        many threads for BLAS and Numba, whatever the environment says. None: change nothing
        (only report).
        Numba's count is set for the calling thread: train in the thread that calls this.
    environ : mapping, optional
        The environment to read (default ``os.environ``).

    Returns
    -------
    dict
        ``blas`` and ``numba``: the thread counts now in effect (None: library not loaded; BLAS:
        the largest over the loaded BLAS libraries), ``blas_source``/``numba_source``: why, in
        words, ``per_rank``: the automatic count (None when not used), ``local_ranks`` (ranks on
        this node), ``sharing`` (ranks whose CPU affinity overlaps this rank's) and ``cores``
        (CPUs in this rank's affinity).
    """
    environ = os.environ if environ is None else environ
    err = None
    try:
        threads = check_threads(threads)
    except (TypeError, ValueError) as exc:
        err = exc
    distributed = comm is not None and comm.Get_size() > 1
    agree_on_errors(comm if distributed else None, err)
    local, sharing, cores = node_share(comm if distributed else None)
    info = {"per_rank": None, "local_ranks": local, "sharing": sharing, "cores": cores}
    if threads is None:
        why = "unchanged, threads=None"
        blas = [c.num_threads for c in _blas_controllers(False)]
        numba, _ = _numba()
        return dict(info, blas=max(blas, default=None), blas_source=why, numba=numba,
                    numba_source=why)
    if threads == "auto":
        n = info["per_rank"] = max(1, cores // sharing)
        why = f"auto: {cores} cores / {sharing} ranks sharing them"
        n_blas, why_blas = 1, "auto: 1, per-layer GEMMs are small; Numba's threads run in parallel"
    else:
        n, why, environ = threads, f"threads={threads}", {}
        n_blas, why_blas = n, why
    blas, blas_why, paths = [], set(), []
    _APPLIED.pop("blas", None)  # set below, library by library
    for ctl in _blas_controllers(True):
        var, _ = _env_int(environ, BLAS_VARS.get(ctl.internal_api, ("OMP_NUM_THREADS",)))
        if var is None:
            ctl.set_num_threads(n_blas)
        blas_why.add(why_blas if var is None else f"{var}={environ[var]} ({ctl.internal_api})")
        blas.append(ctl.num_threads)
        paths.append((ctl.filepath, ctl.num_threads))
    numba, numba_why = _numba(n, why, environ)
    out = dict(info, blas=max(blas, default=None), numba=numba, numba_source=numba_why,
               blas_source="; ".join(sorted(blas_why)) or "no BLAS loaded",
               blas_counts=tuple(paths))
    _APPLIED["blas"] = out["blas_counts"]
    return out


_APPLIED = {}  # the BLAS counts the last configure_threads / apply_threads set


def apply_threads(info):
    """Set this process's thread counts back to ``info`` (what :func:`configure_threads`
    returned): Numba's for the calling thread, and the BLAS libraries' only if another
    configuration changed them since (a threadpoolctl call costs tens of microseconds). Nothing
    for ``threads=None`` configurations. Cheap enough to call at every training step."""
    if info.get("blas_source", "").startswith("unchanged"):
        return
    numba = sys.modules.get("numba")
    if numba is not None and info.get("numba") and numba.get_num_threads() != info["numba"]:
        numba.set_num_threads(info["numba"])
    counts = info.get("blas_counts")
    if counts and _APPLIED.get("blas") != counts:
        wanted = dict(counts)  # library path -> count
        for ctl in _blas_controllers(False):
            if ctl.filepath in wanted:
                ctl.set_num_threads(wanted[ctl.filepath])
        _APPLIED["blas"] = counts


def snapshot_threads():
    """This process's thread counts now (Numba's for the calling thread, every BLAS's), for
    :func:`restore_threads`."""
    numba = sys.modules.get("numba")
    return (None if numba is None else numba.get_num_threads()), _blas.snapshot()


def restore_threads(saved):
    """Set the counts of a :func:`snapshot_threads` back; the next :func:`apply_threads` then
    sets its own BLAS counts again (it no longer knows what is in effect)."""
    n_numba, blas = saved
    if n_numba is not None:
        sys.modules["numba"].set_num_threads(n_numba)
    _blas.restore(blas)
    _APPLIED.pop("blas", None)


def describe(info):
    """One line for ``--timings``: what :func:`configure_threads` chose and why."""
    def count(n):
        return "not loaded" if n is None else n
    return (f"threads per rank: BLAS {count(info['blas'])} ({info['blas_source']}), Numba "
            f"{count(info['numba'])} ({info['numba_source']}); {info['local_ranks']} rank(s) on "
            f"this node, {info['cores']} cores in this rank's affinity")
