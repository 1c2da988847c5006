"""FLUX building blocks on packed tokens: RoPE from position ids, the step's stream selection and FLUX.1's
blocks (per-sequence modulation and the feed-forwards every family shares: :mod:`deepspeed_knap.models.layers`).

Every module here has the parameter names and shapes of its diffusers counterpart, so
``PackedFluxTransformer`` loads a ``FluxTransformer2DModel`` state dict as is. The arithmetic follows
diffusers operation by operation, including where it drops to fp32 (timestep features, RoPE), so the
two agree to rounding in any dtype. The per-sample modulation, RoPE, the step's stream selection
(:class:`FluxStep`) and the embedders are shared with FLUX.2 (:mod:`~deepspeed_knap.models.flux.flux2`).

Shapes: ``T`` tokens on this GPU (``Tt`` text, ``Ti`` image/video), ``n`` sequences (chunks) held,
``D`` model width, ``H`` heads of ``Dh`` channels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepspeed_knap.models.layers import (
    NORM_EPS,
    FeedForward,
    MLPEmbedder,
    gate,
    layer_norm,
    modulate,
    timestep_features,
)
from deepspeed_knap.runtime.attention import KnapDistributedAttention
from deepspeed_knap.runtime.routing import RoutedBatch


def rotary_cos_sin(ids: Tensor, axes_dims: Sequence[int], theta: float = 10000.0) -> tuple[Tensor, Tensor]:
    """FLUX's RoPE tables: ``ids [T, A]`` positions (text ``0``; images ``(0, h, w)``; video
    ``(t, h, w)``) -> ``cos, sin [T, sum(axes_dims)]`` fp32, each frequency repeated twice.
    Angles are computed in fp64 (fp32 where the device has no fp64), as diffusers does."""
    if ids.shape[-1] != len(axes_dims):
        raise ValueError(f"position ids have {ids.shape[-1]} axes but axes_dims_rope has {len(axes_dims)}")
    positions = ids.float()
    freqs_dtype = torch.float32 if ids.device.type in ("mps", "npu") else torch.float64
    cos, sin = [], []
    for axis, dim in enumerate(axes_dims):
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=freqs_dtype, device=ids.device) / dim))
        angles = torch.outer(positions[:, axis], freqs)  # [T, dim / 2]
        cos.append(angles.cos().repeat_interleave(2, dim=1).float())
        sin.append(angles.sin().repeat_interleave(2, dim=1).float())
    return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs of ``x [T, H, Dh]`` by ``cos, sin [T, Dh]`` (in fp32, back to x's dtype)."""
    real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)  # unflatten, unlike reshape(-1), works on 0 tokens
    rotated = torch.stack([-imag, real], dim=-1).flatten(2)
    return (x.float() * cos[:, None] + rotated.float() * sin[:, None]).to(x.dtype)


@dataclass(eq=False)
class FluxStep:
    """What every block of one step needs on this GPU, computed once per step.

    Attributes:
        routed: the routed batch (its tokens are in joint order: per sequence, text then image).
        attention: the attention module the blocks share.
        temb: ``[n, D]`` conditioning (timestep, guidance, pooled text) of each sequence held.
        txt_rows, img_rows: ``[Tt]``, ``[Ti]`` joint rows of the text and the image tokens.
        txt_seq, img_seq: ``[Tt]``, ``[Ti]`` which held sequence each text / image token is of.
        joint_order: ``[T]``: ``cat([text, image]).index_select(0, joint_order)`` is joint order.
        cos, sin: ``[T, Dh]`` RoPE tables in joint order.
    """

    routed: RoutedBatch
    attention: KnapDistributedAttention
    temb: Tensor
    txt_rows: Tensor
    img_rows: Tensor
    txt_seq: Tensor
    img_seq: Tensor
    joint_order: Tensor
    cos: Tensor
    sin: Tensor

    @classmethod
    def build(
        cls,
        routed: RoutedBatch,
        attention: KnapDistributedAttention,
        axes_dims: Sequence[int],
        temb: Tensor | None = None,
        theta: float = 10000.0,
    ) -> FluxStep:
        """From the routed batch's ``ids`` and ``is_text`` columns; ``temb`` defaults to its
        ``sample_data["temb"]``; ``theta`` is the RoPE base (FLUX.1 10000, FLUX.2 2000)."""
        batch = routed.batch
        cos, sin = rotary_cos_sin(batch.token_data["ids"], axes_dims, theta)
        temb = batch.sample_data["temb"] if temb is None else temb
        return cls(routed, attention, temb, **cls.streams(routed), cos=cos, sin=sin)

    @staticmethod
    def streams(routed: RoutedBatch) -> dict[str, Tensor]:
        """``txt_rows``, ``img_rows``, ``txt_seq``, ``img_seq`` and ``joint_order`` of the routed
        batch's ``is_text`` column."""
        is_text = routed.batch.token_data["is_text"]
        txt_rows = is_text.nonzero().squeeze(1)
        img_rows = (~is_text).nonzero().squeeze(1)
        seq = routed.batch.seq_index
        joint_order = torch.argsort(torch.cat([txt_rows, img_rows]))  # inverse of the stream order
        return {"txt_rows": txt_rows, "img_rows": img_rows, "txt_seq": seq.index_select(0, txt_rows),
                "img_seq": seq.index_select(0, img_rows), "joint_order": joint_order}  # fmt: skip

    def joint(self, txt: Tensor, img: Tensor) -> Tensor:
        """Text rows ``[Tt, ...]`` and image rows ``[Ti, ...]`` -> ``[T, ...]`` in joint order."""
        return torch.cat([txt, img]).index_select(0, self.joint_order)

    def rotate(self, x: Tensor) -> Tensor:
        """RoPE of ``x [T, H, Dh]`` (joint order) by this step's tables."""
        return apply_rotary(x, self.cos, self.sin)

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """RoPE, then attention over whole sequences: ``[T, H, Dh]`` each -> ``[T, H * Dh]``."""
        q, k = self.rotate(q), self.rotate(k)
        return self.attention(q, k, v, self.routed).flatten(1).to(q.dtype)


