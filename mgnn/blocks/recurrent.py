"""Recurrent sequence models as time steppers: GRU and tanh-RNN cells over sequence time.

The state at time t is every layer's hidden state, ``u_t`` (B, n_layers, H); one step applies
the cells of all layers in order (layer l reads layer l-1's new hidden state, layer 0 the input
``x_t``), so MGRIT over time parallelises all layers at once. The weights are shared by every
step (PyTorch's ``torch.nn.GRU`` / ``torch.nn.RNN`` layouts and state-dict names): a step kind
with ``shared = True``, whose parameters have no leading step axis and whose parameter gradient
is the sum over the steps, computed after the adjoint solve with one GEMM per weight.

Gate arithmetic runs in the backend's recurrent kernels (``mgnn.backend.RECURRENT_KERNELS``:
``gru_gates_forward`` / ``gru_gates_vjp`` / ``rnn_gates_forward`` / ``rnn_gates_vjp``); the
input projections of layer 0 for every step are one GEMM per call (they do not depend on the
state). Where the backend has them, whole sweeps, relaxation chains, points, linearisations and
gate cotangents are one backend call each (``recurrent_sweep_forward`` ...
``recurrent_gate_cotangents``; Numba: small GEMMs as loops, larger ones BLAS); the single-state
protocol (the list engine, device arrays) uses the array module's matmul (BLAS / cuBLAS). The
weight gradients are one GEMM per weight over all steps.

Coarse MGRIT levels (step size ``h`` = the level's stride, the fine step being 1):
``coarse="rediscretise"`` applies the fine cell with the input at the coarse point;
``coarse="implicit"`` reads the GRU as the ODE ``h' = h + dt (1 - z)(n - h)`` with dt = the
stride and treats the linear term implicitly, ``h' = (h + dt (1 - z) n) / (1 + dt (1 - z))``
(Moon & Cyr 2022); for the RNN, ``h' = h + dt (tanh(a) - h)`` with the same implicit treatment
of ``-h`` is not offered: its coarse steps rediscretise.
"""
import numpy as np

from ..backend import activation_code, is_device_array
from .layers import serial_scratch

CELLS = ("gru", "implicit_gru", "rnn")
COARSE = ("rediscretise", "implicit")


def _xp(a):
    if is_device_array(a):
        import cupy
        return cupy
    return np


