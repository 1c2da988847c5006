"""Ranks of a balance group emulated in one process: what a rank holds under a plan, and Ulysses
attention doing a real member's kernel work without the all-to-all (``bench step``, and
``calibrate --degrees``'s per-degree efficiency).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from deepspeed_knap.cost.model import CostModel
from deepspeed_knap.planner.fixed import Problem
from deepspeed_knap.planner.plan import RoutingPlan
from deepspeed_knap.planner.topology import build_topology
from deepspeed_knap.runtime.attention import KnapDistributedAttention, VarlenSeqs, head_splits
from deepspeed_knap.runtime.layout import AttentionGroup, gpu_layout
from deepspeed_knap.runtime.packing import PackedBatch
from deepspeed_knap.runtime.routing import RoutedBatch


class BlockTimer(Protocol):
    """Times a model's blocks, forward and backward, on what one emulated rank holds, and returns the
    whole transformer's modeled seconds (FLUX's :class:`~deepspeed_knap.models.flux.calibrate.FluxBlockTimer`)."""

    heads: int
    dim: int
    device: torch.device
    dtype: torch.dtype

    def __call__(self, routed: RoutedBatch) -> float: ...


class EmulatedUlyssesAttention(KnapDistributedAttention):
    """:class:`~deepspeed_knap.runtime.attention.KnapDistributedAttention` in one process: the same kernel
    work per GPU, no all-to-all.

    For a bag of ``G > 1`` a member holding ``n`` of the ``L`` tokens of its bag's sequences runs the
    kernel on ``[L, h, Dh]`` (``h`` its head share), filled by repeating its own ``n`` tokens, and
    returns its ``n`` rows with the ``h`` heads tiled back to ``H``. Values are meaningless; shapes,
    and so the work forward and backward, are a real member's. Groups of one GPU run as in training.
    """

    def _ulysses(self, q: Tensor, k: Tensor, v: Tensor, routed: RoutedBatch, index: int, group: AttentionGroup,
                 seqs: VarlenSeqs, num_heads: int) -> Tensor:  # fmt: skip
        heads = head_splits(num_heads, group.size)[group.member]
        local, total = group.num_local_tokens, int(group.seq_lens.sum())
        if local:
            fill = routed.device_array(("fill", index), np.arange(total) % local)
            q_full, k_full, v_full = (t[:, :heads].index_select(0, fill) for t in (q, k, v))
        else:  # a member holding only empty chunks still runs its heads of the bag's sequences
            zeros = q.new_zeros(total, heads, q.shape[-1])
            q_full, k_full, v_full = (zeros + t.sum() for t in (q, k, v))
        out = self.varlen_attn(q_full, k_full, v_full, seqs)  # [L, h, Dh]
        tiled = out[:local].repeat(1, -(-num_heads // heads), 1)[:, :num_heads]
        return tiled if local else tiled + 0 * out.sum()  # keeps the kernel's backward in the graph


def emulated_rank_batch(
    plan: RoutingPlan, gpu: int, text_lens: np.ndarray, dim: int, device: torch.device, dtype: torch.dtype
) -> RoutedBatch:
    """What GPU ``gpu`` holds after routing by ``plan``, with random token states.

    Args:
        text_lens: ``[N]`` text tokens of each sequence of the plan (they come first in a sequence).
    """
    layout = gpu_layout(plan, gpu)
    positions = np.concatenate(
        [np.arange(s, s + n) for s, n in zip(layout.chunk_starts, layout.chunk_lens, strict=True)] or [[]]
    )
    is_text = positions < np.repeat(text_lens[layout.seq_ids], layout.chunk_lens)
    tokens = torch.randn(layout.num_routed_tokens, dim, device=device, dtype=dtype, requires_grad=True)
    batch = PackedBatch(
        tokens,
        tuple(layout.chunk_lens.tolist()),
        {"ids": torch.zeros(len(positions), 3, device=device), "is_text": torch.as_tensor(is_text, device=device)},
        {"temb": torch.randn(len(layout.seq_ids), dim, device=device, dtype=dtype)},
    )
    return RoutedBatch(batch, layout, plan, None)


def calibrate_degrees(timer: BlockTimer, seq_lens: Sequence[int], degrees: Sequence[int], model: CostModel,
                      overhead_s: float) -> tuple[dict[int, float], dict[int, list[float]]]:  # fmt: skip
    """How much of the ideal ``1/G`` share of the work a member of a bag of ``G`` achieves.

    For each degree ``G`` and length ``s``, times what member 0 of a bag of ``G`` GPUs computes of one
    sequence of ``s`` tokens (its ``s / G`` tokens' projections and MLP, attention over the whole
    sequence on its ``H / G`` heads: :class:`EmulatedUlyssesAttention`), and compares it with
    ``model``'s ideal ``(a*s + b*s^2) / G`` (``model`` fitted at ``G = 1`` on the same blocks).

    Returns:
        ``({G: efficiency}, {G: measured seconds per length})``, efficiency = ideal seconds over
        measured seconds less the overhead, summed over the lengths.

    Raises:
        ValueError: a degree below 2 or above the blocks' heads.
    """
    bad = [g for g in degrees if not 2 <= g <= timer.heads]
    if bad:
        raise ValueError(
            f"--degrees {list(degrees)}: bag sizes must be between 2 and the heads ({timer.heads}); got {bad}"
        )
    efficiency, measured = {}, {}
    for degree in degrees:
        topology = build_topology(f"g{degree}n1")
        times = []
        for seq_len in tqdm(seq_lens, desc=f"calibrate G={degree}", leave=False):
            lengths = [[seq_len]] + [[] for _ in range(degree - 1)]
            plan = Problem.build(lengths, topology, model, None).make_plan(
                "calibrate", np.array([0]), np.array([degree])
            )
            routed = emulated_rank_batch(plan, 0, np.array([seq_len // 8]), timer.dim, timer.device, timer.dtype)
            times.append(timer(routed))
        ideal = sum((model.linear_coef * s + model.quadratic_coef * s * s) / degree for s in seq_lens)
        spent = sum(max(t - overhead_s, 1e-12) for t in times)
        efficiency[degree], measured[degree] = min(max(ideal / spent, 0.05), 2.0), times
    return efficiency, measured
