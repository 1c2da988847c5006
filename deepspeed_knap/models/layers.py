"""Building blocks every family shares, on packed tokens: per-sequence AdaLN modulation and gating,
weightless layer norm, sinusoidal timestep features, the MLP embedder and diffusers' GELU
feed-forward. Parameter names are diffusers'.

Shapes: ``T`` tokens on this GPU, ``n`` sequences (chunks) held, ``D`` model width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

NORM_EPS = 1e-6


class _SeqAffine(torch.autograd.Function):
    """``x * (offset + scale[seq]) + shift[seq]``, keeping only ``x`` and the ``[n, D]`` rows for
    backward (autograd of the plain expression would also keep the gathered ``[T, D]`` factor)."""

    @staticmethod
    def forward(ctx, x: Tensor, seq: Tensor, scale: Tensor, shift: Tensor | None, offset: float) -> Tensor:
        factor = offset + scale if offset else scale
        out = x * factor.index_select(0, seq)
        if shift is not None:
            out = out + shift.index_select(0, seq)
        ctx.save_for_backward(x, seq, scale)
        ctx.offset, ctx.has_shift = offset, shift is not None
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, seq, scale = ctx.saved_tensors
        factor = ctx.offset + scale if ctx.offset else scale
        grad_x = grad * factor.index_select(0, seq) if ctx.needs_input_grad[0] else None
        grad_scale = _seq_sum(grad * x, seq, scale) if ctx.needs_input_grad[2] else None
        grad_shift = _seq_sum(grad, seq, scale) if ctx.has_shift and ctx.needs_input_grad[3] else None
        return grad_x, None, grad_scale, grad_shift, None


def _seq_sum(rows: Tensor, seq: Tensor, like: Tensor) -> Tensor:
    """``[T, D]`` rows summed per sequence into ``like``'s ``[n, D]``, accumulated in fp32 (bf16
    sums over thousands of tokens would lose the gradient's low bits)."""
    total = torch.zeros(like.shape, dtype=torch.promote_types(like.dtype, torch.float32), device=like.device)
    return total.index_add_(0, seq, rows.to(total.dtype)).to(like.dtype)


def modulate(x: Tensor, seq: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """AdaLN: ``x * (1 + scale[seq]) + shift[seq]``; ``x [T, D]``, ``seq [T]``, ``shift, scale [n, D]``."""
    return _SeqAffine.apply(x, seq, scale, shift, 1.0)


def gate(x: Tensor, seq: Tensor, gates: Tensor) -> Tensor:
    """``x * gates[seq]``; ``x [T, D]``, ``seq [T]``, ``gates [n, D]``."""
    return _SeqAffine.apply(x, seq, gates, None, 0.0)


def layer_norm(x: Tensor, eps: float = NORM_EPS) -> Tensor:
    """LayerNorm over the last dim without weights (every FLUX norm before a modulation)."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps)


def timestep_features(timestep: Tensor, channels: int = 256, scale: float = 1.0) -> Tensor:
    """``[N]`` timesteps -> ``[N, channels]`` fp32 sinusoidal features, cosines first (diffusers'
    ``Timesteps(channels, flip_sin_to_cos=True, downscale_freq_shift=0, scale=scale)``). FLUX and Wan
    pass timesteps already scaled by 1000 (``scale=1``); Qwen-Image passes them in ``[0, 1]`` and
    ``scale=1000``, which multiplies the fp32 angles, a rounding of its own."""
    half = channels // 2
    exponent = -math.log(10000) * torch.arange(0, half, dtype=torch.float32, device=timestep.device) / half
    angles = timestep[:, None].float() * torch.exp(exponent)[None, :]
    if scale != 1:
        angles = scale * angles
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class GeluProjection(nn.Module):
    """diffusers' ``GELU`` activation module: ``proj`` then GELU (exact or tanh)."""

    def __init__(self, dim: int, hidden: int, approximate: str = "tanh") -> None:
        super().__init__()
        self.proj = nn.Linear(dim, hidden)
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x), approximate=self.approximate)


class FeedForward(nn.Module):
    """diffusers' ``FeedForward(dim, dim_out, inner_dim)`` with a GELU: ``net.0.proj`` -> GELU ->
    ``net.2`` (FLUX.1's blocks: ``hidden = 4 * dim``, tanh; Wan's: ``ffn_dim``)."""

    def __init__(self, dim: int, hidden: int, dim_out: int | None = None, approximate: str = "tanh") -> None:
        super().__init__()
        self.net = nn.ModuleList(
            [GeluProjection(dim, hidden, approximate), nn.Dropout(0.0), nn.Linear(hidden, dim_out or dim)]
        )

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.net:
            x = layer(x)
        return x


class MLPEmbedder(nn.Module):
    """``linear_2(silu(linear_1(x)))``: diffusers' ``TimestepEmbedding`` and (with ``act_1``)
    ``PixArtAlphaTextProjection`` have these parameter names."""

    def __init__(self, in_dim: int, dim: int, bias: bool = True) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim, bias=bias)
        self.linear_2 = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))
