"""The chain-by-chain critical path of an MGRIT solve and ``--levels auto``'s choice from it."""
import math

import pytest

from mgnn.mgrit import MGRITOptions, cycle_work, level_sizes, solve_critical_path
from mgnn.mgrit.hierarchy import auto_levels, chain_critical_path

FCF = MGRITOptions(nrelax=[0, 1]).nrelax_on


@pytest.mark.parametrize("n_layers", [256, 11, 100, 1000])
@pytest.mark.parametrize("levels", [2, 3, 4])
@pytest.mark.parametrize("cycles, skip", [(1, False), (2, True), (3, False)])
def test_on_one_rank_it_is_the_solve_s_work(n_layers, levels, cycles, skip):
    """Layers divisible by cf or not (a last, shorter F-interval on some level)."""
    sizes = level_sizes(n_layers, 4, levels, 2)
    steps, msgs = chain_critical_path(sizes, 4, FCF, 1, cycles, skip)
    want = sum(cycle_work(sizes, 4, FCF, skip and k == 0) for k in range(cycles))
    assert (steps, msgs) == (want + sizes[0] - sizes[1], 0)


@pytest.mark.parametrize("ranks", [2, 4])
def test_with_whole_intervals_on_every_rank_it_equals_the_shared_sweeps(ranks):
    """1024 layers, cf 4, 3 levels on 2 or 4 ranks: every rank holds whole intervals of every
    level, so each sweep is work / P after one message (solve_critical_path's model), plus
    the residual norm's allreduce (log2 P messages) in every cycle but the cascadic one."""
    sizes = level_sizes(1024, 4, 3, 2)
    steps, msgs = chain_critical_path(sizes, 4, FCF, ranks, 2, True, coarsest="sequential")
    s, m = solve_critical_path(sizes, FCF, ranks, 2, skip=True)
    assert (steps, msgs) == (s, m + math.log2(ranks))


def test_an_interval_spanning_ranks_is_a_chain_with_a_hand_off_per_rank():
    """16 layers on 16 ranks, cf 4, 2 levels, one cycle, F relaxation only: each rank holds
    one point, so the F-sweep is a chain of 3 steps over the 4 ranks of an interval (3
    hand-offs); the C-sweep and the coarse right-hand side 1 step after 1 message; the
    coarsest (4 steps) redundant after an allgather over the 16 ranks (4 messages); the
    residual norm's allreduce (4); then the final F-relaxation again."""
    sizes = [16, 4]
    steps, msgs = chain_critical_path(sizes, 4, lambda lev: 0, 16, 1)
    assert steps == 3 + 1 + 1 + 4 + 3
    assert msgs == 3 + 1 + 1 + 4 + 4 + 3
    # sequential: the 5 coarse points' ranks in turn (4 hand-offs); 2 points a rank: 1 hand-off
    # per interval, after a message (16 layers on 8 ranks)
    assert chain_critical_path([16, 4], 4, lambda lev: 0, 16, 1, coarsest="sequential") == \
        (steps, msgs)
    assert chain_critical_path(sizes, 4, lambda lev: 0, 8, 1) == (12, 1 + 1 + 1 + 3 + 3 + 1)
    # the shared-sweep model counts the same F-sweep as 12 / 16 of a step and one message
    assert solve_critical_path(sizes, lambda lev: 0, 16, 1)[0] < steps


def test_one_level_is_the_layer_by_layer_hand_off():
    assert chain_critical_path([64], 4, FCF, 4, 2) == (64.0, 3.0)


def test_auto_levels_choices():
    # one rank: no hierarchy beats stepping layer by layer
    assert auto_levels(1024, 4, 1, (2, 1), FCF)[0] == 1
    # 16384 layers on 4096 ranks (2/1 cycles, cf 4): the predictor's best was 6 levels (10.2
    # ms; 7: 10.8 ms; 3: 99 ms) with a message and call ~3 steps
    levels, costs = auto_levels(16384, 4, 4096, (2, 1), FCF, True, 2, message_steps=3.0)
    assert levels == 6 and costs[3] > 5 * costs[6] and costs[7] > costs[6]
    assert set(costs) == set(range(1, 8))  # 8 levels would leave 1 coarse interval (< 2)
    # cheaper messages favour deeper hierarchies; the fewest levels within the slack win
    assert auto_levels(16384, 4, 4096, (2, 1), FCF, True, 2, message_steps=0.1)[0] == 7
    L, c = auto_levels(256, 4, 16, (2, 1), FCF, True, 2, message_steps=1.0, slack=0.5)
    assert c[L] <= 1.5 * min(c.values()) and all(c[k] > 1.5 * min(c.values()) for k in c
                                                    if k < L)


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan])
def test_auto_levels_names_a_bad_message_cost(bad):
    with pytest.raises(ValueError, match="message_steps must be a finite number >= 0"):
        auto_levels(64, 4, 2, message_steps=bad)


def test_chain_critical_path_names_a_bad_coarsest():
    with pytest.raises(ValueError, match="coarsest must be 'redundant' or 'sequential', got 'x'"):
        chain_critical_path([16, 4], 4, FCF, 2, 1, coarsest="x")
