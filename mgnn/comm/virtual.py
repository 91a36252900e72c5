"""Virtual MPI ranks: mgnn's real distributed code on P ranks inside one process, on a virtual
clock.

:func:`run_virtual` runs ``fn(comm, *args, **kwargs)`` on ``size`` virtual ranks, each a
greenlet (a coroutine with its own stack) in the calling thread, where ``comm`` is a
:class:`VirtualComm`: the part of the mpi4py communicator API that mgnn uses, with MPI's
matching rules. The ranks never run at the same time: a deterministic discrete-event scheduler hands one baton around. A rank runs until it blocks (a
``Wait``, ``Recv`` or collective whose data is not there yet, or a ``Test`` that fails) or
returns; then the ready rank with the lowest virtual clock runs next (ties: the lowest rank).
The same run twice gives the same results, clocks and statistics, whatever the machine's load.

Supported (mpi4py names and signatures): ``Get_rank``, ``Get_size``, ``rank``, ``size``;
``Isend``, ``Send``, ``Irecv``, ``Recv`` of buffers (an array, ``[array, datatype]``,
``[array, count, datatype]``); requests with ``Wait`` and ``Test``; ``Allreduce``,
``Iallreduce`` (``MPI.IN_PLACE``; ``MPI.SUM``, ``PROD``, ``MAX``, ``MIN``), ``Allgather``,
``Allgatherv``, ``Iallgatherv`` (``[array, (counts, displs), datatype]``), ``Bcast``,
``Barrier``, ``Ibarrier``; the pickled ``allreduce``, ``allgather``, ``bcast``, ``gather``;
``Split`` (``MPI.UNDEFINED`` gives ``MPI.COMM_NULL``), ``Split_type(MPI.COMM_TYPE_SHARED)``
(every virtual rank shares one node), ``Dup``, ``Clone``, ``Free``, ``Abort``. Plus
:meth:`VirtualComm.charge` and the virtual ``clock``.

Matching: a message is matched by (communicator context, source, tag) -- ``Dup`` and ``Split``
give new contexts, so their messages never meet the parent's; messages between a pair on one
context and tag are received in the order they were sent (non-overtaking); wildcards
(``ANY_SOURCE``, ``ANY_TAG``) are not supported. A send copies its buffer when it is called
(the receiver sees the values at ``Isend`` time) and completes at once (eager protocol); a
receive longer than its buffer raises ``ValueError`` (MPI's truncation error). Collectives match
by call order on each communicator; a rank calling a different collective (or root) than the
others raises ``ValueError``.

Virtual clock (seconds, one per rank)
-------------------------------------
It starts at 0 and advances only by

* compute, charged explicitly: :meth:`VirtualComm.charge` or :func:`charge` (the running rank;
  for cost hooks that hold no communicator), never by wall time;
* waiting. A message of ``n`` bytes sent at the sender's clock ``t_s`` arrives at
  ``t_s + alpha + n / beta`` (contention-free links; 0 for a rank sending to itself); a receive
  completes at ``max(t_post, arrival)`` and its ``Wait`` returns at ``max(clock, completion)``.
  A collective over ``P`` ranks that entered at clocks ``t_i`` completes at
  ``max_i t_i + T(P, n)`` for every participant (all leave at the same virtual time); the
  blocking forms wait for it at once, the nonblocking ones at ``Wait``/``Test``.

With ``L = ceil(log2 P)`` (0 for ``P = 1``), ``n`` the bytes of one rank's buffer (pickled
size for the lowercase forms) and ``N`` the bytes gathered from all ranks, ``T(P, n)`` is
(Thakur, Rabenseifner and Gropp 2005, the algorithms MPICH picks):

* ``Barrier``, ``Ibarrier``: ``L alpha`` (dissemination);
* ``Bcast``, ``bcast``: ``L (alpha + n / beta)`` (binomial tree);
* ``Allreduce``, ``Iallreduce``, ``allreduce``: ``min(L (alpha + n / beta),
  2 L alpha + 2 (P - 1) / P n / beta)`` (recursive doubling, or Rabenseifner's reduce-scatter +
  allgather for long buffers); the arithmetic itself is not charged;
* ``Allgather``, ``Allgatherv``, ``Iallgatherv``, ``allgather``, ``gather``:
  ``L alpha + (P - 1) / P N / beta`` (recursive doubling; a gather is charged the same);
* ``Split``, ``Split_type``, ``Dup``: an allgather of two 4-byte ints per rank.

Shadow clock (seconds, one per rank)
------------------------------------
A second clock follows the same rules with its own compute charges (``charge(seconds,
shadow=...)``; without ``shadow``, the same seconds): messages arrive at the sender's shadow
clock plus the same transfer time, receives and collectives complete at the largest shadow
clock that the real clock's rules name. The program runs once and its path does not depend on
time, so the shadow clock is the clock of the same run with other compute costs (e.g. the
critical-path bound of a prediction: the kernels' work only). ``VirtualComm.shadow_clock``.

Every blocked stretch ``[t0, t1]`` of a rank is split into message time (the transfer's cost, at
most ``t1 - t0``) and waiting (the rest: a partner that was late), so every rank's
``clock = compute_s + wait_s + message_s`` (:class:`RankStats`).

Numerics: the reductions combine the ranks' values in the order a real run under MPICH and
mpi4py does, so a virtual run with real arithmetic equals ``mpiexec`` bit for bit (checked at
P = 2, 3, 4 and 2 x 2 by tests/comm/test_virtual.py). Typed ``Allreduce``/``Iallreduce``
follow MPICH's recursive doubling: with ``p`` the largest power of two <= P and ``r = P - p``,
ranks ``2i, 2i + 1`` (i < r) are combined first, then the p partial values in a balanced tree of
adjacent pairs (``(v0 + v1) + (v2 + v3)`` at P = 4, ``((v01 + v2) + (v3 + v4))`` at P = 5;
MPICH's reduce-scatter + allgather for long buffers has the same order). The pickled
``allreduce`` follows mpi4py's binomial tree (``op(lower ranks, higher ranks)``:
``((v0 + v1) + (v2 + v3)) + v4`` at P = 5). Another MPI library may add in another order.

Failures: an exception escaping ``fn`` on one rank ends every rank (the others get a
``VirtualStop`` -- a ``BaseException``, so ``except Exception`` cannot swallow it -- at their next
communication call) and :func:`run_virtual` re-raises the original exception with a note naming
the rank. ``Abort`` ends the run likewise with :class:`VirtualAbort`. When every live rank is
blocked (a receive no one sends, a collective a rank never enters) the run ends with
:class:`VirtualDeadlock`, naming each blocked rank and what it waits for -- never a hang.
mgnn's ``abort_on_error`` and ``abort_on_uncaught`` (:mod:`mgnn.comm.layout`) leave virtual
communicators alone: no process-wide hook, no ``MPI_Abort``; the scheduler ends the run.

Process-wide state: each rank has its own warning filters and handlers
(``warnings.catch_warnings`` on one rank does not catch another's warnings); everything else
of the process is shared as coroutines share it -- module globals (:func:`module_copy` gives each
rank its own copy of a module written against a global ``COMM``), ``sys.argv``, ``os.environ``,
NumPy's legacy global random state, the BLAS thread count.

Limits: host (NumPy) buffers only (device states must be staged, ``cuda_aware=False``); a
blocking and a nonblocking collective do not match each other (as in MPI); a rank computing
without communicating cannot be interrupted (Ctrl-C and ``timeout_s`` act at its next
communication call); each hand-over of the baton is two greenlet switches (about a
microsecond), so the wall time of a run is the ranks' Python work; a ``Test`` that fails advances
the clock to the request's completion (a poll loop costs no virtual time); sends are eager (no
rendezvous, the sender is never delayed) and links have no contention.
"""
import heapq
import importlib.util
import math
import numbers
import pickle
import sys
import threading
import time
import warnings
import zlib
from collections import deque
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Network", "RankStats", "VirtualAbort", "VirtualComm", "VirtualDeadlock",
           "VirtualResults", "VirtualStop", "VirtualTimeout", "charge", "current_comm",
           "module_copy", "run_virtual"]


