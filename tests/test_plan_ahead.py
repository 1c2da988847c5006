"""Plans solved ahead in a worker process: the same plans as solving in the step, the same outputs,
and every rank falling back together when one rank's worker or batch is not what was planned."""

import numpy as np
import pytest
import torch

from deepspeed_knap.plan_worker import PlanWorker, PlanWorkerError
from deepspeed_knap.planner import DEFAULT_SOLVER, plan_routing
from deepspeed_knap.topology import build_topology
from deepspeed_knap.workload import WorkloadModel, default_workload
from deepspeed_knap.workloads import sample_workload
from tests.distributed import run_distributed


def test_worker_plans_equal_plan_routings_in_order_and_survive_errors_and_a_death():
    model = default_workload("flux-dev")
    topology = build_topology("auto", 32, gpus_per_node=8)
    steps = [sample_workload("kf_image_video", 32, seed) for seed in range(3)]
    worker = PlanWorker()
    try:
        tickets = [worker.submit(lengths, topology, model, DEFAULT_SOLVER, None) for lengths in steps]
        for ticket, lengths in reversed(list(zip(tickets, steps, strict=True))):  # read in any order
            plan, solve_s = worker.result(ticket)
            assert plan == plan_routing(lengths, topology, model)  # every field, bit for bit
            assert solve_s > 0
        # A solve that raises comes back as the error, and the worker goes on.
        with pytest.raises(ValueError, match="max_tokens_per_gpu") as expected:
            plan_routing(steps[0], topology, model, DEFAULT_SOLVER, 10)
        failing = worker.submit(steps[0], topology, model, DEFAULT_SOLVER, 10)
        with pytest.raises(PlanWorkerError, match="raised ValueError") as raised:
            worker.result(failing)
        assert str(expected.value) in str(raised.value)
        good = worker.submit(steps[1], topology, model, DEFAULT_SOLVER, None)
        assert worker.result(good)[0] == plan_routing(steps[1], topology, model)
        # A dead worker fails its jobs; the next submit starts another.
        worker._process.kill()
        worker._process.wait()
        lost = worker.submit(steps[2], topology, model, DEFAULT_SOLVER, None)
        with pytest.raises(PlanWorkerError, match=r"could not be sent .*exit code -9"):
            worker.result(lost)
        again = worker.submit(steps[2], topology, model, DEFAULT_SOLVER, None)
        assert worker.result(again)[0] == plan_routing(steps[2], topology, model)
    finally:
        worker.close()
    with pytest.raises(PlanWorkerError, match="no job 99"):
        worker.result(99)


DIM, HEADS, COND = 16, 4, 3
WORKLOAD = WorkloadModel(1e-6, 1e-8, alltoall_coef=1e-9)
# Per step, each rank's lengths: the long sequences alternate between the ranks, so plans move work.
LENGTHS = [[[48, 40, 3], [5, 2]], [[4, 6], [56, 30, 9]], [[64, 2], [7]], [[3], [33, 50]], [[40, 41], [1, 2, 3]],
           [[9, 9], [60]]]  # fmt: skip
KILL_AT = 1  # rank 0's worker dies before the prefetch of step 2: step 2 is planned in the step
MISMATCH_AT = 4  # rank 1's step-4 batch is not the one it prefetched


