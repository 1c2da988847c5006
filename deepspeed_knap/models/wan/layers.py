"""Wan 2.x building blocks on packed video tokens, with diffusers' ``WanTransformer3DModel`` names.

Every module here has the parameter names and shapes of its diffusers counterpart, so
:class:`~deepspeed_knap.models.wan.wan.PackedWanTransformer` loads a diffusers state dict as is. The
arithmetic follows diffusers' ``transformer_wan.py`` operation by operation, including every place
it goes through fp32 (``FP32LayerNorm``, the residual stream's ``hidden_states.float()``, the
modulation table plus ``temb.float()``, RoPE tables in fp32), so the two agree to rounding in any
dtype: in bf16 those casts are diffusers' upcasts, and in an fp64 model they are its roundings,
reproduced here.

A Wan block is self-attention over the video tokens (3D RoPE, q/k RMSNorm across all heads), then
cross-attention from the video tokens to the sample's text (and, for I2V, its image context), then
an MLP; AdaLN modulation comes from the timestep, one row per distinct timestep value
(:class:`WanStep`).

Shapes: ``T`` video tokens on this GPU, ``n`` chunks (sequences) held, ``R`` distinct timestep values
held, ``Tc`` context (text or image) rows of the held chunks, ``D`` model width, ``H`` heads of ``Dh``
channels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepspeed_knap.models.layers import FeedForward, MLPEmbedder, gate, modulate, timestep_features
from deepspeed_knap.runtime.attention import KnapDistributedAttention, VarlenSeqs
from deepspeed_knap.runtime.routing import RoutedBatch


class _FP32AffineLayerNorm(torch.autograd.Function):
    """diffusers' ``FP32LayerNorm`` with a weight and a bias: ``layer_norm(x.float(), weight.float(),
    bias.float())`` in fp32, back to ``x``'s dtype. Forward is that kernel call.

    Backward differs only for dtypes wider than fp32 (fp64 models: the conformance tests), where
    diffusers rounds to fp32 a gradient that is a sum over tokens, which packing and balancing
    partition differently (a sample's tokens are split over the GPUs of its group):

    * the weight and bias gradients (the kernel sums them over every row in fp32): with wider
      parameters they are summed in the parameters' dtype;
    * with ``unrounded_input_grad``, the input's gradient too: for the I2V image embedder, whose
      output rows are attended to by every query token of the sample, so the gradient arriving at
      them is a sum over the query tokens this GPU holds. It is then computed in ``x``'s dtype, from
      the fp32 statistics of the forward.

    So the balanced and the unbalanced model agree to fp64 rounding. With fp32 or bf16 it is the
    kernel's own backward.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, eps: float, unrounded_input_grad: bool) -> Tensor:
        x32, weight32, bias32 = x.float(), weight.float(), bias.float()
        out, mean, rstd = torch.native_layer_norm(x32, (x.shape[-1],), weight32, bias32, eps)
        ctx.save_for_backward(x32, weight, bias, mean, rstd)
        ctx.dtype, ctx.unrounded_input_grad = x.dtype, unrounded_input_grad
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x32, weight, bias, mean, rstd = ctx.saved_tensors
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        wide_params = _wider_than_fp32(weight.dtype)
        wide_x = need_x and ctx.unrounded_input_grad and _wider_than_fp32(ctx.dtype)
        mask = [need_x and not wide_x, need_weight and not wide_params, need_bias and not wide_params]
        grad32 = grad.float()
        grad_x, grad_weight, grad_bias = torch.ops.aten.native_layer_norm_backward(
            grad32, x32, [x32.shape[-1]], mean, rstd, weight.float(), bias.float(), mask
        )
        if wide_params or wide_x:
            wide = torch.promote_types(weight.dtype, ctx.dtype)
            normed = (x32.to(wide) - mean.to(wide)) * rstd.to(wide)
            wide_grad = grad.to(wide) if wide_x else grad32.to(wide)  # diffusers' rounding, where it is kept
            if wide_params:
                grad_weight = (wide_grad * normed).sum(0) if need_weight else None
                grad_bias = wide_grad.sum(0) if need_bias else None
            if wide_x:
                grad_normed = wide_grad * weight.float().to(wide)
                grad_x = rstd.to(wide) * (
                    grad_normed
                    - grad_normed.mean(-1, keepdim=True)
                    - normed * (grad_normed * normed).mean(-1, keepdim=True)
                )
        grad_x = grad_x.to(ctx.dtype) if need_x else None
        grad_weight = grad_weight.to(weight.dtype) if need_weight else None
        grad_bias = grad_bias.to(bias.dtype) if need_bias else None
        return grad_x, grad_weight, grad_bias, None, None


def _wider_than_fp32(dtype: torch.dtype) -> bool:
    return torch.promote_types(dtype, torch.float32) != torch.float32


class _RoundToFP32(torch.autograd.Function):
    """``x`` rounded to fp32 precision, kept in its (wider) dtype; the gradient passes unrounded."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.float().to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


def summed_fp32(x: Tensor) -> Tensor:
    """diffusers' ``x.float()`` for a tensor whose gradient is a sum over tokens (``temb.float()``
    in a block: the modulation rows are shared by every token of a sample or timestep value).

    For bf16 and fp32 it is ``x.float()``. For a wider ``x`` (fp64 models: the conformance tests)
    diffusers rounds ``x`` to fp32 going forward, and so does this, but diffusers' backward also
    rounds the gradient to fp32 after summing it over the tokens it holds together, which packing
    and balancing change (a sample's tokens are split over the GPUs of its group): here the gradient
    passes unrounded, so that the balanced and the unbalanced model agree to fp64 rounding."""
    return _RoundToFP32.apply(x) if _wider_than_fp32(x.dtype) else x.float()


def fp32_layer_norm(x: Tensor, eps: float) -> Tensor:
    """diffusers' ``FP32LayerNorm(dim, eps, elementwise_affine=False)(x.float())``: ``[T, D]`` -> fp32."""
    return F.layer_norm(x.float(), (x.shape[-1],), eps=eps)


class FP32LayerNorm(nn.LayerNorm):
    """diffusers' ``FP32LayerNorm`` with weights (``norm2`` of a block, the I2V image embedder's
    norms): LayerNorm in fp32, back to the input's dtype. ``unrounded_input_grad``: see
    :class:`_FP32AffineLayerNorm` (for inputs whose rows many query tokens attend to)."""

    def __init__(self, dim: int, eps: float = 1e-5, unrounded_input_grad: bool = False) -> None:
        super().__init__(dim, eps)
        self.unrounded_input_grad = unrounded_input_grad

    def forward(self, x: Tensor) -> Tensor:
        return _FP32AffineLayerNorm.apply(x, self.weight, self.bias, self.eps, self.unrounded_input_grad)


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """Channels of a head rotated by frame, height and width position: diffusers'
    ``WanRotaryPosEmbed`` split, ``(44, 42, 42)`` for 128."""
    height = 2 * (head_dim // 6)
    return head_dim - 2 * height, height, height


def rotary_cos_sin(positions: Tensor, head_dim: int, theta: float = 10000.0) -> tuple[Tensor, Tensor]:
    """Wan's 3D RoPE tables for ``positions [T, 3]`` (frame, height, width of each token in its
    sample's patch grid) -> ``cos, sin [T, Dh / 2]`` fp32, one angle per rotated channel pair.

    diffusers builds ``rope_max_seq_len`` rows per axis in fp64 and rounds them to fp32; the rows are
    ``position * frequency``, so computing them per token gives the same numbers."""
    cos, sin = [], []
    freqs_dtype = torch.float32 if positions.device.type == "mps" else torch.float64
    for axis, dim in enumerate(rope_axes(head_dim)):
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=freqs_dtype, device=positions.device) / dim))
        angles = torch.outer(positions[:, axis].to(freqs_dtype), freqs)  # [T, dim / 2]
        cos.append(angles.cos().float())
        sin.append(angles.sin().float())
    return torch.cat(cos, dim=1), torch.cat(sin, dim=1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs ``(2j, 2j + 1)`` of ``x [T, H, Dh]`` by ``cos, sin [T, Dh / 2]``, in the
    wider of x's dtype and fp32, back to x's dtype (diffusers' Wan ``apply_rotary_emb``)."""
    real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)  # unflatten, unlike reshape(-1), works on 0 tokens
    cos, sin = cos[:, None], sin[:, None]
    return torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1).flatten(-2).to(x.dtype)


