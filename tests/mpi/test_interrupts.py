"""An interrupt or exit on one rank ends every rank with a non-zero status (real ``mpiexec``),
and the failure handling behind it (``abort_on_error`` on a stand-in communicator)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from mgnn.comm import layout
from mgnn.comm.layout import abort_on_error

from .test_mpi import HAVE_MPI, MPIEXEC, REPO

pytestmark = pytest.mark.mpi
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="mpi4py/mpiexec not installed")

STARTUP_S = 150  # every rank started and stepping (loaded machine)
END_S = 30  # after the interrupt, the whole job has ended


def _wait_for(paths, proc, limit):
    t0 = time.monotonic()
    while not all(os.path.exists(p) for p in paths):
        if proc.poll() is not None or time.monotonic() - t0 > limit:
            return False
        time.sleep(0.1)
    return True


def _kill_all(proc, workdir, ranks):
    """Kill mpiexec and every rank that wrote its pid (the ranks run in their own sessions)."""
    proc.kill()
    for r in range(ranks):
        try:
            with open(os.path.join(workdir, f"pid.{r}")) as f:
                os.kill(int(f.read()), signal.SIGKILL)
        except (OSError, ValueError):
            pass
    proc.wait()


def _run(tmp_path, kind, action, ranks, data_ranks, victim):
    """Start the case, act once every rank is stepping; (exit status, stderr)."""
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=REPO)
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen(
            [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "tests.mpi.interrupt_cases",
             str(tmp_path), kind, action, str(data_ranks), str(victim)],
            cwd=REPO, env=env, stdout=out, stderr=err)
    try:
        ready = _wait_for([tmp_path / f"ready.{r}" for r in range(ranks)], proc, STARTUP_S)
        assert ready, f"not every rank started stepping: {(tmp_path / 'err').read_text()[-3000:]}"
        if action == "sigint":
            os.kill(int((tmp_path / f"pid.{victim}").read_text()), signal.SIGINT)
        else:
            (tmp_path / "go").write_text("")
        try:
            rc = proc.wait(timeout=END_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{kind} {action} on rank {victim} of {ranks}: the other ranks hang; "
                        f"stderr: {(tmp_path / 'err').read_text()[-3000:]}")
    finally:
        if proc.poll() is None:
            _kill_all(proc, tmp_path, ranks)
    return rc, (tmp_path / "err").read_text()


@needs_mpi
@pytest.mark.parametrize("kind, action, ranks, data_ranks, victim", [
    ("network", "sigint", 2, 1, 1),
    ("network", "sigint", 4, 2, 2),
    ("solver", "keyboard", 2, 1, 1),
    ("network", "keyboard", 4, 2, 3),
    ("solver", "exit0", 2, 1, 0),
    ("network", "exit", 4, 2, 1),
    ("network", "uncaught", 2, 1, 1),
    ("solver", "uncaught", 2, 1, 0),
])
def test_interrupt_or_exit_on_one_rank_ends_every_rank(tmp_path, kind, action, ranks,
                                                       data_ranks, victim):
    rc, err = _run(tmp_path, kind, action, ranks, data_ranks, victim)
    assert rc != 0, err[-3000:]
    name = "SystemExit" if action.startswith("exit") else "KeyboardInterrupt"
    assert f"rank {victim}: {name}" in err, err[-3000:]
    assert f"aborting all {ranks} ranks" in err, err[-3000:]


class Aborted(BaseException):
    """Raised by FakeComm.Abort in place of ending the process."""


class FakeComm:
    """A 2-rank communicator stand-in that records Abort's status."""

    def __init__(self):
        self.aborted = []

    def Get_size(self):
        return 2

    def Get_rank(self):
        return 1

    def Abort(self, status):
        self.aborted.append(status)
        raise Aborted


def _escaping(comm, exc):
    """What leaves ``abort_on_error(comm, "t")`` when its block raises ``exc``."""
    try:
        with abort_on_error(comm, "t"):
            raise exc
    except BaseException as out:  # noqa: B036 -- a KeyboardInterrupt must not end pytest
        return out


def _numba_style_interrupt():
    """The SystemError a Ctrl-C inside a Numba parallel kernel surfaces as."""
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as ki:
            raise SystemError("<numba dispatcher> returned a result with an exception set") \
                from ki
    except SystemError as exc:
        return exc


