"""runtime.routing.gather_step_inputs on one rank (its all-gathers replaced by one that returns this
rank's row): bad attention segments, ragged ones included, become this rank's problem, which reaches
the header gather, so every rank raises together instead of one raising before it while the others
wait. With a capacity, the rows ride the header: checked on ranks simulated by threads. Likewise
runtime.groups' agreement on problems and views."""

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from deepspeed_knap.runtime import balancer as balancer_module
from deepspeed_knap.runtime import routing
from deepspeed_knap.runtime.balancer import KnapBalancer


@pytest.fixture
def gathers(monkeypatch):
    calls = []

    def all_gather_ints(values, device, group):
        calls.append(list(values))
        return [list(values)]  # one rank: every rank's rows are this one's

    monkeypatch.setattr(routing, "_all_gather_ints", all_gather_ints)
    return calls


def gather(seq_lens, segments, problem=None):
    return routing.gather_step_inputs(seq_lens, segments, problem, torch.device("cpu"),
                                      SimpleNamespace(balance_group=None), [7])  # fmt: skip


@pytest.mark.parametrize(
    ("segments", "message"),
    [
        ([[1, 2], [2]], "attention segments are not an [N, K] table, one row per sequence"),  # ragged
        ([[1, [2]], [2, 0]], "attention segments are not an [N, K] table"),
        ([[1.5, 1.5], [2.0, 0.0]], "expected an [N, K] integer table"),
        ([[1, 1], [2, 0]], "sequence 0 has attention segments [1, 1], which do not sum to its length 3"),
    ],
)
def test_bad_segments_reach_the_header_gather_as_this_ranks_problem(gathers, segments, message):
    with pytest.raises(ValueError, match="invalid input, so no rank runs this step") as error:
        gather([3, 2], segments)
    assert message in str(error.value)
    assert len(gathers) == 2  # the header, then the problems' text: every rank takes part in both
    assert gathers[0][0] == 0 and gathers[0][-1] == 7  # the header: no count (read on the good path only), its report


def test_a_given_problem_with_ragged_segments_is_still_gathered(gathers):
    with pytest.raises(ValueError, match="sample 4 is broken"):
        gather([3, 2], [[1, 2], [2]], problem="sample 4 is broken")
    assert len(gathers) == 2


def test_good_segments_are_gathered(gathers):
    step = gather([3, 2], np.array([[1, 2], [2, 0]]))
    assert step.seq_lens_per_rank == [[3, 2]] and step.segments_per_rank == [[[1, 2], [2, 0]]]
    assert step.reports == [[7]]


