"""Routing and KnapDistributedAttention on gloo ranks: conservation, equivalence, traffic, bad input.

Each topology runs in one spawn (spawning ranks costs most of the time); the worker returns what it
measured and the tests assert on it.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed

DIM, HEADS, COND = 24, 6, 5  # 6 heads: bags of 4 GPUs split them unevenly (2, 2, 1, 1)

# Per global rank: a rank with no sequences, sequences shorter than the bag, odd lengths.
SEQ_LENS = [[37, 5, 1], [], [64, 3], [2, 11, 19, 7], [1], [23, 23], [], [50]]

# Balancing pays with a free all-to-all, so the solvers really use the bags.
WORKLOAD = dict(linear_coef=1.0, quadratic_coef=0.05, alltoall_coef=0.0)


def _init() -> None:
    import deepspeed.comm as dist

    dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)


def _setup(rank: int, world: int, spec: str, solver: str):
    from deepspeed_knap.balancer import KnapBalancer
    from deepspeed_knap.topology import build_topology, create_process_groups
    from deepspeed_knap.workload import WorkloadModel

    _init()
    topology = build_topology(spec, world)
    groups = create_process_groups(topology)
    return topology, groups, KnapBalancer(groups, WorkloadModel(**WORKLOAD), solver=solver)


def _batch(rank: int, dtype: torch.dtype):
    from deepspeed_knap.packing import pack_samples
    from tests.tiny_dit import make_samples

    samples = make_samples(SEQ_LENS[rank], rank, DIM, COND, dtype)
    for s in samples:
        s["is_text"] = s["modality"] == 0  # a bool column
        s["sample_id"] = torch.tensor(1000 * rank + len(s["tokens"]))  # an int64 per-sample tensor
    if not samples:
        from deepspeed_knap.packing import PackedBatch

        return PackedBatch(
            torch.zeros(0, DIM, dtype=dtype),
            (),
            {"position_ids": torch.zeros(0, 3, dtype=torch.int64), "modality": torch.zeros(0, dtype=torch.int8),
             "is_text": torch.zeros(0, dtype=torch.bool)},
            {"cond": torch.zeros(0, COND, dtype=dtype), "sample_id": torch.zeros(0, dtype=torch.int64)},
        )  # fmt: skip
    return pack_samples(samples, ("position_ids", "modality", "is_text"), ("cond", "sample_id"))


def _conservation(rank: int, world: int, spec: str) -> dict:
    """Route and reverse-route with every solver and two dtypes; check bit-exactness and placement."""
    from deepspeed_knap.routing import reverse_route, route

    topology, groups, balancer = _setup(rank, world, spec, "refine")
    checked = {"max_group": 0, "chunks": 0}
    for solver in ("none", "knapformer", "refine"):
        balancer.solver = solver
        for dtype in (torch.float64, torch.bfloat16):
            batch = _batch(rank, dtype)
            plan = balancer.plan(batch)
            routed = route(batch, plan, groups)
            assert routed.batch.problem() is None
            # Round trip: bitwise, tokens and every side column.
            assert torch.equal(reverse_route(routed.batch.tokens, routed), batch.tokens)
            for name, column in batch.token_data.items():
                back = reverse_route(routed.batch.token_data[name], routed)
                assert back.dtype == column.dtype and torch.equal(back, column), name
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


def _equivalence(rank: int, world: int, spec: str) -> dict:
    """TinyDiT with balancing on vs off: outputs per rank, parameter gradients summed over ranks."""
    import deepspeed.comm as dist

    from tests.tiny_dit import TinyDiT

    topology, _, balancer = _setup(rank, world, spec, "refine")
    result = {}
    for dtype, solver in ((torch.float64, "refine"), (torch.float32, "knapformer")):
        balancer.solver = solver
        torch.manual_seed(0)
        model = TinyDiT(DIM, HEADS, COND, topology=topology).to(dtype)
        batch = _batch(rank, dtype)
        weights = torch.randn(batch.tokens.shape, generator=torch.Generator().manual_seed(rank), dtype=dtype)
        runs = []
        for bal in (None, balancer):
            model.zero_grad(set_to_none=False)
            out = model(batch, bal)
            (out * weights).sum().backward()
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            dist.all_reduce(grads)
            runs.append((out.detach(), grads))
        (out_ref, grads_ref), (out, grads) = runs
        result[str(dtype)] = {
            # relative to the largest output (position ids up to 64 make outputs ~30)
            "out_err": float((out - out_ref).abs().amax() / out_ref.abs().amax().clamp(min=1)) if out.numel() else 0.0,
            "grad_err": float((grads - grads_ref).abs().max() / grads_ref.abs().max()),
            "max_group": int(balancer.plan(batch).seq_group_size.max(initial=1)),
        }
    return result


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
        assert equivalence["torch.float64"]["out_err"] <= 1e-10, (rank, equivalence)
        assert equivalence["torch.float64"]["grad_err"] <= 1e-10, (rank, equivalence)
        assert equivalence["torch.float32"]["out_err"] <= 1e-5, (rank, equivalence)
        assert equivalence["torch.float32"]["grad_err"] <= 1e-5, (rank, equivalence)
        assert equivalence["torch.float32"]["max_group"] == largest_bag
    assert sum(r["conservation"]["chunks"] for r in results) > 0
