"""Where each finished request is decoded: :func:`place_decodes` against brute force, and the
batcher's finishing requests against its own leaves."""

from __future__ import annotations

import itertools
import random

import pytest

from deepspeed_knap.generation.decodes import place_decodes
from deepspeed_knap.generation.schedule import Job, StepBatcher


def _makespan(works: dict[int, float], placed: dict[int, int], world: int) -> float:
    loads = [0.0] * world
    for index, rank in placed.items():
        loads[rank] += works[index]
    return max(loads)


def test_a_step_s_decodes_are_spread_within_graham_s_bound_of_the_best_spread():
    """Longest first onto the least loaded rank: at most (4/3 - 1/(3m)) of the best makespan,
    which brute force finds, on random steps of 1-7 decodes over 2-4 ranks."""
    rng = random.Random(0)
    worse = 0
    for _ in range(300):
        world = rng.randint(2, 4)
        works = {index: float(rng.randint(1, 60)) for index in range(rng.randint(1, 7))}
        homes = {index: rng.randrange(world) for index in works}
        busy = [rng.uniform(0, 10) for _ in range(world)]
        placed = place_decodes(works, homes, busy)
        assert sorted(placed) == sorted(works) and set(placed.values()) <= set(range(world))
        best = min(_makespan(works, dict(zip(works, ranks, strict=True)), world)
                   for ranks in itertools.product(range(world), repeat=len(works)))  # fmt: skip
        ours = _makespan(works, placed, world)
        assert ours <= (4 / 3 - 1 / (3 * world)) * best + 1e-9
        worse += ours > best + 1e-9
    assert worse > 0  # list scheduling is not brute force: the bound is what holds


def test_a_lone_decode_goes_to_the_least_busy_rank_and_ties_stay_home():
    assert place_decodes({7: 100.0}, {7: 0}, [5.0, 2.0, 3.0]) == {7: 1}
    assert place_decodes({7: 100.0}, {7: 2}, [1.0, 1.0, 1.0]) == {7: 2}
    # Two equal clips of rank 0 (the imbalanced bench's case): one moves, the other stays.
    assert place_decodes({0: 50.0, 2: 50.0, 1: 1.0}, {0: 0, 2: 0, 1: 1}, [1.0, 1.0]) == {0: 0, 2: 1, 1: 1}


def test_the_placement_does_not_depend_on_the_order_given():
    works = {3: 10.0, 1: 10.0, 2: 4.0, 0: 4.0}
    homes = {0: 0, 1: 1, 2: 0, 3: 1}
    reordered = dict(reversed(works.items()))
    assert place_decodes(works, homes, [0.0, 0.0]) == place_decodes(reordered, homes, [0.0, 0.0])


@pytest.mark.parametrize(("works", "homes", "message"), [
    ({0: -1.0}, {0: 0}, "request 0's decode price is -1.0"),
    ({0: float("nan")}, {0: 0}, "request 0's decode price is nan"),
    ({0: 1.0}, {0: 2}, "request 0's home is rank 2; there are 2 ranks"),
])  # fmt: skip
def test_bad_prices_and_homes_are_refused(works, homes, message):
    with pytest.raises(ValueError, match=message):
        place_decodes(works, homes, [0.0, 0.0])


def test_the_batcher_names_each_request_finishing_at_the_step_it_runs_last():
    jobs = [Job(i, i % 2, (10 + i,), steps) for i, steps in enumerate([3, 1, 2, 4, 1, 2])]
    batcher = StepBatcher(jobs, 2, 20, lambda lengths: lengths)  # 40 tokens: some wait
    first: dict[int, int] = {}
    finishing: tuple[int, ...] = ()
    finished = []
    while (step := batcher.next_step()) is not None:
        assert step.left == finishing  # those named finishing leave at the next step
        for index in step.joined:
            first[index] = step.number
        finishing = batcher.finishing()
        assert finishing == tuple(i for i in step.active if step.number - first[i] + 1 == jobs[i].steps)
        finished.extend(finishing)
    assert sorted(finished) == list(range(len(jobs))) and len(set(first.values())) > 1