@dataclass(eq=False)
class WanStep:
    """What every block of one step needs on this GPU, computed once per step.

    Conditioning is per distinct timestep value, not per token: Wan 2.1 has one timestep per sample
    and Wan 2.2 TI2V one per token but only a few values per sample (0 for the conditioning frame,
    ``t`` elsewhere), and ``temb`` is a function of the value alone. diffusers' TI2V path keeps a
    ``[L, 6, D]`` fp32 modulation per block; here it is ``[R, 6, D]`` with ``R`` the values held.

    Attributes:
        routed: the routed batch (video tokens only; one chunk per sequence held).
        attention: the self-attention module the blocks share (Ulysses inside a group).
        cond_index: ``[T]`` int64 row of ``temb`` / ``timestep_proj`` of each token.
        temb: ``[R, D]`` timestep embedding (the output layer's modulation).
        timestep_proj: ``[R, 6, D]`` the blocks' modulation before each block's table is added.
        cos, sin: ``[T, Dh / 2]`` RoPE tables.
        chunks: the held chunks as query sequences of cross-attention.
        text: ``[Tc, D]`` the embedded text of each held chunk's sample, chunk after chunk.
        text_seqs: its rows per chunk.
        image, image_seqs: the same for I2V image context, else ``None``.
    """

    routed: RoutedBatch
    attention: KnapDistributedAttention
    cond_index: Tensor
    temb: Tensor
    timestep_proj: Tensor
    cos: Tensor
    sin: Tensor
    chunks: VarlenSeqs
    text: Tensor
    text_seqs: VarlenSeqs
    image: Tensor | None = None
    image_seqs: VarlenSeqs | None = None

    def self_attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """RoPE, then attention over whole sequences (Ulysses in a group): ``[T, H, Dh]`` -> ``[T, H * Dh]``."""
        q, k = apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)
        return self.attention(q, k, v, self.routed).flatten(1).to(q.dtype)

    def cross_attend(self, q: Tensor, k: Tensor, v: Tensor, context: VarlenSeqs) -> Tensor:
        """Each held chunk's queries ``[T, H, Dh]`` over its own sample's context keys and values
        ``[Tc, H, Dh]``, on this GPU alone: every member of a group holds the context of the
        sequences it has chunks of (docs/design.md, "Wan: cross-attention under Ulysses"), so no
        query needs another GPU. ``[T, H * Dh]``."""
        return self.attention.varlen_attn(q, k, v, self.chunks, context).flatten(1).to(q.dtype)


