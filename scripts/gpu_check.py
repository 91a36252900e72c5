#!/usr/bin/env python
"""One-shot GPU check of mgnn: environment, GPU tests, benchmarks and the CLI, in one table.

Run it on a machine with a CUDA GPU (an H200 session has about 15 minutes of device time; this
script plans for at most ``--budget`` seconds, default 480, and a watchdog ends it at budget + 45 s
whatever happens, still printing the table)::

    python scripts/gpu_check.py --out $OUT/gpu_check.json          # full run (~5-8 min)
    python scripts/gpu_check.py --quick --skip-tests --skip-cli    # benchmarks only (~1-2 min)
    python scripts/gpu_check.py --emulate --out /tmp/x.json        # no GPU: the same code paths on
                                                                   # the CPU at tiny sizes

Sections (each check guarded: an exception becomes a FAIL row and the rest still runs):

1. env    GPU, CUDA runtime/driver, package versions, CUDA-aware MPI (asked in a subprocess so this
          process never initialises MPI before it launches mpiexec itself).
2. tests  ``python -m pytest -q -m gpu tests`` in a subprocess; passed/failed/skipped counts.
3. bench  a. fused dense step forward (RawKernel) vs matmul + a separate elementwise epilogue;
          a'. a stacked relaxation wave, fused kernel vs cuBLAS + epilogue, over widths 64-1024:
             the measured crossover for ``MGNN_GEMM_MIN_WIDTH``;
          a''. the conv kernels (forward + state vjp + kernel gradient) vs cuDNN (or im2col +
             cuBLAS where CuPy cannot load cuDNN) at C 8/16/32 28x28 B 32 and 3D 16^3 B 8;
          b. Numba CUDA memory-bound kernels (axpy, sq_norm, residual, correct) as effective
             bandwidth vs a device-to-device copy;
          c. one training step: MGRIT with stacked level states vs layer-by-layer serial
             forward + backward on the same device, and RawKernel launches per step;
          d. (section 4 in the table) ``python -m mgnn train --backend cuda`` on one GPU and under
             ``mpiexec -n 2 ... --layer-ranks 2``; captured CUDA graphs on 2 layer ranks against
             the uncaptured run (``tests/mpi/graph_cases.py``).
5. cpu    the predictor against real ``mpiexec -n P`` MGRIT steps on the machine's cores
          (``scripts/validate_predictor.py``: P = 4, 8, 16 as the cores allow, 2 and 8 layers per
          rank, 3 and 5 levels, dense w 64 B 128): one row per point, PASS within 25 %.

Statuses: PASS, FAIL (an error, or a wrong result), MISS (ran, but a performance target was not
met), INFO (measured, no target), SKIP. The exit code is 1 if any check FAILed (``--strict``: or
MISSed a target), 2 without a GPU (and without ``--emulate``), else 0. The table is printed last as
GitHub markdown and written as JSON to ``--out`` (atomically, after every check, so a killed run
still leaves what it measured).

``--emulate`` runs the very same functions with the ``cuda-emulated`` backend (the RawKernels
compiled for the host), NumPy in place of CuPy, the Numba CUDA kernels under the CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``, set before Numba is imported) and tiny sizes; performance targets are
then informational only, and the pytest and CLI sections are skipped.
"""
import argparse
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Table sections, in print order.
SECTIONS = ("env", "tests", "bench", "cli", "cpu")
SECTION_TITLES = {"env": "1 env", "tests": "2 tests", "bench": "3 bench", "cli": "4 cli",
                  "cpu": "5 cpu"}

T0 = time.perf_counter()
_LOG_LOCK = threading.Lock()


def log(msg):
    """One progress line: wall clock, seconds since start, message (flushed)."""
    with _LOG_LOCK:
        print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------

def fmt_seconds(s):
    if s is None or not math.isfinite(s):
        return str(s)
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def fmt_rate(bytes_per_s):
    if bytes_per_s >= 1e12:
        return f"{bytes_per_s / 1e12:.2f} TB/s"
    return f"{bytes_per_s / 1e9:.3g} GB/s"


def fmt_bytes(n):
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def fmt_flops(flops_per_s):
    if flops_per_s >= 1e12:
        return f"{flops_per_s / 1e12:.3g} TFLOP/s"
    return f"{flops_per_s / 1e9:.3g} GFLOP/s"


def _cell(text, limit=160):
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[:limit - 3] + "..."


class Report:
    """The rows of the summary table; written to ``path`` as JSON after every change."""

    def __init__(self, path, meta):
        self.path, self.meta, self.rows = path, meta, []
        self.current = "startup"
        self._lock = threading.Lock()

    def add(self, id, section, check, value=None, display=None, unit="", target="-",
            status="INFO", detail=""):
        """Append one row. ``value`` is the number (seconds, B/s, a ratio...) or None."""
        if display is None:
            display = "-" if value is None else (f"{value:.3g}{unit}" if isinstance(value, float)
                                                 else f"{value}{unit}")
        row = {"id": id, "section": section, "check": check, "value": value, "display": display,
               "unit": unit, "target": target, "status": status, "detail": detail}
        with self._lock:
            self.rows.append(row)
        log(f"{status:<4} {check}: {display}" + (f"  (target {target})" if target != "-" else "")
            + (f"  [{detail}]" if detail and status == "FAIL" and detail != display else ""))
        self.write()
        return row

    def fail(self, id, section, check, exc):
        msg = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        return self.add(id, section, check, display=msg, status="FAIL", detail=msg)

    def skip(self, id, section, check, why):
        return self.add(id, section, check, display=f"skipped: {why}", status="SKIP", detail=why)

    def counts(self):
        out = {k: 0 for k in ("PASS", "FAIL", "MISS", "INFO", "SKIP")}
        for r in self.rows:
            out[r["status"]] = out.get(r["status"], 0) + 1
        return out

    def as_dict(self):
        return {**self.meta, "elapsed_s": round(time.perf_counter() - T0, 2),
                "counts": self.counts(), "rows": list(self.rows)}

    def write(self):
        """Atomically (temp file + os.replace) write the JSON; never raises."""
        if not self.path:
            return
        try:
            folder = os.path.dirname(os.path.abspath(self.path))
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".gpu_check.", suffix=".json", dir=folder)
            with os.fdopen(fd, "w") as fh:
                json.dump(self.as_dict(), fh, indent=1, default=str)
            os.replace(tmp, self.path)
        except Exception as exc:  # noqa: BLE001 -- the report must not break the run
            log(f"could not write {self.path}: {exc}")

    def table(self):
        order = {s: i for i, s in enumerate(SECTIONS)}
        rows = sorted(self.rows, key=lambda r: order.get(r["section"], len(order)))
        lines = ["| check | value | target | status |", "|---|---|---|---|"]
        for r in rows:
            name = f"{SECTION_TITLES.get(r['section'], r['section'])}: {r['check']}"
            lines.append(f"| {_cell(name, 90)} | {_cell(r['display'])} | {_cell(r['target'], 40)}"
                         f" | {r['status']} |")
        return "\n".join(lines)


