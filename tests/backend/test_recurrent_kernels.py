"""Recurrent gate kernels (mgnn.backend.RECURRENT_KERNELS): every kernel x backend x dtype x mode
x dt against plain NumPy formulas written here, central differences proving that the vjp kernels
are the exact vjps of the forward kernels, PyTorch's GRU step at dt = 1 to round-off, and whole
2-layer GRU / RNN sequence models (numpy GEMMs + the kernels, backpropagation through time)
against the PyTorch reference cases in ../shared/reference/torch."""
import os

import numpy as np
import pytest

from mgnn.backend import RECURRENT_KERNELS, available_backends, get_backend
from tests.backend.test_bn_kernels import call_kernel, poisoned_backend
from tests.conftest import SHARED, assert_close

DTYPES = ["float32", "float64"]
#: (B, H): odd sizes, H = 1, B = 1, and B H spanning several grid-stride passes of the emulation
#: (8 x 8 threads) and of the GPU geometry capped at 4 blocks (1024 threads).
SHAPES = [(7, 5), (13, 1), (1, 3), (4, 33), (9, 130)]
TORCH = os.path.join(SHARED, "reference", "torch")

BACKENDS = [pytest.param(b, marks=pytest.mark.gpu) if b == "cuda" else b
            for b in available_backends()]
BACKENDS.insert(2, "numba-parallel")
if "cuda-emulated" in available_backends():
    BACKENDS.append("cuda-emulated-gpu-geometry")
_made = {}


class _ParallelNumba:
    """The numba backend with every call on its prange driver (whatever the size and threads)."""

    xp = np

    def __getattr__(self, name):
        from mgnn.backend import numba_cpu

        def call(*args):  # the recurrent module reads _gates: patch it there
            mod = numba_cpu.recurrent
            serial, mod._gates = mod._gates, mod._gates_par
            try:
                return getattr(numba_cpu, name)(*args)
            finally:
                mod._gates = serial
        return call


def _backend(name):
    return poisoned_backend(name, _made, {"numba-parallel": _ParallelNumba})


_call = call_kernel


# ------------------------------------------------------------------ the formulas (float64)
def _sig(x):
    return 0.5 * (1 + np.tanh(x / 2))  # = 1 / (1 + exp(-x)), no overflow


def _f64(*arrays):
    return [np.asarray(a, dtype=np.float64) for a in arrays]


def gru_formula(gi, gh, h, dt, mode):
    """(h_next, r, z, n, gh_n) in float64."""
    gi, gh, h = _f64(gi, gh, h)
    (ir, iz, i_n), (hr, hz, hn) = np.split(gi, 3, axis=1), np.split(gh, 3, axis=1)
    r, z = _sig(ir + hr), _sig(iz + hz)
    n = np.tanh(i_n + r * hn)
    a = dt * (1 - z)
    h_next = (h + a * n) / (1 + a) if mode == 1 else h + a * (n - h)
    return h_next, r, z, n, hn


def gru_vjp_formula(g, gi, gh, h, dt, mode):
    """(dh, dgi, dgh) from the partial derivatives of h' in (h, z, n), in float64."""
    g, = _f64(g)
    h_next, r, z, n, hn = gru_formula(gi, gh, h, dt, mode)
    pre_n = np.split(np.asarray(gi, dtype=np.float64), 3, axis=1)[2] + r * hn
    a = dt * (1 - z)
    if mode == 1:  # h' = (h + a n) / (1 + a): dh'/da = (n - h') / (1 + a)
        d_h, d_n, d_z = 1 / (1 + a), a / (1 + a), -dt * (n - h_next) / (1 + a)
    else:
        d_h, d_n, d_z = 1 - a, a, -dt * (n - np.asarray(h, dtype=np.float64))
    pn = g * d_n / np.cosh(pre_n) ** 2
    pr, pz = pn * hn * r * (1 - r), g * d_z * z * (1 - z)
    return g * d_h, np.hstack([pr, pz, pn]), np.hstack([pr, pz, pn * r])


def rnn_formula(gi, gh, h, dt):
    gi, gh, h = _f64(gi, gh, h)
    t = np.tanh(gi + gh)
    return h + dt * (t - h), 1 / np.cosh(gi + gh) ** 2


