"""TinyDiT: the smallest model that uses everything balancing touches, for tests, examples and CPU demos.

Every block uses what a real DiT uses across the routing boundary: per-sample conditioning looked up
per token by sequence (AdaLN-style shift and scale), per-token integer side columns (3-axis position
ids and a modality id), and attention over whole sequences through ``KnapDistributedAttention``. It
is also a template: a model runs balanced when its block stack takes a ``RoutedBatch`` and passes it
to its attention modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepspeed_knap.runtime.attention import KnapDistributedAttention
from deepspeed_knap.runtime.balancer import KnapBalancer, balanced_forward
from deepspeed_knap.runtime.packing import PackedBatch, pack_samples
from deepspeed_knap.runtime.routing import RoutedBatch


class TinyBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, cond_dim: int, attention: KnapDistributedAttention) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.modulation = nn.Linear(cond_dim, 2 * dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.attention = attention

    def forward(self, x: Tensor, routed: RoutedBatch) -> Tensor:
        tokens, dim = x.shape
        shift, scale = self.modulation(routed.batch.sample_data["cond"]).chunk(2, dim=-1)  # [n, D] each
        seq = routed.batch.seq_index
        h = F.layer_norm(x, (dim,)) * (1 + scale[seq]) + shift[seq]
        q, k, v = self.qkv(h).view(tokens, 3, self.num_heads, dim // self.num_heads).unbind(1)
        x = x + self.proj(self.attention(q, k, v, routed).reshape(tokens, dim))
        return x + self.mlp(F.layer_norm(x, (dim,)))


class TinyDiT(nn.Module):
    """``forward(batch, balancer)``: ``batch.tokens`` ``[T, D]``, ``token_data`` ``position_ids [T, 3]``
    int64 and ``modality [T]`` int8, ``sample_data`` ``cond [N, C]``; returns ``[T, D]`` in batch order."""

    def __init__(self, dim: int = 24, num_heads: int = 6, cond_dim: int = 5, depth: int = 2, topology=None) -> None:
        super().__init__()
        self.cond_embed = nn.Linear(cond_dim, cond_dim)  # runs before routing: its gradient crosses it
        self.position = nn.Linear(3, dim)
        self.modality = nn.Embedding(2, dim)
        attention = KnapDistributedAttention(num_heads, backend="sdpa", topology=topology)
        self.blocks = nn.ModuleList(TinyBlock(dim, num_heads, cond_dim, attention) for _ in range(depth))

    def forward(self, batch: PackedBatch, balancer: KnapBalancer | None = None) -> Tensor:
        batch = PackedBatch(batch.tokens, batch.seq_lens, batch.token_data,
                            {"cond": self.cond_embed(batch.sample_data["cond"])})  # fmt: skip

        def blocks(routed: RoutedBatch) -> Tensor:
            data = routed.batch.token_data
            x = routed.batch.tokens + self.position(data["position_ids"].to(routed.batch.tokens.dtype))
            x = x + self.modality(data["modality"].long())
            for block in self.blocks:
                x = block(x, routed)
            return x

        return balanced_forward(batch, blocks, balancer)


def random_samples(seq_lens: list[int], seed: int, dim: int, cond_dim: int, dtype: torch.dtype) -> list[dict]:
    """Samples for :class:`TinyDiT` with the given lengths, a function of ``seed`` only (so any rank
    can rebuild any other rank's samples). Keys: ``tokens [L, D]``, ``position_ids [L, 3]``,
    ``modality [L]`` (a few text tokens, then image tokens), ``cond [C]``."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for length in seq_lens:
        text = min(length, int(torch.randint(0, 4, (1,), generator=generator)))
        samples.append({
            "tokens": torch.randn(length, dim, generator=generator, dtype=torch.float64).to(dtype),
            "position_ids": torch.randint(0, 64, (length, 3), generator=generator),
            "modality": torch.cat([torch.zeros(text), torch.ones(length - text)]).to(torch.int8),
            "cond": torch.randn(cond_dim, generator=generator, dtype=torch.float64).to(dtype),
        })  # fmt: skip
    return samples


def random_batch(
    seq_lens: list[int], seed: int, dim: int = 24, cond_dim: int = 5, dtype: torch.dtype = torch.float32
) -> PackedBatch:
    """:func:`random_samples` packed for :class:`TinyDiT` (defaults: its default dims)."""
    return pack_tiny_samples(random_samples(seq_lens, seed, dim, cond_dim, dtype), dim, cond_dim, dtype)


def pack_tiny_samples(samples: list[dict], dim: int, cond_dim: int, dtype: torch.dtype) -> PackedBatch:
    """Pack :func:`random_samples` output for :class:`TinyDiT`; with no samples, an empty batch with the
    same columns (every rank must carry the same columns, even one without samples this step)."""
    if samples:
        return pack_samples(samples, ("position_ids", "modality"), ("cond",))
    return PackedBatch(torch.zeros(0, dim, dtype=dtype), (),
                       {"position_ids": torch.zeros(0, 3, dtype=torch.int64), "modality": torch.zeros(0, dtype=torch.int8)},
                       {"cond": torch.zeros(0, cond_dim, dtype=dtype)})  # fmt: skip
