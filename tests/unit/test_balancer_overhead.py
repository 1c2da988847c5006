"""The balancer's overhead budget (runtime.balancer.balancer_overhead_s): a collective's time on a
rank includes its wait for slower ranks, which is their imbalance and not the balancer's cost."""

import time
from types import SimpleNamespace

import pytest

from deepspeed_knap.runtime import balancer as balancer_module
from deepspeed_knap.runtime.balancer import OVERHEAD_COLLECTIVES, KnapBalancer, balancer_overhead_s
from deepspeed_knap.runtime.timing import PLAN_PARTS


def test_a_fast_ranks_wait_for_a_slow_one_is_not_overhead():
    """Rank 1 computes 2 s longer, so rank 0 waits 2 s in the reverse route (and rank 1 in none):
    the overhead is what the last to arrive spent, not the busiest rank's sum."""
    fast = {"gather": 0.01, "refit": 0.0007, "solve": 0.002, "agree": 0.001, "route": 0.03, "reverse_route": 2.04}
    slow = {"gather": 0.012, "refit": 0.0005, "solve": 0.004, "agree": 0.002, "route": 0.02, "reverse_route": 0.04}
    # The slow rank's refit and solve together (its own, back to back), each collective's least.
    expected = 0.0005 + 0.004 + 0.01 + 0.001 + 0.02 + 0.04
    assert balancer_overhead_s([fast, slow]) == pytest.approx(expected)
    assert balancer_overhead_s([fast, slow]) < sum(fast.values()) / 20


def test_one_rank_is_its_own_sum_and_missing_parts_count_zero():
    phases = {"gather": 0.1, "refit": 0.05, "solve": 0.2, "agree": 0.3, "route": 0.4, "reverse_route": 0.5,
              "compute": 9.0}  # fmt: skip
    assert balancer_overhead_s([phases]) == pytest.approx(1.55)  # compute and Ulysses are not the balancer's
    assert balancer_overhead_s([{"compute": 1.0}, {"compute": 2.0}]) == 0.0
    assert set(OVERHEAD_COLLECTIVES) == {"gather", "agree", "route", "reverse_route"}


def test_recording_the_last_step_and_the_online_refit_count_as_the_refit_part(monkeypatch):
    """After the lengths gather, the balancer records the closed step's times and refits the cost
    model (online): host work of the balancer's, counted in ``refit`` (not in the gather's time,
    nor nowhere)."""
    gathered = SimpleNamespace(reports=[[1], [2]], row_ints=0)
    monkeypatch.setattr(balancer_module, "gather_step_inputs", lambda *args: gathered)
    recorded = []

    def record(*args):
        recorded.append(args)
        time.sleep(0.05)

    balancer = SimpleNamespace(_closed=("times", "plan"), _report=[0], groups=None, _record=record,
                               _plan_parts=dict.fromkeys(PLAN_PARTS, 0.0), _gather_capacity=0)  # fmt: skip
    assert KnapBalancer._gather(balancer, [3, 4], None, None, "cpu") is gathered
    assert recorded == [("times", "plan", gathered.reports)]
    assert balancer._plan_parts["refit"] >= 0.045 > balancer._plan_parts["gather"]
    assert balancer_overhead_s([{"refit": 0.05}, {"refit": 0.01}]) == 0.05  # the slowest rank's, like a solve


def test_the_compute_leaves_out_every_exchange_inside_the_blocks():
    """Some models route a sample's rows between their blocks (FLUX's text, Wan's experts): that
    route, and a fast rank's wait in it for a slow one, is no compute. Routes before and after the
    blocks were never in it; every kind inside, Ulysses' and its set-up included, is left out."""
    import torch

    from deepspeed_knap.runtime.timing import StepTimes

    times = StepTimes(torch.device("cpu"))

    def exchanged(kind: str, seconds: float) -> None:
        start = times.begin_exchange()
        time.sleep(seconds)
        times.end_exchange(kind, start)

    times.mark("plan_start")
    times.mark("plan_end")
    exchanged("route", 0.05)  # before the blocks
    times.mark("blocks_start")
    exchanged("setup", 0.1)
    exchanged("route", 0.2)  # between blocks: waiting for a slower rank, say
    exchanged("ulysses", 0.1)
    times.mark("blocks_end")
    times.mark("blocks_grad_start")
    exchanged("route", 0.2)  # its backward
    times.mark("blocks_grad_end")
    exchanged("reverse_route", 0.05)  # after
    seconds = times.seconds()
    assert seconds["route"] >= 0.45 and seconds["ulysses"] >= 0.1 and seconds["setup"] >= 0.1
    assert len(times.inside) == 4 and seconds["compute"] < 0.1  # it was >= 0.4, the two routes inside


def test_a_step_no_rank_timed_leaves_the_online_refit_as_it_was():
    """A forward without a backward (a validation loss) or with failed timers reports -1 on every
    rank: the refit does not observe it (its evidence would age a step and the route fit expire
    after enough of them); the next timed step is observed."""
    from deepspeed_knap.cost.model import CostModel
    from deepspeed_knap.cost.online import OnlineCostModel
    from deepspeed_knap.models.registry import sample_mix
    from deepspeed_knap.planner import build_topology, plan_routing
    from deepspeed_knap.runtime.balancer import _REPORTED

    prior = CostModel(1e-5, 1e-9)
    plan = plan_routing(sample_mix("kf_mixed_res", 2, 0), build_topology("auto", 2), prior)
    online = OnlineCostModel(prior, 2)
    balancer = SimpleNamespace(online=online, _measured_steps=2, _overhead=None, _measured=None)
    KnapBalancer._record(balancer, plan, prior, None, [[-1] * len(_REPORTED)] * 2)
    assert online.observed == 0 and balancer._measured_steps == 2
    timed = [[40_000, 0, 100_000] + [100] * (len(_REPORTED) - 3), [50_000, 0, 100_000] + [100] * (len(_REPORTED) - 3)]
    KnapBalancer._record(balancer, plan, prior, None, timed)
    assert online.observed == 1 and balancer._measured_steps == 3 and balancer._overhead > 0
