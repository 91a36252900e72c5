"""Splitting the user's communicator into layer groups x data replicas; failure handling."""
import contextlib
import sys
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


@contextlib.contextmanager
def abort_on_error(comm, what="mgnn"):
    """On an exception inside the block, report it with the rank and abort every rank of ``comm``
    (``comm.Abort(1)``), so no rank hangs waiting for a message; serial runs just re-raise."""
    try:
        yield
    except BaseException as exc:
        if comm is None or comm.Get_size() == 1 or isinstance(exc, (KeyboardInterrupt,
                                                                     SystemExit)):
            raise
        rank = comm.Get_rank()
        sys.stderr.write(f"{what}: rank {rank}: {type(exc).__name__}: {exc}\n"
                         f"{''.join(traceback.format_exception(exc)[-3:])}"
                         f"{what}: rank {rank}: aborting all {comm.Get_size()} ranks\n")
        sys.stderr.flush()
        comm.Abort(1)
        raise  # Abort should not return; if it does, the error must not be swallowed


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
    for rank, (m, _) in enumerate(gathered):
        if m is not None:
            kind = TypeError if m[0] == "TypeError" else ValueError
            if error is not None and rank == comm.Get_rank():
                raise error
            raise kind(f"rank {rank}: {m[1]}")
    return [e for _, e in gathered]
