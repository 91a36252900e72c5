"""Splitting the user's communicator into layer groups x data replicas; failure handling."""
import contextlib
import operator
import os
import signal
import sys
import time
import traceback


class Layout:
    """The 2-D process grid of a distributed run.

    Rank ``r`` of ``comm`` (size P = layer_ranks * data_ranks) is layer rank ``r % layer_ranks`` of
    data replica ``r // layer_ranks``.

    Attributes
    ----------
    comm : the user's communicator (or None)
    layer_comm : ranks of this replica (size layer_ranks), in layer order
    data_comm : ranks at this layer position in every replica (size data_ranks)
    layer_rank, layer_size, replica, data_ranks : int
    """

    def __init__(self, comm, data_ranks=1):
        if isinstance(data_ranks, bool) or not isinstance(data_ranks, int) or data_ranks < 1:
            raise ValueError(f"data_ranks must be an int >= 1, got {data_ranks!r}")
        self.comm = comm
        size = 1 if comm is None else comm.Get_size()
        if size % data_ranks:
            raise ValueError(f"data_ranks={data_ranks} does not divide the communicator size "
                             f"{size}")
        self.data_ranks = data_ranks
        self.layer_size = size // data_ranks
        rank = 0 if comm is None else comm.Get_rank()
        self.rank, self.size = rank, size
        abort_on_uncaught(comm)
        self.layer_rank, self.replica = rank % self.layer_size, rank // self.layer_size
        if comm is None or size == 1:
            self.layer_comm = self.data_comm = None
        else:
            self.layer_comm = comm.Split(color=self.replica, key=self.layer_rank)
            self.data_comm = comm.Split(color=self.layer_rank, key=self.replica)

    @property
    def first(self):
        """This rank runs the opening layer."""
        return self.layer_rank == 0

    @property
    def last(self):
        """This rank runs the closing layer and the loss."""
        return self.layer_rank == self.layer_size - 1


#: Seconds a rank waits between writing its failure report and ``MPI_Abort``.
FORWARD_S = 0.3

#: Exit status of a distributed run ended by an interrupt (128 + SIGINT, as a shell reports it).
INTERRUPT_STATUS = 130


def interrupt_behind(exc):
    """``exc`` itself if it is a ``KeyboardInterrupt``; the ``KeyboardInterrupt`` a
    ``SystemError`` was raised from (a Ctrl-C inside a Numba ``parallel=True`` kernel surfaces as
    "SystemError: ... returned a result with an exception set"); else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        if not isinstance(exc, SystemError):
            return None
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def exit_status(exc):
    """The non-zero status a distributed run ends with after ``exc`` on one rank: 130 for an
    interrupt, the code of ``SystemExit(n)`` for n in 1..255, else 1 (``sys.exit()`` or
    ``sys.exit(0)`` on one rank is still a failure of the run)."""
    if interrupt_behind(exc) is not None:
        return INTERRUPT_STATUS
    code = getattr(exc, "code", None) if isinstance(exc, SystemExit) else None
    return code if isinstance(code, int) and not isinstance(code, bool) and 0 < code < 256 else 1


#: SIGINTs received so far through :func:`_counting_int_handler` (one counter per process).
_SIGINTS = [0]


def _counting_int_handler(signum, frame):
    """Python's default SIGINT handler (raise ``KeyboardInterrupt``), counting the signal
    first: code that swallows the ``KeyboardInterrupt`` and raises something else (Numba's
    argument unboxing turns it into "TypeError: can't unbox ...") still shows it was
    interrupted."""
    _SIGINTS[0] += 1
    signal.default_int_handler(signum, frame)


def _count_interrupts():
    """Install :func:`_counting_int_handler` where Python's default SIGINT handler is (main
    thread; a handler of the program's own is left alone); returns the count so far."""
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _counting_int_handler)
    except (ValueError, OSError, AttributeError):  # not the main thread / no such signal
        pass
    return _SIGINTS[0]


def _as_interrupt(exc):
    """The ``KeyboardInterrupt`` an exception raised after a Ctrl-C stands for (traceback of
    ``exc``, which is its cause)."""
    out = KeyboardInterrupt().with_traceback(exc.__traceback__)
    out.__cause__ = exc
    return out


