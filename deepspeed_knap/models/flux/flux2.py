"""FLUX.2 on packed, balanced batches, loading and saving diffusers' ``Flux2Transformer2DModel`` weights.

    model = PackedFlux2Transformer.from_pretrained("/models/FLUX.2-dev", ds_config=ds_config)
    outputs = model.forward_samples(samples, balancer)  # one [L_i, 128] prediction per sample

The same machinery as FLUX.1 (:mod:`~deepspeed_knap.models.flux.base`: packing, the route-less
forward, per-sample modulation, RoPE from routed ids, stream selection, checkpoints); what differs is
here. FLUX.2 has no pooled text embedding, computes its modulation once per step for all blocks
(``double_stream_modulation_img/_txt``, ``single_stream_modulation``) instead of per block, uses
SwiGLU MLPs, fuses the single-stream block's q, k, v and MLP input into one projection, has no
biases, and rotates 4 position axes ``(t, h, w, l)`` with base 2000.

A sample (:meth:`~PackedFluxBase.pack`): ``hidden_states [L, C]``, ``encoder_hidden_states [Tt, Dj]``,
``timestep`` and ``guidance`` scalars (``guidance`` only with ``guidance_embeds``, as in FLUX.2
[dev]), ``img_ids [L, 4]``, ``txt_ids [Tt, 4]``: :func:`image_ids` and :func:`text_ids` give
diffusers' pipeline positions.

Shapes: ``T`` tokens on this GPU (``Tt`` text, ``Ti`` image), ``n`` sequences (chunks) held, ``D``
model width, ``H`` heads of ``Dh`` channels.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepspeed_knap.models.flux.base import PackedFluxBase
from deepspeed_knap.models.flux.layers import AdaNormOut, FluxAttentionWeights, FluxStep, double_stream
from deepspeed_knap.models.flux.spec import FLUX2
from deepspeed_knap.models.layers import MLPEmbedder, gate, layer_norm, modulate, timestep_features
from deepspeed_knap.planner.topology import Topology


def image_ids(height: int, width: int, t: int = 0) -> Tensor:
    """``[height * width, 4]`` positions ``(t, h, w, 0)`` of a latent grid, row by row: diffusers'
    FLUX.2 ids of the generated image (``t = 0``) or of the ``i``-th reference image (``t = 10 + 10 i``)."""
    h, w = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    return torch.stack([torch.full_like(h, t), h, w, torch.zeros_like(h)], dim=-1).reshape(-1, 4).float()


def swiglu(x: Tensor) -> Tensor:
    """``silu(first half) * second half`` of the last dim (diffusers' ``Flux2SwiGLU``)."""
    value, gates = x.chunk(2, dim=-1)
    return F.silu(value) * gates


class Flux2FeedForward(nn.Module):
    """``linear_in`` (to twice the hidden size) -> SwiGLU -> ``linear_out``, no biases."""

    def __init__(self, dim: int, mlp_ratio: float) -> None:
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.linear_in = nn.Linear(dim, 2 * hidden, bias=False)
        self.linear_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_out(swiglu(self.linear_in(x)))


class Flux2DoubleBlock(nn.Module):
    """diffusers' ``Flux2TransformerBlock``: text and image keep separate weights and meet in joint
    attention. ``forward(txt [Tt, D], img [Ti, D], txt_mod, img_mod [n, 6D], step) -> (txt, img)``."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, mlp_ratio: float, eps: float) -> None:
        super().__init__()
        self.attn = FluxAttentionWeights(dim, num_heads, head_dim, joint=True, bias=False, eps=eps)
        self.ff = Flux2FeedForward(dim, mlp_ratio)
        self.ff_context = Flux2FeedForward(dim, mlp_ratio)
        self.eps = eps

    def forward(self, txt: Tensor, img: Tensor, txt_mod: Tensor, img_mod: Tensor, step: FluxStep):
        return double_stream(self.attn, self.ff, self.ff_context, txt, img, txt_mod.chunk(6, dim=1),
                             img_mod.chunk(6, dim=1), step, self.eps)  # fmt: skip


class Flux2ParallelAttentionWeights(nn.Module):
    """diffusers' ``Flux2ParallelSelfAttention``'s weights: one projection to q, k, v and the MLP
    input (``to_qkv_mlp_proj``), q/k norms, and one output projection of attention and MLP together."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, mlp_ratio: float, eps: float) -> None:
        super().__init__()
        self.heads, self.head_dim = num_heads, head_dim
        self.mlp_hidden = int(dim * mlp_ratio)
        inner = num_heads * head_dim
        self.to_qkv_mlp_proj = nn.Linear(dim, 3 * inner + 2 * self.mlp_hidden, bias=False)
        self.norm_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=eps)
        self.to_out = nn.Linear(inner + self.mlp_hidden, dim, bias=False)