class RecurrentStep:
    """One time step of a stack of ``n_layers`` recurrent cells (the step kind of a sequence
    model; layer-indexed protocol of :mod:`mgnn.blocks.composed` with shared weights).

    Parameters
    ----------
    cell : {'gru', 'implicit_gru', 'rnn'}
        PyTorch's GRU, the implicit GRU (``h' = (h + (1 - z) n) / (1 + (1 - z))`` on the fine
        level), or PyTorch's tanh RNN.
    in_features, hidden, n_layers : int
    coarse : {'rediscretise', 'implicit'}
        Coarse-level propagator (module docstring); 'implicit' needs a GRU cell.
    """

    fused = False   # not the dense / conv fused kernels: stacked steps via the *_layers methods
    shared = True   # one set of weights for every step: gradients are sums over the steps

    def __init__(self, cell, in_features, hidden, n_layers, coarse="rediscretise"):
        if cell not in CELLS:
            raise ValueError(f"cell must be one of {CELLS}, got {cell!r}")
        if coarse not in COARSE:
            raise ValueError(f"coarse must be one of {COARSE}, got {coarse!r}")
        if coarse == "implicit" and cell == "rnn":
            raise ValueError("coarse='implicit' needs a GRU cell (the RNN rediscretises)")
        self.cell, self.coarse = cell, coarse
        self.in_features, self.hidden, self.n_layers = in_features, hidden, n_layers
        self.gates = 1 if cell == "rnn" else 3
        self.cache_width = 4 if cell != "rnn" else 1  # gate caches per step: (B, C H) a layer
        self.prefix = "rnn" if cell == "rnn" else "gru"
        self._code = 0 if cell != "rnn" else 1  # the backend kernels' cell code
        self._identity = activation_code("identity")

    # ------------------------------------------------------------------------------ structure
    def param_shapes(self):
        """PyTorch's per-layer shapes: weight_ih_l{k} (G H, I or H), weight_hh_l{k} (G H, H),
        bias_ih_l{k}, bias_hh_l{k} (G H,); G = 3 (GRU) or 1 (RNN)."""
        G, H = self.gates, self.hidden
        out = {}
        for k in range(self.n_layers):
            out[f"weight_ih_l{k}"] = (G * H, self.in_features if k == 0 else H)
            out[f"weight_hh_l{k}"] = (G * H, H)
            out[f"bias_ih_l{k}"] = (G * H,)
            out[f"bias_hh_l{k}"] = (G * H,)
        return out

    def init_bound(self, name):
        """PyTorch's initialisation: uniform(-1/sqrt(H), 1/sqrt(H)) for every parameter."""
        return 1.0 / np.sqrt(self.hidden)

    def buffer_shapes(self):
        """No buffers."""
        return {}

    def state_shape(self, batch):
        """(B, n_layers, H): every layer's hidden state."""
        return (batch, self.n_layers, self.hidden)

    def check_batch(self, batch, layer=0):
        """Any batch works."""

    def commit_buffers(self, buffers, n, cache):
        """No buffers."""

    # ------------------------------------------------------------------------------ arithmetic
    def _rule(self, h):
        """(dt, mode) of a step of size h (1 on the fine level): the gate kernels' update rule."""
        coarse = float(h) != 1.0
        if self.cell == "rnn":
            return 1.0, 0
        implicit = self.cell == "implicit_gru" or (coarse and self.coarse == "implicit")
        dt = float(h) if coarse and self.coarse == "implicit" else 1.0
        return dt, (1 if implicit else 0)

    def _input_projection(self, P, ctx):
        """x_t W_ih0^T + b_ih0 for every step t: (B, L, G H), one GEMM per call (memoised in
        the context, which the caller resets with each new batch). Where ``ctx.steps`` = (lo,
        hi) (a layer rank's block of time steps) only those rows are computed, the others NaN:
        each rank projects its own steps, not the whole sequence."""
        gi = ctx.memo.get("gi0")
        if gi is None:
            x = ctx.x
            B, L, I = x.shape
            W, b = P["weight_ih_l0"], P["bias_ih_l0"]
            lo, hi = getattr(ctx, "steps", None) or (0, L)
            if lo <= 0 and hi >= L:
                gi = (x.reshape(B * L, I) @ W.T + b).reshape(B, L, -1)
            else:
                xp = _xp(x)
                gi = xp.full((B, L, W.shape[0]), np.nan, dtype=W.dtype)
                gi[:, lo:hi] = (xp.ascontiguousarray(x[:, lo:hi]).reshape(B * (hi - lo), I)
                                @ W.T + b).reshape(B, hi - lo, -1)
            ctx.memo["gi0"] = gi
        return gi

    def _gates_forward(self, gi, gh, h, dt, mode, bk):
        if self.cell == "rnn":
            return bk.rnn_gates_forward(gi, gh, h, dt)
        return bk.gru_gates_forward(gi, gh, h, dt, mode)

    def _run(self, P, n, u, h, bk, ctx, keep):
        """u_{n+1} from u_n = u (B, nl, H) and, if ``keep``, per-layer caches
        (gate cache, layer input, previous hidden state)."""
        xp = _xp(u)
        dt, mode = self._rule(h)
        gi_all = self._input_projection(P, ctx)
        out = xp.empty_like(u)
        caches = []
        inp = None
        for k in range(self.n_layers):
            if k == 0:
                gi = xp.ascontiguousarray(gi_all[:, n, :])
            else:
                gi = inp @ P[f"weight_ih_l{k}"].T + P[f"bias_ih_l{k}"]
            hk = xp.ascontiguousarray(u[:, k, :])
            gh = hk @ P[f"weight_hh_l{k}"].T + P[f"bias_hh_l{k}"]
            h_next, cache = self._gates_forward(gi, gh, hk, dt, mode, bk)
            out[:, k, :] = h_next
            if keep:
                caches.append((cache, inp, hk))
            inp = h_next
        return out, caches

    def forward_layer(self, P, n, u, h, bk, ctx):
        """u_{n+1} = Phi_n(u_n): every layer's cell at step n (step size h: see :meth:`_rule`)."""
        return self._run(P, n, u, h, bk, ctx, False)[0]

    def forward_linearize(self, P, n, u, h, bk, ctx):
        """(u_{n+1}, the caches the vjps need)."""
        return self._run(P, n, u, h, bk, ctx, True)

    def linearize(self, P, n, u, bk, ctx):
        """The caches of step n at u (fine step: the gates do not depend on dt)."""
        return self._run(P, n, u, 1.0, bk, ctx, True)[1]

    def _back(self, P, n, caches, lam, h, bk, collect=None):
        """The state vjp of step n; ``collect``: a list receiving (dgi, dgh) per layer."""
        xp = _xp(lam)
        dt, mode = self._rule(h)
        out = xp.empty_like(lam)
        carry = None  # cotangent of layer k's new hidden state from layer k+1's input
        for k in range(self.n_layers - 1, -1, -1):
            cache, _, hk = caches[k]
            g = xp.ascontiguousarray(lam[:, k, :])
            if carry is not None:
                g = g + carry
            if self.cell == "rnn":
                dh, da = bk.rnn_gates_vjp(g, hk, cache, dt)
                dgi = dgh = da
            else:
                dh, dgi, dgh = bk.gru_gates_vjp(g, hk, cache, dt, mode)
            out[:, k, :] = dh + dgh @ P[f"weight_hh_l{k}"]
            if collect is not None:
                collect.append((k, dgi, dgh))
            carry = dgi @ P[f"weight_ih_l{k}"] if k > 0 else None
        return out

    # ------------------------------------------------------------------ whole-sequence sweeps
    def _stacked_weights(self, P, transposed):
        """(W_ih, W_hh) of every layer stacked (nl, G H, H) (``transposed``: (nl, H, G H)),
        W_ih of layer 0 (it reads x, through the input projection) as zeros."""
        xp = _xp(P["weight_hh_l0"])
        GH, H = self.gates * self.hidden, self.hidden
        ih = [xp.zeros((GH, H), P["weight_hh_l0"].dtype)] + \
            [P[f"weight_ih_l{k}"] for k in range(1, self.n_layers)]
        hh = [P[f"weight_hh_l{k}"] for k in range(self.n_layers)]
        if transposed:
            return (xp.ascontiguousarray(xp.stack(ih).transpose(0, 2, 1)),
                    xp.ascontiguousarray(xp.stack(hh).transpose(0, 2, 1)))
        return xp.stack(ih), xp.stack(hh)

    def can_replay(self, bk):
        """Whether ``bk`` replays captured cycles of recurrent steps (``recurrent_run_tape``)."""
        return callable(getattr(bk, "recurrent_run_tape", None))

    def run_tape_layers(self, P, stores, rows, hs, norms, bk, ctx):
        """Replay a captured forward cycle (:mod:`mgnn.backend.tape`): each step size of
        ``hs`` with its update rule."""
        cell, gi0, WihT, WhhT, bih, bhh = self._stack_args(P, ctx)
        bk.recurrent_run_tape(stores, rows, [self._rule(h) for h in hs.tolist()], norms, cell,
                              gi0, WihT, WhhT, bih, bhh)

    def run_tape_adjoint_layers(self, P, stores, rows, hs, norms, lin, bk, ctx):
        """Replay a captured adjoint cycle at the linearisation ``lin``."""
        Wih, Whh = self._back_weights(P, ctx)
        bk.recurrent_run_tape_adjoint(stores, rows, [self._rule(h) for h in hs.tolist()], norms,
                                      self._code, lin.U, lin.u_off, lin.D, lin.d0, Wih, Whh)

    def can_stack(self, bk, ctx=None):
        """Whether ``bk`` has the stacked recurrent kernels (host arrays); ``ctx`` is not
        used."""
        return callable(getattr(bk, "recurrent_chains_forward", None)) and \
            callable(getattr(bk, "recurrent_points_forward", None))

    def _stack_args(self, P, ctx):
        """(cell code, gi0, W_ih^T, W_hh^T, b_ih, b_hh) of the stacked kernels, built once per
        batch (memoised in the context, reset with each new batch)."""
        got = ctx.memo.get("rec_stack")
        if got is None:
            WihT, WhhT = self._stacked_weights(P, transposed=True)
            bih = np.stack([P[f"bias_ih_l{k}"] for k in range(self.n_layers)])
            bih[0] = 0  # layer 0's input bias is in the input projection
            bhh = np.stack([P[f"bias_hh_l{k}"] for k in range(self.n_layers)])
            got = ctx.memo["rec_stack"] = (self._code,
                                           self._input_projection(P, ctx), WihT, WhhT, bih, bhh)
        return got

    def chains_forward_layers(self, P, U, G, chains, layer0, layer_step, h, bk, ctx):
        """Stacked relaxation (:class:`mgnn.mgrit.engines.StackedEngine`): along each chain
        U[i] = Phi_t(U[i - 1]) (+ G[i]), t = layer0 + i layer_step, step size h."""
        dt, mode = self._rule(h)
        cell, gi0, WihT, WhhT, bih, bhh = self._stack_args(P, ctx)
        bk.recurrent_chains_forward(cell, gi0, U, G, chains, layer0, layer_step, WihT, WhhT,
                                    bih, bhh, dt, mode)

    def can_keep_derivs(self, bk):
        """Whether ``bk`` keeps a final sweep's linearisation (``recurrent_chains_forward_keep``
        and ``recurrent_caches_missing``)."""
        return all(callable(getattr(bk, k, None)) for k in ("recurrent_chains_forward_keep",
                                                           "recurrent_caches_missing"))

    def kept_arrays(self, state_shape, count, dtype, scratch):
        """(D, Y) of :meth:`linearize_stacked` for ``count`` steps of states ``state_shape``
        (B, nl, H), from ``scratch(name, shape, dtype)``: the same arrays it fills."""
        B, nl, H = state_shape
        return (scratch("recurrent caches", (count, nl, B, self.cache_width * H), dtype),
                scratch("recurrent outputs", (count if nl > 1 else 0, B, nl, H), dtype))

    def chains_forward_layers_keep(self, P, U, chains, layer0, layer_step, h, kept, lo, done,
                                   bk, ctx):
        """:meth:`chains_forward_layers` without right-hand sides (the same states), each step t
        also writing its linearisation into ``kept`` = (D, Y) at row t - lo (see
        :meth:`kept_arrays`) and flagging done[t - lo]."""
        dt, mode = self._rule(h)
        cell, gi0, WihT, WhhT, bih, bhh = self._stack_args(P, ctx)
        bk.recurrent_chains_forward_keep(cell, gi0, U, chains, layer0, layer_step, WihT, WhhT,
                                         bih, bhh, dt, mode, kept[0], kept[1], lo, done)

    def points_forward_layers(self, P, U, G, R, slots, out_slots, layer0, layer_step, h,
                              point_mode, bk, ctx):
        """The step into each of U's ``slots`` combined into R by ``point_mode`` (0 residual,
        returns the squared norm; 1 FAS; 2 plain)."""
        dt, mode = self._rule(h)
        cell, gi0, WihT, WhhT, bih, bhh = self._stack_args(P, ctx)
        return bk.recurrent_points_forward(cell, gi0, U, G, R, slots, out_slots, layer0,
                                           layer_step, WihT, WhhT, bih, bhh, dt, mode,
                                           point_mode)

    def sweep_forward_layers(self, P, U, h, store, bk, ctx, scratch=None):
        """Serial propagation over every step in one backend call (``recurrent_sweep_forward``):
        fills U[1:] (U (L + 1, B, nl, H), U[0] given) and returns the caches (L, nl, B, C H)
        (empty unless ``store``; from ``scratch(name, shape, dtype)`` if given, else fresh), or
        None where the backend has no sweep (the caller then steps layer after layer)."""
        sweep = getattr(bk, "recurrent_sweep_forward", None)
        if sweep is None or is_device_array(U):
            return None
        dt, mode = self._rule(h)
        L, B = U.shape[0] - 1, U.shape[1]
        cell, gi0, WihT, WhhT, bih, bhh = self._stack_args(P, ctx)
        C = self.cache_width
        D = serial_scratch(scratch)("recurrent caches",
                                    (L if store else 0, self.n_layers, B, C * self.hidden), U.dtype)
        sweep(cell, gi0, U, WihT, WhhT, bih, bhh, D, dt, mode)
        return D

    def sweep_backward_layers(self, P, U, D, lam, h, bk, ctx, G, scratch=None):
        """The adjoint of :meth:`sweep_forward_layers` (caches ``D`` from it) in one backend
        call, then G[name] = every parameter gradient (summed over the steps, one GEMM per
        weight); returns the cotangent of U[0], or None where ``D`` is not a sweep's (the
        caller then runs the step-by-step vjps). ``scratch`` as :meth:`sweep_forward_layers`
        (the projection cotangents)."""
        sweep = getattr(bk, "recurrent_sweep_backward", None)
        if sweep is None or not isinstance(D, np.ndarray):
            return None
        dt, mode = self._rule(h)
        L, nl, B = D.shape[0], self.n_layers, U.shape[1]
        GH = self.gates * self.hidden
        Wih, Whh = self._back_weights(P, ctx)
        get = serial_scratch(scratch)
        DGI = get("recurrent dgi", (L, nl, B, GH), U.dtype)
        DGH = get("recurrent dgh", (L, nl, B, GH), U.dtype)
        lam0 = sweep(self._code, lam, U, D, Wih, Whh, dt, mode, DGI, DGH)
        self._weight_grads(G, DGI, DGH, ctx.x, U[1:], U[:-1])
        return lam0

    def _weight_grads(self, G, DGI, DGH, x, outputs, states):
        """G[name] = every weight's gradient, one GEMM each, from the projection cotangents
        DGI / DGH (S, nl, B, G H) of S consecutive steps, their inputs x (B, S, I) of layer 0,
        their outputs (S, B, nl, H) (layer k's new hidden state is layer k+1's input; unused
        when nl = 1) and the states (S, B, nl, H) they step out of."""
        S, nl, B, GH = DGI.shape
        H = self.hidden
        if S == 0:  # no steps here (a rank that owns none): this part of the sum is zero
            for k in range(nl):
                self._zero_layer_grads(G, k)
            return
        for k in range(nl):
            dgi, dgh = DGI[:, k].reshape(S * B, GH), DGH[:, k].reshape(S * B, GH)
            inp = (x.transpose(1, 0, 2).reshape(S * B, -1) if k == 0 else
                   outputs[:, :, k - 1].reshape(S * B, H))  # rows in (step, sample) order
            G[f"weight_ih_l{k}"][...] = dgi.T @ inp
            G[f"bias_ih_l{k}"][...] = dgi.sum(axis=0)
            G[f"weight_hh_l{k}"][...] = dgh.T @ states[:, :, k].reshape(S * B, H)
            G[f"bias_hh_l{k}"][...] = dgh.sum(axis=0)

    @staticmethod
    def _zero_layer_grads(G, k):
        """G's four gradients of layer k = 0 (a part of the sum over no steps)."""
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            G[f"{name}_l{k}"][...] = 0

    # ---------------------------------------------- the stacked adjoint (MGRIT adjoint solve)
    def can_stack_adjoint(self, bk, ctx=None):
        """Whether ``bk`` has the stacked recurrent adjoint kernels (host arrays)."""
        return self.can_stack(bk) and all(callable(getattr(bk, k, None)) for k in (
            "recurrent_caches", "recurrent_chains_adjoint", "recurrent_points_adjoint",
            "recurrent_gate_cotangents"))

    def linearize_stacked(self, P, U, first, count, t0, bk, ctx, scratch, done=None):
        """The linearisation of the ``count`` steps t0.. at the states U[first..] (a solver's
        store, (m, B, nl, H)) in one backend call: a :class:`StackedLinearization` (gate caches
        and outputs in arrays from ``scratch(name, shape, dtype)``). ``done``: int8 flags of the
        rows a final sweep already wrote (:meth:`chains_forward_layers_keep`); only the others
        are computed."""
        D, Y = self.kept_arrays(U.shape[1:], count, U.dtype, scratch)
        dt, mode = self._rule(1.0)
        cell, gi0, WihT, WhhT, bih, bhh = self._stack_args(P, ctx)
        if done is None:
            bk.recurrent_caches(cell, gi0, U, first, count, t0, WihT, WhhT, bih, bhh, D, Y, dt,
                                mode)
        else:
            bk.recurrent_caches_missing(cell, gi0, U, first, count, t0, WihT, WhhT, bih, bhh, D,
                                        Y, dt, mode, done)
        return StackedLinearization(U, first - t0, D, t0, Y, self.cache_width)

    def _back_weights(self, P, ctx):
        """(W_ih, W_hh) stacked (nl, G H, H), memoised per batch in the context."""
        got = ctx.memo.get("rec_back")
        if got is None:
            got = ctx.memo["rec_back"] = self._stacked_weights(P, transposed=False)
        return got

    def chains_adjoint_layers(self, P, L, G, chains, layer0, layer_step, h, lin, bk, ctx):
        """Stacked adjoint relaxation: along each chain L[i] = the vjp of step
        t = layer0 + i layer_step (step size h) at the linearisation ``lin`` applied to L[i - 1]
        (+ G[i])."""
        dt, mode = self._rule(h)
        Wih, Whh = self._back_weights(P, ctx)
        bk.recurrent_chains_adjoint(self._code, L, G, chains, layer0, layer_step, lin.U,
                                    lin.u_off, lin.D, lin.d0, Wih, Whh, dt, mode)

    def points_adjoint_layers(self, P, L, G, R, slots, out_slots, layer0, layer_step, h,
                              point_mode, lin, bk, ctx):
        """Stacked adjoint residual / FAS / plain points (see :meth:`chains_adjoint_layers`)."""
        dt, mode = self._rule(h)
        Wih, Whh = self._back_weights(P, ctx)
        return bk.recurrent_points_adjoint(self._code, L, G, R, slots, out_slots,
                                           layer0, layer_step, lin.U, lin.u_off, lin.D, lin.d0,
                                           Wih, Whh, dt, mode, point_mode)

    def vjp_params_stacked_layers(self, P, parts, lin, bk, ctx, G, scratch, h=None):
        """G[name] = the sum over every step of ``lin`` of (dPhi_t/dtheta)^T lam_{t+1}, written:
        ``parts`` lists (L, l0, l_step, count) runs, in step order, that hold lam_{t+1} of the
        steps in turn (L[l0 + p l_step] for the p-th step of the run), or callables returning
        one, called when reached (a run that waits for a message: the runs before it are
        computed first); one backend call per run for the projection cotangents, then one GEMM
        per weight. ``h`` is not used (the step size is the model's rule)."""
        S, nl, B = lin.D.shape[:3]
        GH = self.gates * self.hidden
        DGI = scratch("recurrent dgi", (S, nl, B, GH), lin.D.dtype)
        DGH = scratch("recurrent dgh", (S, nl, B, GH), lin.D.dtype)
        dt, mode = self._rule(1.0)
        Wih, Whh = self._back_weights(P, ctx)
        row = 0
        for part in parts:
            L, l0, l_step, count = part() if callable(part) else part
            bk.recurrent_gate_cotangents(self._code, L, l0, l_step, lin.U,
                                         lin.d0 + lin.u_off + row, lin.D, row, count, Wih, Whh,
                                         dt, mode, DGI, DGH, row)
            row += count
        if row != S:
            raise ValueError(f"the runs cover {row} steps, the linearisation {S}")
        t0, first = lin.d0, lin.d0 + lin.u_off
        self._weight_grads(G, DGI, DGH, ctx.x[:, t0:t0 + S], lin.Y,
                           lin.U[first:first + S])

    def vjp_state_layer(self, P, n, cache, lam, h, bk, ctx):
        """J_n^T lam: the cotangent of u_n from the cotangent ``lam`` of u_{n+1}."""
        return self._back(P, n, cache, lam, h, bk)

    def vjp_params_steps(self, P, steps, U, caches, lams, h, bk, ctx, G):
        """G[name] = the sum over the steps n in ``steps`` of (dPhi_n/dtheta)^T lams[n + 1]
        (written, not accumulated), with one GEMM per weight over all those steps."""
        steps = list(steps)
        xp = _xp(G[f"weight_hh_l0"])
        per_layer = {k: ([], [], [], []) for k in range(self.n_layers)}  # dgi, inp, dgh, h
        for n in steps:
            collected = []
            self._back(P, n, caches[n], lams[n + 1], h, bk, collected)
            for k, dgi, dgh in collected:
                _, inp, hk = caches[n][k]
                acc = per_layer[k]
                acc[0].append(dgi)
                acc[1].append(ctx.x[:, n, :] if k == 0 else inp)
                acc[2].append(dgh)
                acc[3].append(hk)
        for k, (dgis, inps, dghs, hs) in per_layer.items():
            if not steps:
                self._zero_layer_grads(G, k)
                continue
            dgi, inp = xp.concatenate(dgis), xp.concatenate(inps)
            dgh, hh = xp.concatenate(dghs), xp.concatenate(hs)
            G[f"weight_ih_l{k}"][...] = dgi.T @ inp
            G[f"bias_ih_l{k}"][...] = dgi.sum(axis=0)
            G[f"weight_hh_l{k}"][...] = dgh.T @ hh
            G[f"bias_hh_l{k}"][...] = dgh.sum(axis=0)


