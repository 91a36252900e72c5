"""Captured cycles (mgnn.backend.tape): a cycle recorded once and replayed in one Numba call
computes exactly what the engine's calls compute (bit for bit), replays really happen, and
what cannot be replayed is never captured."""
import numpy as np
import pytest

from mgnn import LayerParallel, MGRITOptions, MGRITSolver, conv_resnet, dense_resnet
from mgnn.backend import get_backend, tape as T, vector_ops
from mgnn.mgrit.engines import StackedStates
from mgnn.network import AdjointPropagator, ForwardPropagator
from tests.mgrit.test_stacked_engine import Stacked
from tests.mgrit.test_solver import TanhResNet

OPTIONS = [
    dict(cf=4, max_levels=3, nrelax=[0, 1], tol=0.0, max_iter=2, skip_downcycle=True),
    dict(cf=2, max_levels=4, nrelax=[1], tol=0.0, max_iter=3, cycle="F"),
    dict(cf=3, max_levels=2, nrelax=[0], tol=1e-5, max_iter=25),
    dict(cf=4, max_levels=3, nrelax=[2, 0], tol=0.0, max_iter=2, skip_downcycle=False),
]


def _model(kind, n, dtype, act="tanh"):
    if kind == "dense":
        return dense_resnet(6, 6, 3, n, activation=act, dtype=dtype, seed=1), (5, 6)
    return conv_resnet(1, 2, (5, 4), 3, n, activation=act, dtype=dtype, seed=1), (3, 2, 5, 4)