class AdaNormZero(nn.Module):
    """The ``norm1`` / ``norm`` of a block: ``linear(silu(temb))`` split into ``chunks`` ``[n, D]``
    modulation rows (shift, scale, gate, ...). The LayerNorm it goes with has no weights."""

    def __init__(self, dim: int, chunks: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, chunks * dim)
        self.chunks = chunks

    def forward(self, temb: Tensor) -> tuple[Tensor, ...]:
        return self.linear(F.silu(temb)).chunk(self.chunks, dim=1)


class FluxAttentionWeights(nn.Module):
    """The projections and q/k norms of diffusers' ``FluxAttention`` (FLUX.2's ``Flux2Attention``
    has the same names, without biases: ``bias=False``); the attention itself is the step's shared
    :class:`KnapDistributedAttention`. ``joint=True`` adds the text stream's own projections
    (``add_*_proj``, ``norm_added_*``, ``to_add_out``) and the image output ``to_out``. ``norm`` is
    the q/k norms' class, ``norm(head_dim, eps=eps)``: FLUX's ``nn.RMSNorm``, or Qwen-Image's
    diffusers ``RMSNorm`` (the same weights and names, another rounding)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: int,
        joint: bool,
        bias: bool = True,
        eps: float = NORM_EPS,
        norm: Callable[..., nn.Module] = nn.RMSNorm,
    ) -> None:
        super().__init__()
        self.heads, self.head_dim = num_heads, head_dim
        inner = num_heads * head_dim
        self.norm_q = norm(head_dim, eps=eps)
        self.norm_k = norm(head_dim, eps=eps)
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, inner, bias=bias) for _ in range(3))
        if joint:
            self.to_out = nn.ModuleList([nn.Linear(inner, dim, bias=bias), nn.Dropout(0.0)])
            self.norm_added_q = norm(head_dim, eps=eps)
            self.norm_added_k = norm(head_dim, eps=eps)
            self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, inner, bias=bias) for _ in range(3))
            self.to_add_out = nn.Linear(inner, dim, bias=bias)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``[T, D]`` -> q, k, v ``[T, H, Dh]`` (q and k normed)."""
        q, k, v = (proj(x).unflatten(-1, (self.heads, self.head_dim)) for proj in (self.to_q, self.to_k, self.to_v))
        return self.norm_q(q), self.norm_k(k), v

    def added_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The text stream's ``[Tt, D]`` -> q, k, v ``[Tt, H, Dh]``."""
        projs = (self.add_q_proj, self.add_k_proj, self.add_v_proj)
        q, k, v = (proj(x).unflatten(-1, (self.heads, self.head_dim)) for proj in projs)
        return self.norm_added_q(q), self.norm_added_k(k), v


