"""Balanced layer partitions (:func:`mgnn.mgrit.partition.balanced_starts`) and their work model."""
import itertools

import numpy as np
import pytest

from mgnn.mgrit import MGRITOptions, MGRITSolver, cycle_work, level_sizes
from mgnn.mgrit.hierarchy import step_weights
from mgnn.mgrit.partition import (Partition, balanced_starts, block_starts, block_work,
                                  layer_work, replica_rows)


def _check_valid(starts, n, blocks, cf):
    assert len(starts) == blocks and starts[0] == 0
    assert all(a < b for a, b in zip(starts, starts[1:])) and starts[-1] < n  # a layer each
    assert all(s % cf == 0 for s in starts)
    Partition(n, tuple(starts), tuple(range(blocks)))  # accepted as a partition


@pytest.mark.parametrize("n, blocks, old, new", [(8, 2, [0, 8], [0, 4]),
                                                 (16, 3, [0, 8, 16], None)])
def test_issue_examples_leave_no_rank_empty(n, blocks, old, new):
    """Issue 11: cf 4, 3 levels: the C-point split gave the last rank no layer."""
    sizes = level_sizes(n, 4, 3, 2)
    assert block_starts(n + 1, blocks, 4) == old  # the old split: the last block is point N only
    starts = balanced_starts(n, blocks, 4, sizes, nrelax=[0, 1])
    _check_valid(starts, n, blocks, 4)
    if new is not None:
        assert starts == new
    work = block_work(n, starts, 4, sizes, nrelax=[0, 1])
    assert max(work) <= max(block_work(n, old, 4, sizes, nrelax=[0, 1]))
    # layer by layer (no MGRIT) the split is by layer count
    assert balanced_starts(n, blocks) == ([0, 4] if n == 8 else [0, 5, 11])


def test_32_layers_on_2_ranks_split_16_16():
    """The old split put 20 and 12 layers on 2 ranks (cf 4): per FCF V-cycle on 3 levels that is
    work 63 against 37; the balanced split is 16/16 layers, work 50/50."""
    sizes = level_sizes(32, 4, 3, 2)
    old = block_starts(33, 2, 4)
    assert old == [0, 20] and block_work(32, old, 4, sizes) == [63.0, 37.0]
    new = balanced_starts(32, 2, 4, sizes)
    assert new == [0, 16] and block_work(32, new, 4, sizes) == [50.0, 50.0]
    # the closing layer + loss on the last rank moves work to the first
    new = balanced_starts(32, 2, 4, sizes, extra_last=20.0)
    assert new == [0, 20] and max(block_work(32, new, 4, sizes, extra_last=20.0)) == 63.0


def _brute(n, blocks, cf, kw):
    cands = range(cf, n, cf)
    return min(max(block_work(n, [0, *cut], cf, **kw))
               for cut in itertools.combinations(cands, blocks - 1))


@pytest.mark.parametrize("n, cf, levels", [(11, 1, 1), (13, 2, 3), (17, 3, 2), (24, 2, 4),
                                           (26, 4, 2)])