def _propagators(kind, n, dtype, act="tanh"):
    model, shape = _model(kind, n, dtype, act)
    bk = get_backend("numba")
    u0 = np.random.default_rng(2).standard_normal(shape).astype(dtype)
    U, D = LayerParallel(model, backend="numba", threads=None)._serial_states(u0, store=True)
    return (lambda: ForwardPropagator(model, bk)), (lambda: AdjointPropagator(model, U, D, bk)), u0


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: f"cf{o['cf']}-L{o['max_levels']}")
@pytest.mark.parametrize("kind", ["dense", "conv"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_replayed_cycles_equal_the_engine_bit_for_bit(opts, kind, dtype):
    n = 29  # no cf divides it: ragged last intervals on every level
    fwd, adj, u0 = _propagators(kind, n, dtype, act="tanh" if kind == "conv" else "relu")
    o = MGRITOptions(**opts)
    for make in (fwd, adj):
        plain = MGRITSolver(make(), n, o, ops=vector_ops("numba"), capture=False)
        taped = MGRITSolver(make(), n, o, ops=vector_ops("numba"))
        for _ in range(3):
            a, b = plain.solve(u0), taped.solve(u0)
            assert a.residuals == b.residuals and a.iterations == b.iterations
            for x, y in zip(a.states, b.states):
                np.testing.assert_array_equal(x, y)
        assert not plain._tapes
        assert taped._tapes and all(t.replays >= 1 for t in taped._tapes.values())


def test_the_threaded_and_serial_replays_agree():
    fwd, adj, u0 = _propagators("dense", 40, "float64")
    for make in (fwd, adj):
        s = MGRITSolver(make(), 40, MGRITOptions(**OPTIONS[0]), ops=vector_ops("numba"))
        s.solve(u0)
        U0 = s.solve(u0).store[0]  # the second solve merged the parts into one tape
        bk = get_backend("numba")
        whole = [t for k, t in s._tapes.items() if k[0] == "solve"]
        assert len(whole) == 1 and (whole[0].rows[:, T.CORR_SLOT] >= 0).any()
        if make is adj:  # the adjoint's FAS points run in pairs with their chains
            assert whole[0].rows[:, T.ZIP].any()
        for tape in s._tapes.values():
            prop = s.prop
            W, P, d0 = ((prop.W, prop.b, 0) if isinstance(prop, ForwardPropagator)
                        else (prop.W, *prop._stacked_derivs()))
            out = []
            for parallel in (False, True):
                stores = [a.copy() for a in [U0] + tape.stores[1:]]
                norms = np.zeros(max(tape.n_norms, 1))
                adjoint = not isinstance(prop, ForwardPropagator)
                bk.dense_run_tape(bk.stores_list(stores), tape.rows, tape.hs, W, P, d0,
                                  2 if adjoint else prop.kind.act, adjoint, norms,
                                  parallel=parallel)
                out.append((stores, norms))
            for x, y in zip(out[0][0], out[1][0]):
                np.testing.assert_array_equal(x, y)
            np.testing.assert_array_equal(out[0][1], out[1][1])


def test_residual_points_ride_on_the_chains_that_feed_them():
    fwd, _, u0 = _propagators("dense", 32, "float64")
    s = MGRITSolver(fwd(), 32, MGRITOptions(**OPTIONS[0]), ops=vector_ops("numba"))
    s.solve(u0)
    tape = s._tapes[next(k for k in s._tapes if k[:2] == ("cycle", False))]
    rows = tape.rows
    tails = (rows[:, T.OP] == T.CHAIN) & (rows[:, T.R] >= 0)
    assert tails.sum() == 8 + 2  # the residuals at levels 0 (8 C-points) and 1 (2)
    assert (rows[tails, T.MODE] == 0).all() and (rows[tails, T.NORM] >= 0).all()
    # forward steps: the coarse FAS steps out of the injected C-points share the chains' GEMMs
    assert ((rows[:, T.SHARE_R] >= 0) == tails).all() and not (rows[:, T.OP] == T.POINT).any()


def test_share_first_steps_needs_an_exact_copy_and_the_same_layer():
    def case(inject_first=1, chain_l0=-2, extra=()):
        inject = _row(T.INJECT, U=0, R=1, G=3, FIRST=inject_first, N=4, OUT=1, LEN=3)
        chains = [_row(T.CHAIN, U=0, FIRST=2, N=3, MODE=0, R=2, OUT=2, NORM=0, LAYER0=chain_l0,
                       LSTEP=1, H=0),
                  _row(T.CHAIN, U=0, FIRST=6, N=3, MODE=0, R=2, OUT=3, NORM=1, LAYER0=chain_l0,
                       LSTEP=1, H=0)]
        fas = [_row(T.POINT, U=1, R=2, FIRST=2, OUT=2, MODE=1, LAYER0=-8, LSTEP=4, H=1),
               _row(T.POINT, U=1, R=2, FIRST=3, OUT=3, MODE=1, LAYER0=-8, LSTEP=4, H=1)]
        return T.share_first_steps(_calls([inject], *[list(g) for g in extra], chains, fas))
    rows = case()  # fine slot 1 + 4 q holds point 4 q = coarse slot 1 + q; layer 4 q
    assert len(rows) == 3 and [r[T.SHARE_SLOT] for r in rows[1:]] == [2, 3]
    assert [r[T.SHARE_H] for r in rows[1:]] == [1, 1]
    assert len(case(inject_first=2)) == 5  # injected from other slots: not the chains' inputs
    assert len(case(chain_l0=-1)) == 5  # other layers
    written = [_row(T.CHAIN, U=0, FIRST=1, N=1, MODE=2)]  # the chain's input changed since
    rows = case(extra=(written,))
    assert len(rows) == 5 and sum(r[T.SHARE_R] >= 0 for r in rows) == 1


def _row(op, **cols):
    r = T.blank(op)
    for k, v in cols.items():
        r[getattr(T, k)] = v
    return r


def _calls(*groups):
    rows = []
    for g in groups:
        g[0][T.RUN] = len(g)
        rows += g
    return rows


def test_fuse_tails_only_where_it_computes_the_same():
    chains = [_row(T.CHAIN, U=0, FIRST=1, N=3, MODE=2), _row(T.CHAIN, U=0, FIRST=5, N=3, MODE=2)]
    points = [_row(T.POINT, U=0, R=1, FIRST=4, OUT=1, MODE=0, NORM=0),
              _row(T.POINT, U=0, R=1, FIRST=8, OUT=2, MODE=0, NORM=1)]
    fused = T.fuse_tails(_calls([list(r) for r in chains], [list(r) for r in points]))
    assert len(fused) == 2 and fused[0][T.RUN] == 2
    assert [(r[T.R], r[T.OUT], r[T.NORM]) for r in fused] == [(1, 1, 0), (1, 2, 1)]
    # C-relaxation writes U itself: a later chain reads the old value, so no fusion
    crelax = [_row(T.CHAIN, U=0, FIRST=4, N=1, MODE=2), _row(T.CHAIN, U=0, FIRST=8, N=1, MODE=2)]
    assert len(T.fuse_tails(_calls([list(r) for r in chains], crelax))) == 4
    # a point whose input no chain produced, an output into U, another level's layers
    for change in (dict(FIRST=3), dict(R=0), dict(LSTEP=4)):
        bad = [list(r) for r in points]
        for k, v in change.items():
            bad[1][getattr(T, k)] = v
        assert len(T.fuse_tails(_calls([list(r) for r in chains], bad))) == 4


def test_a_fixed_cycle_count_becomes_one_tape_with_its_copies_on_the_chains():
    fwd, _, u0 = _propagators("dense", 32, "float64")
    s = MGRITSolver(fwd(), 32, MGRITOptions(**OPTIONS[0]), ops=vector_ops("numba"))
    first = [s.solve(u0) for _ in range(3)]  # captured, replayed in parts, replayed whole
    plain = MGRITSolver(fwd(), 32, MGRITOptions(**OPTIONS[0]), ops=vector_ops("numba"),
                        capture=False).solve(u0)
    for res in first:
        assert res.residuals == plain.residuals
        for x, y in zip(res.states, plain.states):
            np.testing.assert_array_equal(x, y)
    whole = {k: t for k, t in s._tapes.items() if k[0] == "solve"}
    assert len(whole) == 1
    tape = next(iter(whole.values()))
    assert tape.replays == 1 and isinstance(tape.result, list) and len(tape.result) == 3
    rows = tape.rows
    # every correction rides on a chain (the last one of each cycle across the seam); of the
    # injections only the C-point 0 of each level and the skipped down-cycle's stay calls
    assert not (rows[:, T.OP] == T.CORRECT).any()
    assert sorted(rows[rows[:, T.OP] == T.INJECT, T.LEN]) == [1, 1, 3, 9]
    assert (rows[:, T.CORR_SLOT] >= 0).sum() == 2 * 2 + 2 * 8  # level 1 to 2, level 0 to 1
    s2 = MGRITSolver(fwd(), 32, MGRITOptions(**{**OPTIONS[0], "tol": 1e-9, "max_iter": 3,
                                                "warn_not_converged": False}),
                     ops=vector_ops("numba"))
    for _ in range(3):
        s2.solve(u0)
    assert not any(k[0] == "solve" for k in s2._tapes)  # tol > 0: the cycle count may vary


def _copy_case(correct_first=5, firsts=(2, 6)):
    """A CORRECT of slots correct_first + 4 q (q < 2) before two chains of slots f..f+2 (f in
    ``firsts``) whose tails read slot f + 3."""
    corr = _row(T.CORRECT, U=0, G=2, R=1, FIRST=correct_first, N=4, OUT=2, LEN=2)
    chains = [_row(T.CHAIN, U=0, FIRST=f, N=3, MODE=0, R=3, OUT=2 + q, NORM=q)
              for q, f in enumerate(firsts)]
    return _calls([corr], chains)


def test_fuse_copies_moves_each_item_onto_the_chain_that_ends_at_its_slot():
    rows = T.fuse_copies(_copy_case())
    assert len(rows) == 2 and rows[0][T.RUN] == 2
    assert [(r[T.CORR_SLOT], r[T.CORR_OUT]) for r in rows] == [(5, 2), (9, 3)]
    # slots 1 and 5: no chain ends at slot 1, so that item stays a call of its own
    rows = T.fuse_copies(_copy_case(correct_first=1))
    assert len(rows) == 3 and rows[0][T.OP] == T.CORRECT and rows[0][T.LEN] == 1
    assert rows[0][T.FIRST] == 1 and rows[1][T.CORR_SLOT] == 5
    # the chains the other way round: slot 5's correction would move past the chain of slots
    # 6..8, which reads slot 5 first, so it stays; slot 9's rides on that chain
    rows = T.fuse_copies(_copy_case(firsts=(6, 2)))
    assert len(rows) == 3 and (rows[0][T.FIRST], rows[0][T.LEN]) == (5, 1)
    assert [r[T.CORR_SLOT] for r in rows[1:]] == [9, -1]
    inject = _row(T.INJECT, U=0, R=4, G=5, FIRST=5, N=4, OUT=1, LEN=2)
    rows = T.fuse_copies(_calls(_copy_case()[:1], [inject], _copy_case()[1:]))
    assert [(r[T.CORR_SLOT], r[T.INJ_SLOT]) for r in rows] == [(5, 5), (9, 9)]
    # an injection before a correction of the same slot would run after it on a chain: it stays
    rows = T.fuse_copies(_calls([inject], *[[r] for r in _copy_case()[:1]],
                                _copy_case()[1:]))
    assert rows[0][T.OP] == T.INJECT and rows[0][T.LEN] == 2
    assert all(r[T.INJ_SLOT] < 0 for r in rows[1:])


def test_read_sources_reads_an_injected_state_where_it_came_from_if_that_is_the_same():
    def case(between=()):
        inject = _row(T.INJECT, U=0, R=1, G=2, FIRST=1, N=4, OUT=1, LEN=2)
        chain = _row(T.CHAIN, U=0, FIRST=2, N=3, MODE=2, CORR_SLOT=5, CORR_G=3, CORR_R=1,
                     CORR_OUT=2)
        return T.read_sources(_calls([inject], *[[list(r)] for r in between], [chain]))
    rows = case()  # slot 2 of store 1 is a copy of slot 5 of store 0, unchanged since
    assert rows[1][T.CORR_R] == -1
    assert (rows[0][T.R], rows[0][T.G]) == (2, -1)  # store 1 is read by nobody: not written
    rows = case(between=[_row(T.CHAIN, U=0, FIRST=5, N=1, MODE=2)])  # slot 5 changed since
    assert rows[2][T.CORR_R] == 1 and (rows[0][T.R], rows[0][T.G]) == (1, 2)


def test_replayed_forward_cycles_write_each_injected_state_once():
    fwd, adj, u0 = _propagators("dense", 32, "float64")
    for make in (fwd, adj):
        s = MGRITSolver(make(), 32, MGRITOptions(**OPTIONS[0]), ops=vector_ops("numba"))
        for _ in range(2):
            s.solve(u0)
        rows = next(t for k, t in s._tapes.items() if k[0] == "solve").rows
        carried = rows[:, T.CORR_SLOT] >= 0
        assert carried.any() and (rows[carried, T.CORR_R] == -1).all()
        injected = rows[:, T.INJ_SLOT] >= 0
        # forward: the FAS right-hand sides read the fine C-points, so the copies of them that
        # the corrections and the coarse steps no longer read are not made; the adjoint's
        # coarse steps (FAS points) read them
        one_copy = (rows[injected, T.INJ_G] == -1).all() and \
            (rows[rows[:, T.OP] == T.INJECT, T.G] == -1).all()
        assert one_copy == (make is fwd)


def test_zip_calls_pairs_points_with_chains_only_where_that_computes_the_same():
    chains = [_row(T.CHAIN, U=0, FIRST=2, N=3, MODE=0, R=3, OUT=2, NORM=0),
              _row(T.CHAIN, U=0, FIRST=6, N=3, MODE=0, R=3, OUT=3, NORM=0)]

    def points(first=2, norm=-1, mode=1):
        return [_row(T.POINT, U=1, R=3, FIRST=first + q, OUT=2 + q, MODE=mode,
                     NORM=norm) for q in range(2)]
    rows = T.zip_calls(_calls([list(r) for r in chains], points()))
    assert rows[0][T.ZIP] == 1 and sum(r[T.ZIP] for r in rows) == 1
    # point 0 writing R[3], which chain 1's tail writes later: stays apart
    clash = points()
    clash[0][T.OUT] = 3
    assert not any(r[T.ZIP] for r in T.zip_calls(_calls([list(r) for r in chains], clash)))
    # the same norm: the order of its sum would change
    same = _calls([list(r) for r in chains], points(norm=0, mode=0))
    assert not any(r[T.ZIP] for r in T.zip_calls(same))


def test_what_cannot_be_replayed_is_not_captured(rng):
    u0 = rng.standard_normal(3)
    opts = MGRITOptions(cf=2, max_levels=3, tol=0.0, max_iter=2)
    prop = TanhResNet(rng.standard_normal((16, 3, 3)), rng.standard_normal((16, 3)), 0.1)
    s = MGRITSolver(Stacked(prop), 16, opts)  # stacked, but no run_tape
    s.solve(u0)
    s.solve(u0)
    assert s.engine.stacked and not s._tapes
    model, _ = _model("dense", 16, "float64")
    s = MGRITSolver(ForwardPropagator(model, get_backend("numpy")), 16, opts)  # no tape kernel
    s.solve(rng.standard_normal((5, 6)))
    assert s.engine.stacked and not s._tapes


def test_user_ops_and_overridden_steps_are_never_replayed(rng):
    """A replay does the corrections as u + (uc - v) and the steps by the propagator's own
    kernels: an ops object or a subclass that does them otherwise runs through the engine."""
    from mgnn.backend.fas_ops import NumbaOps

    class Damped(NumbaOps):
        def correct_strided(self, Uf, fine0, stride, Uc, V, coarse0, k, tmp):
            view = Uf[fine0:fine0 + (k - 1) * stride + 1:stride]
            view += 0.5 * (Uc[coarse0:coarse0 + k] - V[coarse0:coarse0 + k])

    fwd, _, u0 = _propagators("dense", 24, "float64")
    o = MGRITOptions(cf=2, max_levels=3, tol=0.0, max_iter=3)
    runs = [MGRITSolver(fwd(), 24, o, ops=Damped(), capture=c) for c in (False, True)]
    for _ in range(2):
        a, b = (s.solve(u0) for s in runs)
        assert a.residuals == b.residuals
    assert not runs[1]._tapes

    class Shifted(ForwardPropagator):
        def advance(self, U, G, chains, origin, stride, level):
            super().advance(U, G, chains, origin, stride, level)
            U[1:-1] *= 1.0  # a subclass's own work

    model, _ = _model("dense", 24, "float64")
    s = MGRITSolver(Shifted(model, get_backend("numba")), 24, o, ops=vector_ops("numba"))
    s.solve(u0)
    s.solve(u0)
    assert not s._tapes


def test_the_cascadic_f_cycle_is_captured_too():
    fwd, _, u0 = _propagators("dense", 32, "float64")
    o = MGRITOptions(cf=2, max_levels=4, tol=0.0, max_iter=2, cycle="F", skip_downcycle=True)
    s = MGRITSolver(fwd(), 32, o, ops=vector_ops("numba"))
    s.solve(u0)
    assert sorted(k[:2] for k, t in s._tapes.items() if t) == [
        ("cycle", False), ("cycle", True), ("final", (35, 5, 6))]


def test_a_new_layer_count_recaptures():
    fwd, _, u0 = _propagators("dense", 24, "float64")
    prop = fwd()
    s = MGRITSolver(prop, 24, MGRITOptions(**OPTIONS[0]), ops=vector_ops("numba"))
    s.solve(u0)
    keys = set(s._tapes)
    prop.W, prop.b = np.concatenate([prop.W, prop.W]), np.concatenate([prop.b, prop.b])
    s.solve(u0)
    assert keys < set(s._tapes)  # the old tapes were checked against 24 layers


def test_stacked_states_index_like_a_list():
    U = np.arange(6 * 2.0).reshape(6, 2)  # slots 0..5 for points 3..6 of 0..9
    v = StackedStates(U, 3, 7, 9)
    assert len(v) == 10 and v[2] is None and v[7] is None
    np.testing.assert_array_equal(v[3], U[1])
    np.testing.assert_array_equal(v[-4], U[4])
    assert [x is None for x in v[2:5]] == [True, False, False]
    assert sum(x is not None for x in v) == 4
    with pytest.raises(IndexError):
        v[10]


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_training_steps_with_replayed_cycles_equal_the_engine(kind, rng):
    """LayerParallel's solvers replay their cycles from the second step on: losses and gradients
    over several SGD steps (parameters changing in place) equal solvers that never capture."""
    fwd = MGRITOptions(cf=2, max_levels=3, tol=0.0, max_iter=2)
    bwd = MGRITOptions(cf=2, max_levels=3, tol=0.0, max_iter=1)
    runs = []
    for capture in (True, False):
        model, shape = _model(kind, 12, "float64")
        lp = LayerParallel(model, fwd=fwd, bwd=bwd, backend="numba", threads=None)
        x = np.random.default_rng(3).standard_normal(shape[:1] + (6,) if kind == "dense"
                                                     else (3, 1, 5, 4))
        y = np.arange(x.shape[0]) % 3
        out = []
        for step in range(3):
            loss, grads = lp.loss_and_grad(x, y)
            if step == 0:
                for s in lp._solvers.values():
                    s.capture = capture
            out.append((loss, {k: v.copy() for k, v in grads.items()}))
            for k, g in grads.items():
                model.params[k] -= 0.1 * g
        runs.append((out, lp))
    (taped, lp), (plain, _) = runs
    assert all(t.replays for s in lp._solvers.values() for t in s._tapes.values())
    assert all(s._tapes for s in lp._solvers.values())
    for (la, ga), (lb, gb) in zip(taped, plain):
        assert la == lb
        for k in ga:
            np.testing.assert_array_equal(ga[k], gb[k])


def test_run_tape_checks_its_arguments_once_per_store_list_and_types():
    """A tape cut by halo messages replays one call per segment, so the argument check is
    memoised per store list and argument types: a mismatch is still a TypeError every time."""
    bk = get_backend("numba")
    stores = bk.stores_list([np.zeros((3, 2, 4), np.float32)])
    rows, hs, norms = np.zeros((0, T.COLS), np.int64), np.zeros(1, np.float32), np.zeros(1)
    W, b = np.zeros((2, 4, 4), np.float32), np.zeros((2, 4), np.float32)
    for _ in range(2):
        with pytest.raises(TypeError, match=r"dense tape \(adjoint=False\): W float64"):
            bk.dense_run_tape(stores, rows, hs, W.astype(np.float64), b, 0, 0, False, norms)
        bk.dense_run_tape(stores, rows, hs, W, b, 0, 0, False, norms)  # matching: runs
    with pytest.raises(TypeError, match="adjoint=True"):  # b is not a sigma' stack
        bk.dense_run_tape(stores, rows, hs, W, b, 0, 2, True, norms)