def varlen_seqs(routed: RoutedBatch, key: str, seq_lens: Sequence[int]) -> VarlenSeqs:
    """Boundaries of ``seq_lens`` rows per held chunk (``key`` names them), ``cu_seqlens`` on the
    device made once per step."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    cu_seqlens = routed.device_array(("wan", key), np.concatenate([[0], np.cumsum(lens)]), torch.int32)
    return VarlenSeqs(tuple(lens.tolist()), cu_seqlens, int(lens.max(initial=0)))


class PatchEmbedding(nn.Conv3d):
    """diffusers' ``patch_embedding`` (a Conv3d whose stride is its kernel, the patch), applied to
    patch rows ``[T, C * pt * ph * pw]`` (channel-major, as :func:`~deepspeed_knap.models.wan.wan.patchify`
    cuts them) as the matrix product it is: ``[T, D]``. Same parameters, names and shapes."""

    def forward(self, patches: Tensor) -> Tensor:
        return F.linear(patches, self.weight.flatten(1), self.bias)


class TextProjection(nn.Module):
    """diffusers' ``PixArtAlphaTextProjection`` with ``gelu_tanh``: text-encoder rows -> ``D``."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.act_1 = nn.GELU(approximate="tanh")
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(self.act_1(self.linear_1(x)))


