"""FLUX.1 on packed, balanced batches, loading and saving diffusers' ``FluxTransformer2DModel`` weights.

    model = PackedFluxTransformer.from_pretrained("black-forest-labs/FLUX.1-dev/transformer")
    outputs = model.forward_samples(samples, balancer)  # one [L_i, C] prediction per sample

diffusers' model conditions a whole batch row on one timestep and one RoPE table, so samples of
different sizes cannot share a batch. Here each rank's samples are packed into one token sequence
(per sample: its text tokens, then its image or video tokens), conditioning is looked up per token
by sample, and attention runs over each sample alone. With a balancer, the raw inputs are routed to
the step's compute bags, embedded there, and the predictions routed back before the loss. What the
FLUX families share is in :mod:`~deepspeed_knap.models.flux.base`; this module is FLUX.1's layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from deepspeed_knap.models.flux.base import FluxInputs, PackedFluxBase
from deepspeed_knap.models.flux.layers import AdaNormOut, FluxDoubleBlock, FluxSingleBlock, FluxStep, TimeTextEmbedding
from deepspeed_knap.models.flux.spec import FLUX1
from deepspeed_knap.planner.topology import Topology

__all__ = ["FluxInputs", "PackedFluxTransformer", "latent_ids", "rope_axes"]


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """FLUX's split of a head's channels over the ``(t, h, w)`` axes, for any even ``head_dim``:
    ``(16, 56, 56)`` for 128, about 1/8 for time and the rest halved, every part even."""
    time_dim = max(2, head_dim // 16 * 2)
    height_dim = (head_dim - time_dim) // 4 * 2
    return time_dim, height_dim, head_dim - time_dim - height_dim


def latent_ids(frames: int, height: int, width: int) -> Tensor:
    """``[frames * height * width, 3]`` float positions ``(t, h, w)`` of a latent token grid, frame by
    frame, row by row; with ``frames=1`` exactly diffusers' FLUX image ids ``(0, h, w)``."""
    t, h, w = torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij")
    return torch.stack([t, h, w], dim=-1).reshape(-1, 3).float()


class PackedFluxTransformer(PackedFluxBase):
    """FLUX.1 (double-stream then single-stream blocks) over packed samples, balanced or not.

    The constructor takes ``FluxTransformer2DModel``'s config, so ``state_dict`` names and shapes are
    identical to diffusers' (``load_state_dict(diffusers_model.state_dict(), strict=True)`` works),
    plus:

    Args:
        attention_backend: local kernel of every block's attention (see ``VarlenAttention``); the
            config's ``knapformer.attention_backend`` replaces it under ``deepspeed_knap.initialize``.
        topology: when given, checked against the heads at construction.
        gradient_checkpointing: recompute each block in backward instead of keeping its activations.

    A sample (:meth:`pack`): ``hidden_states [L, C]``, ``encoder_hidden_states [Tt, Dj]``,
    ``pooled_projections [Dp]``, ``timestep`` and ``guidance`` scalars (``guidance`` only for
    guidance-distilled models such as FLUX.1-dev), ``img_ids [L, 3]``, ``txt_ids [Tt, 3]``.
    """

    spec = FLUX1

    def __init__(
        self,
        patch_size: int = 1,
        in_channels: int = 64,
        out_channels: int | None = None,
        num_layers: int = 19,
        num_single_layers: int = 38,
        attention_head_dim: int = 128,
        num_attention_heads: int = 24,
        joint_attention_dim: int = 4096,
        pooled_projection_dim: int = 768,
        guidance_embeds: bool = False,
        axes_dims_rope: Sequence[int] = (16, 56, 56),
        attention_backend: str = "auto",
        topology: Topology | None = None,
        gradient_checkpointing: bool = False,
    ) -> None:
        arguments = locals()
        super().__init__()
        config = {key: arguments[key] for key in self.config_keys()}
        self._init_common(config, attention_backend, topology, gradient_checkpointing)
        dim = self.inner_dim
        self.time_text_embed = TimeTextEmbedding(dim, pooled_projection_dim, guidance_embeds)
        self.context_embedder = nn.Linear(joint_attention_dim, dim)
        self.x_embedder = nn.Linear(in_channels, dim)
        self.transformer_blocks = nn.ModuleList(
            FluxDoubleBlock(dim, num_attention_heads, attention_head_dim) for _ in range(num_layers)
        )
        self.single_transformer_blocks = nn.ModuleList(
            FluxSingleBlock(dim, num_attention_heads, attention_head_dim) for _ in range(num_single_layers)
        )
        self.norm_out = AdaNormOut(dim)
        self.proj_out = nn.Linear(dim, patch_size * patch_size * self.out_channels)

    def embed_conditioning(self, conditioning: Mapping[str, Tensor], dtype: torch.dtype) -> Tensor:
        timestep = conditioning["timestep"].to(dtype) * 1000
        guidance = conditioning.get("guidance")
        guidance = None if guidance is None else guidance.to(dtype) * 1000
        return self.time_text_embed(timestep, guidance, conditioning["pooled_projections"])

    def transform(self, txt: Tensor, img: Tensor, step: FluxStep) -> Tensor:
        for block in self.transformer_blocks:
            txt, img = self._run(block, txt, img, step)
        x = step.joint(txt, img)
        for block in self.single_transformer_blocks:
            x = self._run(block, x, step)
        img = x.index_select(0, step.img_rows)
        return self.proj_out(self.norm_out(img, step.img_seq, step.temb))
