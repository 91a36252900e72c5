"""BLAS thread pools of this process (threadpoolctl), and one BLAS thread inside Numba's
parallel loops.

mgnn's dense kernels call BLAS through ``np.dot`` (Numba: SciPy's ``cython_blas``). Inside a
``prange`` loop every Numba thread makes its own calls, so a BLAS that starts threads of its own
oversubscribes the cores: on 2 cores with OpenBLAS's default 2 threads, a dense MGRIT solve
(N = 256, w = 64, B = 128) whose chains ran in parallel took 180 ms against 12 ms with one BLAS
thread. :func:`one_blas_thread` sets every loaded BLAS to one thread for the duration of such a
call and puts the counts back after, so the parallel drivers are safe whatever the process's
BLAS setting (:func:`mgnn.comm.configure_threads` sets the counts for a whole run).
:func:`solve_blas_context` holds them at one for a whole MGRIT solve, so that the solve's serial
kernel calls do not switch the pools back in between (an uncaptured solve: 40 ms with each
parallel call guarded, 16 ms guarded as a whole).

The counts are process-wide: a count changed inside the context is overwritten on exit, and
two Python threads solving at once may restore the counts while the other is still inside
(slower, never wrong). threadpoolctl is a dependency of mgnn; without it nothing is limited.
"""
import contextlib
import os
import sys

_CONTROLLERS = {}  # the BLAS controllers found at a count of loaded modules (scans are slow)


def blas_controllers(load_numba_blas=False):
    """threadpoolctl controllers of every loaded BLAS (cached until a module is imported; [] if
    threadpoolctl is missing); with ``load_numba_blas`` first load the one Numba's ``np.dot``
    calls (SciPy's ``scipy.linalg.cython_blas``) so it is found too."""
    if load_numba_blas:
        try:
            import scipy.linalg.cython_blas  # noqa: F401
        except ImportError:
            pass
    # a new library comes with a new module (a BLAS loaded through ctypes alone is not seen)
    if _CONTROLLERS.get("modules") != len(sys.modules):
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:
            found = []
        else:
            found = ThreadpoolController().select(user_api="blas").lib_controllers
        _CONTROLLERS.update(modules=len(sys.modules), blas=found)
    return _CONTROLLERS["blas"]


@contextlib.contextmanager
def one_blas_thread():
    """Context: every loaded BLAS runs one thread inside it; the counts that were higher are
    restored on exit (a few microseconds when every BLAS already has one thread). Numba's BLAS
    (SciPy's, which Numba loads at its first ``np.dot``) is loaded first, so it is limited too."""
    lowered = []
    try:
        for ctl in blas_controllers(True):
            n = ctl.num_threads
            if n > 1:
                ctl.set_num_threads(1)
                lowered.append((ctl, n))
        yield
    finally:
        restore(lowered)


def solve_blas_context(bk, blas_in_threads=True):
    """The context a propagator on backend ``bk`` runs a solve in: :func:`one_blas_thread` when
    its kernels call BLAS from Numba's threads (``blas_in_threads``: the propagator's, e.g. a
    dense stacked solve, and the backend's flag) and Numba has more than one thread now, else
    nothing."""
    if blas_in_threads and getattr(bk, "blas_in_threads", False):
        import numba
        if numba.get_num_threads() > 1:
            return one_blas_thread()
    return contextlib.nullcontext()


def snapshot():
    """The BLAS counts now, for :func:`restore` (every loaded BLAS, Numba's included)."""
    return [(ctl, ctl.num_threads) for ctl in blas_controllers(True)]


def restore(saved):
    """Set the BLAS counts back to a :func:`snapshot`."""
    for ctl, n in saved:
        ctl.set_num_threads(n)


#: OpenBLAS kernel sets (threadpoolctl's ``architecture``) that use AVX-512.
AVX512_CORES = ("SkylakeX", "Cooperlake", "SapphireRapids")
#: The AVX-512 subset OpenBLAS's SkylakeX kernels need.
AVX512_FLAGS = ("avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl")


def cpu_flags(path="/proc/cpuinfo"):
    """Set of the first CPU's flags in ``path`` (empty where unreadable: not Linux)."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return set(value.split())
    except OSError:
        pass
    return set()


def blas_kernels():
    """[(library file name, version, kernel architecture, threads)] of every loaded BLAS,
    Numba's included ([] without threadpoolctl)."""
    return [(os.path.basename(c.filepath), getattr(c, "version", None) or "?",
             getattr(c, "architecture", None) or "?", c.num_threads)
            for c in blas_controllers(True)]


def blas_advice(kernels=None, flags=None, environ=None):
    """A warning line when OpenBLAS runs kernels without AVX-512 on a CPU that has it because
    ``OPENBLAS_CORETYPE`` says so (every BLAS call -- dense layers, GRU gates, NumPy -- runs
    at half the width; the conv core used BLAS until its SIMD tiles and measured 2.7-3.4x
    slower per kernel with ``Haswell`` on a Zen 5), else None.
    mgnn never overrides the variable: a user or site that set it keeps it."""
    environ = os.environ if environ is None else environ
    core = environ.get("OPENBLAS_CORETYPE")
    flags = cpu_flags() if flags is None else flags
    if not core or not all(f in flags for f in AVX512_FLAGS):
        return None
    kernels = blas_kernels() if kernels is None else kernels
    slow = sorted({arch for lib, _, arch, _ in kernels
                   if "openblas" in lib.lower() and arch not in AVX512_CORES})
    if not slow:
        return None
    return (f"OPENBLAS_CORETYPE={core} runs OpenBLAS's {'/'.join(slow)} kernels (no AVX-512) on "
            "this AVX-512 CPU: mgnn's dense and recurrent kernels (every BLAS call) run slower "
            "than with OpenBLAS's own choice; unset it (or set SkylakeX) before Python starts unless it is there on "
            "purpose")