@pytest.mark.parametrize("exc, status", [
    (KeyboardInterrupt(), 130), (SystemExit(0), 1), (SystemExit(None), 1), (SystemExit(3), 3),
    (SystemExit("bye"), 1), (SystemExit(True), 1), (RuntimeError("x"), 1),
    (_numba_style_interrupt(), 130), (SystemError("other"), 1)])
def test_every_exit_aborts_with_a_nonzero_status(exc, status, capsys):
    comm = FakeComm()
    assert isinstance(_escaping(comm, exc), Aborted)
    assert comm.aborted == [status] and layout.exit_status(exc) == status
    err = capsys.readouterr().err
    name = "KeyboardInterrupt" if status == 130 else type(exc).__name__
    assert f"t: rank 1: {name}" in err and f"aborting all 2 ranks (exit status {status})" in err


def test_second_interrupt_while_aborting_still_aborts(monkeypatch):
    """SIGINT is ignored once aborting; an interrupt while reporting cannot skip the Abort."""
    comm = FakeComm()
    installed = []
    monkeypatch.setattr(signal, "signal", lambda sig, handler: installed.append((sig, handler)))

    class Interrupting:
        def write(self, text):
            raise KeyboardInterrupt

    monkeypatch.setattr(sys, "stderr", Interrupting())
    assert isinstance(_escaping(comm, SystemExit(0)), Aborted)
    # (before it, entering the block may install the counting SIGINT handler)
    assert installed[-1] == (signal.SIGINT, signal.SIG_IGN) and comm.aborted == [1]
    assert all(h is layout._counting_int_handler for _, h in installed[:-1])


def test_serial_interrupt_in_a_kernel_is_a_keyboard_interrupt():
    exc = _numba_style_interrupt()
    assert layout.interrupt_behind(exc) is exc.__cause__
    assert layout.interrupt_behind(SystemError()) is None
    assert type(_escaping(None, exc)) is KeyboardInterrupt
    assert type(_escaping(None, SystemError("not an interrupt"))) is SystemError


def _interrupt_swallowed():
    """A Ctrl-C that arrives in code which swallows the KeyboardInterrupt and raises something
    else, as Numba's argument unboxing does ("TypeError: can't unbox ...")."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # (the handler raises at the next bytecode)
    except KeyboardInterrupt:
        raise TypeError("can't unbox a <class 'numba.typed.typedlist.List'> as a <NULL>") \
            from None
    raise AssertionError("no KeyboardInterrupt")


@pytest.mark.parametrize("distributed", [False, True])
def test_an_error_after_a_sigint_is_the_interrupt(distributed, capsys):
    """Any exception raised after a SIGINT reached the block is reported as the interrupt
    (serial: a KeyboardInterrupt caused by it; distributed: status 130); without a SIGINT the
    same TypeError stays a TypeError, and a SIGINT handler of the program's own is kept."""
    saved = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        comm = FakeComm() if distributed else None
        try:
            with abort_on_error(comm, "t"):
                _interrupt_swallowed()
        except BaseException as exc:  # noqa: B036 -- a KeyboardInterrupt must not end pytest
            out = exc
        if distributed:
            assert isinstance(out, Aborted) and comm.aborted == [130]
            assert "t: rank 1: KeyboardInterrupt" in capsys.readouterr().err
        else:
            assert type(out) is KeyboardInterrupt and type(out.__cause__) is TypeError
        signal.signal(signal.SIGINT, signal.default_int_handler)
        assert type(_escaping(comm, TypeError("can't unbox"))) is (
            Aborted if distributed else TypeError)
        if distributed:
            assert comm.aborted == [130, 1]

        def own(signum, frame):
            pass

        signal.signal(signal.SIGINT, own)
        with abort_on_error(None, "t"):
            assert signal.getsignal(signal.SIGINT) is own
    finally:
        signal.signal(signal.SIGINT, saved)


def test_abort_that_returns_still_ends_the_rank_nonzero():
    """MPICH's Abort returns while its launcher kills the job; the rank then ends itself."""
    code = ("import sys; from mgnn.comm.layout import _abort\n"
            "class C:\n Get_rank = Get_size = lambda self: 2\n Abort = lambda self, s: None\n"
            "_abort(C(), SystemExit(0), 't', grace_s=0.1)\nsys.exit(0)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 1 and "t: rank 2: SystemExit" in proc.stderr, proc.stderr