class ImageEmbedding(nn.Module):
    """diffusers' ``WanImageEmbedding`` without ``pos_embed`` (I2V): ``[Li, image_dim]`` CLIP image
    tokens -> ``[Li, D]``."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        # Every query token of a sample attends to these rows: the gradient arriving at them is a sum
        # that balancing partitions, kept unrounded in fp64 models (_FP32AffineLayerNorm).
        self.norm1 = FP32LayerNorm(in_dim, unrounded_input_grad=True)
        self.ff = FeedForward(in_dim, in_dim, dim, approximate="none")
        self.norm2 = FP32LayerNorm(dim, unrounded_input_grad=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm2(self.ff(self.norm1(x)))


class TimeTextImageEmbedding(nn.Module):
    """diffusers' ``WanTimeTextImageEmbedding`` (``condition_embedder``): timestep -> ``temb`` and
    the blocks' modulation, text -> ``D``, I2V image context -> ``D``. The three parts are called
    separately: text and image context are embedded where they are routed to."""

    def __init__(self, dim: int, freq_dim: int, text_dim: int, image_dim: int | None) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.time_embedder = MLPEmbedder(freq_dim, dim)
        self.act_fn = nn.SiLU()
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.text_embedder = TextProjection(text_dim, dim)
        self.image_embedder = ImageEmbedding(image_dim, dim) if image_dim is not None else None

    def embed_timesteps(self, timesteps: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``[R]`` timesteps (diffusers' scale, 0-1000) -> ``temb [R, D]`` (in ``dtype``: diffusers
        casts it to the text's dtype) and ``timestep_proj [R, 6, D]``."""
        features = timestep_features(timesteps, self.freq_dim)  # fp32, as diffusers' Timesteps
        temb = self.time_embedder(features.to(self.time_embedder.linear_1.weight.dtype)).to(dtype)
        return temb, self.time_proj(self.act_fn(temb)).unflatten(1, (6, -1))