def _ignore_interrupts():
    """Ignore SIGINT from now on (main thread only): nothing may stop an abort under way."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except (ValueError, OSError, AttributeError):  # not the main thread / no such signal
        pass


@contextlib.contextmanager
def abort_on_error(comm, what="mgnn", collective=()):
    """End every rank of ``comm`` when the block raises anything on one rank.

    Any exception, ``KeyboardInterrupt`` (Ctrl-C) and ``SystemExit`` (``sys.exit`` in a user
    propagator) included, is reported with the rank and ends every rank of ``comm`` with
    ``comm.Abort(status)``, status from :func:`exit_status` (never 0), so no rank is left waiting
    for a message. SIGINT is ignored while aborting, so a second Ctrl-C cannot interrupt it.
    Serial runs (``comm`` None or of size 1) and virtual ranks (:mod:`mgnn.comm.virtual`, whose
    scheduler ends every rank) re-raise. Either way an interrupt inside a Numba
    kernel is reported as a ``KeyboardInterrupt``, not as the ``SystemError`` it surfaces as, and
    so is any other exception raised after a SIGINT reached the block (Numba's argument unboxing
    turns the interrupt into a ``TypeError``): the SIGINT handler counts signals where Python's
    default handler was installed.

    ``collective``: exception types that every rank raises at the same point (e.g. an MGRIT
    divergence seen in an all-reduced residual); they are re-raised on every rank instead, so the
    caller can report them with context.
    """
    interrupts = _count_interrupts()
    try:
        yield
    except BaseException as exc:
        if interrupt_behind(exc) is None and _SIGINTS[0] != interrupts:
            exc = _as_interrupt(exc)  # what the interrupt became (a TypeError from Numba, ...)
        if comm is None or comm.Get_size() == 1 or _virtual(comm) or \
                (collective and isinstance(exc, collective)):
            if isinstance(exc, KeyboardInterrupt) and exc.__cause__ is not None:
                raise exc from exc.__cause__
            if isinstance(exc, SystemError) and interrupt_behind(exc) is not None:
                raise KeyboardInterrupt().with_traceback(exc.__traceback__) from None
            raise
        _abort(comm, exc, what)


def _virtual(comm):
    """Whether ``comm`` is a virtual communicator (:mod:`mgnn.comm.virtual`): its scheduler ends
    every rank when one raises, so no ``Abort`` (its report, sleep and ``os._exit`` fallback) and
    no process-wide hook that would outlive the virtual run."""
    return getattr(comm, "is_virtual", False) is True


#: The communicator :func:`abort_on_uncaught` ends (the first one registered), or None.
_UNCAUGHT = []


def abort_on_uncaught(comm, what="mgnn"):
    """From now on an exception that nothing catches, a Ctrl-C between two mgnn calls say, ends
    every rank of ``comm`` as :func:`abort_on_error` does, instead of letting this rank finalize
    MPI and exit while the others wait for it forever.

    Chains to the previous ``sys.excepthook`` (the traceback is printed first), then aborts with
    :func:`exit_status`. Installed once per process (by every distributed :class:`Layout` and
    :class:`~mgnn.mgrit.MGRITSolver`); a no-op for ``None``, a size-1 or a virtual
    communicator. Exceptions the program catches are not affected.
    """
    if comm is None or comm.Get_size() == 1 or _virtual(comm) or _UNCAUGHT:
        return
    _UNCAUGHT.append(comm)
    previous = sys.excepthook

    def hook(kind, exc, tb):
        try:
            previous(kind, exc, tb)
        finally:
            _abort(comm, exc, what)

    sys.excepthook = hook


def _abort(comm, exc, what, grace_s=10.0):
    """Report ``exc`` on stderr with the rank, then ``comm.Abort`` (even if reporting fails or
    is interrupted). Never returns: MPICH's Abort returns while its launcher ends the job, so
    this rank waits up to ``grace_s`` for that, then ends itself with the same status."""
    _ignore_interrupts()
    status = exit_status(exc)
    try:
        rank = comm.Get_rank()
        if interrupt_behind(exc) is not None:  # where it was interrupted, not a SystemError
            tb = traceback.format_list(traceback.extract_tb(exc.__traceback__)[-1:])
            report = f"{what}: rank {rank}: KeyboardInterrupt (interrupted)\n{''.join(tb)}"
        else:
            report = (f"{what}: rank {rank}: {type(exc).__name__}: {exc}\n"
                      f"{''.join(traceback.format_exception(exc)[-3:])}")
        sys.stderr.write(f"{report}{what}: rank {rank}: aborting all {comm.Get_size()} ranks "
                         f"(exit status {status})\n")
        sys.stderr.flush()
        sys.stdout.flush()
    except BaseException:  # noqa: B036 -- a broken stderr or a late signal must not stop Abort
        pass
    # MPI_Abort makes the launcher tear the job down at once, and what it has not yet forwarded
    # from this rank's stderr pipe is lost (seen: a traceback cut off mid-line); give it a moment
    time.sleep(FORWARD_S)
    comm.Abort(status)
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        time.sleep(0.05)
    os._exit(status)


def polled_barrier(comm, sleep=0.002):
    """A barrier that sleeps while it waits (``Ibarrier`` tested every ``sleep`` seconds; MPICH's
    ``Barrier`` spins and takes the cores that a computing rank needs); signals (Ctrl-C) are
    handled between tests. No-op for None or one rank."""
    if comm is not None and comm.Get_size() > 1:
        req = comm.Ibarrier()
        while not req.Test():
            time.sleep(sleep)


def agree_on_errors(comm, error, extra=None):
    """Collective: every rank passes the exception it hit in validation (or None) and any
    picklable ``extra``; if any rank has an exception, every rank raises the same
    ``ValueError``/``TypeError`` naming the first failing rank, so no rank is left waiting for
    the others. Returns the list of every rank's ``extra`` (rank order)."""
    if comm is None or comm.Get_size() == 1:
        if error is not None:
            raise error
        return [extra]
    msg = None if error is None else (type(error).__name__, str(error))
    gathered = comm.allgather((msg, extra))
    # C-level passes over the P pairs (thousands of virtual ranks each do this)
    if any(map(operator.itemgetter(0), gathered)):
        for rank, (m, _) in enumerate(gathered):
            if m is not None:
                kind = TypeError if m[0] == "TypeError" else ValueError
                if error is not None and rank == comm.Get_rank():
                    raise error
                raise kind(f"rank {rank}: {m[1]}")
    return list(map(operator.itemgetter(1), gathered))