class StackedLinearization:
    """The linearisation of steps d0 .. d0 + S - 1 of a recurrent model at given states, in
    arrays: the state of step t is U[t + u_off] (B, nl, H) (a solver's store), its gate caches
    D[t - d0] (nl, B, C H) and, with more than one layer, its output Y[t - d0] (B, nl, H).
    ``lin[t]`` is step t's cache in the single-state protocol (per layer: gate cache, layer
    input or None for layer 0, hidden state), for the list engine's steps."""

    __slots__ = ("U", "u_off", "D", "d0", "Y", "C")

    def __init__(self, U, u_off, D, d0, Y, C):
        self.U, self.u_off, self.D, self.d0, self.Y, self.C = U, u_off, D, d0, Y, C

    def __getitem__(self, t):
        k = t - self.d0
        if not 0 <= k < self.D.shape[0]:
            return None
        u = self.U[t + self.u_off]
        B, H = u.shape[0], u.shape[2]
        shape = (B, self.C, H) if self.C > 1 else (B, H)
        return [(self.D[k, j].reshape(shape),
                 None if j == 0 else np.ascontiguousarray(self.Y[k, :, j - 1]),
                 np.ascontiguousarray(u[:, j])) for j in range(u.shape[1])]


class ZeroOpening:
    """u_0 = 0 (B, n_layers, H): PyTorch's default initial hidden state; the input sequence x
    (B, L, I) enters every step instead. No parameters."""

    def __init__(self, seq_len, in_features, hidden, n_layers):
        self.seq_len, self.in_features = seq_len, in_features
        self.hidden, self.n_layers = hidden, n_layers

    def param_shapes(self):
        return {}

    def input_shape(self):
        """(L, I)."""
        return (self.seq_len, self.in_features)

    def forward(self, params, x, bk):
        xp = _xp(x)
        return xp.zeros((x.shape[0], self.n_layers, self.hidden), dtype=x.dtype), None

    def vjp(self, params, x, cache, g, bk):
        """No parameters, and x enters through the steps: (None, {})."""
        return None, {}


class LastHiddenClosing:
    """logits = h_last C^T + c on the last layer's hidden state at the last step; u (B, nl, H)."""

    def __init__(self, hidden, n_classes):
        from .layers import DenseClosing
        self._dense = DenseClosing(hidden, n_classes)
        self.hidden, self.n_classes = hidden, n_classes

    def param_shapes(self):
        return self._dense.param_shapes()

    def forward(self, params, u, bk):
        return self._dense.forward(params, _xp(u).ascontiguousarray(u[:, -1, :]), bk)

    def vjp(self, params, u, cache, g, bk):
        gf, gp = self._dense.vjp(params, u[:, -1, :], cache, g, bk)
        gu = _xp(u).zeros_like(u)
        gu[:, -1, :] = gf
        return gu, gp