class WanAttentionWeights(nn.Module):
    """diffusers' ``WanAttention``'s parameters: ``to_q``, ``to_k``, ``to_v``, ``to_out.0`` and
    RMSNorms ``norm_q``, ``norm_k`` over all ``H * Dh`` channels of a token; with ``added_kv_dim``
    (I2V cross-attention) also ``add_k_proj``, ``add_v_proj``, ``norm_added_k``. The attention
    itself is the step's (:class:`WanStep`)."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, eps: float, added_kv_dim: int | None = None) -> None:
        super().__init__()
        self.heads, self.head_dim = num_heads, head_dim
        inner = num_heads * head_dim
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, inner) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Dropout(0.0)])
        self.norm_q = nn.RMSNorm(inner, eps=eps)
        self.norm_k = nn.RMSNorm(inner, eps=eps)
        if added_kv_dim is not None:
            self.add_k_proj = nn.Linear(added_kv_dim, inner)
            self.add_v_proj = nn.Linear(added_kv_dim, inner)
            self.norm_added_k = nn.RMSNorm(inner, eps=eps)

    def heads_of(self, x: Tensor) -> Tensor:
        """``[T, H * Dh]`` -> ``[T, H, Dh]``."""
        return x.unflatten(-1, (self.heads, self.head_dim))

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention's ``[T, D]`` -> q, k, v ``[T, H, Dh]``, q and k normed.

        The q/k RMSNorm is over all ``H * Dh`` channels of a token, so it runs here, on the
        token-sharded side: this GPU holds every head of its own tokens. After the Ulysses
        all-to-all a member holds only its ``h`` of ``H`` heads (of every token of the sequence),
        and the norm's mean square over the other members' heads would need one more collective."""
        q, k = self.norm_q(self.to_q(x)), self.norm_k(self.to_k(x))
        return self.heads_of(q), self.heads_of(k), self.heads_of(self.to_v(x))

    def cross_kv(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """Text context ``[Tc, D]`` -> k, v ``[Tc, H, Dh]`` (k normed)."""
        return self.heads_of(self.norm_k(self.to_k(context))), self.heads_of(self.to_v(context))

    def image_kv(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """I2V image context ``[Tc, D]`` -> k, v ``[Tc, H, Dh]`` (k normed)."""
        return self.heads_of(self.norm_added_k(self.add_k_proj(context))), self.heads_of(self.add_v_proj(context))


class WanBlock(nn.Module):
    """diffusers' ``WanTransformerBlock``: self-attention, cross-attention, MLP.
    ``forward(x [T, D], step) -> [T, D]``."""

    def __init__(self, dim: int, ffn_dim: int, num_heads: int, cross_attn_norm: bool, eps: float,
                 added_kv_proj_dim: int | None) -> None:  # fmt: skip
        super().__init__()
        head_dim = dim // num_heads
        self.eps = eps
        self.attn1 = WanAttentionWeights(dim, num_heads, head_dim, eps)
        self.attn2 = WanAttentionWeights(dim, num_heads, head_dim, eps, added_kv_proj_dim)
        self.norm2 = FP32LayerNorm(dim, eps) if cross_attn_norm else nn.Identity()
        self.ffn = FeedForward(dim, ffn_dim)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(self, x: Tensor, step: WanStep) -> Tensor:
        rows = step.cond_index
        # [R, 6, D]: diffusers adds temb in fp32 (its table is kept in fp32 when loading bf16).
        mods = (self.scale_shift_table + summed_fp32(step.timestep_proj)).unbind(1)
        shift, scale, gate_attn, c_shift, c_scale, c_gate = mods

        # 1. Self-attention over the video tokens of each whole sequence (Ulysses inside a group).
        normed = modulate(fp32_layer_norm(x, self.eps), rows, shift, scale).to(x.dtype)
        attended = step.self_attend(*self.attn1.qkv(normed))
        attn_out = self.attn1.to_out[1](self.attn1.to_out[0](attended))
        x = (x.float() + gate(attn_out, rows, gate_attn)).to(x.dtype)

        # 2. Cross-attention to the sample's text (and I2V image context), on this GPU alone.
        normed = self.norm2(x.float()).to(x.dtype)
        attn2 = self.attn2
        q = attn2.heads_of(attn2.norm_q(attn2.to_q(normed)))
        attended = step.cross_attend(q, *attn2.cross_kv(step.text), step.text_seqs)
        if step.image is not None:
            attended = attended + step.cross_attend(q, *attn2.image_kv(step.image), step.image_seqs)
        x = x + attn2.to_out[1](attn2.to_out[0](attended))

        # 3. MLP.
        normed = modulate(fp32_layer_norm(x, self.eps), rows, c_shift, c_scale).to(x.dtype)
        return (x.float() + gate(self.ffn(normed).float(), rows, c_gate)).to(x.dtype)


def output_modulation(table: Tensor, temb: Tensor) -> tuple[Tensor, Tensor]:
    """The output layer's ``shift, scale [R, D]`` from the model's ``scale_shift_table [1, 2, D]`` and
    ``temb [R, D]`` (diffusers adds them in the table's dtype, without the blocks' fp32 cast)."""
    shift, scale = (table + temb[:, None]).unbind(1)
    return shift, scale


__all__ = [
    "FP32LayerNorm",
    "FeedForward",
    "ImageEmbedding",
    "PatchEmbedding",
    "TimeTextImageEmbedding",
    "WanAttentionWeights",
    "WanBlock",
    "WanStep",
    "apply_rotary",
    "fp32_layer_norm",
    "output_modulation",
    "rope_axes",
    "rotary_cos_sin",
    "varlen_seqs",
]