def _prefetch_worker(rank: int, world: int, online: bool) -> tuple[list[dict], list[str]]:
    import select

    import deepspeed.comm as dist

    from deepspeed_knap.balancer import KnapBalancer
    from deepspeed_knap.models.tiny_dit import TinyDiT, random_batch
    from deepspeed_knap.online import OnlineSettings
    from deepspeed_knap.topology import create_process_groups

    dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    topology = build_topology("auto", world)
    settings = OnlineSettings(warmup_steps=2) if online else None
    balancer = KnapBalancer(create_process_groups(topology), WORKLOAD, online=settings)
    torch.manual_seed(0)
    model = TinyDiT(DIM, HEADS, COND).double()

    def batch(step: int, lengths=None):
        return random_batch(lengths or LENGTHS[step][rank], 100 * step + rank, DIM, COND, torch.float64)

    results = []
    for step in range(len(LENGTHS)):
        if step == KILL_AT and rank == 0:  # once it has replied to this step's job, the worker dies
            worker = balancer._worker._process
            assert select.select([worker.stdout], [], [], 60)[0], "the worker did not reply within 60 s"
            worker.kill()
            worker.wait()
        if step + 1 < len(LENGTHS):
            balancer.prefetch(batch(step + 1).seq_lens)
        prefetched_with = balancer.model  # what the next step's plan was sent to the worker with
        given = batch(step, [17, 1]) if step == MISMATCH_AT and rank == 1 else batch(step)
        model.zero_grad()
        out = model(given, balancer)
        (out * out).sum().backward()
        balanced_grads = [p.grad.numpy().copy() for p in model.parameters()]
        model.zero_grad()
        reference = model(given)
        (reference * reference).sum().backward()
        seq_lens_per_rank, plan, _, _, planned_with = balancer._last
        results.append({
            "ahead": balancer.metrics()["knapformer/planned_ahead"],
            "out_err": float((out - reference).abs().max().detach()),
            "grads": [(b, p.grad.numpy().copy()) for b, p in zip(balanced_grads, model.parameters(), strict=True)],
            "lengths": seq_lens_per_rank,
            "as_solved_in_step": plan == plan_routing(seq_lens_per_rank, topology, planned_with),
            "model": planned_with,
            "prefetched_with": prefetched_with,
            "fingerprint": plan.fingerprint,
            "groups": sorted(set(plan.seq_group_size.tolist())),
        })  # fmt: skip
        if online:
            results[-1]["observed"] = balancer.online.observed
    errors = []
    try:  # bad lengths on one rank: every rank raises, none waits
        balancer.prefetch([5, -3] if rank == 1 else [4])
    except ValueError as error:
        errors.append(str(error))
    balancer.prefetch([4])
    try:  # twice for the same forward
        balancer.prefetch([4])
    except RuntimeError as error:
        errors.append(str(error))
    return results, errors


@pytest.mark.parametrize("online", [False, True], ids=["fixed-model", "online-refit"])
def test_prefetched_plans_equal_plans_solved_in_the_step_and_ranks_fall_back_together(online):
    results, errors = zip(*run_distributed(_prefetch_worker, 2, args=(online,), timeout=240), strict=True)
    assert "rank(s) [1]" in errors[0][0] and "non-negative integers below 2**62; got [5, -3]" in errors[1][0], errors
    assert all("already called" in rank_errors[1] for rank_errors in errors), errors
    ahead = [1.0] * len(LENGTHS)
    ahead[0] = ahead[KILL_AT + 1] = ahead[MISMATCH_AT] = 0.0  # nothing prefetched; a dead worker; a mismatch
    for rank, steps in enumerate(results):
        assert [step["ahead"] for step in steps] == ahead, rank
        for index, step in enumerate(steps):
            assert step["as_solved_in_step"], (rank, index)
            assert step["out_err"] <= 1e-10, (rank, index)
    for index, (mine, theirs) in enumerate(zip(*results, strict=True)):
        assert mine["fingerprint"] == theirs["fingerprint"], index  # one plan on every rank
        assert mine["lengths"] == theirs["lengths"], index
        assert mine["model"] == theirs["model"], index
        # Rank-summed gradients of the balanced run equal those of the unbalanced one.
        for (b0, r0), (b1, r1) in zip(mine["grads"], theirs["grads"], strict=True):
            reference = r0 + r1
            assert np.abs((b0 + b1) - reference).max() <= 1e-10 * np.abs(reference).max(), index
    assert results[0][MISMATCH_AT]["lengths"][1] == [17, 1]  # planned for the batch given, not prefetched
    assert any(2 in step["groups"] for step in results[0]), "some step must split a sequence over both ranks"
    if online:
        steps = results[0]
        # Step s's times ride with the next lengths gathered, at the top of step s + 1 (its prefetch):
        # each step recorded once, none twice. The last step prefetches nothing, and its own plan was
        # prefetched: no gather ships step 4's times.
        assert [step["observed"] for step in steps] == [0, 1, 2, 3, 4, 4]
        # A plan made ahead used the model as it was at the prefetch, a step before its own.
        for index in range(1, len(LENGTHS)):
            if steps[index]["ahead"]:
                assert steps[index]["model"] == steps[index - 1]["prefetched_with"], index
        # The refit ran (warm after 2 steps) and planned what followed: later steps' models differ.
        assert steps[-1]["model"] != steps[0]["model"]