class _Ranks:
    """``size`` ranks as threads, with an all-gather that, like gloo's, waits for every rank and
    needs the same number of integers from each (a rank sending a different size would hang or
    fail there)."""

    def __init__(self, size):
        self.size, self.barrier = size, threading.Barrier(size, timeout=10)
        self.slots, self.calls, self.local = [None] * size, [0] * size, threading.local()

    def all_gather_ints(self, values, device, group):
        rank = self.local.rank
        self.calls[rank] += 1
        self.slots[rank] = list(values)
        self.barrier.wait()
        gathered = list(self.slots)
        self.barrier.wait()  # every rank has read the slots before any overwrites them
        assert len({len(row) for row in gathered}) == 1, f"ranks sent different sizes: {gathered}"
        return gathered

    def run(self, step):
        """``step(rank)`` on every rank at once: each rank's result, or the error it raised."""
        results = [None] * self.size

        def body(rank):
            self.local.rank = rank
            try:
                results[rank] = step(rank)
            except Exception as error:  # each rank's error, compared by the test
                results[rank] = error

        threads = [threading.Thread(target=body, args=(rank,)) for rank in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return results


LENS = [[3, 2, 4], [], [1, 1, 2, 2, 5]]  # three ranks: 9, 0 and 15 integers with K = 2
SEGMENTS = [[[1, 2], [2, 0], [4, 0]], [], [[1, 0], [0, 1], [1, 1], [2, 0], [3, 2]]]


def gather_on_ranks(monkeypatch, capacity, problems=(None, None, None), lens=LENS, segments=SEGMENTS):
    """Every rank's gather_step_inputs at once; ``segments[rank]`` ``None``: that rank gives none."""
    ranks = _Ranks(len(lens))
    monkeypatch.setattr(routing, "_all_gather_ints", ranks.all_gather_ints)

    def step(rank):
        table = None if segments[rank] is None else np.array(segments[rank], dtype=np.int64).reshape(-1, 2)
        return routing.gather_step_inputs(lens[rank], table, problems[rank], torch.device("cpu"),
                                          SimpleNamespace(balance_group=None), [rank, 10 + rank], capacity)  # fmt: skip

    return ranks.run(step), ranks.calls


@pytest.mark.parametrize(("capacity", "collectives"), [(0, 2), (14, 2), (15, 1), (64, 1)])
def test_the_rows_ride_the_header_when_every_ranks_fit_the_capacity(monkeypatch, capacity, collectives):
    """The largest rank sends 5 lengths and 10 segment counts: one all-gather from a capacity of 15
    integers, two below it; every rank gets every rank's rows and report either way."""
    results, calls = gather_on_ranks(monkeypatch, capacity)
    assert calls == [collectives] * 3
    for step in results:
        assert step.seq_lens_per_rank == LENS and step.segments_per_rank == SEGMENTS
        assert step.reports == [[0, 10], [1, 11], [2, 12]]
        assert step.row_ints == 15


@pytest.mark.parametrize(("capacity", "collectives"), [(0, 2), (4, 2), (5, 1)])
def test_lengths_without_segments_ride_the_header_too(monkeypatch, capacity, collectives):
    results, calls = gather_on_ranks(monkeypatch, capacity, segments=[None] * 3)
    assert calls == [collectives] * 3
    for step in results:
        assert step.seq_lens_per_rank == LENS and step.segments_per_rank is None and step.row_ints == 5


@pytest.mark.parametrize("capacity", [0, 64])
def test_no_sequences_anywhere_take_one_all_gather(monkeypatch, capacity):
    results, calls = gather_on_ranks(monkeypatch, capacity, lens=[[], [], []], segments=[[], [], []])
    assert calls == [1] * 3
    assert all(step.seq_lens_per_rank == [[], [], []] and step.segments_per_rank == [[], [], []]
               and step.row_ints == 0 for step in results)  # fmt: skip


def test_ranks_with_and_without_segments_raise_together_after_the_header(monkeypatch):
    results, calls = gather_on_ranks(monkeypatch, 64, segments=[SEGMENTS[0], None, SEGMENTS[2]])
    assert calls == [1] * 3
    assert all(isinstance(error, ValueError) and "ranks disagree on attention segments" in str(error)
               and "[2, -1, 2]" in str(error) for error in results), results  # fmt: skip


@pytest.mark.parametrize("bad", [[1.5, "x"], [1.5, 2.5], [3, -1], [True, False], [2**62], iter([3, 2]), 5])
@pytest.mark.parametrize("with_segments", [False, True])
def test_lengths_that_are_not_integers_are_that_ranks_problem_on_every_rank(monkeypatch, bad, with_segments):
    """Floats, negatives, bools, 2**62 and beyond, an iterator or a
    number: rank 1's problem, raised on every rank after the header, not on rank 1 before it."""
    segments = SEGMENTS if with_segments else [None] * 3
    results, calls = gather_on_ranks(monkeypatch, 64, lens=[LENS[0], bad, LENS[2]], segments=segments)
    assert calls == [2] * 3  # the header, then the problems' text
    assert all(isinstance(error, ValueError) and "balance-group rank(s) [1]: sequence lengths must be a list of "
               "integers" in str(error) for error in results), results  # fmt: skip


@pytest.mark.parametrize(("table", "message"), [
    (np.array([[True, False], [False, True]]), "expected an [N, K] integer table"),
    (np.array([[2**64 - 1, 4], [2, 0]], dtype=np.uint64), "expected an [N, K] integer table below 2**62"),
    (np.zeros((2, 0), dtype=np.int64), "sequence 0 has attention segments [], which do not sum to its length 3"),
])  # fmt: skip
def test_segments_that_wrap_or_are_not_counts_are_this_ranks_problem(gathers, table, message):
    """Bools, a uint64 row whose sum wraps to the length, no columns for sequences of tokens."""
    with pytest.raises(ValueError, match="invalid input") as error:
        gather([3, 2], table)
    assert message in str(error.value)


def test_a_problem_on_one_rank_raises_on_every_rank_with_rows_inline(monkeypatch):
    results, calls = gather_on_ranks(monkeypatch, 64, problems=(None, "sample 2 is broken", None))
    assert all(isinstance(error, ValueError) and "balance-group rank(s) [1]: sample 2 is broken" in str(error)
               for error in results), results  # fmt: skip
    assert calls == [2] * 3  # the header with the rows, then the problems' text


def test_the_balancer_passes_the_largest_rows_seen_rounded_up_to_a_power_of_two(monkeypatch):
    """KnapBalancer._gather: the first step's lengths take two all-gathers; later ones pass the
    capacity the gathered rows showed (every rank computes it from the same gathered counts)."""
    capacities = []

    def gather_step_inputs(seq_lens, segments, problem, device, groups, report, capacity):
        capacities.append(capacity)
        return SimpleNamespace(reports=[[-1]], row_ints=row_ints.pop(0))

    monkeypatch.setattr(balancer_module, "gather_step_inputs", gather_step_inputs)
    row_ints = [15, 16, 3, 17, 0, 5000, 1000, 0]
    balancer = SimpleNamespace(_closed=None, _report=[-1], groups=None, _plan_parts={"gather": 0.0},
                               _gather_capacity=0)  # fmt: skip
    for _ in range(8):
        KnapBalancer._gather(balancer, [3], None, None, "cpu")
    # 5,000 integers once (past the 1,024 kept): that step's own second gather, not every later one's.
    assert capacities == [0, 16, 16, 16, 32, 32, 32, 1024]


@pytest.mark.parametrize(("segments", "prefetched"), [([[1, 2], [2]], None), ([[1.0, 2.0], [2.0, 0.0]], [[1, 2], [2, 0]]),
                                                      ([[True, True, True], [True, True, False]], [[1, 1, 1], [1, 1, 0]])])  # fmt: skip
def test_segments_the_gather_refuses_match_no_prefetched_plan_and_reach_the_agreement(
    monkeypatch, segments, prefetched
):
    """KnapBalancer._plan_ahead with segments the lengths gather would refuse (ragged, floats, bools),
    beside a plan prefetched for these lengths with the segments they would convert to: this rank
    chooses no plan and still takes part in the agreement (the fallback's gather then names the
    segments on every rank). Converting ragged rows would raise on this rank alone while the others
    waited in the agreement; converting the others would use the plan."""
    sent = []
    monkeypatch.setattr(balancer_module, "gather_ints", lambda value, device, groups: sent.append(value) or [value])
    ahead = balancer_module._PlanAhead([[3, 2]], None, 0, [3, 2], None, prefetched, reply=("plan", 0.0, False))
    worker = SimpleNamespace(waits_for_start=lambda ticket: False, discard=lambda ticket: None)
    balancer = SimpleNamespace(_ahead={0: ahead}, _worker=worker, _worker_timeout_s=1.0, steps=0,
                               _plan_parts={"solve": 0.0, "agree": 0.0}, groups=SimpleNamespace(rank=0, group_rank=0))  # fmt: skip
    batch = SimpleNamespace(seq_lens=[3, 2], tokens=torch.zeros(5, 1))
    assert KnapBalancer._plan_ahead(balancer, batch, segments, None) is None
    assert sent == [-1]
    # The plan is chosen for the segments it was prefetched with: the test is not passing for want of a match.
    balancer._ahead = {0: ahead}
    assert KnapBalancer._plan_ahead(balancer, batch, prefetched, None)[1] == "plan" and sent == [-1, 0]


def test_a_problem_or_view_naming_a_path_that_is_not_utf8_reaches_the_agreement(monkeypatch):
    """A path's byte that is not UTF-8 (a lone surrogate in Python) must not raise on the one rank
    that found it before the all-gather, leaving the others waiting in it."""
    from deepspeed_knap.runtime import groups

    monkeypatch.setattr(groups, "all_gather_bytes", lambda data: [b"", data])  # rank 1 found the problem
    path = "/ckpt/\udcff/mp_rank_00_model_states.pt"
    assert (
        groups.gather_problems(f"{path} is not there")
        == "rank(s) [1]: /ckpt/\\udcff/mp_rank_00_model_states.pt is not there"
    )
    assert groups.text_digest(path) != groups.text_digest(path.replace("\udcff", "\\udcff"))