def _case(rng, B, H, dt, width=3):
    """gi, gh (B, width H) with a few saturating entries, h, g (B, H)."""
    gi, gh = (2 * rng.standard_normal((B, width * H)) for _ in range(2))
    gi.flat[::7] = 30 * np.sign(gi.flat[::7])
    h, g = rng.standard_normal((B, H)), rng.standard_normal((B, H))
    return [a.astype(dt) for a in (gi, gh, h, g)]


# ---------------------------------------------------------------------------------- tests
def test_every_backend_has_the_recurrent_kernels():
    for name in available_backends():
        bk = get_backend(name)
        assert [k for k in RECURRENT_KERNELS if not callable(getattr(bk, k, None))] == [], name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gate_kernels_against_the_formulas(backend, dtype, shape, rng):
    bk, dt, (B, H) = _backend(backend), np.dtype(dtype), shape
    gi, gh, h, g = _case(rng, B, H, dt)
    for mode in (0, 1):
        for step in (1.0, 4.0):
            what = f"mode={mode} dt={step}"
            h_next, cache = _call(bk, "gru_gates_forward", gi, gh, h, step, mode)
            want = gru_formula(gi, gh, h, step, mode)
            assert cache.shape == (B, 4, H)
            assert_close(h_next, want[0], dt, f"h_next {what}")
            for k, name in enumerate("r z n gh_n".split()):
                assert_close(cache[:, k], want[k + 1], dt, f"{name} {what}")
            got = _call(bk, "gru_gates_vjp", g, h, cache, step, mode)
            for a, w, name in zip(got, gru_vjp_formula(g, gi, gh, h, step, mode),
                                  ("dh", "dgi", "dgh")):
                assert_close(a, w, dt, f"{name} {what}")
    ri, rh = gi[:, :H].copy(), gh[:, :H].copy()
    for step in (1.0, 4.0):
        h_next, deriv = _call(bk, "rnn_gates_forward", ri, rh, h, step)
        want_h, want_d = rnn_formula(ri, rh, h, step)
        assert_close(h_next, want_h, dt, f"rnn h_next dt={step}")
        assert_close(deriv, want_d, dt, f"rnn deriv dt={step}")
        dh, da = _call(bk, "rnn_gates_vjp", g, h, deriv, step)
        assert_close(dh, (1 - step) * g.astype(np.float64), dt, f"rnn dh dt={step}")
        assert_close(da, step * np.multiply(g, deriv, dtype=np.float64), dt, f"rnn da dt={step}")


def _loss(bk, kernel, g, *args):
    """L() = sum g * (first output of kernel(*args)), reading the arrays in ``args`` at call time."""
    return lambda: float((g * _call(bk, kernel, *args)[0]).sum())


