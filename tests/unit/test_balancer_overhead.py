"""The balancer's overhead budget (runtime.balancer.balancer_overhead_s): a collective's time on a
rank includes its wait for slower ranks, which is their imbalance and not the balancer's cost."""

import pytest

from deepspeed_knap.runtime.balancer import OVERHEAD_COLLECTIVES, balancer_overhead_s


def test_a_fast_ranks_wait_for_a_slow_one_is_not_overhead():
    """Rank 1 computes 2 s longer, so rank 0 waits 2 s in the reverse route (and rank 1 in none):
    the overhead is what the last to arrive spent, not the busiest rank's sum."""
    fast = {"gather": 0.01, "solve": 0.002, "agree": 0.001, "route": 0.03, "reverse_route": 2.04}
    slow = {"gather": 0.012, "solve": 0.004, "agree": 0.002, "route": 0.02, "reverse_route": 0.04}
    expected = 0.004 + 0.01 + 0.001 + 0.02 + 0.04  # the largest solve, each collective's least
    assert balancer_overhead_s([fast, slow]) == pytest.approx(expected)
    assert balancer_overhead_s([fast, slow]) < sum(fast.values()) / 20


def test_one_rank_is_its_own_sum_and_missing_parts_count_zero():
    phases = {"gather": 0.1, "solve": 0.2, "agree": 0.3, "route": 0.4, "reverse_route": 0.5, "compute": 9.0}
    assert balancer_overhead_s([phases]) == pytest.approx(1.5)  # compute and Ulysses are not the balancer's
    assert balancer_overhead_s([{"compute": 1.0}, {"compute": 2.0}]) == 0.0
    assert set(OVERHEAD_COLLECTIVES) == {"gather", "agree", "route", "reverse_route"}
