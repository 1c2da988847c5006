"""FLUX.3 building blocks on packed tokens held in mode-major order.

Every module has the parameter names and shapes of its diffusers counterpart
(``Flux3ModeTransformerBlock``, ``Flux3SingleTransformerBlock``, ``Flux3Modulation``), so
``PackedFlux3Transformer`` loads a ``Flux3Transformer2DModel`` state dict as is. The arithmetic follows
diffusers operation by operation, including its fp32 q/k norm and RoPE.

Token order. A GPU's routed tokens are in routed order (chunk after chunk, each chunk's text, image
and reference tokens in sequence order). The blocks hold them *mode-major* instead: every text
token, then every image token, then every reference token (each mode in routed order), so that a
mode's weights apply to one contiguous slice of rows: no padding, no loop over samples. Only
attention needs routed order (the Ulysses all-to-all cuts sequences into contiguous chunks), so
q, k and v are permuted there and back (:meth:`Flux3Step.attend`).

Shapes: ``T`` tokens on this GPU (``Tt`` text, ``Ti`` image, ``Tr`` reference), ``n`` sequences
(chunks) held, ``D`` model width, ``H`` heads of ``Dh`` channels, ``K = 3`` modes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from deepspeed_knap.models.flux.flux2 import Flux2FeedForward
from deepspeed_knap.models.flux.layers import apply_rotary
from deepspeed_knap.models.layers import gate, layer_norm, modulate
from deepspeed_knap.runtime.attention import KnapDistributedAttention
from deepspeed_knap.runtime.routing import RoutedBatch

# Token modes, in the order of a sequence (and of diffusers' joint sequence): text, image, references.
MODES = ("txt", "image", "image_cond")


class Flux3Modulation(nn.Module):
    """One mode's ``linear`` from its activated conditioning to ``(shift, scale, gate)``:
    ``[n, D] -> [n, 3D]`` (one row per sequence held, not per token: a mode's tokens of a sequence
    share their conditioning)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 3 * dim, bias=False)

    def forward(self, activated: Tensor) -> Tensor:
        return self.linear(activated)


class Flux3AttentionWeights(nn.Module):
    """diffusers' ``Flux3Attention``'s weights: q, k, v and output projections without biases and
    per-head q/k RMSNorms, which diffusers runs in fp32 (then RoPE in fp32, one cast back)."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.heads, self.head_dim = num_heads, head_dim
        inner = num_heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.norm_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=eps)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim, bias=False), nn.Dropout(0.0)])

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x [t, D]`` -> q, k ``[t, H, Dh]`` normed in fp32 (still fp32: RoPE follows), v ``[t, H, Dh]``."""
        q, k, v = (proj(x).unflatten(-1, (self.heads, self.head_dim)) for proj in (self.to_q, self.to_k, self.to_v))
        return self.norm_q(q.float()), self.norm_k(k.float()), v


class Flux3Block(nn.Module):
    """The weights of a ``Flux3ModeTransformerBlock`` or ``Flux3SingleTransformerBlock`` (the same
    names and shapes): a weightless LayerNorm, ``attn`` and a SwiGLU ``ff`` run in parallel on the
    modulated input. How they run is :func:`mode_layer` and :func:`single_layer`."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, mlp_ratio: float, eps: float) -> None:
        super().__init__()
        self.attn = Flux3AttentionWeights(dim, num_heads, head_dim, eps)
        self.ff = Flux2FeedForward(dim, mlp_ratio)
        self.eps = eps


@dataclass(eq=False)
class Flux3Step:
    """What every block of one step needs on this GPU, computed once per step.

    Attributes:
        routed: the routed batch.
        attention: the attention module every block shares.
        counts: ``(Tt, Ti, Tr)`` tokens of each mode held.
        mode_seq: per mode ``[Tt]``, ``[Ti]``, ``[Tr]``: the held sequence of each of its tokens.
        mod_index: ``[T]`` mode-major: ``mode * n + seq``, a token's row in a ``[K * n, .]`` table of
            per-mode, per-sequence modulation.
        to_routed, to_modes: ``[T]`` permutations between mode-major and routed order.
        cos, sin: ``[T, Dh]`` fp32 RoPE tables, mode-major.
        segments: ``[N, K]`` lengths of each mode of every sequence of the step, by sequence id.
    """

    routed: RoutedBatch
    attention: KnapDistributedAttention
    counts: tuple[int, int, int]
    mode_seq: tuple[Tensor, Tensor, Tensor]
    mod_index: Tensor
    to_routed: Tensor
    to_modes: Tensor
    cos: Tensor
    sin: Tensor
    segments: np.ndarray

    def attend(self, q: Tensor, k: Tensor, v: Tensor, by_mode: bool) -> Tensor:
        """RoPE on fp32 q, k, then attention, mode-major ``[T, H, Dh]`` -> ``[T, H * Dh]`` in v's
        dtype: within each mode of each sequence (``by_mode``, the per-mode blocks) or over whole
        sequences (the joint blocks). One Ulysses all-to-all each way either way."""
        q = apply_rotary(q, self.cos, self.sin).to(v.dtype)
        k = apply_rotary(k, self.cos, self.sin).to(v.dtype)
        q, k, v = (t.index_select(0, self.to_routed) for t in (q, k, v))
        out = self.attention(q, k, v, self.routed, segments=self.segments if by_mode else None)
        return out.index_select(0, self.to_modes).flatten(1).to(v.dtype)


def mode_layer(blocks: Sequence[Flux3Block], x: Tensor, mods: Sequence[Tensor], step: Flux3Step) -> Tensor:
    """One per-mode layer: the text, image and reference blocks of one depth (``blocks``, in
    :data:`MODES` order), each on its own mode's rows of ``x [T, D]`` (mode-major) with its own
    modulation ``mods[m] [n, 3D]``, attending within its mode of each sequence. Every block runs,
    on empty rows when a mode has none here (ZeRO-3 needs every rank to call every module)."""
    parts = x.split(step.counts)
    normed, qs, ks, vs = [], [], [], []
    for block, part, mod, seq in zip(blocks, parts, mods, step.mode_seq, strict=True):
        shift, scale, _ = mod.chunk(3, dim=1)
        h = modulate(layer_norm(part, block.eps), seq, shift, scale)
        q, k, v = block.attn.qkv(h)
        normed.append(h)
        qs.append(q)
        ks.append(k)
        vs.append(v)
    attended = step.attend(torch.cat(qs), torch.cat(ks), torch.cat(vs), by_mode=True).split(step.counts)
    out = []
    for block, part, h, a, mod, seq in zip(blocks, parts, normed, attended, mods, step.mode_seq, strict=True):
        y = block.attn.to_out[1](block.attn.to_out[0](a)) + block.ff(h)
        out.append(part + gate(y, seq, mod.chunk(3, dim=1)[2]))
    return torch.cat(out)


def single_layer(block: Flux3Block, x: Tensor, table: tuple[Tensor, Tensor, Tensor], step: Flux3Step) -> Tensor:
    """One joint single block over every token (``x [T, D]`` mode-major), attention over whole
    sequences; ``table``: shift, scale and gate ``[K * n, D]`` rows by mode and sequence, picked
    per token by ``step.mod_index`` (text and references at their own heads, image at its own)."""
    shift, scale, gates = table
    h = modulate(layer_norm(x, block.eps), step.mod_index, shift, scale)
    q, k, v = block.attn.qkv(h)
    a = step.attend(q, k, v, by_mode=False)
    y = block.attn.to_out[1](block.attn.to_out[0](a)) + block.ff(h)
    return x + gate(y, step.mod_index, gates)