def _mpi():
    """mpi4py's MPI module, or None without mpi4py (then only Python ops and no constants)."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI


class VirtualDeadlock(RuntimeError):
    """Every live virtual rank is blocked. ``blocked``: {world rank: what it waits for}."""

    def __init__(self, message, blocked):
        super().__init__(message)
        self.blocked = blocked

    def __reduce__(self):  # picklable both ways (e.g. from a forked prediction)
        return type(self), (str(self), self.blocked)


class VirtualAbort(RuntimeError):
    """A virtual rank called ``Abort``. ``rank``, ``errorcode``; ``__cause__``: the exception
    that rank was handling, if any."""

    def __init__(self, message, rank, errorcode):
        super().__init__(message)
        self.rank, self.errorcode = rank, errorcode

    def __reduce__(self):
        return type(self), (str(self), self.rank, self.errorcode)


class VirtualTimeout(RuntimeError):
    """:func:`run_virtual` ran past its ``timeout_s`` of wall time."""


class VirtualStop(BaseException):
    """Raised inside a virtual rank whose run is ending because of another rank (an exception,
    an abort, a deadlock, a timeout or Ctrl-C); the message says which."""


class _Aborted(BaseException):
    """Raised inside the rank that called ``Abort``."""

    def __init__(self, rank, errorcode, cause):
        super().__init__(rank, errorcode)
        self.rank, self.errorcode, self.cause = rank, errorcode, cause


@dataclass(frozen=True)
class Network:
    """Contention-free links: a message of ``n`` bytes takes ``alpha + n / beta`` seconds.

    Parameters
    ----------
    alpha : float
        Latency per message, seconds (>= 0). Default 1 us: a placeholder, not a measurement.
    beta : float
        Bandwidth, bytes per second (> 0, may be ``inf``). Default 1e10 (10 GB/s).
    """

    alpha: float = 1e-6
    beta: float = 1e10

    def __post_init__(self):
        for name, value in (("alpha", self.alpha), ("beta", self.beta)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"Network {name} must be a real number, got {value!r}")
        if not (math.isfinite(self.alpha) and self.alpha >= 0):
            raise ValueError(f"Network alpha must be finite and >= 0 seconds, got {self.alpha!r}")
        if not self.beta > 0:  # NaN fails too
            raise ValueError(f"Network beta must be > 0 bytes/s, got {self.beta!r}")

    def message(self, nbytes):
        """Seconds for one point-to-point message of ``nbytes`` bytes."""
        return self.alpha + nbytes / self.beta

    def collective(self, kind, size, nbytes):
        """Seconds for collective ``kind`` over ``size`` ranks; ``nbytes``: one rank's buffer
        (bcast, allreduce) or everything gathered (allgather, gather); see the module docstring.
        """
        if size <= 1:
            return 0.0
        steps = math.ceil(math.log2(size))
        a, b = self.alpha, self.beta
        if kind == "barrier":
            return steps * a
        if kind == "bcast":
            return steps * (a + nbytes / b)
        if kind == "allreduce":
            return min(steps * (a + nbytes / b), 2 * steps * a + 2 * (size - 1) / size * nbytes / b)
        if kind in ("allgather", "gather"):
            return steps * a + (size - 1) / size * nbytes / b
        raise ValueError(f"no cost model for collective kind {kind!r}")


@dataclass
class RankStats:
    """Virtual time and traffic of one rank (seconds, bytes).

    ``clock == compute_s + wait_s + message_s``. ``events`` (only with ``trace=True``): tuples
    ``(kind, t_start, t_end, what)``, kind 'compute', 'wait' or 'message', in time order.
    """

    rank: int
    clock: float = 0.0
    compute_s: float = 0.0
    wait_s: float = 0.0
    message_s: float = 0.0
    sent_messages: int = 0
    sent_bytes: int = 0
    recv_messages: int = 0
    recv_bytes: int = 0
    collectives: int = 0
    collective_bytes: int = 0
    events: list = field(default_factory=list)

    def as_dict(self):
        """The numbers as a dict (no events)."""
        return {k: v for k, v in self.__dict__.items() if k != "events"}


class VirtualResults(list):
    """The per-rank return values of :func:`run_virtual` (a list, rank order), with
    ``stats`` (list of :class:`RankStats`), ``time`` (the largest final clock, seconds) and
    ``network``."""

    def __init__(self, values, stats, network):
        super().__init__(values)
        self.stats, self.network = stats, network
        self.time = max((s.clock for s in stats), default=0.0)


# rank states
_NEW, _READY, _RUNNING, _BLOCKED, _DONE = "new", "ready", "running", "blocked", "done"

_local = threading.local()  # .rank: the _Rank running in this thread (None outside virtual ranks)


_WARNING_STATE = ("filters", "showwarning", "_showwarnmsg_impl")


def _warning_state():
    return tuple(getattr(warnings, name) for name in _WARNING_STATE)


def _set_warning_state(state):
    for name, value in zip(_WARNING_STATE, state):
        setattr(warnings, name, value)
    warnings._filters_mutated()


def _swap_warnings(rank):
    """Exchange the process's warning filters and handlers with ``rank``'s (each virtual rank
    has its own, as each MPI process does: ``warnings.catch_warnings`` on one rank must not
    catch another's warnings)."""
    mine = rank.warnings
    rank.warnings = _warning_state()
    _set_warning_state(mine)  # its registries reset too: a 'default' warning once per rank


class _Rank:
    __slots__ = ("index", "clock", "shadow", "stats", "glet", "status", "waiting", "result",
                 "comm", "trace", "warnings")

    def __init__(self, index, trace):
        self.index, self.clock, self.shadow, self.trace = index, 0.0, 0.0, trace
        self.stats = RankStats(index)
        self.glet = self.waiting = self.result = self.comm = self.warnings = None
        self.status = _NEW

    def event(self, kind, t0, t1, what=""):
        if self.trace and t1 > t0:
            self.stats.events.append((kind, t0, t1, what))


class _Request:
    """A pending operation of one rank: a message or a collective."""

    __slots__ = ("owner", "what", "label", "done", "completion", "transfer", "finished",
                 "waiter", "deliver", "output", "error", "post", "view", "comm", "post2",
                 "completion2")

    def __init__(self, owner, what, label, comm=None):
        """``what``: a description for deadlock reports (or a callable making it); ``label``:
        a short one for traces."""
        self.owner, self.what, self.label, self.comm = owner, what, label, comm
        self.done = self.finished = False
        self.completion = self.transfer = self.completion2 = 0.0
        self.waiter = self.deliver = self.output = self.error = self.view = None
        self.post, self.post2 = owner.clock, owner.shadow

    def describe(self):
        return self.what() if callable(self.what) else self.what


class VirtualRequest:
    """mpi4py-like request of a virtual rank: ``Wait()`` and ``Test()``."""

    __slots__ = ("_req", "_world")

    def __init__(self, world, req):
        self._world, self._req = world, req

    def Wait(self, status=None):
        """Block (virtually) until the operation completes; returns True."""
        _no_status(status)
        self._world.wait(self._req)
        return True

    def Test(self, status=None):
        """True if the operation has completed by this rank's clock (and finish it). Else
        False, after advancing the clock to its completion (blocking for a message not yet
        sent), so the next ``Test``/``Wait`` succeeds: a poll loop costs no virtual time."""
        _no_status(status)
        return self._world.test(self._req)


def _no_status(status):
    if status is not None:
        raise TypeError("status objects are not supported on virtual ranks")


class _Collective:
    __slots__ = ("kind", "label", "root", "size", "arrived", "finish", "comm")

    def __init__(self, kind, label, root, comm, finish):
        self.kind, self.label, self.root, self.comm, self.finish = kind, label, root, comm, finish
        self.size = comm.Get_size()
        self.arrived = {}  # local rank -> (clock, contribution, request)


class _World:
    """The scheduler and message matching of one :func:`run_virtual` call."""

    def __init__(self, size, network, trace):
        self.size, self.network = size, network
        self.ranks = [_Rank(i, trace) for i in range(size)]
        self.heap = [(0.0, i) for i in range(size)]  # (resume clock, rank) of ready ranks
        self.blocked = {}
        self.done = 0
        self.running = None
        self.failure = None  # (kind, rank or None, exception)
        self.main = self.deadline = self.timeout_s = None
        self.calls = 0
        self.payloads = True
        self.unexpected, self.posted = {}, {}  # (ctx, src, dst, tag) -> deque
        self.collectives = {}  # (ctx, sequence) -> _Collective
        self.contexts = 0
        self.labels = {}

    # -- scheduling ------------------------------------------------------------------------

    def new_context(self, label):
        ctx, self.contexts = self.contexts, self.contexts + 1
        self.labels[ctx] = label
        return ctx

    def pick(self):
        """The next rank to run (popped from the ready heap), or None when every rank has
        ended; a run with live ranks and none ready is a deadlock (recorded as the failure,
        and the blocked ranks are woken to end)."""
        while True:
            if self.failure is not None and self.blocked:  # wake them to raise VirtualStop
                for r in sorted(self.blocked.values(), key=lambda r: r.index):
                    r.status = _READY
                    heapq.heappush(self.heap, (r.clock, r.index))
                self.blocked.clear()
            if not self.heap:
                if self.done == self.size:
                    return None
                if self.failure is None:
                    self.failure = ("deadlock", None, self._deadlock())
                    continue
                if not self.blocked:  # live ranks neither ready nor blocked: nothing can run
                    return None
                continue
            _, i = heapq.heappop(self.heap)
            rank = self.ranks[i]
            if rank.status == _NEW and self.failure is not None:
                rank.status = _DONE  # never started: nothing to unwind
                self.done += 1
                continue
            return rank

    def schedule(self, deadline=None):
        """The scheduler loop (in the caller of :func:`run_virtual`): run the next rank until
        it blocks or ends, until every rank has ended. Each rank is a greenlet; a hand-over is
        two greenlet switches (rank -> this loop -> next rank), no OS thread switch."""
        import greenlet
        main = self.main = greenlet.getcurrent()
        while True:
            if deadline is not None:
                self.check_deadline()
            rank = self.pick()
            if rank is None:
                self.running = None
                return
            if rank.status == _NEW:
                rank.glet = greenlet.greenlet(self._body, parent=main)
            rank.status, self.running = _RUNNING, rank
            _local.rank = rank
            try:
                rank.glet.switch(rank)
            finally:
                _local.rank = None

    def _body(self, rank):
        rank.warnings = self.warnings
        _swap_warnings(rank)
        try:
            rank.result = self.fn(rank.comm, *self.args, **self.kwargs)
        except VirtualStop:
            pass
        except _Aborted as exc:
            if self.failure is None:
                self.failure = ("abort", rank.index, exc)
        except KeyboardInterrupt as exc:
            if self.failure is None:
                self.failure = ("interrupt", rank.index, exc)
        except BaseException as exc:  # noqa: B036 -- any failure ends every rank
            if self.failure is None:
                self.failure = ("exception", rank.index, exc)
        finally:
            _swap_warnings(rank)
            rank.status = _DONE
            rank.stats.clock = rank.clock
            self.done += 1
            self.running = None
        # returning hands control back to the scheduler loop (the greenlet's parent)

    def current(self, rank):
        """Check that ``rank`` holds the baton and the run goes on (past the timeout: ends)."""
        if self.running is not rank:
            who = "no virtual rank" if self.running is None else f"rank {self.running.index}"
            raise RuntimeError(f"a communicator of virtual rank {rank.index} was used while "
                               f"{who} runs (communicators must not be shared between ranks)")
        if self.deadline is not None:
            self.calls += 1
            if self.calls % 64 == 0:  # the clock read is the costly part
                self.check_deadline()
        if self.failure is not None:
            raise VirtualStop(self.stop_message())

    def check_deadline(self):
        """Past ``timeout_s``: the run's failure is a VirtualTimeout (if it has none yet)."""
        if self.failure is None and time.monotonic() > self.deadline:
            self.failure = ("timeout", None, VirtualTimeout(
                f"virtual run past its timeout of {self.timeout_s} s ({self.describe_state()})"))

    def block(self, rank, req):
        """Give up the baton until ``req`` completes."""
        self.current(rank)
        rank.status, rank.waiting, req.waiter = _BLOCKED, req, rank
        self.blocked[rank.index] = rank
        _swap_warnings(rank)
        self.running = None
        self.main.switch()
        _swap_warnings(rank)
        rank.waiting = None
        if self.failure is not None:
            raise VirtualStop(self.stop_message())

    def wake(self, req):
        rank = req.waiter
        if rank is not None and rank.status == _BLOCKED and rank.waiting is req:
            del self.blocked[rank.index]
            rank.status = _READY
            heapq.heappush(self.heap, (max(rank.clock, req.completion), rank.index))

    def _advance(self, rank, req):
        """Move ``rank``'s clock to ``req``'s completion: message time, then waiting (and its
        shadow clock to the shadow completion)."""
        if req.completion2 > rank.shadow:
            rank.shadow = req.completion2
        if req.completion > rank.clock:
            t0, exposed = rank.clock, req.completion - rank.clock
            msg = min(exposed, req.transfer)
            rank.stats.message_s += msg
            rank.stats.wait_s += exposed - msg
            rank.event("wait", t0, req.completion - msg, req.label)
            rank.event("message", req.completion - msg, req.completion, req.label)
            rank.clock = req.completion

    def _finish(self, rank, req):
        self._advance(rank, req)
        req.finished = True
        if req.error is not None:
            raise req.error
        if req.deliver is not None:
            req.deliver(req.output)

    def wait(self, req):
        rank = req.owner
        self.current(rank)
        if req.finished:
            return
        if not req.done:
            self.block(rank, req)
        self._finish(rank, req)

    def test(self, req):
        rank = req.owner
        self.current(rank)
        if req.finished:
            return True
        if req.done and req.completion <= rank.clock:
            self._finish(rank, req)
            return True
        if not req.done:
            self.block(rank, req)
        self._advance(rank, req)
        return False

    def charge(self, rank, seconds, shadow=None):
        for name, v in (("seconds", seconds), ("shadow", seconds if shadow is None else shadow)):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or \
                    not (math.isfinite(v) and v >= 0):
                raise ValueError(f"charge: {name} must be a finite number >= 0, got {v!r}")
        self.current(rank)
        t0 = rank.clock
        rank.shadow += float(seconds if shadow is None else shadow)
        rank.clock += float(seconds)
        rank.stats.compute_s += float(seconds)
        rank.event("compute", t0, rank.clock)

    # -- messages --------------------------------------------------------------------------

    def isend(self, comm, payload, dest_world, tag):
        rank = comm._owner
        self.current(rank)
        nbytes = payload.size
        transfer = 0.0 if dest_world == rank.index else self.network.message(nbytes)
        msg = (payload, rank.clock + transfer, transfer, rank.shadow + transfer)
        rank.stats.sent_messages += 1
        rank.stats.sent_bytes += nbytes
        key = (comm._ctx, rank.index, dest_world, tag)
        waiting = self.posted.get(key)
        if waiting:
            req = waiting.popleft()
            if not waiting:
                del self.posted[key]
            self._match(req, msg)
        else:
            self.unexpected.setdefault(key, deque()).append(msg)
        req = _Request(rank, "Isend", "Isend")
        req.done, req.completion, req.completion2 = True, rank.clock, rank.shadow
        return req

    def irecv(self, comm, view, source_world, source, tag):
        rank = comm._owner
        self.current(rank)
        req = _Request(rank, lambda: (
            f"a message from rank {source} (world rank {source_world}), tag {tag}, on "
            f"{comm._describe()}{self._finished_note(source_world)}"),
            f"message from rank {source_world}, tag {tag}", comm)
        req.view = view
        key = (comm._ctx, source_world, rank.index, tag)
        queued = self.unexpected.get(key)
        if queued:
            msg = queued.popleft()
            if not queued:
                del self.unexpected[key]
            self._match(req, msg)
        else:
            self.posted.setdefault(key, deque()).append(req)
        return req

    def _match(self, req, msg):
        payload, arrival, transfer, arrival2 = msg
        if payload.size > req.view.size:
            req.error = ValueError(
                f"virtual rank {req.owner.index}: message truncated: {payload.size} bytes "
                f"received into a buffer of {req.view.size} bytes ({req.describe()})")
        else:
            req.view[:payload.size] = 0 if isinstance(payload, _Sized) else payload
            req.owner.stats.recv_messages += 1
            req.owner.stats.recv_bytes += payload.size
        req.done, req.transfer = True, transfer
        req.completion = max(req.post, arrival)
        req.completion2 = max(req.post2, arrival2)
        self.wake(req)

    def _finished_note(self, world_rank):
        status = self.ranks[world_rank].status
        return f" (rank {world_rank} has ended)" if status == _DONE else ""

    # -- collectives -----------------------------------------------------------------------

    def collective(self, comm, kind, label, contribution, finish, root=None):
        """Enter a collective; ``finish(contributions in rank order) -> (outputs, nbytes)``.
        Returns the request (its ``output`` is this rank's output)."""
        rank = comm._owner
        self.current(rank)
        key = (comm._ctx, comm._seq)
        comm._seq += 1
        coll = self.collectives.get(key)
        if coll is None:
            coll = self.collectives[key] = _Collective(kind, label, root, comm, finish)
        elif coll.label != label or coll.root != root:
            first = min(coll.arrived)
            raise ValueError(
                f"collective mismatch on {comm._describe()}: rank {comm._rank} called {label}"
                f"{'' if root is None else f' (root {root})'} where rank {first} called "
                f"{coll.label}{'' if coll.root is None else f' (root {coll.root})'}")
        req = _Request(rank, lambda: self._collective_wait(comm, coll),
                       f"{label} on comm {comm._ctx}", comm)
        coll.arrived[comm._rank] = (rank.clock, contribution, req, rank.shadow)
        rank.stats.collectives += 1
        rank.stats.collective_bytes += _size(contribution)
        if len(coll.arrived) == coll.size:
            del self.collectives[key]
            order = [coll.arrived[i] for i in range(coll.size)]
            outputs, nbytes = coll.finish([c for _, c, _, _ in order])
            cost = self.network.collective(kind, coll.size, nbytes)
            end = max(t for t, _, _, _ in order) + cost
            end2 = max(t for _, _, _, t in order) + cost
            for (_, _, r, _), out in zip(order, outputs):
                r.done, r.completion, r.transfer, r.output = True, end, cost, out
                r.completion2 = end2
                self.wake(r)
        return req

    def _collective_wait(self, comm, coll):
        missing = [i for i in range(coll.size) if i not in coll.arrived]
        ended = [i for i in missing if self.ranks[comm._group[i]].status == _DONE]
        note = f"; ended: ranks {ended}" if ended else ""
        return (f"{coll.label} on {comm._describe()} (arrived: ranks {sorted(coll.arrived)}; "
                f"not yet: ranks {missing}{note})")

    # -- failures --------------------------------------------------------------------------

    def _deadlock(self):
        blocked = {i: r.waiting.describe() for i, r in sorted(self.blocked.items())}
        lines = "; ".join(f"rank {i} waits for {what}" for i, what in blocked.items())
        ended = [r.index for r in self.ranks if r.status == _DONE]
        tail = f" (ranks {ended} have ended)" if ended else ""
        return VirtualDeadlock(f"virtual deadlock: every live rank is blocked: {lines}{tail}",
                               blocked)

    def stop_message(self):
        kind, rank, exc = self.failure
        if kind == "exception":
            return f"virtual run ended: rank {rank} raised {type(exc).__name__}: {exc}"
        if kind == "abort":
            return f"virtual run ended: rank {rank} called Abort({exc.errorcode})"
        return f"virtual run ended: {exc}"

    def describe_state(self):
        running = "none" if self.running is None else f"rank {self.running.index}"
        blocked = "; ".join(f"rank {i} waits for {r.waiting.describe()}"
                            for i, r in sorted(self.blocked.items()) if r.waiting is not None)
        return f"running: {running}; blocked: {blocked or 'none'}"


def _size(contribution):
    """Bytes a rank contributes to a collective (arrays, pickles; 8 for a Split's ints)."""
    if contribution is None:
        return 0
    if isinstance(contribution, tuple):
        return 8
    return len(contribution) if isinstance(contribution, bytes) else contribution.nbytes


def _as_array(obj, what):
    if isinstance(obj, np.ndarray):
        return obj
    if hasattr(obj, "__cuda_array_interface__"):
        raise TypeError(f"{what}: device buffers are not supported on virtual ranks; stage "
                        "them through host memory (cuda_aware=False)")
    try:
        return np.asarray(memoryview(obj))
    except TypeError:
        raise TypeError(f"{what}: expected an array or buffer, got {type(obj).__name__}") from None


def _int64_vector(v):
    """``v`` as a 1-d int64 array: ``v`` itself if it is one (so that checks kept per array,
    :func:`_vector_facts`, find it again)."""
    a = np.asarray(v, dtype=np.int64)
    return a if a.ndim == 1 else a.reshape(-1)


def _spec(spec, what):
    """(array, datatype, count, vector) of an mpi4py buffer spec: ``array``, ``[array,
    datatype]``, ``[array, count, datatype]``, ``[array, (counts, displs), datatype]``."""
    datatype = count = vector = None
    if isinstance(spec, (list, tuple)):
        if not 1 <= len(spec) <= 3:
            raise TypeError(f"{what}: a buffer spec has 1 to 3 items, got {len(spec)}")
        arr, *rest = spec
        if rest and not isinstance(rest[-1], (numbers.Integral, list, tuple)):
            datatype = rest.pop()
        if rest:
            c = rest[0]
            if isinstance(c, numbers.Integral):
                count = int(c)
            elif isinstance(c, (list, tuple)) and len(c) == 2:  # 1-d int64 arrays as they are
                vector = (_int64_vector(c[0]), _int64_vector(c[1]))
            else:
                raise TypeError(f"{what}: bad count in buffer spec: {c!r}")
    else:
        arr = spec
    return _as_array(arr, what), datatype, count, vector


def _bytes(arr, what, writable=False):
    """Flat uint8 view of a C-contiguous array (mpi4py's buffer rules)."""
    if not arr.flags.c_contiguous:
        raise BufferError(f"{what}: buffer is not C-contiguous (shape {arr.shape}, strides "
                          f"{arr.strides})")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{what}: receive buffer is read-only")
    return arr.reshape(-1).view(np.uint8)


def _unit(arr, datatype):
    """Bytes per element of ``datatype`` (the array's itemsize when none is given)."""
    size = getattr(datatype, "Get_size", None)
    return arr.itemsize if size is None else int(size())


def _elements(spec, what, writable=False):
    """(flat uint8 view limited to the spec's count, element size) of a buffer spec."""
    arr, datatype, count, _ = _spec(spec, what)
    view = _bytes(arr, what, writable)
    unit = _unit(arr, datatype)
    if count is not None:
        if count < 0 or count * unit > view.size:
            raise ValueError(f"{what}: count {count} exceeds the buffer ({view.size} bytes)")
        view = view[:count * unit]
    return view, unit


_UFUNCS = (("SUM", np.add), ("PROD", np.multiply), ("MAX", np.maximum), ("MIN", np.minimum))


def _ufunc(op):
    """The NumPy ufunc of an MPI reduction op for typed buffers."""
    MPI = _mpi()
    if op is None:
        return np.add
    for name, fn in _UFUNCS:
        if op is fn or (MPI is not None and op == getattr(MPI, name)):
            return fn
    raise ValueError(f"reduction op {op!r} is not supported on virtual ranks (SUM, PROD, MAX, "
                     "MIN)")


def _in_place(buf):
    MPI = _mpi()
    return buf is None or (MPI is not None and buf is MPI.IN_PLACE)


def _mpich_order(values, op):
    """Combine ``values`` (rank order) in MPICH's recursive-doubling order."""
    p = 1
    while 2 * p <= len(values):
        p *= 2
    r = len(values) - p
    level = [op(values[2 * i], values[2 * i + 1]) for i in range(r)] + list(values[2 * r:])
    while len(level) > 1:
        level = [op(level[2 * j], level[2 * j + 1]) for j in range(len(level) // 2)]
    return level[0]


def _binomial_order(values, op):
    """Combine ``values`` (rank order) in mpi4py's binomial tree: op(lower ranks, higher)."""
    values, mask = list(values), 1
    while mask < len(values):
        for i in range(0, len(values), 2 * mask):
            if i + mask < len(values):
                values[i] = op(values[i], values[i + mask])
        mask *= 2
    return values[0]


def _object_op(op):
    MPI = _mpi()
    if op is None:
        return MPI.SUM if MPI is not None else (lambda a, b: a + b)
    if not callable(op):
        raise TypeError(f"reduction op must be callable (an MPI.Op or a function), got {op!r}")
    return op


_dumps = pickle.dumps


class _Sized:
    """The stand-in of a typed buffer's contents when a run carries no payloads
    (``run_virtual(payloads=False)``): its size only."""

    __slots__ = ("size", "nbytes")

    def __init__(self, arr):
        self.size, self.nbytes = arr.size, arr.nbytes


def _contents(world, arr):
    """A copy of ``arr`` to send, or its :class:`_Sized` stand-in without payloads."""
    return arr.copy() if world.payloads else _Sized(arr)
_ATOMS = (type(None), bool, int, float, complex, str, bytes)


def _immutable(obj, depth=0):
    """Whether ``obj`` cannot be changed in place (atoms and tuples / frozensets of them)."""
    if isinstance(obj, _ATOMS):
        return True
    if isinstance(obj, (tuple, frozenset)) and depth < 4:
        return all(_immutable(v, depth + 1) for v in obj)
    return False


def _vector_facts(counts, displs, unit, nbytes, label, size, keep=True):
    """(packed, the collective's name, sum of counts) of an Allgatherv on ``size`` ranks of
    ``counts`` and ``displs`` (int64 arrays) into ``nbytes`` of ``unit``-byte elements, checked
    (ValueError); with ``keep``, kept per array pair and its contents for every virtual rank
    (callers pass the same vectors every cycle: at thousands of ranks these O(P) checks per
    call cost more than the message). ``packed``: parts laid end to end from displacement 0
    (the usual layout), so one copy of the joined parts serves every rank."""
    # kept per array pair, and used only while their contents are the ones checked (a caller
    # may change its arrays in place between calls): two C-level copies and compares a call,
    # no hashing of O(P) bytes
    key = (id(counts), id(displs), unit, nbytes, label, size)
    cb, db = counts.tobytes(), displs.tobytes()
    got = _VECTORS.get(key)
    if got is not None and got[0] is counts and got[1] is displs and got[2] == cb \
            and got[3] == db:
        return got[4]
    if len(counts) != size or len(displs) != size:
        raise ValueError(f"{label}: {len(counts)} counts and {len(displs)} displacements "
                         f"for {size} ranks")
    bad = np.flatnonzero((counts < 0) | (displs < 0) | ((counts + displs) * unit > nbytes))
    if bad.size:
        c, d = int(counts[bad[0]]), int(displs[bad[0]])
        raise ValueError(f"{label}: count {c} at displacement {d} exceeds the receive "
                         f"buffer ({nbytes} bytes)")
    packed = bool(displs[0] == 0 and np.array_equal(displs[1:], np.cumsum(counts)[:-1]))
    total = int(counts.sum())
    name = (f"{label}({tuple(counts.tolist())})" if size <= 8 else
            f"{label}({size} counts, {total} elements, crc32 "
            f"{zlib.crc32(cb):08x})")
    if keep:
        if len(_VECTORS) >= 64:
            _VECTORS.clear()
        _VECTORS[key] = (counts, displs, cb, db, (packed, name, total))
    return packed, name, total


#: Allgatherv vectors -> their checks (_vector_facts), for every virtual rank of the process
_VECTORS = {}


class VirtualComm:
    """One virtual rank's communicator: the mpi4py API subset listed in :mod:`the module
    <mgnn.comm.virtual>`. Made by :func:`run_virtual` (the world) and by ``Split``/``Dup``;
    usable only from its own rank."""

    #: Marks a communicator of virtual ranks (mgnn.comm.layout leaves it to the scheduler).
    is_virtual = True

    def __init__(self, world, ctx, group, rank, owner):
        # a split shares one tuple among its members (a copy each: O(P^2) at P ranks)
        group = group if isinstance(group, tuple) else tuple(group)
        self._world, self._ctx, self._group, self._rank = world, ctx, group, rank
        self._owner, self._seq, self._freed = owner, 0, False

    def __repr__(self):
        return f"<VirtualComm {self._describe()}, rank {self._rank} of {len(self._group)}>"

    def _describe(self):
        return f"comm {self._ctx} ({self._world.labels[self._ctx]})"

    def _live(self):
        if self._freed:
            raise ValueError(f"virtual rank {self._owner.index}: {self._describe()} was freed")

    # -- local queries -----------------------------------------------------------------

    def Get_rank(self):
        """This rank's index in the communicator."""
        return self._rank

    def Get_size(self):
        """Ranks in the communicator."""
        return len(self._group)

    rank = property(Get_rank)
    size = property(Get_size)

    @property
    def world_rank(self):
        """This rank's index among all ranks of the :func:`run_virtual` call."""
        return self._owner.index

    @property
    def clock(self):
        """This rank's virtual time, seconds."""
        return self._owner.clock

    @property
    def shadow_clock(self):
        """This rank's shadow clock (see the module: the same run with the ``shadow`` compute
        charges), seconds."""
        return self._owner.shadow

    @property
    def stats(self):
        """This rank's :class:`RankStats` (live: the numbers so far)."""
        return self._owner.stats

    def charge(self, seconds, shadow=None):
        """Advance this rank's virtual clock by ``seconds`` of compute (finite, >= 0), its
        shadow clock by ``shadow`` (default: ``seconds``)."""
        self._world.charge(self._owner, seconds, shadow)

    def _peer(self, r, what):
        if isinstance(r, bool) or not isinstance(r, numbers.Integral) or \
                not 0 <= r < len(self._group):
            raise ValueError(f"{what}: rank {r!r} is not in 0..{len(self._group) - 1} of "
                             f"{self._describe()} (wildcards are not supported)")
        return self._group[int(r)]

    @staticmethod
    def _tag(tag, what):
        if isinstance(tag, bool) or not isinstance(tag, numbers.Integral) or tag < 0:
            raise ValueError(f"{what}: tag must be an int >= 0, got {tag!r} (wildcards are not "
                             "supported)")
        return int(tag)

    # -- point to point ----------------------------------------------------------------

    def Isend(self, buf, dest, tag=0):
        """Start sending ``buf`` (copied now) to ``dest``; the request is complete at once."""
        self._live()
        view, _ = _elements(buf, "Isend")
        dest_world = self._peer(dest, "Isend")
        return VirtualRequest(self._world, self._world.isend(
            self, _contents(self._world, view), dest_world, self._tag(tag, "Isend")))

    def Send(self, buf, dest, tag=0):
        """Send ``buf`` to ``dest`` (eager: returns at once)."""
        self.Isend(buf, dest, tag).Wait()

    def Irecv(self, buf, source, tag=0):
        """Start receiving into ``buf`` from ``source``."""
        self._live()
        view, _ = _elements(buf, "Irecv", writable=True)
        source_world = self._peer(source, "Irecv")
        return VirtualRequest(self._world, self._world.irecv(
            self, view, source_world, source, self._tag(tag, "Irecv")))

    def Recv(self, buf, source, tag=0, status=None):
        """Receive into ``buf`` from ``source`` (blocking)."""
        _no_status(status)
        self.Irecv(buf, source, tag).Wait()

    # -- collectives -------------------------------------------------------------------

    def _coll(self, kind, label, contribution, finish, root=None, deliver=None):
        self._live()
        req = self._world.collective(self, kind, label, contribution, finish, root)
        req.deliver = deliver
        return VirtualRequest(self._world, req)

    def _root(self, root, what):
        self._peer(root, what)
        return int(root)

    def Iallreduce(self, sendbuf, recvbuf, op=None):
        """Start reducing the ranks' buffers into ``recvbuf`` (``sendbuf`` may be
        ``MPI.IN_PLACE``); MPICH's order (module docstring)."""
        return self._allreduce(sendbuf, recvbuf, op, "Iallreduce")

    def Allreduce(self, sendbuf, recvbuf, op=None):
        """Reduce the ranks' buffers into ``recvbuf`` on every rank (blocking)."""
        self._allreduce(sendbuf, recvbuf, op, "Allreduce").Wait()

    def _allreduce(self, sendbuf, recvbuf, op, label):
        ufunc = _ufunc(op)
        arr, datatype, count, _ = _spec(recvbuf, label)
        _bytes(arr, label, writable=True)
        if _unit(arr, datatype) != arr.itemsize:
            raise TypeError(f"{label}: datatype {datatype} does not match the buffer's "
                            f"dtype {arr.dtype}")
        n = arr.size if count is None else count
        flat = arr.reshape(-1)[:n]
        if _in_place(sendbuf):
            mine = _contents(self._world, flat)
        else:
            sarr, _, scount, _ = _spec(sendbuf, label)
            _bytes(sarr, label)
            if sarr.dtype != arr.dtype or (sarr.size if scount is None else scount) != n:
                raise ValueError(f"{label}: send buffer ({sarr.dtype}, {sarr.size}) and "
                                 f"receive buffer ({arr.dtype}, {n}) differ")
            mine = _contents(self._world, sarr.reshape(-1)[:n])

        def finish(parts):
            if isinstance(parts[0], _Sized):  # no payloads: the receive buffers stay as they are
                return [None] * len(parts), parts[0].nbytes
            total = _mpich_order(parts, ufunc)
            return [total] * len(parts), total.nbytes

        def deliver(total):
            if total is not None:
                flat[:] = total
        return self._coll("allreduce", label, mine, finish, deliver=deliver)

    def Iallgatherv(self, sendbuf, recvbuf):
        """Start gathering every rank's ``sendbuf`` into ``recvbuf`` = ``[array, (counts,
        displs), datatype]`` (counts and displacements in elements)."""
        return self._allgather(sendbuf, recvbuf, "Iallgatherv")

    def Allgatherv(self, sendbuf, recvbuf):
        """Gather every rank's ``sendbuf`` into ``recvbuf`` (blocking)."""
        self._allgather(sendbuf, recvbuf, "Allgatherv").Wait()

    def Allgather(self, sendbuf, recvbuf):
        """Gather ``sendbuf`` of every rank into equal parts of ``recvbuf``, in rank order."""
        self._allgather(sendbuf, recvbuf, "Allgather").Wait()

    def _allgather(self, sendbuf, recvbuf, label):
        send, _ = _elements(sendbuf, label)
        arr, datatype, count, vector = _spec(recvbuf, label)
        out = _bytes(arr, label, writable=True)
        unit = _unit(arr, datatype)
        size = self.Get_size()
        if vector is None:  # equal parts: count elements each, or the buffer split in P
            if count is None and out.size % (size * unit):
                raise ValueError(f"{label}: receive buffer of {out.size} bytes does not split "
                                 f"into {size} equal parts")
            part = out.size // (size * unit) if count is None else count
            vector = (np.full(size, part, dtype=np.int64),
                      np.arange(size, dtype=np.int64) * part)
            keep = False  # fresh vectors: not worth keeping
        else:
            keep = True
        counts, displs = vector
        packed, name, total = _vector_facts(counts, displs, unit, out.size, label, size, keep)
        me = self._rank
        if send.size != counts[me] * unit:
            raise ValueError(f"{label}: rank {me} sends {send.size} bytes, counts[{me}] = "
                             f"{counts[me]} elements of {unit} bytes")

        def finish(parts):
            nbytes = sum(p.size for p in parts)
            if isinstance(parts[0], _Sized):  # no payloads: the receive buffers stay as they are
                return [None] * len(parts), nbytes
            joined = np.concatenate(parts) if packed else None
            return [(parts, joined)] * len(parts), nbytes

        def deliver(got):
            if got is None:
                return
            parts, joined = got
            if packed and joined is not None and joined.size == total * unit:
                out[:joined.size] = joined
                return
            for p, d in zip(parts, displs.tolist()):
                out[d * unit:d * unit + p.size] = p
        return self._coll("allgather", name, _contents(self._world, send), finish,
                          deliver=deliver)

    def Bcast(self, buf, root=0):
        """Copy ``buf`` of rank ``root`` into ``buf`` of every rank."""
        root = self._root(root, "Bcast")
        view, _ = _elements(buf, "Bcast", writable=True)
        mine = _contents(self._world, view) if self._rank == root else None

        def finish(parts):
            data = parts[root]
            return [data] * len(parts), data.size

        def deliver(data):
            if data.size != view.size:
                raise ValueError(f"Bcast: rank {self._rank} has a buffer of {view.size} bytes, "
                                 f"root {root} sent {data.size}")
            if not isinstance(data, _Sized):
                view[:] = data
        self._coll("bcast", "Bcast", mine, finish, root=root, deliver=deliver).Wait()

    def Ibarrier(self):
        """Start a barrier."""
        return self._coll("barrier", "Ibarrier", None, lambda parts: ([None] * len(parts), 0))

    def Barrier(self):
        """Wait until every rank has entered."""
        self._coll("barrier", "Barrier", None, lambda parts: ([None] * len(parts), 0)).Wait()

    # pickled objects: every rank receives its own copy

    def _objects(self, kind, label, obj, finish, root=None):
        box = []
        self._coll(kind, label, _dumps(obj, pickle.HIGHEST_PROTOCOL), finish, root=root,
                   deliver=box.append).Wait()
        return box[0]

    def allgather(self, sendobj):
        """[object of rank 0, object of rank 1, ...] on every rank (copies; objects that cannot
        be changed -- None, numbers, strings, tuples of them -- are shared)."""
        def finish(ps):
            loaded = [pickle.loads(p) for p in ps]
            shared = loaded if all(_immutable(v) for v in loaded) else None
            return [(ps, shared)] * len(ps), sum(len(p) for p in ps)
        ps, shared = self._objects("allgather", "allgather", sendobj, finish)
        return list(shared) if shared is not None else [pickle.loads(p) for p in ps]

    def gather(self, sendobj, root=0):
        """The list of every rank's object on ``root`` (copies), None elsewhere."""
        root = self._root(root, "gather")

        def finish(ps):
            return [ps if i == root else None for i in range(len(ps))], sum(len(p) for p in ps)
        out = self._objects("gather", "gather", sendobj, finish, root=root)
        return None if out is None else [pickle.loads(p) for p in out]

    def bcast(self, obj, root=0):
        """Rank ``root``'s object on every rank (a copy)."""
        root = self._root(root, "bcast")

        def finish(ps):
            return [ps[root]] * len(ps), len(ps[root])
        return pickle.loads(self._objects("bcast", "bcast", obj if self._rank == root else None,
                                          finish, root=root))

    def allreduce(self, sendobj, op=None):
        """``op`` over every rank's object, mpi4py's binomial order (module docstring)."""
        fn = _object_op(op)

        def finish(ps):
            total = _dumps(_binomial_order([pickle.loads(p) for p in ps], fn),
                           pickle.HIGHEST_PROTOCOL)
            return [total] * len(ps), max(len(p) for p in ps)
        return pickle.loads(self._objects("allreduce", "allreduce", sendobj, finish))

    # -- communicators -----------------------------------------------------------------

    def _split(self, label, color, key):
        MPI = _mpi()
        undefined = None if MPI is None else MPI.UNDEFINED
        null = None if MPI is None else MPI.COMM_NULL
        world, parent = self._world, self

        def finish(ps):
            out = [null] * len(ps)
            by_color = {}  # one pass: a scan per color is O(P^2) when each rank has its own
            for i, (c, k) in enumerate(ps):
                if c != undefined:
                    by_color.setdefault(c, []).append((k, i))
            one_color = len(set(c_ for c_, _ in ps)) == 1
            for c in sorted(by_color):
                members = sorted(by_color[c])
                group = tuple(parent._group[i] for _, i in members)
                what = label if one_color else f"{label} color {c}"
                ctx = world.new_context(f"{what} of comm {parent._ctx}")
                for new_rank, (_, i) in enumerate(members):
                    out[i] = VirtualComm(world, ctx, group, new_rank, world.ranks[group[new_rank]])
            return out, 8 * len(ps)
        box = []
        self._coll("allgather", label, (color, key), finish, deliver=box.append).Wait()
        return box[0]

    def Split(self, color=0, key=0):
        """New communicators of the ranks with equal ``color``, ordered by (``key``, rank);
        ``MPI.UNDEFINED`` gives ``MPI.COMM_NULL``."""
        for name, v in (("color", color), ("key", key)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"Split: {name} must be an int, got {v!r}")
        return self._split("Split", int(color), int(key))

    def Split_type(self, split_type, key=0, info=None):
        """``MPI.COMM_TYPE_SHARED``: every rank of this communicator (one virtual node)."""
        MPI = _mpi()
        shared = None if MPI is None else MPI.COMM_TYPE_SHARED
        if split_type != shared and not (MPI is not None and split_type == MPI.UNDEFINED):
            raise ValueError(f"Split_type: only COMM_TYPE_SHARED is supported, got {split_type!r}")
        color = 0 if split_type == shared else (MPI.UNDEFINED if MPI is not None else None)
        return self._split("Split_type", color, int(key))

    def Dup(self, info=None):
        """A new communicator of the same ranks (a new message context)."""
        return self._split("Dup", 0, self._rank)

    Clone = Dup

    def Free(self):
        """Mark this communicator freed (later calls raise)."""
        self._freed = True

    def Abort(self, errorcode=0):
        """End every virtual rank: :func:`run_virtual` raises :class:`VirtualAbort` naming this
        rank (caused by the exception being handled here, if any). Never returns."""
        raise _Aborted(self._owner.index, errorcode, sys.exc_info()[1])


def current_comm():
    """The world :class:`VirtualComm` of the virtual rank running in this thread, or None."""
    rank = getattr(_local, "rank", None)
    return None if rank is None else rank.comm


def charge(seconds, shadow=None):
    """Charge ``seconds`` of compute (``shadow`` to the shadow clock; default the same) to the
    virtual rank running in this thread (for cost hooks that hold no communicator). Raises
    RuntimeError outside :func:`run_virtual`."""
    comm = current_comm()
    if comm is None:
        raise RuntimeError("charge() called outside a virtual rank")
    comm.charge(seconds, shadow)


def run_virtual(size, fn, *args, network=None, timeout_s=None, trace=False, payloads=True,
                **kwargs):
    """Run ``fn(comm, *args, **kwargs)`` on ``size`` virtual ranks; see :mod:`the module
    <mgnn.comm.virtual>` for the scheduler, the cost model and the failure handling.

    Parameters
    ----------
    size : int
        Virtual ranks (>= 1).
    fn : callable
        ``fn(comm, *args, **kwargs)``, ``comm`` a :class:`VirtualComm` over all ranks. Runs in
        one greenlet per rank; module globals are shared between ranks (use :func:`module_copy`
        for programs written against a module-level communicator).
    network : Network or None
        Message costs (default ``Network()``).
    timeout_s : float or None
        Wall-clock limit; past it, every rank ends at its next communication call and
        :class:`VirtualTimeout` is raised. A rank that never communicates again is not
        interrupted (the ranks share one thread; tests guard with pytest-timeout).
    trace : bool
        Record each rank's compute / wait / message intervals in ``RankStats.events``.
    payloads : bool
        False: typed buffers (``Isend``/``Irecv``, ``Allreduce``, ``Allgather(v)``, ``Bcast``
        and their nonblocking forms) carry their sizes only, for cost-only runs whose array
        values mean nothing (:mod:`mgnn.studies.costs`): a received message is zeros, a collective
        leaves the receive buffers as they are, nothing is copied or added (a run of 4096
        ranks each holding a whole coarse MGRIT level then fits in memory). Pickled objects are
        always delivered. Sizes, matching, clocks and statistics are the same as with payloads
        as long as no control flow depends on array values (MGRIT with ``tol = 0``: fixed
        cycles; with ``tol > 0`` a residual reduction returns each rank's own value).

    Returns
    -------
    VirtualResults
        The return values in rank order (a list), with ``stats`` (:class:`RankStats` per rank)
        and ``time`` (the largest final clock).

    Raises
    ------
    The exception a rank raised (a note names the rank); :class:`VirtualAbort`,
    :class:`VirtualDeadlock`, :class:`VirtualTimeout`; ``KeyboardInterrupt`` on Ctrl-C.
    """
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
        raise ValueError(f"size must be an int >= 1, got {size!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    network = Network() if network is None else network
    if not isinstance(network, Network):
        raise TypeError(f"network must be a Network, got {type(network).__name__}")
    if timeout_s is not None and not (isinstance(timeout_s, numbers.Real) and timeout_s > 0):
        raise ValueError(f"timeout_s must be None or > 0 seconds, got {timeout_s!r}")
    if getattr(_local, "rank", None) is not None:
        raise RuntimeError("run_virtual cannot be called from inside a virtual rank")
    world = _World(int(size), network, bool(trace))
    world.payloads = bool(payloads)
    world.warnings = _warning_state()  # every rank starts with the caller's
    world.fn, world.args, world.kwargs = fn, args, kwargs
    ctx = world.new_context("world")
    group = tuple(range(world.size))  # one tuple shared by every rank's world comm
    for r in world.ranks:
        r.comm = VirtualComm(world, ctx, group, r.index, r)
    if timeout_s is not None:
        world.timeout_s, world.deadline = timeout_s, time.monotonic() + timeout_s
    try:
        try:
            world.schedule(world.deadline)
        except BaseException as exc:  # noqa: B036 -- in the loop itself (e.g. Ctrl-C there)
            if world.failure is None:
                kind = "interrupt" if isinstance(exc, KeyboardInterrupt) else "exception"
                world.failure = (kind, None, exc)
            world.schedule(None)  # every rank unwinds (VirtualStop) and frees what it holds
            raise
    finally:
        _set_warning_state(world.warnings)
    if world.failure is not None:
        kind, rank, exc = world.failure
        if kind == "exception":
            exc.add_note(f"raised on virtual rank {rank} of {world.size} (mgnn.comm.virtual)")
            raise exc
        if kind == "interrupt":
            raise exc
        if kind == "abort":
            raise VirtualAbort(f"virtual rank {rank} called Abort({exc.errorcode})" + (
                "" if exc.cause is None else
                f" while handling {type(exc.cause).__name__}: {exc.cause}"),
                rank, exc.errorcode) from exc.cause
        raise exc
    return VirtualResults([r.result for r in world.ranks], [r.stats for r in world.ranks],
                          network)


def module_copy(name, **overrides):
    """A private copy of module ``name``, executed afresh from its source (not the one in
    ``sys.modules``), its globals then updated with ``overrides``.

    How a program written against module-level globals runs on virtual ranks: one copy per
    rank, e.g. ``module_copy("tests.mpi.mpi_cases", COMM=comm, RANK=comm.Get_rank(),
    SIZE=comm.Get_size())`` inside ``fn``; its functions then see this rank's communicator.
    Its module-level code runs with the real globals first (e.g. ``MPI.COMM_WORLD``).
    """
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ValueError(f"module_copy: no module named {name!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.__dict__.update(overrides)
    return module