def guarded(rep, id, section, check, fn, *args, **kwargs):
    """Run one check; an exception becomes a FAIL row (with a traceback in the log)."""
    rep.current = f"{section}: {check}"
    log(f"--- {check}")
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 -- one failed check must not stop the others
        log("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip())
        rep.fail(id, section, check, exc)
        return None


def target_status(value, minimum, setup):
    """PASS / MISS against ``value >= minimum`` on a GPU; INFO when emulated."""
    if setup.emulated:
        return "INFO"
    return "PASS" if value >= minimum else "MISS"


# ---------------------------------------------------------------------------------------------
# setup: everything that differs between the GPU and the emulated run
# ---------------------------------------------------------------------------------------------

@dataclass
class Setup:
    emulated: bool
    backend: str              # 'cuda' or 'cuda-emulated'
    xp: object                # cupy or numpy
    sync: object              # waits for the device (no-op when emulated)
    repeats: int
    warmup: int
    min_time: float           # each timing sample loops the call until it lasts this long
    dense: tuple              # (batch, width) of the fused dense step benchmark
    mem_elems: int            # entries of the memory-bound benchmark arrays
    numba_threads: object     # threads per block of the Numba CUDA kernels (None: keep)
    train: dict               # n_layers, width, batch, cf
    cleanup: object = field(default=lambda: None)
    budget: float = 480.0

    def remaining(self):
        return self.budget - (time.perf_counter() - T0)

    @property
    def array_kind(self):
        return "numpy" if self.xp.__name__ == "numpy" else "cupy"


def make_setup(args):
    import numpy as np
    if args.emulate:
        return Setup(emulated=True, backend="cuda-emulated", xp=np, sync=lambda: None,
                     repeats=1, warmup=1, min_time=0.0, dense=(8, 8), mem_elems=64,
                     numba_threads=32, train=dict(n_layers=16, width=8, batch=8, cf=4),
                     budget=args.budget)
    import cupy
    stream_sync = lambda: cupy.cuda.get_current_stream().synchronize()  # noqa: E731
    pool = cupy.get_default_memory_pool()
    return Setup(emulated=False, backend="cuda", xp=cupy, sync=stream_sync,
                 repeats=3 if args.quick else 7, warmup=2, min_time=0.02 if args.quick else 0.05,
                 dense=(1024, 1024), mem_elems=1 << 28, numba_threads=None,
                 train=dict(n_layers=1024, width=64, batch=64, cf=4),
                 cleanup=pool.free_all_blocks, budget=args.budget)


def median_times(fns, sync, repeats, warmup, min_time, host=None):
    """Median seconds per call of each ``fns[name]()``, samples interleaved between the functions
    (so clock or thermal drift hits all alike); the device is synchronised before and after each
    sample only, and each sample loops the call until it lasts ``min_time``.

    ``host``, a dict, receives the median host seconds per call: the time until the sample's last
    call returned, before the closing synchronisation. Asynchronous launches return at once, so
    host < wall means the device is the bottleneck; host ~ wall means the host (Python dispatch,
    or a synchronising call) sets the pace."""
    import statistics
    for f in fns.values():
        for _ in range(warmup):
            f()
        sync()
    inner = {}
    for name, f in fns.items():
        sync()
        t0 = time.perf_counter()
        f()
        sync()
        inner[name] = max(1, int(min_time / max(time.perf_counter() - t0, 1e-7)))
    samples = {name: [] for name in fns}
    hosts = {name: [] for name in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            n = inner[name]
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                f()
            t1 = time.perf_counter()
            sync()
            samples[name].append((time.perf_counter() - t0) / n)
            hosts[name].append((t1 - t0) / n)
    if host is not None:
        host.update({name: float(statistics.median(v)) for name, v in hosts.items()})
    return {name: float(statistics.median(v)) for name, v in samples.items()}


# ---------------------------------------------------------------------------------------------
# 1. environment
# ---------------------------------------------------------------------------------------------

def _dist_version(name):
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cupy_dists():
    from importlib import metadata
    names = sorted({(d.metadata["Name"] or "") for d in metadata.distributions()})
    return [f"{n} {_dist_version(n)}" for n in names if n.lower().startswith("cupy")]


MPI_PROBE = r"""
import json
from mpi4py import MPI
from mgnn.comm.device import cuda_aware_mpi
aware, reason = cuda_aware_mpi()
lib = MPI.Get_library_version().strip().splitlines()[0]
print("MGNN_MPI_PROBE " + json.dumps({"aware": bool(aware), "reason": reason, "library": lib}))
"""


def section_env(rep, st):
    S = "env"

    def gpu():
        if st.emulated:
            rep.skip("env.gpu", S, "GPU", "emulated run (no device used)")
            return
        import cupy
        rt = cupy.cuda.runtime
        props = rt.getDeviceProperties(0)
        name = props["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        cc = cupy.cuda.Device(0).compute_capability
        mem = props.get("totalGlobalMem", 0) / 2**30
        mode = {0: "default", 1: "exclusive-thread", 2: "prohibited",
                3: "exclusive-process"}.get(props.get("computeMode"), props.get("computeMode"))
        rep.add("env.gpu", S, "GPU", display=f"{name}, sm_{cc}, {mem:.0f} GiB, "
                f"{rt.getDeviceCount()} device(s), compute mode {mode}", status="PASS")
        if mode != "default":
            log("warning: the GPU is not in the default compute mode; the pytest and CLI "
                "subprocesses may not get a context while this process holds one")

        def ver(v):
            return f"{v // 1000}.{(v % 1000) // 10}"
        rep.add("env.cuda", S, "CUDA runtime / driver",
                display=f"runtime {ver(rt.runtimeGetVersion())}, "
                        f"driver {ver(rt.driverGetVersion())}")

    def versions():
        import numpy
        parts = [f"python {sys.version.split()[0]}", f"numpy {numpy.__version__}"]
        parts += _cupy_dists() or ["cupy: not installed"]
        for d in ("numba", "numba-cuda", "mpi4py", "mgnn"):
            parts.append(f"{d} {_dist_version(d) or 'not installed'}")
        rep.add("env.versions", S, "package versions", display=", ".join(parts))

    def nvcc():
        import shutil
        path = shutil.which("nvcc")
        rep.add("env.nvcc", S, "nvcc", display=path or "not on PATH")

    def mpi():
        res = run_cmd([sys.executable, "-c", MPI_PROBE], timeout=min(60, max(5, st.remaining())),
                      echo=False)
        line = next((ln for ln in res.lines if ln.startswith("MGNN_MPI_PROBE ")), None)
        if line is None:
            raise RuntimeError(f"MPI probe failed (rc {res.rc}): {res.tail(3)}")
        info = json.loads(line.split(" ", 1)[1])
        rep.add("env.mpi", S, "CUDA-aware MPI", value=info["aware"],
                display=f"{'yes' if info['aware'] else 'no'}: {info['reason']} "
                        f"[{info['library']}]")

    guarded(rep, "env.gpu", S, "GPU", gpu)
    guarded(rep, "env.versions", S, "package versions", versions)
    guarded(rep, "env.nvcc", S, "nvcc", nvcc)
    guarded(rep, "env.mpi", S, "CUDA-aware MPI", mpi)


# ---------------------------------------------------------------------------------------------
# subprocesses
# ---------------------------------------------------------------------------------------------

_CHILD = [None]


@dataclass
class CmdResult:
    rc: object        # exit code, None when killed on timeout
    lines: list
    timed_out: bool
    seconds: float

    def tail(self, n=5):
        return " / ".join(ln.strip() for ln in self.lines[-n:] if ln.strip())

    def error(self):
        """The most telling line of a failed run: the last exception or 'error:' line (the
        output's last lines when there is none)."""
        for pat in (r"\w(Error|Exception)\b|error:", r"Abort|abort|Killed|Segmentation|timeout"):
            for ln in reversed(self.lines):
                if re.search(pat, ln) and not ln.strip().startswith(("File ", "^", "raise ")):
                    return ln.strip()
        return self.tail(3)


def _kill(proc):
    """End ``proc`` and its process group (it was started in a new session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass


def child_env():
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("NUMBA_ENABLE_CUDASIM", None)  # children see the real device (or none)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # GPU machines often run as root with Open MPI, whose mpiexec refuses root without these
        # (seen on the H200 image: Debian Open MPI 4.1.6); MPICH ignores them
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    # Open MPI counts physical cores as slots: a VM's hardware threads count too (the CPU
    # section runs mpiexec -n 16 on 16 logical CPUs); MPICH ignores it
    env.setdefault("OMPI_MCA_hwloc_base_use_hwthreads_as_cpus", "1")
    return env


def run_cmd(cmd, timeout, echo=True, env=None):
    """Run ``cmd`` in the repository root (stderr merged into stdout), echoing its lines as
    progress; killed with its process group after ``timeout`` seconds."""
    log(f"$ {shlex.join(cmd)}   (timeout {timeout:.0f} s)")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env or child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True)
    _CHILD[0] = proc
    lines = []

    def pump():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if echo:
                log("  | " + line.rstrip()[:200])

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill(proc)
        proc.wait()
    finally:
        _CHILD[0] = None
    reader.join(5)
    return CmdResult(None if timed_out else proc.returncode, lines, timed_out,
                     time.perf_counter() - t0)


def _budgeted(st, nominal, reserve=30):
    """Timeout for a subprocess: ``nominal`` or what the time budget leaves (None: too little)."""
    left = st.remaining() - reserve
    return None if left < 20 else min(nominal, left)


# ---------------------------------------------------------------------------------------------
# 2. GPU tests
# ---------------------------------------------------------------------------------------------

_PYTEST_WORDS = ("passed", "failed", "skipped", "deselected", "errors", "error", "xfailed",
                 "xpassed", "warnings", "warning")


def parse_pytest_summary(lines):
    """Counts of pytest's final summary line (``3 passed, 1 skipped in 2.0s``) as a dict with the
    keys passed, failed, skipped, deselected, errors, xfailed, xpassed (0 when absent); None if no
    summary line is found."""
    pat = re.compile(r"(\d+) (" + "|".join(_PYTEST_WORDS) + r")\b")
    for line in reversed(lines):
        found = pat.findall(line)
        if found and (" in " in line or line.strip().startswith("=")):
            counts = dict.fromkeys(("passed", "failed", "skipped", "deselected", "errors",
                                    "xfailed", "xpassed"), 0)
            for n, word in found:
                word = {"error": "errors", "warning": "warnings"}.get(word, word)
                if word in counts:
                    counts[word] += int(n)
            return counts
        if "no tests ran" in line:
            return dict.fromkeys(("passed", "failed", "skipped", "deselected", "errors",
                                  "xfailed", "xpassed"), 0)
    return None


def section_tests(rep, st, args):
    S, ID, CHECK = "tests", "tests.gpu", "pytest -m gpu tests"
    if st.emulated:
        return rep.skip(ID, S, CHECK, "emulated run")
    if args.skip_tests:
        return rep.skip(ID, S, CHECK, "--skip-tests")
    timeout = _budgeted(st, args.tests_timeout, reserve=150 if not args.skip_cli else 20)
    if timeout is None:
        return rep.skip(ID, S, CHECK, "time budget used up")

    def run():
        res = run_cmd([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p",
                       "no:cacheprovider", "tests"], timeout)
        counts = parse_pytest_summary(res.lines)
        failures = [ln.strip() for ln in res.lines if ln.startswith(("FAILED ", "ERROR "))][:5]
        if res.timed_out:
            msg = f"timed out after {timeout:.0f} s" + (f"; so far {counts}" if counts else "")
            return rep.add(ID, S, CHECK, display=msg, status="FAIL",
                           detail=msg + "; " + res.tail(5))
        if counts is None:
            msg = f"no pytest summary line (rc {res.rc}): {res.error()}"
            return rep.add(ID, S, CHECK, display=msg, status="FAIL", detail=msg)
        text = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
                f"{counts['skipped']} skipped ({res.seconds:.0f} s)")
        ok = (res.rc == 0 and counts["failed"] == 0 and counts["errors"] == 0
              and counts["passed"] > 0)
        if failures:
            text += "; " + "; ".join(failures)
        rep.add(ID, S, CHECK, value=counts["passed"], display=text,
                target="all pass, none skipped" if counts["skipped"] == 0 else "all pass",
                status="PASS" if ok else "FAIL", detail=json.dumps(counts))
        if counts["skipped"] and ok:
            log(f"note: {counts['skipped']} GPU tests were skipped on a GPU machine")

    guarded(rep, ID, S, CHECK, run)


# ---------------------------------------------------------------------------------------------
# 3. benchmarks
# ---------------------------------------------------------------------------------------------

def bench_dense(rep, st, dtype, target):
    """3a: the fused RawKernel ``dense_forward`` (GEMM + bias + tanh + residual in one launch)
    against ``xp.matmul`` plus a separate elementwise epilogue, same shape and dtype."""
    import numpy as np
    from mgnn.backend import get_backend
    S = "bench"
    xp, bk = st.xp, get_backend(st.backend)
    B, w = st.dense
    dt = np.dtype(dtype)
    tag = f"dense fwd {dt.name} w={w} B={B}"
    rng = np.random.default_rng(0)
    x = xp.asarray(rng.standard_normal((B, w)).astype(dt))
    W = xp.asarray((rng.standard_normal((w, w)) / np.sqrt(w)).astype(dt))
    b = xp.asarray((0.1 * rng.standard_normal(w)).astype(dt))
    h = dt.type(0.1)

    def fused():
        return bk.dense_forward(x, W, b, h, 0, True)

    def unfused():
        z = xp.matmul(x, W.T)
        return x + h * xp.tanh(z + b)

    log(f"{tag}: first calls (compile kernels)")
    y1, y0 = fused(), unfused()
    st.sync()
    scale = float(xp.abs(y0).max())
    err = float(xp.abs(y1 - y0).max()) / max(scale, 1e-30)
    tol = 1e-4 if dt == np.float32 else 1e-10
    rep.add(f"bench.dense.{dt.name}.error", S, f"{tag}: fused == matmul + epilogue",
            value=err, display=f"max rel. diff {err:.2e}", target=f"<= {tol:g}",
            status="PASS" if err <= tol else "FAIL")
    t = median_times({"fused": fused, "unfused": unfused}, st.sync, st.repeats, st.warmup,
                     st.min_time)
    flops = 2.0 * B * w * w
    for key, label in (("fused", "fused dense_forward (RawKernel)"),
                       ("unfused", f"{st.array_kind}.matmul + elementwise epilogue")):
        rep.add(f"bench.dense.{dt.name}.{key}_s", S, f"{tag}: {label}", value=t[key], unit="s",
                display=f"{fmt_seconds(t[key])} ({fmt_flops(flops / t[key])})")
    ratio = t["unfused"] / t["fused"]
    rep.add(f"bench.dense.{dt.name}.ratio", S, f"{tag}: throughput fused / unfused", value=ratio,
            unit="x", display=f"{ratio:.3g}x",
            target=f">= {target}" if target else "info",
            status=target_status(ratio, target, st) if target else "INFO")


def _conv_baseline(xp, nd):
    """(name, fwd(x, K) -> z, bwd_data(s, K) -> conv^T, bwd_filter(x, s) -> gK) of the vendor
    library a user would pick: cuDNN through CuPy's binding where it loads, else im2col + one
    ``xp.matmul`` (cuBLAS on a GPU) per convolution. Zero padding 1, stride 1, no bias."""
    pad, one = (1,) * nd, (1,) * nd
    try:
        if xp.__name__ == "numpy":
            raise ImportError("no cuDNN without a GPU")
        from cupyx import cudnn  # needs libcudnn on the machine

        def fwd(x, K):
            y = xp.empty((x.shape[0], K.shape[0]) + x.shape[2:], x.dtype)
            cudnn.convolution_forward(x, K, None, y, pad, one, one, 1, auto_tune=True,
                                      tensor_core="never")
            return y

        def bwd_data(s, K):
            gx = xp.empty((s.shape[0], K.shape[1]) + s.shape[2:], s.dtype)
            cudnn.convolution_backward_data(K, s, None, gx, pad, one, one, 1, deterministic=True,
                                            auto_tune=True, tensor_core="never")
            return gx

        def bwd_filter(x, s):
            gK = xp.empty((s.shape[1], x.shape[1]) + (3,) * nd, x.dtype)
            cudnn.convolution_backward_filter(x, s, gK, pad, one, one, 1, deterministic=True,
                                              auto_tune=True, tensor_core="never")
            return gK

        x0 = xp.ones((1, 1) + (3,) * nd, xp.float32)
        fwd(x0, xp.ones((1, 1) + (3,) * nd, xp.float32))  # raises here if cuDNN is missing
        return "cuDNN (cupyx.cudnn)", fwd, bwd_data, bwd_filter
    except Exception:  # noqa: BLE001 -- no cuDNN: the cuBLAS baseline
        pass

    def cols(x):  # (B, C, *S) -> (C taps, B prod(S)) of the zero-padded input
        B, C = x.shape[:2]
        S = x.shape[2:]
        xp_ = xp.pad(x, [(0, 0), (0, 0)] + [(1, 1)] * nd)
        taps = []
        for t in range(3 ** nd):
            off = [(t // 3 ** (nd - 1 - a)) % 3 for a in range(nd)]
            sl = tuple(slice(o, o + n) for o, n in zip(off, S))
            taps.append(xp_[(slice(None), slice(None)) + sl])
        c = xp.stack(taps, axis=2)  # (B, C, T, *S)
        return c.reshape(B, C * 3 ** nd, -1).transpose(1, 0, 2).reshape(C * 3 ** nd, -1)

    def rows(a):  # (B, C, *S) -> (C, B prod(S))
        return a.reshape(a.shape[0], a.shape[1], -1).transpose(1, 0, 2).reshape(a.shape[1], -1)

    def back(z, shape):  # (C, B prod(S)) -> (B, C, *S)
        return xp.ascontiguousarray(z.reshape((shape[1], shape[0]) + shape[2:]).swapaxes(0, 1))

    def fwd(x, K):
        z = xp.matmul(K.reshape(K.shape[0], -1), cols(x))
        return back(z, (x.shape[0], K.shape[0]) + x.shape[2:])

    def bwd_data(s, K):
        Kf = xp.flip(K, axis=tuple(range(2, 2 + nd))).swapaxes(0, 1)
        return fwd(s, xp.ascontiguousarray(Kf))

    def bwd_filter(x, s):
        return xp.matmul(rows(s), cols(x).T).reshape((s.shape[1], x.shape[1]) + (3,) * nd)

    return f"im2col + {'cuBLAS' if xp.__name__ != 'numpy' else 'NumPy'} matmul", fwd, bwd_data, \
        bwd_filter


def bench_conv(rep, st):
    """3a'': the conv step's three convolutions (forward with the fused epilogue and sigma',
    state vjp, kernel + bias gradient) of the cuda backend against the vendor library (cuDNN
    where CuPy loads it, else im2col + cuBLAS) at the issue's shapes, float32 relu: results
    checked against each other first, then timed side by side; ratio = vendor time / mgnn time
    (> 1: mgnn faster)."""
    import numpy as np
    from mgnn.backend import get_backend
    S = "bench"
    xp, bk = st.xp, get_backend(st.backend)
    dt = np.dtype(np.float32)
    h = dt.type(0.1)
    shapes = ([(2, 3, (5, 6)), (2, 3, (3, 4, 3))] if st.emulated else
              [(32, 8, (28, 28)), (32, 16, (28, 28)), (32, 32, (28, 28)), (8, 8, (16, 16, 16)),
               (8, 16, (16, 16, 16))])
    rng = np.random.default_rng(0)
    for B, C, spatial in shapes:
        nd = len(spatial)
        name, fwd, bwd_data, bwd_filter = _conv_baseline(xp, nd)
        tag = f"conv{nd}d C={C} {'x'.join(map(str, spatial))} B={B} float32 relu"
        key = f"bench.conv.{nd}d.c{C}"
        x = xp.asarray(rng.standard_normal((B, C) + spatial).astype(dt))
        gy = xp.asarray(rng.standard_normal((B, C) + spatial).astype(dt))
        K = xp.asarray((rng.standard_normal((C, C) + (3,) * nd) / np.sqrt(9 * C)).astype(dt))
        b = xp.asarray((0.1 * rng.standard_normal(C)).astype(dt))
        p = "conv3d_" if nd == 3 else "conv_"
        fwd_deriv, vjp_in, vjp_par = (getattr(bk, p + k) for k in
                                      ("forward_deriv", "vjp_input", "vjp_params"))
        y, d = fwd_deriv(x, K, b, h, 1, True)
        s = d * gy
        checks = {"forward": (y, x + h * xp.maximum(fwd(x, K) + b.reshape((1, C) + (1,) * nd),
                                                    0)),
                  "vjp": (vjp_in(gy, d, K, h, True), gy + h * bwd_data(s, K)),
                  "kgrad": (vjp_par(gy, d, x, h)[0], h * bwd_filter(x, s))}
        st.sync()
        err = max(float(xp.abs(a - r).max()) / max(float(xp.abs(r).max()), 1e-30)
                  for a, r in checks.values())
        rep.add(key + ".error", S, f"{tag}: mgnn == {name}", value=err,
                display=f"max rel. diff {err:.2e}", target="<= 1e-4",
                status="PASS" if err <= 1e-4 else "FAIL")
        fns = {"mgnn": lambda: (fwd_deriv(x, K, b, h, 1, True), vjp_in(gy, d, K, h, True),
                                vjp_par(gy, d, x, h)),
               "vendor": lambda: (fwd(x, K), bwd_data(s, K), bwd_filter(x, s))}
        t = median_times(fns, st.sync, st.repeats, st.warmup, st.min_time)
        flops = 3 * 2.0 * B * C * C * 3 ** nd * int(np.prod(spatial))
        for k, label in (("mgnn", "mgnn RawKernels fwd+vjp+kgrad"), ("vendor", name)):
            rep.add(f"{key}.{k}_s", S, f"{tag}: {label}", value=t[k], unit="s",
                    display=f"{fmt_seconds(t[k])} ({fmt_flops(flops / t[k])})")
        ratio = t["vendor"] / t["mgnn"]
        rep.add(key + ".ratio", S, f"{tag}: {name} time / mgnn time", value=ratio, unit="x",
                display=f"{ratio:.3g}x", target=">= 1 (info)", status="INFO")


def bench_gemm_crossover(rep, st):
    """3a': the width from which a stacked dense wave is faster on cuBLAS (strided-batched GEMM
    + mgnn's epilogue kernel) than in the fused hand-written kernel: one relaxation wave of
    ``count`` steps (``dense_points_forward``, mode 2) at each width, both paths, float32; the
    results must agree. Reports the measured crossover beside ``RawBackend.gemm_min_width``."""
    import numpy as np
    from mgnn.backend import get_backend
    S = "bench"
    xp, bk = st.xp, get_backend(st.backend)
    widths, B, count = ((8, 16), 8, 3) if st.emulated else ((64, 128, 256, 512, 1024), 64, 16)
    dt = np.dtype("float32")
    rng = np.random.default_rng(1)
    default, ratios = bk.gemm_min_width, {}
    try:
        for w in widths:
            tag = f"stacked dense wave w={w} B={B} x{count}"
            U = xp.asarray(rng.standard_normal((count + 1, B, w)).astype(dt))
            W = xp.asarray((rng.standard_normal((count + 1, w, w)) / np.sqrt(w)).astype(dt))
            b = xp.asarray((0.1 * rng.standard_normal((count + 1, w))).astype(dt))
            R = {k: xp.zeros((count, B, w), dt) for k in ("fused", "cublas")}
            slots, outs = np.arange(1, count + 1), np.arange(count)

            def wave(path):
                bk.gemm_min_width = w if path == "cublas" else 1 << 30
                bk.dense_points_forward(U, None, R[path], W, b, slots, outs, 0, 1, dt.type(0.1), 0,
                                        2)

            fns = {k: (lambda k=k: wave(k)) for k in R}
            for f in fns.values():
                f()
            st.sync()
            scale = float(xp.abs(R["fused"]).max())
            err = float(xp.abs(R["cublas"] - R["fused"]).max()) / max(scale, 1e-30)
            rep.add(f"bench.gemm.w{w}.error", S, f"{tag}: cuBLAS path == fused", value=err,
                    display=f"max rel. diff {err:.2e}", target="<= 1e-4",
                    status="PASS" if err <= 1e-4 else "FAIL")
            # the adjoint walks the layers backwards (negative batch stride) through sigma'
            D = xp.asarray(rng.uniform(0, 1, (count + 1, B, w)).astype(dt))
            RA = {}
            for path in ("fused", "cublas"):
                bk.gemm_min_width = w if path == "cublas" else 1 << 30
                RA[path] = xp.zeros((count, B, w), dt)
                bk.dense_points_adjoint(U, None, RA[path], W, D, 0, slots, outs, count, -1,
                                        dt.type(0.1), 2)
            st.sync()
            scale = float(xp.abs(RA["fused"]).max())
            err = float(xp.abs(RA["cublas"] - RA["fused"]).max()) / max(scale, 1e-30)
            rep.add(f"bench.gemm.w{w}.adjoint_error", S, f"{tag}: adjoint (layers backwards) "
                    "cuBLAS path == fused", value=err, display=f"max rel. diff {err:.2e}",
                    target="<= 1e-4", status="PASS" if err <= 1e-4 else "FAIL")
            t = median_times(fns, st.sync, st.repeats, st.warmup, st.min_time)
            ratios[w] = t["fused"] / t["cublas"]
            rep.add(f"bench.gemm.w{w}.ratio", S, f"{tag}: time fused / cuBLAS + epilogue",
                    value=ratios[w], unit="x", display=f"{fmt_seconds(t['fused'])} / "
                    f"{fmt_seconds(t['cublas'])} = {ratios[w]:.3g}x")
    finally:
        bk.gemm_min_width = default
    wins = [w for w in widths if all(ratios[v] > 1.0 for v in widths if v >= w)]
    found = wins[0] if wins else None
    rep.add("bench.gemm.crossover", S, "cuBLAS crossover width (gemm_min_width)",
            value=found, display=f"measured {found if found else 'none up to ' + str(widths[-1])}"
            f"; default {default} (set MGNN_GEMM_MIN_WIDTH)")


def _numba_cuda(st):
    """mgnn.backend.numba_cuda, checked to launch real kernels in this mode (device kernels on a
    GPU, the CUDA simulator when emulated); threads per block set for the mode."""
    from mgnn.backend import numba_cuda as nc
    if st.emulated and not nc._SIM:
        raise RuntimeError("NUMBA_ENABLE_CUDASIM is not active: Numba was imported before the "
                           "script could set it")
    if st.numba_threads is not None:
        nc.THREADS = st.numba_threads
    return nc


def bench_memory(rep, st, target):
    """3b: Numba CUDA memory-bound kernels as effective bandwidth against a device-to-device
    copy (2 accesses per entry) of arrays of the same size."""
    import numpy as np
    S = "bench"
    nc = _numba_cuda(st)
    ops = nc.CudaOps()
    xp = st.xp
    n = st.mem_elems
    dt = np.dtype(np.float32)
    rng = np.random.default_rng(1)
    make = lambda: xp.asarray(rng.standard_normal(n).astype(dt))  # noqa: E731
    a, c, d, e = make(), make(), make(), make()
    dst = xp.empty_like(a)
    if not nc._kernel_ok(a, c, d):
        raise RuntimeError(f"CudaOps would not use its kernels for {type(a).__module__} arrays")
    item = dt.itemsize

    # correctness at this size first (cheap; compiles the kernel), then the timings
    log(f"memory-bound kernels on {n} float32 entries: first calls (compile kernels)")
    r, rr = ops.residual(a, c, d)
    st.sync()
    ref = a - c + d
    ok = (float(xp.abs(r - ref).max()) <= 1e-6 * float(xp.abs(ref).max())
          and abs(rr - float((ref.astype(np.float64) ** 2).sum())) <= 1e-4 * rr)
    rep.add("bench.mem.residual_check", S, "CudaOps.residual == reference (float32)",
            display="ok" if ok else "MISMATCH", target="equal to 1e-6",
            status="PASS" if ok else "FAIL")
    del r, ref

    def copy():
        xp.copyto(dst, a)

    # the reductions are timed as the solver runs them: partial sums added on the device, no
    # device-to-host copy per call (sq_norm()/residual() return a float: one sync each)
    r_out, dv = xp.empty_like(a), nc._dev
    cases = {
        "copy": (copy, 2),
        "axpy": (lambda: nc.axpy(0.5, c, e), 3),
        "sq_norm": (lambda: nc._reduce(nc._sq_norm_kernel, n, a, dv(a), lazy=True), 1),
        "residual": (lambda: nc._reduce(nc._residual_kernel, n, a, dv(a), dv(c), dv(d), True,
                                        dv(r_out), lazy=True), 4),
        "correct": (lambda: ops.correct(a, c, d), 4),
    }
    host = {}
    t = median_times({k: f for k, (f, _) in cases.items()}, st.sync, st.repeats, st.warmup,
                     st.min_time, host=host)
    bw = {k: cases[k][1] * n * item / t[k] for k in cases}
    rep.add("bench.mem.copy_Bps", S, f"device copy of {fmt_bytes(n * item)} float32 (baseline)",
            value=bw["copy"], unit="B/s",
            display=f"{fmt_rate(bw['copy'])} ({fmt_seconds(t['copy'])})")
    for k in ("axpy", "sq_norm", "residual", "correct"):
        ratio = bw[k] / bw["copy"]
        name = {"axpy": "numba_cuda.axpy", "sq_norm": "numba_cuda.sq_norm (lazy sum)",
                "residual": "residual kernel (lazy sum)", "correct": "CudaOps.correct"}[k]
        rep.add(f"bench.mem.{k}.ratio", S,
                f"{name} bandwidth / copy ({cases[k][1]} accesses/entry)",
                value=ratio, unit="x",
                display=f"{ratio:.3g}x ({fmt_rate(bw[k])}, {fmt_seconds(t[k])}; host "
                        f"{fmt_seconds(host[k])}/call)",
                target=f">= {target}", status=target_status(ratio, target, st))
    over = max(host[k] / t[k] for k in cases)
    rep.add("bench.mem.host_share", S, "host dispatch per call / device time per call (worst)",
            value=over, unit="x", display=f"{100 * over:.1f} %"
            + (" (launches overlap the kernels)" if over < 1 else " (host-bound)"), status="INFO")


def _device_inputs(lp, x, y, st):
    """(x, y, note): device arrays when the backend is 'cuda' and LayerParallel accepts them,
    else the NumPy arrays. Makes one (warm-up) call."""
    note = "numpy inputs"
    if st.array_kind != "numpy":
        xd, yd = st.xp.asarray(x), st.xp.asarray(y)
        try:
            lp.loss_and_grad(xd, yd)
            return xd, yd, f"{st.array_kind} inputs"
        except (TypeError, ValueError) as exc:
            note = (f"{st.array_kind} inputs rejected ({type(exc).__name__}: {exc}); "
                    "numpy inputs used")
            log(f"note: {note}")
    lp.loss_and_grad(x, y)
    return x, y, note


def bench_train(rep, st, target):
    """3c: one training step (loss_and_grad) by MGRIT with stacked level states against
    layer-by-layer serial forward + backward, same model, same device."""
    import numpy as np
    import mgnn
    from mgnn import MGRITOptions
    S = "bench"
    p = st.train
    N, w, B, cf = p["n_layers"], p["width"], p["batch"], p["cf"]
    tag = f"train step N={N} w={w} B={B} float32"
    model = mgnn.dense_resnet(w, w, 10, N, dtype="float32", seed=0)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((B, w)).astype(np.float32)
    y = rng.integers(0, 10, B).astype(np.int64)
    fwd = MGRITOptions(cf=cf, max_levels=3, max_iter=2, tol=0.0)
    bwd = MGRITOptions(cf=cf, max_levels=3, max_iter=1, tol=0.0)
    lps = {"mgrit": mgnn.LayerParallel(model, fwd=fwd, bwd=bwd, backend=st.backend,
                                        guard=None),
           "mgrit_nographs": mgnn.LayerParallel(model, fwd=fwd, bwd=bwd, backend=st.backend,
                                                capture=False, guard=None),
           "serial": mgnn.LayerParallel(model, backend=st.backend)}
    bk = lps["mgrit"].bk
    launcher = getattr(bk, "launcher", None)
    calls, notes, launches, losses = {}, {}, {}, {}
    for k, lp in lps.items():
        log(f"{tag}: first {k} step (compiles kernels)")
        xi, yi, notes[k] = _device_inputs(lp, x, y, st)
        calls[k] = (lambda lp=lp, xi=xi, yi=yi: lp.loss_and_grad(xi, yi))
        st.sync()
        before = getattr(launcher, "launches", None)
        losses[k] = float(calls[k]()[0])
        st.sync()
        if before is not None:
            launches[k] = launcher.launches - before
    host = {}
    t = median_times(calls, st.sync, st.repeats, st.warmup, st.min_time, host=host)
    try:  # private, informational only: which storage the MGRIT solves used
        engine = lps["mgrit"]._solver("forward", fwd).engine
        batched = "stacked states" if engine.stacked else f"list, batched {engine.batched}"
    except Exception:  # noqa: BLE001
        batched = None
    res = lps["mgrit"].stats.get("forward", {}).get("residuals", [])
    from mgnn.mgrit import level_sizes
    sizes = level_sizes(N, cf, fwd.max_levels, fwd.min_coarse)
    # the cycles captured as CUDA graphs (the default) against the engine's launches
    graphs = sum(len(s._graphs) for s in lps["mgrit"]._solvers.values())
    (la, ga), (lb, gb) = (lps[k].loss_and_grad(xi, yi) for k in ("mgrit", "mgrit_nographs"))
    st.sync()
    diff = max([abs(float(la) - float(lb))] + [float(abs(ga[k] - gb[k]).max()) for k in ga])
    rep.add("bench.train.graphs_equal", S, f"{tag}: MGRIT step with cycles as CUDA graphs == "
            "without", value=diff, display=f"max abs diff {diff:.3g} ({graphs} graph keys)",
            target="0 (the same kernels)", status="PASS" if diff == 0 else "FAIL")
    for k, label in (("mgrit", f"MGRIT cf={cf} levels {sizes}, 2 fwd / 1 adj cycles"
                      f" (relaxation: {batched}; cycles as CUDA graphs where supported)"),
                     ("mgrit_nographs", "the same MGRIT step, every cycle through the engine"),
                     ("serial", "serial layer by layer")):
        extra = f", {launches[k]} RawKernel launches" if k in launches else ""
        if notes[k] != f"{st.array_kind} inputs":
            extra += f"; {notes[k]}"
        rep.add(f"bench.train.{k}_s", S, f"{tag}: {label}", value=t[k], unit="s",
                display=f"{fmt_seconds(t[k])}/step (host {fmt_seconds(host[k])}){extra}",
                detail=notes[k]
                + (f"; loss {losses[k]:.6g}" if k in losses else "")
                + (f"; forward residuals {[float(f'{r:.3g}') for r in res]}" if k == "mgrit"
                   else ""))
    speedup = t["serial"] / t["mgrit"]
    rep.add("bench.train.speedup", S, f"{tag}: speedup MGRIT vs serial", value=speedup, unit="x",
            display=f"{speedup:.3g}x", target=f">= {target}",
            status=target_status(speedup, target, st))
    if launches:
        rep.add("bench.train.launches", S, f"{tag}: RawKernel launches per step (MGRIT / serial)",
                value=launches.get("mgrit"),
                display=f"{launches.get('mgrit')} / {launches.get('serial')} "
                        "(Numba CUDA vector kernels not counted)")
    else:
        rep.add("bench.train.launches", S, f"{tag}: kernel launches per step",
                display="not available (backend has no launcher.launches)")


def section_bench(rep, st, args):
    S = "bench"
    for id, check, fn, extra in (
            ("bench.dense.float32", "3a fused dense step float32", bench_dense, ("float32", 0.8)),
            ("bench.dense.float64", "3a fused dense step float64", bench_dense, ("float64", None)),
            ("bench.gemm", "3a' cuBLAS crossover of stacked waves", bench_gemm_crossover, ()),
            ("bench.conv", "3a'' conv kernels vs cuDNN", bench_conv, ()),
            ("bench.mem", "3b memory-bound Numba CUDA kernels", bench_memory, (0.8,)),
            ("bench.train", "3c training step MGRIT vs serial", bench_train, (3.0,))):
        guarded(rep, id, S, check, fn, rep, st, *extra)
        try:
            st.cleanup()  # the arrays of the check are gone: give their memory back
        except Exception as exc:  # noqa: BLE001
            rep.fail(id + ".cleanup", S, check + ": free device memory", exc)


# ---------------------------------------------------------------------------------------------
# 4. CLI
# ---------------------------------------------------------------------------------------------

def backend_choices_from_help(text):
    """The choices of ``--backend {a,b}`` in an argparse help text ([] if not found)."""
    m = re.search(r"--backend \{([^}]*)\}", text)
    return [c.strip() for c in m.group(1).split(",")] if m else []


def parse_train_output(lines):
    """(summary dict of ``--json`` or None, the 'final test accuracy' line or None)."""
    summary = None
    for ln in lines:
        s = ln.strip()
        if s.startswith("{") and "test_accuracy" in s:
            try:
                summary = json.loads(s)
            except ValueError:
                pass
    final = next((ln.strip() for ln in reversed(lines) if "final test accuracy" in ln), None)
    return summary, final


CLI_TRAIN_ARGS = ["--data", "synthetic", "--layers", "16", "--width", "32", "--epochs", "1",
                  "--batch-size", "32", "--levels", "2", "--cf", "4", "--no-progress", "--json"]


def section_cli(rep, st, args):
    import shutil
    S = "cli"
    checks = (("cli.single", "train --backend cuda, 1 process"),
              ("cli.mpi2", "mpiexec -n 2 train --backend cuda --layer-ranks 2 (one GPU)"))
    if st.emulated or args.skip_cli:
        for id, check in checks:
            rep.skip(id, S, check, "emulated run" if st.emulated else "--skip-cli")
        return
    state = {}

    def help_check():
        res = run_cmd([sys.executable, "-m", "mgnn", "train", "--help"], timeout=60, echo=False)
        choices = backend_choices_from_help("\n".join(res.lines))
        state["choices"] = choices
        if res.rc != 0 or not choices:
            raise RuntimeError(f"`python -m mgnn train --help` failed (rc {res.rc}): "
                               f"{res.tail(3)}")

    guarded(rep, "cli.help", S, "train --help", help_check)
    mpiexec = (shutil.which("mpiexec", path=os.path.dirname(sys.executable))
               or shutil.which("mpiexec"))
    base = [sys.executable, "-m", "mgnn", "train", "--backend", "cuda", *CLI_TRAIN_ARGS]
    cmds = {"cli.single": base,
            "cli.mpi2": [mpiexec, "-n", "2", *base, "--layer-ranks", "2"] if mpiexec else None}
    for id, check in checks:
        choices = state.get("choices")
        if choices is not None and "cuda" not in choices:
            msg = (f"the CLI has no --backend cuda (choices: {', '.join(choices)}); not run")
            rep.add(id, S, check, display=msg, target="exit 0", status="FAIL", detail=msg)
            continue
        if cmds[id] is None:  # a prerequisite of the check is missing, not a GPU failure
            rep.skip(id, S, check, "no mpiexec next to the interpreter or on PATH")
            continue
        timeout = _budgeted(st, args.cli_timeout, reserve=10)
        if timeout is None:
            rep.skip(id, S, check, "time budget used up")
            continue

        def one(id=id, check=check):
            env = child_env()
            env.setdefault("NUMBA_NUM_THREADS", "1")
            env.setdefault("OMP_NUM_THREADS", "1")
            res = run_cmd(cmds[id], timeout, env=env)
            summary, final = parse_train_output(res.lines)
            if res.timed_out:
                msg = f"timed out after {timeout:.0f} s: {res.tail(3)}"
                return rep.add(id, S, check, display=msg, target="exit 0", status="FAIL",
                               detail=msg)
            if res.rc != 0 or summary is None:
                msg = f"rc {res.rc}: {res.error()}"
                return rep.add(id, S, check, display=msg, target="exit 0", status="FAIL",
                               detail=msg)
            acc = float(summary["test_accuracy"])
            rep.add(id, S, check, value=acc, display=f"{final or f'accuracy {100 * acc:.1f}%'}"
                    f" [{res.seconds:.0f} s]", target="exit 0", status="PASS",
                    detail=json.dumps(summary))

        guarded(rep, id, S, check, one)

    graph_check = "captured CUDA graphs on 2 layer ranks (one GPU) vs uncaptured, bit for bit"
    timeout = _budgeted(st, args.cli_timeout, reserve=10)
    if mpiexec is None or timeout is None:
        rep.skip("cli.graphs2", S, graph_check,
                 "no mpiexec" if mpiexec is None else "time budget used up")
        return

    def graphs():  # tests/mpi/graph_cases.py: 4 SGD steps, float64, dense, redundant coarsest
        env = child_env()
        env.setdefault("NUMBA_NUM_THREADS", "1")
        res = run_cmd([mpiexec, "-n", "2", sys.executable,
                       os.path.join(REPO, "tests", "mpi", "graph_cases.py"), "dense",
                       "redundant"], timeout, env=env)
        got = next((json.loads(ln) for ln in reversed(res.lines) if ln.startswith("{")), None)
        if res.rc != 0 or got is None:
            msg = f"rc {res.rc}: {res.error()}"
            return rep.add("cli.graphs2", S, graph_check, display=msg, target="equal",
                           status="FAIL", detail=msg)
        ok = (got["same_as_uncaptured"] and got["max_diff_numba"] <= 1e-12
              and got["graph_launches"] > 0 and not got["fake_cupy"])
        rep.add("cli.graphs2", S, graph_check, value=got["max_diff_numba"],
                display=f"same as uncaptured: {got['same_as_uncaptured']}, vs numba "
                        f"{got['max_diff_numba']:.1e}, {got['graph_launches']} graph launches, "
                        f"up to {got['max_graphs_per_cycle']} graphs per cycle",
                target="bitwise; numba <= 1e-12", status="PASS" if ok else "FAIL",
                detail=json.dumps(got))

    guarded(rep, "cli.graphs2", S, graph_check, graphs)


# ---------------------------------------------------------------------------------------------
# 5. the predictor against real mpiexec runs on this machine's cores
# ---------------------------------------------------------------------------------------------

#: ``scripts/validate_predictor.py``'s grid on the GPU machine (its 16 cores: one per rank)
#: (one mpiexec run a point: a core per rank there, and the budget is short)
CPU_GRID = ("--per-rank", "2,8", "--levels", "3,5", "--repeats", "5", "--launches", "1")


def section_cpu(rep, st, args, grid=CPU_GRID):
    """``scripts/validate_predictor.py`` at P = 4, 8, 16 (those the cores allow, one core per
    rank), within the time budget; one row per measured point (PASS: prediction within 25 %)."""
    import shutil
    S, ID, CHECK = "cpu", "cpu.validate", "predictor vs mpiexec (validate_predictor.py)"
    if args.skip_cpu or (st.emulated and not args.cpu_ranks):
        return rep.skip(ID, S, CHECK, "--skip-cpu" if args.skip_cpu else "emulated run")
    from mgnn.studies.predict import _cores
    cores = _cores()  # (this process's CPUs: affinity, as the validation counts them)
    wanted = args.cpu_ranks or (4, 8, 16)
    # the largest P first: the points nothing else can measure, before the budget runs out
    ranks = sorted((P for P in wanted if P <= cores), reverse=True)
    if not ranks:
        return rep.skip(ID, S, CHECK, f"{cores} cores: no P of {', '.join(map(str, wanted))} "
                        "has a core per rank")
    if shutil.which("mpiexec", path=os.path.dirname(sys.executable)) is None and \
            shutil.which("mpiexec") is None:
        return rep.skip(ID, S, CHECK, "no mpiexec next to the interpreter or on PATH")
    timeout = _budgeted(st, args.cpu_timeout, reserve=15)
    if timeout is not None and timeout < 60:
        timeout = None  # (calibration alone takes ~20 s: too little for a point)
    if timeout is None:
        return rep.skip(ID, S, CHECK, "time budget used up")
    out = tempfile.mkdtemp(prefix="gpu_check_cpu.")
    cmd = [sys.executable, os.path.join(REPO, "scripts", "validate_predictor.py"),
           "--ranks", ",".join(map(str, ranks)), *grid, "--out", out,
           "--budget", f"{max(timeout - 40, 10):.0f}"]

    def run():
        env = child_env()
        res = run_cmd(cmd, timeout, env=env)
        try:
            with open(os.path.join(out, "validate_grid.json")) as fh:
                doc = json.load(fh)
        except (OSError, ValueError):
            doc = None
        if doc is None or not (doc["rows"] or doc.get("failed")):
            why = "timed out" if res.timed_out else f"rc {res.rc}"
            raise RuntimeError(f"no point measured ({why}): {res.error()}")
        for f in doc.get("failed", []):
            P, n, L = f["point"]
            rep.add(f"cpu.P{P}.n{n}.L{L}", S, f"P={P} ({n} layers/rank, {L} levels)",
                    display=f["error"], target="|error| <= 25%", status="FAIL",
                    detail=f["error"])
        if res.timed_out or (res.rc != 0 and not doc.get("failed")):
            msg = ("timed out" if res.timed_out else f"rc {res.rc}") + f": {res.error()}"
            rep.add(ID, S, CHECK, display=msg, status="FAIL", detail=msg)
        for r in doc["rows"]:
            err = r["error"]
            rep.add(f"cpu.P{r['ranks']}.n{r['layers_per_rank']}.L{r['levels']}", S,
                    f"P={r['ranks']} ({r['layers_per_rank']} layers/rank, {r['levels']} levels)"
                    f"{' oversubscribed' if r['oversubscribed'] else ''}", value=err,
                    display=f"measured {1e3 * r['measured_s']:.3f} ms, predicted "
                    f"{1e3 * r['predicted_s']:.3f} ms ({100 * err:+.1f}%), bound "
                    f"{1e3 * r['bound_s']:.3f} ms", target="|error| <= 25%",
                    status="PASS" if abs(err) <= 0.25 else "MISS", detail=json.dumps(r))
        if doc.get("not_measured"):
            rep.add(ID, S, CHECK, display=f"{len(doc['not_measured'])} points not measured "
                    f"(time budget)", status="INFO")

    guarded(rep, ID, S, CHECK, run)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_check.json", help="JSON report (default gpu_check.json)")
    p.add_argument("--quick", action="store_true", help="fewer timing repeats")
    p.add_argument("--skip-tests", action="store_true", help="skip the pytest -m gpu section")
    p.add_argument("--skip-cli", action="store_true", help="skip the CLI section")
    p.add_argument("--emulate", action="store_true",
                   help="no GPU: cuda-emulated backend, NumPy, Numba CUDA simulator, tiny sizes")
    p.add_argument("--strict", action="store_true", help="a missed performance target also "
                   "makes the exit code 1")
    p.add_argument("--budget", type=float, default=480.0,
                   help="seconds the run plans for (subprocess timeouts shrink to fit; a watchdog "
                        "ends the run at budget + 45 s; default 480)")
    p.add_argument("--tests-timeout", type=float, default=240.0, help="pytest timeout (s)")
    p.add_argument("--cli-timeout", type=float, default=120.0, help="timeout per CLI run (s)")
    p.add_argument("--skip-cpu", action="store_true",
                   help="skip the CPU section (the predictor against real mpiexec runs)")
    p.add_argument("--cpu-timeout", type=float, default=150.0,
                   help="timeout of the CPU section (s)")
    p.add_argument("--cpu-ranks", type=lambda t: tuple(int(v) for v in t.split(",")),
                   default=None, help="P of the CPU section (default 4,8,16 as cores allow; "
                   "given, it also runs when emulated)")
    return p.parse_args(argv)


def finish(rep, args, reason=None):
    """Print the summary table, write the JSON, return the exit code."""
    c = rep.counts()
    rep.meta["finished"] = reason or "completed"
    rep.write()
    print("", flush=True)
    print(f"## mgnn gpu_check ({rep.meta['mode']}) - {rep.meta['finished']}", flush=True)
    print("", flush=True)
    print(rep.table(), flush=True)
    print("", flush=True)
    print(f"{c['PASS']} pass, {c['FAIL']} fail, {c['MISS']} missed targets, {c['INFO']} info, "
          f"{c['SKIP']} skipped; {time.perf_counter() - T0:.0f} s; JSON: "
          f"{os.path.abspath(args.out) if args.out else '-'}", flush=True)
    failed = c["FAIL"] > 0 or (args.strict and c["MISS"] > 0)
    return 1 if failed else 0


def _watchdog(rep, args, seconds):
    def fire():
        log(f"WATCHDOG: {seconds:.0f} s exceeded while in '{rep.current}'; ending the run")
        if _CHILD[0] is not None:
            _kill(_CHILD[0])
        rep.add("watchdog", "env", "watchdog", display=f"run exceeded {seconds:.0f} s in "
                f"'{rep.current}'", status="FAIL")
        code = finish(rep, args, reason=f"watchdog after {seconds:.0f} s")
        os._exit(code or 1)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def main(argv=None):
    args = parse_args(argv)
    if args.emulate:
        # before Numba is first imported (by mgnn): the Numba CUDA kernels run in the simulator
        if "numba" in sys.modules and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
            log("warning: numba already imported; the CUDA simulator cannot be enabled")
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    if REPO not in sys.path:
        sys.path.insert(0, REPO)  # check this checkout's mgnn
    mode = "emulated" if args.emulate else "gpu"
    rep = Report(args.out, {"mode": mode, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                            "argv": sys.argv[1:], "budget_s": args.budget})
    log(f"mgnn gpu_check: mode {mode}, budget {args.budget:.0f} s, repo {REPO}")
    from mgnn.backend import gpu_available
    if not args.emulate and not gpu_available():
        try:
            import cupy
            why = f"CuPy {cupy.__version__} is installed but cupy.cuda.is_available() is False"
            why += " (no device or driver)"
        except Exception as exc:  # noqa: BLE001
            why = f"CuPy cannot be imported ({type(exc).__name__}: {exc})"
        print(f"gpu_check: no CUDA GPU here: {why}.\n"
              f"Run it on a GPU machine, or pass --emulate to check this script on the CPU "
              f"(cuda-emulated backend, tiny sizes).", file=sys.stderr, flush=True)
        rep.meta["mode"] = "no-gpu"
        rep.add("env.gpu", "env", "GPU", display=f"none: {why}", status="FAIL")
        rep.write()
        return 2
    _watchdog(rep, args, args.budget + 45)
    st = guarded(rep, "setup", "env", "setup", make_setup, args)
    if st is None:
        return finish(rep, args)
    log(f"backend {st.backend}, arrays {st.array_kind}, dense {st.dense}, "
        f"memory {st.mem_elems} entries, train {st.train}, {st.repeats} repeats")
    section_env(rep, st)
    section_bench(rep, st, args)   # first: in-process, the most wanted numbers
    section_tests(rep, st, args)   # subprocesses: isolated from any device error above
    section_cli(rep, st, args)
    section_cpu(rep, st, args)     # what is left: the one place P = 16 has a core per rank
    return finish(rep, args)


if __name__ == "__main__":
    sys.exit(main())