def _fd(arr, loss, eps=1e-6):
    g = np.empty(arr.shape)
    for i in np.ndindex(arr.shape):
        old = arr[i]
        arr[i] = old + eps
        up = loss()
        arr[i] = old - eps
        g[i] = (up - loss()) / (2 * eps)
        arr[i] = old
    return g


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("step", [1.0, 4.0])
def test_vjp_kernels_are_the_vjps_of_the_forward_kernels(backend, mode, step, rng):
    """Central differences (float64) of L = sum g * h_next(gi, gh, h) through each backend's own
    forward kernel against its vjp kernel: dgi, dgh and dh_direct (gh held fixed)."""
    bk = _backend(backend)
    gi, gh, h, g = _case(rng, 3, 4, np.float64)
    gi.flat[::7] /= 10  # saturated gates have tiny derivatives: keep them visible to the FD
    cache = _call(bk, "gru_gates_forward", gi, gh, h, step, mode)[1]
    got = _call(bk, "gru_gates_vjp", g, h, cache, step, mode)
    loss = _loss(bk, "gru_gates_forward", g, gi, gh, h, step, mode)
    for a, arr, what in zip(got, (h, gi, gh), ("dh", "dgi", "dgh")):
        want = _fd(arr, loss)
        np.testing.assert_allclose(a, want, rtol=1e-6, atol=1e-8 * np.abs(want).max(),
                                   err_msg=what)
    ri, rh = gi[:, :4].copy(), gh[:, :4].copy()
    deriv = _call(bk, "rnn_gates_forward", ri, rh, h, step)[1]
    dh, da = _call(bk, "rnn_gates_vjp", g, h, deriv, step)
    loss = _loss(bk, "rnn_gates_forward", g, ri, rh, h, step)
    for a, arr, what in ((dh, h, "rnn dh"), (da, ri, "rnn da (gi)"), (da, rh, "rnn da (gh)")):
        want = _fd(arr, loss)
        np.testing.assert_allclose(a, want, rtol=1e-6, atol=1e-8 * np.abs(want).max(),
                                   err_msg=what)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dt_one_is_pytorchs_gru_and_rnn_to_round_off(backend, rng):
    """mode 0 at dt = 1 is h' = (1 - z) n + z h (PyTorch) to 1e-15 in float64, from the kernel's
    own gates and from the formula; the RNN at dt = 1 is tanh(gi + gh) to 1e-15."""
    bk = _backend(backend)
    gi, gh, h, _ = _case(rng, 6, 11, np.float64)
    h_next, cache = _call(bk, "gru_gates_forward", gi, gh, h, 1.0, 0)
    r, z, n, _ = (cache[:, k] for k in range(4))
    assert np.abs(h_next - ((1 - z) * n + z * h)).max() <= 1e-15
    _, r, z, n, _ = gru_formula(gi, gh, h, 1.0, 0)
    assert np.abs(h_next - ((1 - z) * n + z * h)).max() <= 1e-15
    a, b = gi[:, :11].copy(), gh[:, :11].copy()
    assert np.abs(_call(bk, "rnn_gates_forward", a, b, h, 1)[0] - np.tanh(a + b)).max() <= 1e-15


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gates_are_stable_for_huge_inputs(backend, dtype):
    """sigmoid and tanh of |x| = 1e4 (exp would overflow): finite gates that are exactly 0 / 1,
    no floating-point warning."""
    dt = np.dtype(dtype)
    gi = np.array([[1e4, -1e4, 1e4, -1e4, 1e4, -1e4]], dt)
    gh, h = np.zeros_like(gi), np.array([[0.5, -0.5]], dt)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        h_next, cache = _call(_backend(backend), "gru_gates_forward", gi, gh, h, 4.0, 1)
    np.testing.assert_array_equal(cache[0, :3], [[1, 0], [1, 0], [1, -1]])  # r, z, n
    np.testing.assert_allclose(h_next, [[0.5, (-0.5 - 4) / 5]], rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_names_the_value(backend):
    bk = _backend(backend)
    gi, h = np.ones((2, 6)), np.ones((2, 2))
    with pytest.raises(ValueError, match=r"gh .*\(2, 6\).*\(2, 5\)"):
        _call(bk, "gru_gates_forward", gi, np.ones((2, 5)), h, 1.0, 0)
    with pytest.raises(ValueError, match="gi .*float64.*float32"):
        _call(bk, "gru_gates_forward", gi.astype(np.float32), gi, h, 1.0, 0)
    with pytest.raises(ValueError, match=r"h must .*\(2, 2, 1\)"):
        _call(bk, "rnn_gates_forward", h, h, np.ones((2, 2, 1)), 1.0)
    with pytest.raises(ValueError, match=r"cache .*\(2, 4, 2\).*\(2, 3, 2\)"):
        _call(bk, "gru_gates_vjp", h, h, np.ones((2, 3, 2)), 1.0, 0)
    for dt in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"dt .*{dt}"):
            _call(bk, "rnn_gates_vjp", h, h, h, dt)
    with pytest.raises(TypeError, match="dt .*'1'"):
        _call(bk, "rnn_gates_forward", h, h, h, "1")
    with pytest.raises(ValueError, match="mode .*2"):
        _call(bk, "gru_gates_forward", gi, gi, h, 1.0, 2)


