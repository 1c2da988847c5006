"""KnapDistributedAttention as a drop-in for DeepSpeed's DistributedAttention: DeepSpeed's constructor
and call give DeepSpeed's outputs and gradients outside a balanced step (both layouts, even and uneven
heads, 2 and 4 gloo ranks), and balance exactly inside one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.distributed import run_distributed

HEAD_DIM, LOCAL_SEQ, BATCH = 4, 5, 2


def _sdpa_layout(batch_dim_idx: int):
    """A local attention over whole (gathered) sequences in DeepSpeed's layout: [b, s, h, d] for
    ``batch_dim_idx`` 0, [s, b, h, d] for 1."""

    def local_attention(q, k, v, *args, **kwargs):
        to_bhsd = (lambda t: t.permute(0, 2, 1, 3)) if batch_dim_idx == 0 else (lambda t: t.permute(1, 2, 0, 3))
        out = F.scaled_dot_product_attention(to_bhsd(q), to_bhsd(k), to_bhsd(v))  # [b, h, s, d]
        return out.permute(0, 2, 1, 3) if batch_dim_idx == 0 else out.permute(2, 0, 1, 3)

    return local_attention


class _SequenceParallelWorld:
    """DeepSpeed's uneven-heads path reads the rank from the global mpu: make it the world's."""

    def get_sequence_parallel_rank(self):
        return torch.distributed.get_rank()

    def get_sequence_parallel_world_size(self):
        return torch.distributed.get_world_size()


def _full(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _unbalanced_worker(rank: int, world: int) -> dict:
    import deepspeed.comm as dist
    from deepspeed.sequence.layer import DistributedAttention
    from deepspeed.utils import groups

    from deepspeed_knap.runtime.attention import KnapDistributedAttention

    dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    groups.mpu = _SequenceParallelWorld()
    group = torch.distributed.new_group(list(range(world)))
    errors = {}
    for batch_dim_idx in (0, 1):
        for heads in (world * 2, world * 2 - 1):  # even, and uneven (DeepSpeed's other path)
            seq = LOCAL_SEQ * world
            shape = (BATCH, seq, heads, HEAD_DIM) if batch_dim_idx == 0 else (seq, BATCH, heads, HEAD_DIM)
            full = [_full(shape, seed) for seed in (1, 2, 3)]
            mine = slice(rank * LOCAL_SEQ, (rank + 1) * LOCAL_SEQ)
            local = [(t[:, mine] if batch_dim_idx == 0 else t[mine]).clone().requires_grad_() for t in full]
            gather_idx = 1 if batch_dim_idx == 0 else 0
            runs = {}
            for name, cls in (("deepspeed", DistributedAttention), ("ours", KnapDistributedAttention)):
                module = cls(_sdpa_layout(batch_dim_idx), group, scatter_idx=2, gather_idx=gather_idx)
                inputs = [t.detach().clone().requires_grad_() for t in local]
                out = module(*inputs, batch_dim_idx)
                (out * _full(out.shape, 7 + rank)).sum().backward()
                runs[name] = (out.detach(), [t.grad for t in inputs])
            reference = _sdpa_layout(batch_dim_idx)(*full)
            reference = reference[:, mine] if batch_dim_idx == 0 else reference[mine]
            (out_ds, grads_ds), (out_ours, grads_ours) = runs["deepspeed"], runs["ours"]
            errors[(batch_dim_idx, heads)] = {
                "vs_deepspeed": max(float((out_ours - out_ds).abs().max()),
                                    *(float((a - b).abs().max()) for a, b in zip(grads_ours, grads_ds, strict=True))),
                "vs_reference": float((out_ours - reference).abs().max()),
            }  # fmt: skip
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_outside_a_balanced_step_it_is_deepspeeds_distributed_attention(world):
    for errors in run_distributed(_unbalanced_worker, world, timeout=180):
        for case, error in errors.items():
            assert error["vs_deepspeed"] == 0.0, case  # the same code path: bit-identical
            assert error["vs_reference"] <= 1e-12, case  # and right: attention over the whole sequence


def _balanced_worker(rank: int, world: int) -> dict:
    """A DeepSpeed-Ulysses style block ([1, T, H, Dh] q/k/v, batch_dim_idx 0) run by the balancer:
    equal to the same block without balancing, sequence by sequence, with activation checkpointing,
    also when a second step runs forward before the first one's backward (its recomputation must see
    its own routing); after the backward, the module is DeepSpeed's again."""
    import deepspeed.comm as dist
    from deepspeed.sequence.layer import DistributedAttention
    from deepspeed.utils import groups as deepspeed_groups

    from deepspeed_knap.cost.model import CostModel
    from deepspeed_knap.models.tiny_dit import random_batch
    from deepspeed_knap.planner.topology import build_topology
    from deepspeed_knap.runtime.attention import KnapDistributedAttention, balanced_step_in_flight
    from deepspeed_knap.runtime.balancer import KnapBalancer
    from deepspeed_knap.runtime.groups import create_process_groups

    dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    deepspeed_groups.mpu = _SequenceParallelWorld()  # 6 heads on 4 ranks: DeepSpeed's uneven path
    heads, dim = 6, 24
    groups = create_process_groups(build_topology("auto", world))
    balancer = KnapBalancer(groups, CostModel(1.0, 0.05, 0.5))
    torch.manual_seed(0)
    qkv_layer = torch.nn.Linear(dim, 3 * dim).double()
    local = _sdpa_layout(0)  # the user's kernel: not called in a balanced step (it sees no sequence boundaries)
    attention = KnapDistributedAttention(local, torch.distributed.group.WORLD, 2, 1, backend="sdpa")

    def block(tokens):
        q, k, v = qkv_layer(tokens).view(1, -1, 3, heads, dim // heads).unbind(2)  # [1, T, H, Dh]
        return attention(q, k, v, batch_dim_idx=0).reshape(-1, dim)

    def blocks(routed):  # recomputed in backward: the step is current while its gradient runs
        return torch.utils.checkpoint.checkpoint(block, routed.batch.tokens, use_reentrant=False)

    seq_lens = [[37, 5, 1], [64, 3], [2, 11, 19, 7], [23, 23]][rank]
    batch = random_batch(seq_lens, 100 + rank, dim, 5, torch.float64)
    batch = batch.__class__(batch.tokens.requires_grad_(), batch.seq_lens, batch.token_data, batch.sample_data)
    balanced = balancer.forward(batch, blocks)
    plan = balancer._last[1]
    # Another step's forward before this one's backward: the same tokens a rank, other sequences.
    other = balancer.forward(random_batch(seq_lens[::-1], 200 + rank, dim, 5, torch.float64), blocks)
    balanced.sum().backward()
    gradient = batch.tokens.grad.clone()
    other.sum().backward()
    after = balanced_step_in_flight()
    shape = (BATCH, LOCAL_SEQ, heads, HEAD_DIM)  # an unbalanced DeepSpeed call after the step
    plain = [_full(shape, seed + 10 * rank) for seed in (1, 2, 3)]
    deepspeed = DistributedAttention(local, torch.distributed.group.WORLD, 2, 1)(*plain, 0)
    unbalanced_error = float((attention(*plain, 0) - deepspeed).abs().max())
    refused = None
    try:  # rotary embeddings would be dropped: refused instead, on every rank
        balancer.forward(batch, lambda routed: attention(*[routed.batch.tokens.view(1, -1, heads, dim // heads)] * 3,
                                                         0, "rotary").reshape(-1, dim))  # fmt: skip
    except ValueError as error:
        refused = str(error)
    # Reference: each sequence alone, with plain attention.
    tokens = batch.tokens.detach().clone().requires_grad_()
    reference = []
    for sequence in torch.split(tokens, seq_lens):
        q, k, v = qkv_layer(sequence).view(-1, 3, heads, dim // heads).unbind(1)
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))[0]
        reference.append(out.transpose(0, 1).reshape(-1, dim))
    torch.cat(reference).sum().backward()
    return {"error": float((balanced - torch.cat(reference)).abs().max()),
            "grad_error": float((gradient - tokens.grad).abs().max()), "refused": refused,
            "sizes": sorted(set(plan.seq_group_size.tolist())), "after": after,
            "unbalanced_error": unbalanced_error}  # fmt: skip


def test_inside_a_balanced_step_the_drop_in_balances_exactly():
    results = run_distributed(_balanced_worker, 4, timeout=180)
    assert results[0]["sizes"] != [1], "the plan must put sequences in groups"
    for result in results:
        assert result["error"] <= 1e-12 and result["grad_error"] <= 1e-12  # activation checkpointing too
        assert result["after"] is None and result["unbalanced_error"] == 0.0  # DeepSpeed's own path again
        assert "cannot honour ['rotary']" in result["refused"]


def test_packed_construction_takes_the_heads_and_keywords_only():
    from deepspeed_knap.planner.topology import build_topology
    from deepspeed_knap.runtime.attention import KnapDistributedAttention

    assert KnapDistributedAttention(num_heads=6, backend="sdpa").num_heads == 6
    assert KnapDistributedAttention(6, topology=build_topology("g4n1")).num_heads == 6
    with pytest.raises(ValueError, match="takes the heads and then keywords"):
        KnapDistributedAttention(4, "flash")  # a positional backend would land in sequence_process_group
    with pytest.raises(ValueError, match="bags of 8 GPUs but attention has only 4 heads"):
        KnapDistributedAttention(num_heads=4, topology=build_topology("g8n1"))
    with pytest.raises(ValueError, match="local_attention callable"):
        KnapDistributedAttention("sdpa")
