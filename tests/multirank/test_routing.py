"""Routing and KnapDistributedAttention on gloo ranks: conservation, equivalence, traffic, bad input.

Each topology runs in one spawn (spawning ranks costs most of the time); the worker returns what it
measured and the tests assert on it.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

from tests.support.distributed import run_distributed

DIM, HEADS, COND = 24, 6, 5  # 6 heads: bags of 4 GPUs split them unevenly (2, 2, 1, 1)

# Per global rank: a rank with no sequences, sequences shorter than the bag, odd lengths.
SEQ_LENS = [[37, 5, 1], [], [64, 3], [2, 11, 19, 7], [1], [23, 23], [], [50]]

# Balancing pays with a free all-to-all, so the solvers really use the bags.
WORKLOAD = dict(linear_coef=1.0, quadratic_coef=0.05, alltoall_coef=0.0)


def _init() -> None:
    import deepspeed.comm as dist

    dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)


def _setup(rank: int, world: int, spec: str, solver: str):
    from deepspeed_knap.cost.model import CostModel
    from deepspeed_knap.planner.topology import build_topology
    from deepspeed_knap.runtime.balancer import KnapBalancer
    from deepspeed_knap.runtime.groups import create_process_groups

    _init()
    topology = build_topology(spec, world)
    groups = create_process_groups(topology)
    return topology, groups, KnapBalancer(groups, CostModel(**WORKLOAD), solver=solver)


def _batch(rank: int, dtype: torch.dtype):
    from deepspeed_knap.models.tiny_dit import random_samples
    from deepspeed_knap.runtime.packing import pack_samples

    samples = random_samples(SEQ_LENS[rank], 1000 + rank, DIM, COND, dtype)
    for s in samples:
        s["is_text"] = s["modality"] == 0  # a bool column
        s["sample_id"] = torch.tensor(1000 * rank + len(s["tokens"]))  # an int64 per-sample tensor
    if not samples:
        from deepspeed_knap.runtime.packing import PackedBatch

        return PackedBatch(
            torch.zeros(0, DIM, dtype=dtype),
            (),
            {"position_ids": torch.zeros(0, 3, dtype=torch.int64), "modality": torch.zeros(0, dtype=torch.int8),
             "is_text": torch.zeros(0, dtype=torch.bool)},
            {"cond": torch.zeros(0, COND, dtype=dtype), "sample_id": torch.zeros(0, dtype=torch.int64)},
        )  # fmt: skip
    return pack_samples(samples, ("position_ids", "modality", "is_text"), ("cond", "sample_id"))


@contextlib.contextmanager
def _counted_all_to_alls():
    """Counts this rank's calls of ``deepspeed.comm.all_to_all_single`` (every exchange's collective)."""
    import deepspeed.comm as dist

    calls, real = [0], dist.all_to_all_single

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    with mock.patch.object(dist, "all_to_all_single", counted):
        yield calls


def _conservation(rank: int, world: int, spec: str) -> dict:
    """Route and reverse-route with every solver and two dtypes; check bit-exactness and placement,
    and count the all-to-alls of plans that keep every token home and of those that move some."""
    from deepspeed_knap.runtime.routing import reverse_route, route

    topology, groups, balancer = _setup(rank, world, spec, "refine")
    checked = {"max_group": 0, "chunks": 0, "all_to_alls_home": 0, "all_to_alls_moving": 0}
    for solver in ("none", "knapformer", "refine"):
        balancer.solver = solver
        for dtype in (torch.float64, torch.bfloat16):
            batch = _batch(rank, dtype)
            plan = balancer.plan(batch)
            with _counted_all_to_alls() as calls:
                routed = route(batch, plan, groups)
                assert routed.batch.problem() is None
                # Round trip: bitwise, tokens and every side column.
                assert torch.equal(reverse_route(routed.batch.tokens, routed), batch.tokens)
                for name, column in batch.token_data.items():
                    back = reverse_route(routed.batch.token_data[name], routed)
                    assert back.dtype == column.dtype and torch.equal(back, column), name
            checked["all_to_alls_home" if plan.tokens_moved == 0 else "all_to_alls_moving"] += calls[0]
            # Placement: every held chunk is exactly that slice of its sequence, with its sample's rows.
            home_ranks = {g: groups.replica * topology.group_size + g for g in range(topology.group_size)}
            offset = 0
            chunks = zip(routed.seq_ids, routed.layout.chunk_starts, routed.layout.chunk_lens, strict=True)
            for row, (seq, start, length) in enumerate(chunks):
                src = int(plan.seq_src_rank[seq])
                index = int(seq) - int((plan.seq_src_rank < src).sum())
                source = _batch(home_ranks[src], dtype)
                first = source.offsets[index] + int(start)
                assert torch.equal(routed.batch.tokens[offset : offset + length], source.tokens[first : first + length])
                for name in source.token_data:
                    assert torch.equal(routed.batch.token_data[name][offset : offset + length],
                                       source.token_data[name][first : first + length])  # fmt: skip
                for name in source.sample_data:
                    assert torch.equal(routed.batch.sample_data[name][row], source.sample_data[name][index])
                offset += int(length)
                checked["chunks"] += 1
            assert offset == routed.batch.num_tokens == plan.gpu_tokens[groups.group_rank]
            checked["max_group"] = max(checked["max_group"], int(plan.seq_group_size.max(initial=1)))
    return checked


def _balanced_against_unbalanced(model, batch, balancer, rank: int) -> dict:
    """Outputs (this rank's) and parameter gradients (summed over ranks) of ``model`` with and without
    ``balancer``: the largest relative differences."""
    import deepspeed.comm as dist

    weights = torch.randn(batch.tokens.shape, generator=torch.Generator().manual_seed(rank), dtype=batch.tokens.dtype)
    runs = []
    for bal in (None, balancer):
        model.zero_grad(set_to_none=False)
        out = model(batch, bal)
        (out * weights).sum().backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        dist.all_reduce(grads)
        runs.append((out.detach(), grads))
    (out_ref, grads_ref), (out, grads) = runs
    return {
        # relative to the largest output (position ids up to 64 make outputs ~30)
        "out_err": float((out - out_ref).abs().amax() / out_ref.abs().amax().clamp(min=1)) if out.numel() else 0.0,
        "grad_err": float((grads - grads_ref).abs().max() / grads_ref.abs().max()),
    }


def _equivalence(rank: int, world: int, spec: str) -> dict:
    """TinyDiT with balancing on vs off: outputs per rank, parameter gradients summed over ranks."""

    from deepspeed_knap.models.tiny_dit import TinyDiT
    from deepspeed_knap.runtime.balancer import KnapBalancer
    from tests.unit.test_layout import mixed_plan

    class MixedPlans(KnapBalancer):
        """Plans no solver makes: GPUs in several attention groups at once (home and bag)."""

        def plan(self, batch):
            plan = super().plan(batch)
            lens = [plan.seq_lens[plan.seq_src_rank == g].tolist() for g in range(topology.group_size)]
            return mixed_plan(lens, topology, self.cost_model, seed=7)

    topology, groups, balancer = _setup(rank, world, spec, "refine")
    mixed = MixedPlans(groups, balancer.cost_model)
    result = {}
    # "mixed" last: it replaces the balancer.
    for dtype, solver in ((torch.float64, "refine"), (torch.float32, "knapformer"), (torch.float64, "none"),
                          (torch.float64, "mixed")):  # fmt: skip
        if solver == "mixed":
            balancer = mixed
        else:
            balancer.solver = solver
        torch.manual_seed(0)
        model = TinyDiT(DIM, HEADS, COND, topology=topology).to(dtype)
        batch = _batch(rank, dtype)
        with _counted_all_to_alls() as calls:  # forward and backward, with balancing and without
            errors = _balanced_against_unbalanced(model, batch, balancer, rank)
        result[f"{dtype}-{solver}"] = {
            **errors,
            "max_group": int(balancer.plan(batch).seq_group_size.max(initial=1)),
            "all_to_alls": calls[0],
        }
    return result


def _empty_chunk_worker(rank: int, world: int) -> float:
    """GPU 1 holds only an empty chunk of its one bag sequence and runs its own sequence alone: it is
    in two attention groups, one with no rows."""
    import numpy as np

    from deepspeed_knap.models.tiny_dit import TinyDiT, random_batch
    from deepspeed_knap.planner.fixed import Problem
    from deepspeed_knap.runtime.balancer import KnapBalancer

    topology, groups, _ = _setup(rank, world, "g2n1", "refine")

    class EdgePlan(KnapBalancer):
        def plan(self, batch):
            problem = Problem.build([[1], [5]], topology, self.cost_model, None)
            return problem.make_plan("edge", np.array([0, 1]), np.array([2, 1]))

    torch.manual_seed(0)
    model = TinyDiT(DIM, HEADS, COND).double()
    batch = random_batch([[1], [5]][rank], rank, DIM, COND, torch.float64)
    balanced = model(batch, EdgePlan(groups, _cost_model()))
    return float((balanced - model(batch)).abs().max())


def _cost_model():
    from deepspeed_knap.cost.model import CostModel

    return CostModel(**WORKLOAD)


def test_gpu_in_two_attention_groups_one_with_only_an_empty_chunk():
    assert max(run_distributed(_empty_chunk_worker, 2)) <= 1e-12


def _topology_worker(rank: int, world: int, spec: str) -> dict:
    return {"conservation": _conservation(rank, world, spec), "equivalence": _equivalence(rank, world, spec)}


@pytest.mark.parametrize(
    ("spec", "world"),
    [("g1n4", 4), ("g2n2", 4), ("g4n1", 4), ("g1n2+g2n1", 4), ("g1n2+g2n1+g4n1", 8), ("g1n2+g2n1", 8)],
    ids=["g1n4", "g2n2", "g4n1", "g1n2+g2n1", "g1n2+g2n1+g4n1", "g1n2+g2n1-x2-replicas"],
)
def test_routing_is_exact_and_balanced_model_equals_unbalanced(spec, world):
    results = run_distributed(_topology_worker, world, args=(spec,), timeout=300)
    largest_bag = max(int(term.split("n")[0][1:]) for term in spec.split("+"))
    for rank, result in enumerate(results):
        conservation, equivalence = result["conservation"], result["equivalence"]
        assert conservation["max_group"] == largest_bag, "the solvers must really use the bags"
        for case, tolerance in (("torch.float64-refine", 1e-10), ("torch.float32-knapformer", 1e-5),
                                ("torch.float64-mixed", 1e-10), ("torch.float64-none", 1e-10)):  # fmt: skip
            assert equivalence[case]["out_err"] <= tolerance, (rank, case, equivalence)
            assert equivalence[case]["grad_err"] <= tolerance, (rank, case, equivalence)
        assert equivalence["torch.float32-knapformer"]["max_group"] == largest_bag
        # A plan that keeps every token home routes without a collective, forward or backward; the
        # others' all-to-alls are counted, so the counter does see them.
        assert conservation["all_to_alls_home"] == equivalence["torch.float64-none"]["all_to_alls"] == 0, result
        assert conservation["all_to_alls_moving"] > 0 and equivalence["torch.float64-refine"]["all_to_alls"] > 0
    assert sum(r["conservation"]["chunks"] for r in results) > 0


def _errors_worker(rank: int, world: int) -> dict:
    """Bad input on some or all ranks: every rank must raise (and stay in step for the next case)."""
    from deepspeed_knap.planner import plan_routing
    from deepspeed_knap.planner.topology import build_topology
    from deepspeed_knap.runtime.attention import KnapDistributedAttention
    from deepspeed_knap.runtime.packing import PackedBatch
    from deepspeed_knap.runtime.routing import route

    topology, groups, balancer = _setup(rank, world, "g2n2", "refine")
    batch = _batch(rank, torch.float64)
    plan = balancer.plan(batch)
    errors = {}

    def record(case, fn):
        try:
            fn()
        except ValueError as error:
            errors[case] = str(error)

    # Rank 2's lengths do not add up to its tokens: caught after the gather, on every rank.
    bad = (
        PackedBatch(batch.tokens, (*batch.seq_lens[:-1], batch.seq_lens[-1] + 1), batch.token_data)
        if rank == 2
        else batch
    )
    record("lengths", lambda: balancer.plan(bad))
    # Rank 0 routes a later step's batch with this step's plan.
    later = _batch(rank, torch.float64)
    if rank == 0:
        later = PackedBatch(later.tokens[:-1], (*later.seq_lens[:-1], later.seq_lens[-1] - 1), {}, {})
    record("stale_plan", lambda: route(later, plan, groups))
    # Rank 3 plans with another solver: same lengths, different plan.
    other = plan_routing(plan_lens(plan, topology), topology, balancer.cost_model, "none") if rank == 3 else plan
    record("different_plans", lambda: route(batch, other, groups))
    # Every rank passes a plan made for another topology.
    foreign = plan_routing(plan_lens(plan, topology), build_topology("g4n1", world), balancer.cost_model)
    record("topology", lambda: route(batch, foreign, groups))
    # Rank 1 packs one column fewer (e.g. a rank without samples built its empty batch differently).
    fewer = {k: v for k, v in batch.token_data.items() if k != "is_text"}
    odd = PackedBatch(batch.tokens, batch.seq_lens, fewer, batch.sample_data) if rank == 1 else batch
    record("columns", lambda: route(odd, plan, groups))
    # q/k/v with the wrong head count, on every rank.
    routed = route(batch, plan, groups)
    attention = KnapDistributedAttention(HEADS)
    qkv = torch.zeros(routed.batch.num_tokens, HEADS + 1, 4, dtype=torch.float64)
    record("heads", lambda: attention(qkv, qkv, qkv, routed))
    # Too few heads for the bags, without the topology check at construction: caught on every rank.
    record("heads_vs_plan", lambda: KnapDistributedAttention(1)(qkv[:, :1], qkv[:, :1], qkv[:, :1], routed))
    record("construct", lambda: KnapDistributedAttention(1, topology=topology))
    record("backend", lambda: KnapDistributedAttention(HEADS, backend="flash3"))
    return errors


def plan_lens(plan, topology) -> list[list[int]]:
    return [plan.seq_lens[plan.seq_src_rank == g].tolist() for g in range(topology.group_size)]


def test_bad_input_raises_on_every_rank_with_a_clear_message():
    results = run_distributed(_errors_worker, 4, timeout=120)
    for errors in results:
        assert set(errors) == {"lengths", "stale_plan", "different_plans", "topology", "columns", "heads",
                               "heads_vs_plan", "construct", "backend"}  # fmt: skip
        assert "runs sequences on 2 GPUs but attention has only 1 heads" in errors["heads_vs_plan"]
        assert "ranks 0 and [1] carry different tokens or columns" in errors["columns"]
        assert "rank(s) [2]" in errors["lengths"]
        assert "rank(s) [0]" in errors["stale_plan"]
        assert "different plans" in errors["different_plans"]
        assert "'g4n1'" in errors["topology"] and "'g2n2'" in errors["topology"]
        assert "[T, H, Dh]" in errors["heads"] and str(HEADS) in errors["heads"]
        assert "bags of 2 GPUs" in errors["construct"] and "1 heads" in errors["construct"]
        assert "'flash3'" in errors["backend"]
    assert "seq_lens sum to" in results[2]["lengths"]  # the bad rank says what is wrong
    assert "plan has sequence lengths" in results[0]["stale_plan"]


# What a group's first all-to-all costs here, standing in for NCCL's one-time set-up of a group (its
# communicator, each peer's connection) at its first collective.
SETUP_S = 0.5


def _traffic_worker(rank: int, world: int, spec: str) -> dict:
    """Bytes the real exchanges send, summed over ranks, for a route + reverse route and one attention
    forward, to check the benchmark's formulas; and the longest of those exchanges as timed for the
    cost model, with each group's first all-to-all ``SETUP_S`` slower."""
    import time

    import deepspeed.comm as dist

    from deepspeed_knap.bench.routing import step_traffic
    from deepspeed_knap.runtime.attention import KnapDistributedAttention
    from deepspeed_knap.runtime.packing import PackedBatch
    from deepspeed_knap.runtime.routing import record_traffic, reverse_route, route, time_exchanges
    from deepspeed_knap.runtime.timing import StepTimes

    _, groups, balancer = _setup(rank, world, spec, "knapformer")
    full = _batch(rank, torch.float64)
    batch = PackedBatch(full.tokens, full.seq_lens)
    plan = balancer.plan(batch)
    head_dim = DIM // HEADS
    real, set_up = dist.all_to_all_single, set()

    def first_slow(*args, group=None, **kwargs):
        if group not in set_up:
            set_up.add(group)
            time.sleep(SETUP_S)
        return real(*args, group=group, **kwargs)

    times = StepTimes(torch.device("cpu"))  # as a balanced step stamps it: the blocks between the routes
    time_exchanges(times)
    with mock.patch.object(dist, "all_to_all_single", first_slow), record_traffic() as sent:
        times.mark("plan_start")
        times.mark("plan_end")
        routed = route(batch, plan, groups)
        times.mark("blocks_start")
        q = routed.batch.tokens.reshape(-1, HEADS, head_dim)
        KnapDistributedAttention(HEADS)(q, q, q, routed)
        times.mark("blocks_end")
        times.mark("blocks_grad_start")
        times.mark("blocks_grad_end")
        reverse_route(routed.batch.tokens, routed)
    time_exchanges(None)
    measured = torch.tensor([sent["route"] + sent["reverse_route"], sent["ulysses"]], dtype=torch.int64)
    dist.all_reduce(measured)
    expected = step_traffic(plan, DIM, HEADS, num_layers=1, bytes_per_element=8)
    timed = {kind: [start.seconds_until(end) for start, end in spans] for kind, spans in times.spans.items()}
    return {"measured": measured.tolist(), "expected": [expected.route_bytes, expected.ulysses_bytes],
            "timed": timed, "seconds": times.seconds(), "groups_set_up": len(set_up)}  # fmt: skip


@pytest.mark.parametrize("spec", ["g4n1", "g1n2+g2n1"])
def test_benchmark_traffic_formulas_match_bytes_really_sent(spec):
    results = run_distributed(_traffic_worker, 4, args=(spec,))
    assert results[0]["measured"] == results[0]["expected"]
    assert results[0]["measured"][1] > 0
    # A group's one-time set-up is left out of what the cost model learns from. It prices an exchange
    # by its least-waiting rank (a rank's exchange includes its wait for its partners, which may be
    # setting up a group of their own): each kind's is timed without the set-up. Every group's
    # set-up (a route's before the blocks, a Ulysses group's inside them) is stamped apart, on the
    # ranks of that group, and every rank's compute is without it.
    for kind in ("route", "reverse_route", "ulysses"):
        least = min(sum(result["timed"][kind]) for result in results if kind in result["timed"])
        assert least < SETUP_S / 2, (kind, [result["timed"] for result in results])
    for result in results:
        timed, seconds = result["timed"], result["seconds"]
        assert result["groups_set_up"] >= 1 and seconds["compute"] < SETUP_S / 2, seconds
        assert result["groups_set_up"] * SETUP_S <= seconds["setup"] < (result["groups_set_up"] + 1) * SETUP_S, seconds
        assert len(timed["setup"]) == result["groups_set_up"] >= 1 + ("ulysses" in timed), timed


def _sample_ints_worker(rank: int, world: int) -> dict:
    """A step's per-sample gather between the blocks (FLUX.3's segments) where rank 1 arrives
    ``SETUP_S`` late: this rank's seconds, and the rows gathered."""
    import time

    import numpy as np

    from deepspeed_knap.runtime.routing import gather_sample_ints, route, time_exchanges
    from deepspeed_knap.runtime.timing import StepTimes

    _, groups, balancer = _setup(rank, world, "g2n1", "knapformer")
    batch = _batch(rank, torch.float64)
    routed = route(batch, balancer.plan(batch), groups)
    times = StepTimes(torch.device("cpu"))
    time_exchanges(times)
    times.mark("plan_start")
    times.mark("plan_end")
    times.mark("blocks_start")
    if rank == 1:
        time.sleep(SETUP_S)  # a slower rank's blocks before the gather
    rows = gather_sample_ints(np.asarray(batch.seq_lens)[:, None], routed)
    times.mark("blocks_end")
    times.mark("blocks_grad_start")
    times.mark("blocks_grad_end")
    time_exchanges(None)
    return {"seconds": times.seconds(), "rows": rows.ravel().tolist(), "lens": [int(n) for n in batch.seq_lens]}


def test_a_wait_in_the_per_sample_gather_between_blocks_is_not_compute():
    """FLUX.3 gathers its samples' segments between the blocks: a fast rank's wait there for a slow
    one is an exchange's, as in the routes, and not its compute (which the online refit learns from)."""
    fast, slow = run_distributed(_sample_ints_worker, 2)
    assert fast["rows"] == slow["rows"] == fast["lens"] + slow["lens"]
    assert fast["seconds"]["compute"] < SETUP_S / 2, fast["seconds"]
    assert slow["seconds"]["compute"] >= SETUP_S, slow["seconds"]


# ----------------------------------------------------------------------------------------------------
# Topology "auto": every sequence in its own aligned group; GPUs in several nested groups per layer.

AUTO_DIM, AUTO_HEADS = 32, 8  # 8 heads: groups of up to 8 GPUs
# A priced all-to-all keeps short sequences whole, so the planner mixes group sizes 1, 2, 4 (and 8).
AUTO_WORKLOAD = dict(linear_coef=1.0, quadratic_coef=0.05, alltoall_coef=0.5)
# On nodes of 2 GPUs with max_degree 4, a cap of 30 tokens leaves the 90-token sequence (45 per GPU
# in a node's group of 2) only the group of both nodes.
ACROSS_LENS, ACROSS_CAP = [[90], [5], [3, 2], [4]], 30


def _auto_worker(rank: int, world: int) -> dict:
    """Conservation and equivalence with auto plans: the planner's, and random nested ones (every
    sequence in a random aligned group of a random size)."""
    import numpy as np

    from deepspeed_knap.cost.model import CostModel
    from deepspeed_knap.models.tiny_dit import TinyDiT, random_batch
    from deepspeed_knap.planner.fixed import Problem
    from deepspeed_knap.planner.topology import build_topology
    from deepspeed_knap.runtime.balancer import KnapBalancer
    from deepspeed_knap.runtime.groups import create_process_groups
    from deepspeed_knap.runtime.routing import reverse_route, route

    _init()
    topology = build_topology("auto", world, max_degree=world)
    groups = create_process_groups(topology)
    cost_model = CostModel(**AUTO_WORKLOAD)

    class RandomGroups(KnapBalancer):
        def plan(self, batch):
            plan = super().plan(batch)
            problem = Problem.build(plan_lens(plan, topology), topology, cost_model, None)
            rng = np.random.default_rng(11)
            sizes = rng.choice(np.unique(problem.bag_size), len(problem.seq_lens))  # a size, then a group of it
            pick = [rng.choice(np.flatnonzero(problem.bag_size == size)) for size in sizes]
            return problem.make_plan("random", problem.bag_first[pick], problem.bag_size[pick])

    cases = [("refine", KnapBalancer(groups, cost_model), torch.float64, SEQ_LENS[rank]),
             ("refine32", KnapBalancer(groups, cost_model), torch.float32, SEQ_LENS[rank]),
             ("random", RandomGroups(groups, cost_model), torch.float64, SEQ_LENS[rank])]  # fmt: skip
    if world == 4:  # nodes of 2 GPUs: the 90-token sequence needs the group of both nodes under the cap
        across = create_process_groups(build_topology("auto", world, gpus_per_node=2, max_degree=4))
        cases.append(("across", KnapBalancer(across, cost_model, max_tokens_per_gpu=ACROSS_CAP), torch.float64,
                      ACROSS_LENS[rank]))  # fmt: skip
    result = {}
    for name, balancer, dtype, lengths in cases:
        torch.manual_seed(0)
        model = TinyDiT(AUTO_DIM, AUTO_HEADS, COND, topology=topology).to(dtype)
        batch = random_batch(lengths, 1000 + rank, AUTO_DIM, COND, dtype)
        plan = balancer.plan(batch)
        routed = route(batch, plan, groups)
        assert torch.equal(reverse_route(routed.batch.tokens, routed), batch.tokens)
        result[name] = {
            **_balanced_against_unbalanced(model, batch, balancer, rank),
            "sizes": sorted(set(plan.seq_group_size.tolist())),
            "max_gpu_tokens": int(plan.gpu_tokens.max()),
            "groups_here": len(routed.layout.attention_groups),
        }
    return result


@pytest.mark.parametrize("world", [4, 8])
def test_auto_plans_mix_group_sizes_and_balanced_model_equals_unbalanced(world):
    results = run_distributed(_auto_worker, world, timeout=300)
    expected_sizes = [1, 2, 4, 8] if world == 8 else [1, 2, 4]
    assert results[0]["refine"]["sizes"] == expected_sizes, "the planner must mix group sizes on one step"
    assert max(r["refine"]["groups_here"] for r in results) >= 2, "some GPU must run attention in several groups"
    assert max(r["random"]["groups_here"] for r in results) >= 3
    if world == 4:
        assert results[0]["across"]["sizes"][-1] == 4 and results[0]["across"]["max_gpu_tokens"] <= ACROSS_CAP
    cases = (("refine", 1e-10), ("refine32", 1e-5), ("random", 1e-10)) + ((("across", 1e-10),) if world == 4 else ())
    for rank, result in enumerate(results):
        for case, tolerance in cases:
            assert result[case]["out_err"] <= tolerance, (rank, case, result)
            assert result[case]["grad_err"] <= tolerance, (rank, case, result)