# ------------------------------------------------- whole sequence models against PyTorch
def _cell(bk, kind):
    """(forward(gi, gh, h) -> (h_next, cache), vjp(g, h, cache) -> (dh, dgi, dgh)) at dt = 1."""
    def forward(gi, gh, h):
        if kind == "gru":
            return _call(bk, "gru_gates_forward", gi, gh, h, 1.0, 0)
        return _call(bk, "rnn_gates_forward", gi, gh, h, 1.0)

    def vjp(g, h, cache):
        if kind == "gru":
            return _call(bk, "gru_gates_vjp", g, h, cache, 1.0, 0)
        dh, da = _call(bk, "rnn_gates_vjp", g, h, cache, 1.0)
        return dh, da, da
    return forward, vjp


def sequence_loss_and_grad(bk, kind, params, x, y):
    """Loss, last hidden state and gradients of a stacked GRU / RNN classifier (PyTorch layout,
    batch_first, h0 = 0, affine closing on the last step): GEMMs in NumPy, gate epilogues from
    ``bk``, backpropagation through time with the vjp kernels."""
    fwd, vjp = _cell(bk, kind)
    B, L, _ = x.shape
    seq, tape, n_layers = x, [], sum(k.startswith(f"{kind}.weight_ih") for k in params)
    for layer in range(n_layers):
        W_ih, W_hh, b_ih, b_hh = (params[f"{kind}.{n}_l{layer}"] for n in
                                  ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
        gi_all = seq @ W_ih.T + b_ih  # every step's input projection: one GEMM
        h, hs, steps = np.zeros((B, W_hh.shape[1])), [], []
        for t in range(L):
            h_next, cache = fwd(np.ascontiguousarray(gi_all[:, t]), h @ W_hh.T + b_hh, h)
            steps.append((h, cache))
            h = h_next
            hs.append(h)
        tape.append((seq, steps))
        seq = np.stack(hs, axis=1)
    Wc, bc = params["closing.weight"], params["closing.bias"]
    logits = h @ Wc.T + bc
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    loss = -np.log(p[np.arange(B), y]).mean()
    dlogits = (p - np.eye(p.shape[1])[y]) / B
    grads = {"closing.weight": dlogits.T @ h, "closing.bias": dlogits.sum(axis=0)}
    dseq = np.zeros_like(seq)
    dseq[:, -1] = dlogits @ Wc
    for layer in reversed(range(n_layers)):
        W_ih, W_hh = params[f"{kind}.weight_ih_l{layer}"], params[f"{kind}.weight_hh_l{layer}"]
        inp, steps = tape[layer]
        g, dgi_all = np.zeros_like(dseq[:, 0]), np.zeros((B, L, W_ih.shape[0]))
        gW_hh, gb_hh = np.zeros_like(W_hh), np.zeros(W_hh.shape[0])
        for t in reversed(range(L)):
            h_prev, cache = steps[t]
            dh, dgi, dgh = vjp(np.ascontiguousarray(g + dseq[:, t]), h_prev, cache)
            gW_hh += dgh.T @ h_prev
            gb_hh += dgh.sum(axis=0)
            dgi_all[:, t] = dgi
            g = dh + dgh @ W_hh
        grads.update({f"{kind}.weight_ih_l{layer}": np.einsum("blg,bli->gi", dgi_all, inp),
                      f"{kind}.bias_ih_l{layer}": dgi_all.sum(axis=(0, 1)),
                      f"{kind}.weight_hh_l{layer}": gW_hh, f"{kind}.bias_hh_l{layer}": gb_hh})
        dseq = dgi_all @ W_ih
    return loss, h, grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["gru", "rnn"])
def test_sequence_model_matches_pytorch(backend, kind):
    """2-layer torch.nn.GRU / RNN (float64, L = 10): loss, last hidden state and every gradient
    of ../shared/reference/torch/<kind>_2layer.npz to rtol 1e-10."""
    ref = np.load(os.path.join(TORCH, f"{kind}_2layer.npz"))
    params = {k[6:]: ref[k] for k in ref.files if k.startswith("param/")}
    loss, h, grads = sequence_loss_and_grad(_backend(backend), kind, params, ref["x"], ref["y"])
    np.testing.assert_allclose(loss, ref["loss"], rtol=1e-10)
    np.testing.assert_allclose(h, ref["hidden_last"], rtol=1e-10, atol=1e-14)
    assert set(grads) == set(params)
    for name, g in grads.items():
        want = ref[f"grad/{name}"]
        np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-12 * np.abs(want).max(),
                                   err_msg=name)