def test_optimal_against_every_aligned_split(n, cf, levels, rng):
    sizes = level_sizes(n, cf, levels, 1) if cf > 1 else None
    models = [dict(sizes=sizes), dict(sizes=sizes, extra_first=2.5, extra_last=7.0),
              dict(sizes=sizes, nrelax=[0, 2], cycle="F", coarsest="sequential",
                   extra_last=3.0),
              dict(sizes=sizes, skip=True, extra_first=1.0),
              dict(work=rng.uniform(0.0, 5.0, n), extra_first=0.7, extra_last=4.1),
              dict(work=rng.integers(0, 3, n).astype(float))]
    for kw, blocks in itertools.product(models, range(1, 5)):
        if -(-n // cf) < blocks:
            continue
        starts = balanced_starts(n, blocks, cf, **kw)
        _check_valid(starts, n, blocks, cf)
        best = _brute(n, blocks, cf, kw)
        assert max(block_work(n, starts, cf, **kw)) <= best * (1 + 1e-12) + 1e-12, (kw, blocks)


@pytest.mark.parametrize("levels, cf, nrelax, skip, cycle", [
    (3, 4, [0, 1], False, "V"), (2, 2, 1, False, "F"), (4, 2, [0, 1, 2], True, "F"),
    (3, 3, 0, True, "V")])
@pytest.mark.parametrize("mirrored", [False, True])
def test_layer_work_is_what_the_solver_steps(levels, cf, nrelax, skip, cycle, mirrored):
    """Counted per rank: a push step out of fine index i runs on i's owner; the adjoint (pull,
    reversed indices m = N - i) runs its step into m on the owner of N - m."""
    n = 67
    counts = np.zeros(n)

    class Count:
        def step(self, u, start, stop, level):
            counts[n - stop if mirrored else start] += 1
            return 0.5 * u + 1.0

    opts = MGRITOptions(cf=cf, max_levels=levels, nrelax=nrelax, tol=0.0, max_iter=2,
                        skip_downcycle=skip, cycle=cycle)
    MGRITSolver(Count(), n, opts).solve(np.array([1.0]))
    sizes = level_sizes(n, cf, levels, 2)
    kw = dict(nrelax=opts.nrelax_on, cycle=cycle, coarsest="sequential", mirrored=mirrored)
    want = (layer_work(n, cf, sizes, skip=skip, **kw) + layer_work(n, cf, sizes, **kw)
            + ((n - np.arange(n) if mirrored else np.arange(n) + 1) % cf != 0))  # final F
    np.testing.assert_array_equal(counts, want)
    # redundant: the coarsest solve leaves the per-layer work, cycle_work is the sum of both
    red = layer_work(n, cf, sizes, nrelax=opts.nrelax_on, cycle=cycle, skip=skip)
    solves = step_weights(sizes, cf, opts.nrelax_on, skip, cycle)[2]
    assert red.sum() + solves * sizes[-1] == cycle_work(sizes, cf, opts.nrelax_on, skip, cycle)
    shared = block_work(n, [0], cf, sizes, nrelax=opts.nrelax_on, cycle=cycle, skip=skip)
    assert shared == [cycle_work(sizes, cf, opts.nrelax_on, skip, cycle)]


def test_bad_input_names_the_value():
    sizes = level_sizes(16, 4, 3, 2)
    with pytest.raises(ValueError, match=r"n_steps=16 .* cf=4 give 4 .* n_blocks=5"):
        balanced_starts(16, 5, 4, sizes)
    with pytest.raises(ValueError, match="n_blocks=9"):
        balanced_starts(8, 9)
    with pytest.raises(ValueError, match="n_blocks must be >= 1, got 0"):
        balanced_starts(8, 0)
    with pytest.raises(TypeError, match="n_steps must be an int, got 8.0"):
        balanced_starts(8.0, 2)
    with pytest.raises(ValueError, match="extra_last must be a finite number >= 0, got -1"):
        balanced_starts(8, 2, extra_last=-1)
    with pytest.raises(ValueError, match="extra_first .* nan"):
        block_work(8, [0, 4], extra_first=float("nan"))
    with pytest.raises(ValueError, match=r"sizes \[16, 5\] are not a level hierarchy"):
        balanced_starts(16, 2, 4, [16, 5])
    with pytest.raises(ValueError, match="coarsest must be 'redundant' or 'sequential', got 'x'"):
        balanced_starts(16, 2, 4, sizes, coarsest="x")
    with pytest.raises(ValueError, match="cycle must be 'V' or 'F', got 'W'"):
        layer_work(16, 4, sizes, cycle="W")
    with pytest.raises(ValueError, match="not both"):
        balanced_starts(16, 2, 4, sizes, work=np.ones(16))
    with pytest.raises(ValueError, match=r"work must be 16 .* shape \(15,\)"):
        balanced_starts(16, 2, work=np.ones(15))
    with pytest.raises(ValueError, match="min -1"):
        block_work(16, [0, 8], work=-np.ones(16))
    with pytest.raises(ValueError, match=r"starts \[0, 8, 8\]"):
        block_work(16, [0, 8, 8])
    with pytest.raises(ValueError, match="nrelax must be >= 0, got -1"):
        layer_work(16, 4, sizes, nrelax=[0, -1])


def test_large_partition_completes():
    """N = 65536 on 4096 blocks (timed by hand at ~0.1-0.2 s on a loaded machine; not asserted)."""
    n, blocks = 65536, 4096
    starts = balanced_starts(n, blocks, extra_first=3.0, extra_last=5.0)
    _check_valid(starts, n, blocks, 1)
    work = block_work(n, starts, extra_first=3.0, extra_last=5.0)
    assert max(work) == 17.0 and min(work) >= 16.0  # ceil((65536 + 8) / 4096) = 17
    sizes = level_sizes(n, 2, 6, 2)
    starts = balanced_starts(n, blocks, 2, sizes, nrelax=[0, 1], extra_last=40.0)
    _check_valid(starts, n, blocks, 2)
    work = block_work(n, starts, 2, sizes, nrelax=[0, 1], extra_last=40.0)
    old = block_work(n, block_starts(n + 1, blocks, 2), 2, sizes, nrelax=[0, 1],
                     extra_last=40.0)
    assert max(work) <= max(old) and max(work) - min(work) <= 2 * max(layer_work(
        n, 2, sizes, nrelax=[0, 1]).reshape(-1, 2).sum(1))  # within one group of cf layers


def test_layer_parallel_uses_balanced_blocks():
    """LayerParallel's layer blocks: balanced by modelled work, every layer rank holding layers
    (the issue's examples: 32 layers on 2 ranks split 16/16, not 20/12; 8 layers on 2 ranks
    [0, 4], not [0, 8]; 16 on 3 ranks no empty rank)."""
    import mgnn
    from mgnn import MGRITOptions
    from mgnn.network import CLOSING_WORK, OPENING_WORK, layer_work_model
    opts = MGRITOptions(cf=4, max_levels=3, nrelax=[0, 1], max_iter=2, tol=0.0)
    for n, P, want in ((32, 2, [0, 16]), (8, 2, [0, 4])):
        work = layer_work_model(n, opts, opts)
        starts = balanced_starts(n, P, 4, work=work, extra_first=OPENING_WORK,
                                 extra_last=CLOSING_WORK)
        assert starts == want
    starts = balanced_starts(16, 3, 4, work=layer_work_model(16, opts, opts),
                             extra_first=OPENING_WORK, extra_last=CLOSING_WORK)
    assert len(starts) == 3 and all(b > a for a, b in zip(starts, starts[1:])) and starts[-1] < 16
    lp = mgnn.LayerParallel(mgnn.dense_resnet(4, 4, 3, 32), opts, opts, threads=None)
    assert list(lp.partition.starts) == [0] and len(lp.block_work) == 1


@pytest.mark.parametrize("mirrored", [False, True])
def test_level_cost_weighs_each_level_s_counted_steps(mirrored):
    """With a cost per level (spatial coarsening: coarse steps are cheaper) the per-layer work
    is every counted step times its level's cost: the solver's calls, counted per level."""
    n, cf, levels = 67, 2, 3
    cost = [1.0, 0.25, 0.0625]
    counts = np.zeros(n)

    class Count:
        def step(self, u, start, stop, level):
            counts[n - stop if mirrored else start] += cost[level]
            return 0.5 * u + 1.0

    opts = MGRITOptions(cf=cf, max_levels=levels, nrelax=[0, 1], tol=0.0, max_iter=1)
    MGRITSolver(Count(), n, opts).solve(np.array([1.0]))
    sizes = level_sizes(n, cf, levels, 2)
    got = layer_work(n, cf, sizes, nrelax=opts.nrelax_on, coarsest="sequential",
                     mirrored=mirrored, level_cost=cost)
    final_f = (n - np.arange(n) if mirrored else np.arange(n) + 1) % cf != 0
    np.testing.assert_allclose(got + final_f, counts, rtol=0, atol=1e-12)
    assert got.sum() < layer_work(n, cf, sizes, nrelax=opts.nrelax_on,
                                  coarsest="sequential").sum()
    for bad in ([1.0, 0.5], [1.0, -1.0, 0.5], [1.0, float("nan"), 1.0], "abc"):
        with pytest.raises(ValueError, match="level_cost"):
            layer_work(n, cf, sizes, level_cost=bad)


def test_critical_path_weighs_levels():
    from mgnn.mgrit import cycle_critical_path, solve_critical_path
    opts = MGRITOptions(cf=4, max_levels=3, nrelax=[0, 1])
    sizes = level_sizes(256, 4, 3, 2)
    assert cycle_critical_path(sizes, opts.nrelax_on, 4, level_cost=[1, 1, 1]) == \
        cycle_critical_path(sizes, opts.nrelax_on, 4)
    every, into_f, solves = step_weights(sizes, 4, opts.nrelax_on)
    cost = [1.0, 0.25, 0.0625]
    nxt = sizes[1:] + [sizes[-1]]
    want = sum(c * (e * n + f * (n - m)) for c, e, f, n, m in zip(cost, every, into_f, sizes, nxt)) \
        + cost[-1] * solves * sizes[-1]
    assert cycle_critical_path(sizes, opts.nrelax_on, 1, level_cost=cost) == \
        pytest.approx((want, 0), rel=1e-14)
    s1, _ = solve_critical_path(sizes, opts.nrelax_on, 4, 2, level_cost=cost)
    s0, _ = solve_critical_path(sizes, opts.nrelax_on, 4, 2)
    assert s1 < s0
    with pytest.raises(ValueError, match=r"level_cost must hold 3 .*\(one per level\), got \[1, 1\]"):
        cycle_critical_path(sizes, opts.nrelax_on, 2, level_cost=[1, 1])


def test_spatial_coarsening_balances_with_cheaper_coarse_steps():
    """LayerParallel weighs a spatially coarsened level's steps by its pixel ratio (15x15 ->
    7x7: 49/225): the split minimises the largest block's weighted work, which the unweighted
    split does not (16x16 -> 8x8 -> 4x4, 32 layers, cf 4: 64 against 66.5 on 5 ranks)."""
    import mgnn
    from mgnn.network import CLOSING_WORK, OPENING_WORK, layer_work_model
    opts = MGRITOptions(cf=4, max_levels=3, nrelax=[0, 1], max_iter=2, tol=0.0)
    odd = mgnn.conv_resnet(1, 2, (15, 15), 3, 32, seed=0)
    assert mgnn.LayerParallel(odd, opts, opts, spatial_levels=(0,),
                              threads=None).level_cost == (1.0, 49 / 225, 49 / 225)
    assert mgnn.LayerParallel(odd, opts, opts, threads=None).level_cost == (1.0, 1.0, 1.0)
    model = mgnn.conv_resnet(1, 2, (16, 16), 3, 32, seed=0)
    lp = mgnn.LayerParallel(model, opts, opts, spatial_levels=(0, 1), threads=None)
    assert lp.level_cost == (1.0, 0.25, 0.0625)
    work = layer_work_model(32, opts, opts, "sequential", lp.level_cost)
    plain = layer_work_model(32, opts, opts, "sequential")
    kw = dict(extra_first=OPENING_WORK, extra_last=CLOSING_WORK)
    for P, best in ((3, 98.0), (5, 64.0)):
        weighted = balanced_starts(32, P, 4, work=work, **kw)
        unweighted = balanced_starts(32, P, 4, work=plain, **kw)
        assert max(block_work(32, weighted, work=work, **kw)) == pytest.approx(best)
        assert max(block_work(32, unweighted, work=work, **kw)) > best + 0.4


def test_replica_rows_are_the_owned_rows_of_the_redundant_coarsest_level():
    """replica_rows (arithmetic) against the rows listed one by one, for every layer block,
    stride and row count, forward (row r: layer r S) and adjoint (layer N - (r + 1) S)."""
    checked = 0
    for N in range(1, 25):
        for S in range(1, 7):
            for n_rows in range(0, -(-N // S) + 1):
                for adjoint in (False, True):
                    layer = [N - (r + 1) * S if adjoint else r * S for r in range(n_rows)]
                    for lo, hi in itertools.combinations(range(N + 1), 2):
                        mine = [r for r in range(n_rows) if lo <= layer[r] < hi]
                        r0, r1 = replica_rows(lo, hi, N, S, n_rows, adjoint)
                        assert list(range(r0, r1)) == mine, (N, S, n_rows, adjoint, lo, hi)
                        checked += bool(mine)
    assert checked > 1000


def test_replica_counts_are_every_ranks_replica_rows():
    """Partition.replica_counts (cached, in rank order) against replica_rows rank by rank, for
    partitions with ranks in order and reversed, forward and adjoint."""
    rng = np.random.default_rng(3)
    for _ in range(300):
        N = int(rng.integers(2, 60))
        P = int(rng.integers(1, min(N, 8) + 1))
        starts = (0,) + tuple(sorted(rng.choice(np.arange(1, N), P - 1, replace=False).tolist()))
        S = int(rng.integers(1, 9))
        n_rows = -(-N // S)
        for ranks in (tuple(range(P)), tuple(reversed(range(P)))):
            part = Partition(N, starts, ranks)
            for adjoint in (False, True):
                counts, displs = part.replica_counts(S, n_rows, adjoint)
                for r in range(P):
                    r0, r1 = replica_rows(*part.fine_range(r), N, S, n_rows, adjoint)
                    assert (displs[r], counts[r]) == (r0, r1 - r0) or counts[r] == r1 - r0 == 0


def test_partition_entries_that_cannot_be_checked_get_the_plain_error():
    """Unhashable starts (kept checks are keyed by the values) still get the ValueError that
    names them, and equal partitions share their checked tuples."""
    from mgnn.mgrit.partition import Partition
    with pytest.raises(ValueError, match="must begin at 0"):
        Partition(4, [[0], [2]], [0, 1])
    a, b = Partition(8, [0, 4], [0, 1]), Partition(8, (0, 4), (0, 1))
    assert a == b and a.starts is b.starts and a.ranks is b.ranks