class FluxDoubleBlock(nn.Module):
    """diffusers' ``FluxTransformerBlock``: text and image tokens keep separate weights and meet only
    in joint attention. ``forward(txt [Tt, D], img [Ti, D], step) -> (txt, img)``."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = AdaNormZero(dim, 6)
        self.norm1_context = AdaNormZero(dim, 6)
        self.attn = FluxAttentionWeights(dim, num_heads, head_dim, joint=True)
        self.ff = FeedForward(dim, 4 * dim)
        self.ff_context = FeedForward(dim, 4 * dim)

    def forward(self, txt: Tensor, img: Tensor, step: FluxStep) -> tuple[Tensor, Tensor]:
        txt_mods, img_mods = self.norm1_context(step.temb), self.norm1(step.temb)
        return double_stream(self.attn, self.ff, self.ff_context, txt, img, txt_mods, img_mods, step)


def double_stream(
    attn: FluxAttentionWeights,
    ff: nn.Module,
    ff_context: nn.Module,
    txt: Tensor,
    img: Tensor,
    txt_mods: Sequence[Tensor],
    img_mods: Sequence[Tensor],
    step: FluxStep,
    eps: float = NORM_EPS,
    img_index: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """A double-stream (MMDiT) block: FLUX.1's, FLUX.2's and Qwen-Image's arithmetic is the same
    (FLUX.2 computes the modulation once per step instead of per block, the MLPs differ, and
    Qwen-Image's Edit-2511 modulates reference image tokens by their own rows).

    Args:
        attn: the block's joint :class:`FluxAttentionWeights`.
        ff, ff_context: the image and the text stream's MLPs.
        txt, img: ``[Tt, D]``, ``[Ti, D]`` the two streams.
        txt_mods, img_mods: six rows each: shift, scale, gate of attention, then of the MLP; the
            text's ``[n, D]`` (per held sequence), the image's ``[m, D]`` rows that ``img_index`` picks.
        step: this step's routed tokens.
        eps: of the weightless LayerNorms.
        img_index: ``[Ti]`` the row of ``img_mods`` of each image token; default ``step.img_seq``
            (per held sequence).

    Returns:
        ``(txt, img)`` after the block.
    """
    shift, scale, gate_attn, shift_mlp, scale_mlp, gate_mlp = img_mods
    c_shift, c_scale, c_gate_attn, c_shift_mlp, c_scale_mlp, c_gate_mlp = txt_mods
    img_index = step.img_seq if img_index is None else img_index

    img_q, img_k, img_v = attn.qkv(modulate(layer_norm(img, eps), img_index, shift, scale))
    txt_q, txt_k, txt_v = attn.added_qkv(modulate(layer_norm(txt, eps), step.txt_seq, c_shift, c_scale))
    attended = step.attend(step.joint(txt_q, img_q), step.joint(txt_k, img_k), step.joint(txt_v, img_v))
    img_attn = attn.to_out[1](attn.to_out[0](attended.index_select(0, step.img_rows)))
    txt_attn = attn.to_add_out(attended.index_select(0, step.txt_rows))

    img = img + gate(img_attn, img_index, gate_attn)
    mlp_in = modulate(layer_norm(img, eps), img_index, shift_mlp, scale_mlp)
    img = img + gate(ff(mlp_in), img_index, gate_mlp)

    txt = txt + gate(txt_attn, step.txt_seq, c_gate_attn)
    mlp_in = modulate(layer_norm(txt, eps), step.txt_seq, c_shift_mlp, c_scale_mlp)
    txt = txt + gate(ff_context(mlp_in), step.txt_seq, c_gate_mlp)
    if txt.dtype == torch.float16:
        txt = txt.clip(-65504, 65504)
    return txt, img


class FluxSingleBlock(nn.Module):
    """diffusers' ``FluxSingleTransformerBlock``: one weight set for all tokens, attention and MLP in
    parallel. ``forward(x [T, D] joint order, step) -> [T, D]``."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm = AdaNormZero(dim, 3)
        self.proj_mlp = nn.Linear(dim, int(dim * mlp_ratio))
        self.proj_out = nn.Linear(dim + int(dim * mlp_ratio), dim)
        self.attn = FluxAttentionWeights(dim, num_heads, head_dim, joint=False)

    def forward(self, x: Tensor, step: FluxStep) -> Tensor:
        shift, scale, gates = self.norm(step.temb)
        seq = step.routed.batch.seq_index
        normed = modulate(layer_norm(x), seq, shift, scale)
        mlp = F.gelu(self.proj_mlp(normed), approximate="tanh")
        attended = step.attend(*self.attn.qkv(normed))
        x = x + gate(self.proj_out(torch.cat([attended, mlp], dim=1)), seq, gates)
        if x.dtype == torch.float16:
            x = x.clip(-65504, 65504)
        return x


class TimeTextEmbedding(nn.Module):
    """``temb [N, D]`` from timestep ``[N]``, guidance ``[N]`` (when the model has guidance) and
    pooled text ``[N, Dp]``, as diffusers' ``CombinedTimestep(Guidance)TextProjEmbeddings``."""

    def __init__(self, dim: int, pooled_dim: int, guidance: bool) -> None:
        super().__init__()
        self.timestep_embedder = MLPEmbedder(256, dim)
        if guidance:
            self.guidance_embedder = MLPEmbedder(256, dim)
        self.text_embedder = MLPEmbedder(pooled_dim, dim)

    def forward(self, timestep: Tensor, guidance: Tensor | None, pooled: Tensor) -> Tensor:
        temb = self.timestep_embedder(timestep_features(timestep).to(pooled.dtype))
        if guidance is not None:
            temb = temb + self.guidance_embedder(timestep_features(guidance).to(pooled.dtype))
        return temb + self.text_embedder(pooled)


class AdaNormOut(nn.Module):
    """diffusers' ``AdaLayerNormContinuous`` at the output: ``norm(x) * (1 + scale) + shift`` with
    ``scale, shift = linear(silu(temb))`` (scale first)."""

    def __init__(self, dim: int, bias: bool = True, eps: float = NORM_EPS) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim, bias=bias)
        self.eps = eps

    def forward(self, x: Tensor, seq: Tensor, temb: Tensor) -> Tensor:
        scale, shift = self.linear(F.silu(temb).to(x.dtype)).chunk(2, dim=1)
        return modulate(layer_norm(x, self.eps), seq, shift, scale)