def test_gru_step_composed_from_gemms_is_the_written_out_step(rng):
    """One PyTorch GRU step from numpy GEMMs + the numba kernel equals the step written out gate
    by gate (float64); its input, state and weight gradients (vjp kernel + GEMMs) equal central
    differences of the written-out step."""
    B, I, H = 3, 4, 5
    x, h = rng.standard_normal((B, I)), rng.standard_normal((B, H))
    W_ih, W_hh = rng.standard_normal((3 * H, I)), rng.standard_normal((3 * H, H))
    b_ih, b_hh = rng.standard_normal(3 * H), rng.standard_normal(3 * H)
    g = rng.standard_normal((B, H))

    def written_out():
        S = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
        r = S(x @ W_ih[:H].T + b_ih[:H] + h @ W_hh[:H].T + b_hh[:H])
        z = S(x @ W_ih[H:2 * H].T + b_ih[H:2 * H] + h @ W_hh[H:2 * H].T + b_hh[H:2 * H])
        n = np.tanh(x @ W_ih[2 * H:].T + b_ih[2 * H:] + r * (h @ W_hh[2 * H:].T + b_hh[2 * H:]))
        return (1 - z) * n + z * h

    bk = get_backend("numba")
    h_next, cache = bk.gru_gates_forward(x @ W_ih.T + b_ih, h @ W_hh.T + b_hh, h, 1.0, 0)
    np.testing.assert_allclose(h_next, written_out(), rtol=1e-13, atol=1e-15)
    dh, dgi, dgh = bk.gru_gates_vjp(g, h, cache, 1.0, 0)
    loss = lambda: float((g * written_out()).sum())  # noqa: E731
    for got, arr, what in ((dh + dgh @ W_hh, h, "h"), (dgi @ W_ih, x, "x"),
                           (dgi.T @ x, W_ih, "W_ih"), (dgh.T @ h, W_hh, "W_hh"),
                           (dgh.sum(axis=0), b_hh, "b_hh")):
        np.testing.assert_allclose(got, _fd(arr, loss), rtol=1e-6, atol=1e-8, err_msg=what)


def recurrent_chain(bk, dt, B=9, w=10):
    """The four gate kernels of ``bk`` once per mode / dt on fixed inputs: a list of every output,
    for comparing two backends (the every-kernel check of test_raw_kernels.py)."""
    gi, gh, h, g = _case(np.random.default_rng(8), B, w, dt)
    out = []
    for step in (1.0, 4.0):
        for mode in (0, 1):
            h_next, cache = bk.gru_gates_forward(gi, gh, h, step, mode)
            out += [h_next, cache, *bk.gru_gates_vjp(g, h, cache, step, mode)]
        h_next, deriv = bk.rnn_gates_forward(gi[:, :w].copy(), gh[:, :w].copy(), h, step)
        out += [h_next, deriv, *bk.rnn_gates_vjp(g, h, deriv, step)]
    return out


def test_gru_bench_row_runs_on_a_small_case():
    """The ``bench kernels`` GRU row (timings are reported, never asserted)."""
    from mgnn.studies.bench import bench_gru_step, format_results
    from mgnn.studies.bench import gru_step_case
    step, tiny = bench_gru_step(batch=2, hidden=3, tiny=(2, 2))
    assert step["time_us"] > 0 and step["baseline_time_us"] > 0 and np.isfinite(step["ratio"])
    assert tiny["time_us"] > 0
    assert "GRU step" in format_results([step, tiny])
    for got, want in zip(*(f() for f in gru_step_case(3, 4, "float64"))):  # same step
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_gru_sequence_bench_rows_run_on_a_small_case():
    """``bench kernels``' per-time-step rows of a whole training step, serial and MGRIT
    (timings are reported, never asserted)."""
    from mgnn.studies.bench import bench_gru_sequence, format_results
    rows = bench_gru_sequence(seq_len=16, repeats=1)
    assert [r["name"].split(", ")[1] for r in rows] == ["serial", "MGRIT"]
    assert all(r["time_us"] > 0 for r in rows)
    assert "per time step" in format_results(rows)
