"""runtime.routing.gather_step_inputs on one rank (its all-gathers replaced by one that returns this
rank's row): bad attention segments, ragged ones included, become this rank's problem, which reaches
the header gather, so every rank raises together instead of one raising before it while the others
wait."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from deepspeed_knap.runtime import routing


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
    assert gathers[0][0] == 2 and gathers[0][-1] == 7  # the header: this rank's count, ..., its report


def test_a_given_problem_with_ragged_segments_is_still_gathered(gathers):
    with pytest.raises(ValueError, match="sample 4 is broken"):
        gather([3, 2], [[1, 2], [2]], problem="sample 4 is broken")
    assert len(gathers) == 2


def test_good_segments_are_gathered(gathers):
    step = gather([3, 2], np.array([[1, 2], [2, 0]]))
    assert step.seq_lens_per_rank == [[3, 2]] and step.segments_per_rank == [[[1, 2], [2, 0]]]
    assert step.reports == [[7]]
