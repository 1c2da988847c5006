"""Qwen-Image building blocks on packed tokens, with diffusers' ``QwenImageTransformer2DModel`` names.

A Qwen-Image block is a FLUX double-stream block (:func:`~deepspeed_knap.models.flux.layers.double_stream`,
:class:`~deepspeed_knap.models.flux.layers.FluxAttentionWeights`, the step's stream selection of
:class:`~deepspeed_knap.models.flux.layers.FluxStep`) with its own modulation layers, names and
three departures, each reproduced here operation by operation:

* q/k and text norms are diffusers' ``RMSNorm``: the mean square in fp32, ``x`` times its fp32
  reciprocal square root (:class:`RMSNorm`);
* RoPE is complex: channel pairs as complex64 numbers times rows of fp32-built complex64 tables of
  positions -4096..4095 per axis (:func:`rotary_freqs`), in any dtype: an fp64 model's q and k are
  rounded to fp32 there, as in diffusers;
* with ``zero_cond_t`` (Edit-2511) reference image tokens are modulated by timestep 0, target image
  and text tokens by the sample's timestep (:class:`QwenImageStep`'s ``img_mod_index``).

Shapes: ``T`` tokens on this GPU (``Tt`` text, ``Ti`` image), ``n`` sequences (chunks) held, ``D``
model width, ``H`` heads of ``Dh`` channels.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from deepspeed_knap.models.flux.layers import FluxAttentionWeights, FluxStep, double_stream
from deepspeed_knap.models.layers import NORM_EPS, FeedForward, MLPEmbedder, timestep_features
from deepspeed_knap.runtime.attention import KnapDistributedAttention
from deepspeed_knap.runtime.routing import RoutedBatch

# diffusers' QwenEmbedRope tables cover positions -ROPE_POSITIONS .. ROPE_POSITIONS - 1 on each axis.
ROPE_POSITIONS = 4096
ROPE_THETA = 10000


class RMSNorm(nn.Module):
    """diffusers' ``RMSNorm`` (``models/normalization.py``) with a weight: ``x * rsqrt(mean(x^2) + eps)``
    with the mean square and its reciprocal square root in fp32 (an fp64 ``x`` is scaled by an fp32
    factor), cast to the weight's dtype where that is fp16 or bf16, times the weight."""

    def __init__(self, dim: int, eps: float = NORM_EPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return x * self.weight


def _rope_params(index: Tensor, dim: int) -> Tensor:
    """``[len(index), dim / 2]`` complex64 rotations of positions ``index`` (diffusers'
    ``QwenEmbedRope.rope_params``: fp32 angles, ``torch.polar``)."""
    freqs = torch.outer(index, 1.0 / torch.pow(ROPE_THETA, torch.arange(0, dim, 2).to(torch.float32).div(dim)))
    return torch.polar(torch.ones_like(freqs), freqs)


@functools.lru_cache(maxsize=8)
def _axis_tables(axes_dims: tuple[int, ...], device: torch.device) -> tuple[Tensor, ...]:
    """Per axis, ``[2 * ROPE_POSITIONS, dim / 2]`` complex64 rows of positions -4096..4095 (row
    ``p + 4096``). Built on the host from tables of diffusers' shapes, as diffusers builds them, and
    moved: ``cos`` and ``sin`` are bitwise its own whatever the device."""
    positive = torch.arange(ROPE_POSITIONS)
    negative = torch.arange(ROPE_POSITIONS).flip(0) * -1 - 1
    return tuple(torch.cat([_rope_params(negative, dim), _rope_params(positive, dim)]).to(device) for dim in axes_dims)


def rotary_freqs(positions: Tensor, axes_dims: Sequence[int]) -> Tensor:
    """``positions [T, A]`` int64 (one per RoPE axis, in -4096..4095) -> ``[T, Dh / 2]`` complex64,
    each token's rotations: diffusers' ``QwenEmbedRope`` rows, axis after axis."""
    tables = _axis_tables(tuple(axes_dims), positions.device)
    return torch.cat(
        [table.index_select(0, positions[:, axis] + ROPE_POSITIONS) for axis, table in enumerate(tables)], dim=1
    )


@dataclass(eq=False)
class QwenImageStep(FluxStep):
    """:class:`FluxStep` with Qwen-Image's RoPE and per-token image modulation.

    Attributes (beside :class:`FluxStep`'s, whose ``temb [n, D]`` is the sample's timestep's, the
    text's and the output layer's conditioning):
        cos, sin: ``[T, Dh / 2]`` fp32: the real and imaginary parts of each token's complex64
            rotations (:func:`rotary_freqs`), joint order.
        img_temb: the conditioning of image tokens: ``temb``, or with ``zero_cond_t``
            ``cat([temb, zero_temb]) [2n, D]`` (timestep-0 rows after the timestep's).
        img_mod_index: ``[Ti]`` each image token's row of ``img_temb``.
        target_rows: ``[Tg]`` the image stream's rows of target tokens (the output's), ascending.
    """

    img_temb: Tensor
    img_mod_index: Tensor
    target_rows: Tensor

    @classmethod
    def from_routed(
        cls,
        routed: RoutedBatch,
        attention: KnapDistributedAttention,
        axes_dims: Sequence[int],
        temb: Tensor,
        zero_temb: Tensor | None,
    ) -> QwenImageStep:
        """From the routed batch's ``positions``, ``is_text`` and ``is_reference`` columns;
        ``zero_temb [n, D]`` (timestep 0) with ``zero_cond_t``, else ``None``."""
        batch = routed.batch
        streams = cls.streams(routed)
        freqs = rotary_freqs(batch.token_data["positions"], axes_dims)
        is_reference = batch.token_data["is_reference"].index_select(0, streams["img_rows"])
        img_seq = streams["img_seq"]
        if zero_temb is None:
            img_temb, img_mod_index = temb, img_seq
        else:
            img_temb, img_mod_index = torch.cat([temb, zero_temb]), img_seq + batch.num_seqs * is_reference
        return cls(routed, attention, temb, **streams, cos=freqs.real, sin=freqs.imag, img_temb=img_temb,
                   img_mod_index=img_mod_index, target_rows=(~is_reference).nonzero().squeeze(1))  # fmt: skip

    @functools.cached_property
    def freqs(self) -> Tensor:
        """``[T, 1, Dh / 2]`` complex64 rotations, made once per step (every block's q and k take them)."""
        return torch.complex(self.cos, self.sin).unsqueeze(1)

    def rotate(self, x: Tensor) -> Tensor:
        """diffusers' ``apply_rotary_emb_qwen(use_real=False)``: the channel pairs of ``x [T, H, Dh]``
        as complex64 numbers times the tokens' rotations, back to ``x``'s dtype."""
        pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # unflatten works on 0 tokens
        return torch.view_as_real(pairs * self.freqs).flatten(2).type_as(x)


class QwenImageBlock(nn.Module):
    """diffusers' ``QwenImageTransformerBlock``: text and image tokens keep separate weights and meet
    in joint attention. ``forward(txt [Tt, D], img [Ti, D], step) -> (txt, img)``."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, eps: float = NORM_EPS) -> None:
        super().__init__()
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.txt_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.attn = FluxAttentionWeights(dim, num_heads, head_dim, joint=True, eps=eps, norm=RMSNorm)
        self.img_mlp = FeedForward(dim, 4 * dim)
        self.txt_mlp = FeedForward(dim, 4 * dim)
        self.eps = eps

    def forward(self, txt: Tensor, img: Tensor, step: QwenImageStep) -> tuple[Tensor, Tensor]:
        img_mods = self.img_mod(step.img_temb).chunk(6, dim=1)  # shift, scale, gate of attention, then MLP
        txt_mods = self.txt_mod(step.temb).chunk(6, dim=1)
        txt, img = double_stream(self.attn, self.img_mlp, self.txt_mlp, txt, img, txt_mods, img_mods, step, self.eps,
                                 img_index=step.img_mod_index)  # fmt: skip
        if img.dtype == torch.float16:  # double_stream clips the text stream; diffusers clips both
            img = img.clip(-65504, 65504)
        return txt, img


class TimestepEmbedding(nn.Module):
    """diffusers' ``QwenTimestepProjEmbeddings`` without the additional condition (Qwen-Image-Layered's):
    ``[N]`` timesteps in ``[0, 1]`` -> ``temb [N, D]``, the fp32 features scaled by 1000 inside."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.timestep_embedder = MLPEmbedder(256, dim)

    def forward(self, timestep: Tensor) -> Tensor:
        return self.timestep_embedder(timestep_features(timestep, 256, scale=1000).to(timestep.dtype))