class Flux2SingleBlock(nn.Module):
    """diffusers' ``Flux2SingleTransformerBlock``: one weight set for all tokens, attention and SwiGLU
    MLP in parallel. ``forward(x [T, D] joint order, mod [n, 3D], step) -> [T, D]``."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, mlp_ratio: float, eps: float) -> None:
        super().__init__()
        self.attn = Flux2ParallelAttentionWeights(dim, num_heads, head_dim, mlp_ratio, eps)
        self.eps = eps

    def forward(self, x: Tensor, mod: Tensor, step: FluxStep) -> Tensor:
        shift, scale, gates = mod.chunk(3, dim=1)
        attn = self.attn
        seq = step.routed.batch.seq_index
        projected = attn.to_qkv_mlp_proj(modulate(layer_norm(x, self.eps), seq, shift, scale))
        qkv, mlp = projected.split([projected.shape[1] - 2 * attn.mlp_hidden, 2 * attn.mlp_hidden], dim=1)
        q, k, v = (t.unflatten(-1, (attn.heads, attn.head_dim)) for t in qkv.chunk(3, dim=1))
        attended = step.attend(attn.norm_q(q), attn.norm_k(k), v)
        x = x + gate(attn.to_out(torch.cat([attended, swiglu(mlp)], dim=1)), seq, gates)
        if x.dtype == torch.float16:
            x = x.clip(-65504, 65504)
        return x


class Flux2Modulation(nn.Module):
    """``linear(silu(temb))``: ``sets`` x (shift, scale, gate) ``[n, 3 * sets * D]`` rows for every
    block of one kind, computed once per step."""

    def __init__(self, dim: int, sets: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 3 * sets * dim, bias=False)

    def forward(self, temb: Tensor) -> Tensor:
        return self.linear(F.silu(temb))


class Flux2TimeGuidanceEmbedding(nn.Module):
    """``temb [N, D]`` from timestep ``[N]`` and guidance ``[N]`` (with ``guidance_embeds``), as
    diffusers' ``Flux2TimestepGuidanceEmbeddings``."""

    def __init__(self, channels: int, dim: int, guidance: bool) -> None:
        super().__init__()
        self.channels = channels
        self.timestep_embedder = MLPEmbedder(channels, dim, bias=False)
        if guidance:
            self.guidance_embedder = MLPEmbedder(channels, dim, bias=False)

    def forward(self, timestep: Tensor, guidance: Tensor | None) -> Tensor:
        temb = self.timestep_embedder(timestep_features(timestep, self.channels).to(timestep.dtype))
        if guidance is not None:
            temb = temb + self.guidance_embedder(timestep_features(guidance, self.channels).to(guidance.dtype))
        return temb


class PackedFlux2Transformer(PackedFluxBase):
    """FLUX.2 (double-stream then single-stream blocks) over packed samples, balanced or not.

    The constructor takes ``Flux2Transformer2DModel``'s config (defaults: FLUX.2 [dev], 32B), so
    ``state_dict`` names and shapes are diffusers', plus:

    Args:
        attention_backend: local kernel of every block's attention (see ``VarlenAttention``); the
            config's ``knapformer.attention_backend`` replaces it under ``deepspeed_knap.initialize``.
        topology: when given, checked against the heads at construction.
        gradient_checkpointing: recompute each block in backward instead of keeping its activations.
    """

    spec = FLUX2

    def __init__(
        self,
        patch_size: int = 1,
        in_channels: int = 128,
        out_channels: int | None = None,
        num_layers: int = 8,
        num_single_layers: int = 48,
        attention_head_dim: int = 128,
        num_attention_heads: int = 48,
        joint_attention_dim: int = 15360,
        timestep_guidance_channels: int = 256,
        mlp_ratio: float = 3.0,
        axes_dims_rope: Sequence[int] = (32, 32, 32, 32),
        rope_theta: int = 2000,
        eps: float = 1e-6,
        guidance_embeds: bool = True,
        attention_backend: str = "auto",
        topology: Topology | None = None,
        gradient_checkpointing: bool = False,
    ) -> None:
        arguments = locals()
        super().__init__()
        config = {key: arguments[key] for key in self.config_keys()}
        self._init_common(config, attention_backend, topology, gradient_checkpointing)
        dim, heads, head_dim = self.inner_dim, num_attention_heads, attention_head_dim
        self.time_guidance_embed = Flux2TimeGuidanceEmbedding(timestep_guidance_channels, dim, guidance_embeds)
        self.double_stream_modulation_img = Flux2Modulation(dim, sets=2)
        self.double_stream_modulation_txt = Flux2Modulation(dim, sets=2)
        self.single_stream_modulation = Flux2Modulation(dim, sets=1)
        self.x_embedder = nn.Linear(in_channels, dim, bias=False)
        self.context_embedder = nn.Linear(joint_attention_dim, dim, bias=False)
        self.transformer_blocks = nn.ModuleList(
            Flux2DoubleBlock(dim, heads, head_dim, mlp_ratio, eps) for _ in range(num_layers)
        )
        self.single_transformer_blocks = nn.ModuleList(
            Flux2SingleBlock(dim, heads, head_dim, mlp_ratio, eps) for _ in range(num_single_layers)
        )
        self.norm_out = AdaNormOut(dim, bias=False, eps=eps)
        self.proj_out = nn.Linear(dim, patch_size * patch_size * self.out_channels, bias=False)

    def embed_conditioning(self, conditioning: Mapping[str, Tensor], dtype: torch.dtype) -> Tensor:
        timestep = conditioning["timestep"].to(dtype) * 1000
        guidance = conditioning.get("guidance")
        return self.time_guidance_embed(timestep, None if guidance is None else guidance.to(dtype) * 1000)

    def transform(self, txt: Tensor, img: Tensor, step: FluxStep) -> Tensor:
        txt_mod = self.double_stream_modulation_txt(step.temb)  # [n, 6D]
        img_mod = self.double_stream_modulation_img(step.temb)
        for block in self.transformer_blocks:
            txt, img = self._run(block, txt, img, txt_mod, img_mod, step)
        x = step.joint(txt, img)
        single_mod = self.single_stream_modulation(step.temb)  # [n, 3D]
        for block in self.single_transformer_blocks:
            x = self._run(block, x, single_mod, step)
        img = x.index_select(0, step.img_rows)
        return self.proj_out(self.norm_out(img, step.img_seq, step.temb))
