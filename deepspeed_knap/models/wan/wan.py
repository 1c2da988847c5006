"""Wan 2.x on packed, balanced batches, loading and saving diffusers' ``WanTransformer3DModel`` weights.

    model = PackedWanTransformer.from_pretrained("/models/Wan2.1-T2V-14B-Diffusers")
    outputs = model.forward_samples(samples, balancer)  # one [C, F, H, W] prediction per sample

diffusers' model runs a batch of videos of one size. Here each rank's samples (videos of any frame
count and resolution, and images: one frame) are cut into patches and packed into one token
sequence; conditioning is looked up per token; self-attention runs over each sample's video tokens
alone, with DeepSpeed-Ulysses inside the group a sample is planned on; cross-attention runs from
each chunk of video tokens to its own sample's text on the GPU that holds the chunk. The balancer
plans and routes video tokens only: text is not part of the self-attention sequence, and travels
to every GPU holding a chunk of its sample (:func:`~deepspeed_knap.runtime.routing.route_sample_rows`).

A sample (:meth:`PackedWanTransformer.pack`), with diffusers' forward-argument names, unbatched:

* ``hidden_states [C, F, H, W]``: latents (an image is ``F = 1``); ``F``, ``H``, ``W`` multiples of
  the patch (``(1, 2, 2)``).
* ``encoder_hidden_states [Lt, Dj]``: text-encoder rows (diffusers' pipeline pads them to 512).
* ``timestep``: a scalar (Wan 2.1, Wan 2.2 A14B) or one per latent token after patching, ``[L]``
  with ``L = F/pt * H/ph * W/pw`` (Wan 2.2 TI2V-5B: the pipeline's ``expand_timesteps``, 0 on the
  conditioning frame), on diffusers' scale (0-1000).
* ``encoder_hidden_states_image [Li, Di]``: I2V models only (``image_dim`` in the config): the CLIP
  image tokens. Text and image context are separate inputs here; diffusers concatenates them and
  splits at 512 text tokens, which is the same when the text has the pipeline's 512.

Shapes: ``N`` samples on a rank, ``T`` video tokens, ``P = pt * ph * pw`` the patch volume, ``C``
latent channels, ``Dj`` text-encoder width, ``Di`` image-encoder width, ``D`` model width.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from deepspeed_knap.models.inputs import PackedInputs, pack_carrying, route_text_embedded
from deepspeed_knap.models.layers import modulate
from deepspeed_knap.models.loading import DiffusersCheckpoint
from deepspeed_knap.models.wan.layers import (
    PatchEmbedding,
    TimeTextImageEmbedding,
    WanBlock,
    WanStep,
    fp32_layer_norm,
    output_modulation,
    rotary_cos_sin,
    varlen_seqs,
)
from deepspeed_knap.models.wan.spec import WAN
from deepspeed_knap.planner.topology import Topology
from deepspeed_knap.runtime.attention import KnapDistributedAttention
from deepspeed_knap.runtime.balancer import KnapBalancer, balanced_forward
from deepspeed_knap.runtime.packing import PackedBatch
from deepspeed_knap.runtime.routing import RoutedBatch, route_sample_rows

__all__ = ["PackedWanTransformer", "WanInputs", "output_rows", "patchify", "unpatchify"]


def patchify(latents: Tensor, patch_size: Sequence[int]) -> Tensor:
    """``[C, F, H, W]`` latents -> ``[L, C * P]`` patch rows, frame by frame, row by row, each patch
    channel-major (``C, pt, ph, pw``: how ``patch_embedding``'s Conv3d weight is laid out)."""
    channels, frames, height, width = latents.shape
    pt, ph, pw = patch_size
    grid = latents.reshape(channels, frames // pt, pt, height // ph, ph, width // pw, pw)
    return grid.permute(1, 3, 5, 0, 2, 4, 6).reshape(-1, channels * pt * ph * pw)


def unpatchify(rows: Tensor, grid: Sequence[int], patch_size: Sequence[int]) -> Tensor:
    """The model's ``[L, P * C]`` output rows of one sample (each patch channel-last, as diffusers'
    ``proj_out``) with post-patch ``grid (F', H', W')`` -> ``[C, F, H, W]``, diffusers' output."""
    (frames, height, width), (pt, ph, pw) = grid, patch_size
    patches = rows.reshape(frames, height, width, pt, ph, pw, -1)
    return patches.permute(6, 0, 3, 1, 4, 2, 5).reshape(-1, frames * pt, height * ph, width * pw)


def output_rows(latents: Tensor, patch_size: Sequence[int]) -> Tensor:
    """The inverse of :func:`unpatchify`: ``[C, F, H, W]`` (e.g. a flow-matching target) -> ``[L, P * C]``
    rows in the order of the model's packed output, for a loss on :meth:`PackedWanTransformer.forward`."""
    channels, frames, height, width = latents.shape
    pt, ph, pw = patch_size
    grid = latents.reshape(channels, frames // pt, pt, height // ph, ph, width // pw, pw)
    return grid.permute(1, 3, 5, 2, 4, 6, 0).reshape(-1, pt * ph * pw * channels)


def grid_positions(frames: int, height: int, width: int) -> Tensor:
    """``[frames * height * width, 3]`` int64 ``(f, h, w)`` of a post-patch grid, in token order."""
    f, h, w = torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij")
    return torch.stack([f, h, w], dim=-1).reshape(-1, 3)


@dataclass(frozen=True, eq=False)
class WanInputs(PackedInputs):
    """One rank's samples, packed; the names are diffusers' forward arguments where they exist.

    Attributes:
        hidden_states: ``[T, C * P]`` latent patches of every sample (:func:`patchify`), sample after sample.
        positions: ``[T, 3]`` int64 ``(f, h, w)`` of each token in its sample's post-patch grid.
        timestep: ``[T]`` fp32, each token's timestep (a sample's scalar repeated over its tokens).
        encoder_hidden_states: ``[Tt, Dj]`` text-encoder rows, sample after sample.
        grids: ``N`` post-patch grids ``(F', H', W')``.
        patch_size: ``(pt, ph, pw)``.
        text_lens: ``N`` text rows per sample.
        encoder_hidden_states_image: ``[Ti, Di]`` I2V image context rows, sample after sample, else ``None``.
        image_lens: ``N`` image context rows per sample (empty without).
        problem: why the samples given could not be packed (naming the sample), or ``None``; inputs
            with a problem hold no samples, and :meth:`PackedWanTransformer.forward` raises it on
            every rank of the step (``pack(samples, on_problem="carry")``).
    """

    hidden_states: Tensor
    positions: Tensor
    timestep: Tensor
    encoder_hidden_states: Tensor
    grids: tuple[tuple[int, int, int], ...]
    patch_size: tuple[int, int, int]
    text_lens: tuple[int, ...]
    encoder_hidden_states_image: Tensor | None = None
    image_lens: tuple[int, ...] = ()
    problem: str | None = None

    @property
    def seq_lens(self) -> tuple[int, ...]:
        """``N`` video token counts: what the balancer plans."""
        return tuple(math.prod(grid) for grid in self.grids)

    @property
    def output_lens(self) -> tuple[int, ...]:
        """The model predicts every video token: ``seq_lens``."""
        return self.seq_lens

    def subset(self, keep: np.ndarray) -> WanInputs:
        """The samples ``keep`` (``[N]`` bool) marks, in order (a two-expert model's samples of one
        expert)."""
        keep = np.asarray(keep, dtype=bool)

        def rows(lens: Sequence[int]) -> Tensor:
            lens = np.asarray(lens, dtype=np.int64)
            index = np.concatenate([np.arange(start, start + n) for start, n, kept
                                    in zip(np.cumsum(lens) - lens, lens, keep, strict=True) if kept] or [[]])  # fmt: skip
            return torch.as_tensor(index, dtype=torch.int64, device=self.hidden_states.device)

        def kept(values: Sequence) -> tuple:
            return tuple(value for value, k in zip(values, keep, strict=True) if k)

        tokens, text = rows(self.seq_lens), rows(self.text_lens)
        image = None if self.encoder_hidden_states_image is None else rows(self.image_lens)
        return dataclasses.replace(
            self,
            hidden_states=self.hidden_states.index_select(0, tokens),
            positions=self.positions.index_select(0, tokens.to(self.positions.device)),
            timestep=self.timestep.index_select(0, tokens.to(self.timestep.device)),
            encoder_hidden_states=self.encoder_hidden_states.index_select(0, text),
            grids=kept(self.grids),
            text_lens=kept(self.text_lens),
            encoder_hidden_states_image=None
            if image is None
            else self.encoder_hidden_states_image.index_select(0, image),
            image_lens=kept(self.image_lens) if image is not None else (),
        )

    def sample_timesteps(self) -> list[float]:
        """Each sample's noise level: the largest timestep of its tokens (TI2V's clean first frame is 0)."""
        return [float(t.max()) if len(t) else 0.0 for t in torch.split(self.timestep, list(self.seq_lens))]

    def split(self, rows: Tensor) -> list[Tensor]:
        """The model's ``[T, P * C]`` output -> one ``[C, F, H, W]`` tensor per sample (diffusers' output)."""
        return [unpatchify(p, grid, self.patch_size) for p, grid in zip(super().split(rows), self.grids, strict=True)]


def _context_column(name: str, context: Tensor) -> str:
    """The name of the per-sample column counting a context's rows. It says whether the context
    needs a gradient: that gradient goes back through an all-to-all every rank must join, and the
    route refuses, on every rank, ranks whose columns differ (a rank whose context needs none, e.g.
    one with no samples, would otherwise leave the others waiting in backward)."""
    return f"{name}_rows" + ("_with_grad" if context.requires_grad else "")


class PackedWanTransformer(DiffusersCheckpoint, nn.Module):
    """Wan 2.x (Wan 2.1 T2V/I2V, Wan 2.2 TI2V-5B and each A14B expert) over packed samples, balanced or not.

    The constructor takes ``WanTransformer3DModel``'s config, so ``state_dict`` names and shapes are
    diffusers' (``load_state_dict(diffusers_model.state_dict(), strict=True)`` works), plus:

    Args:
        attention_backend: local kernel of self- and cross-attention (see ``VarlenAttention``); the
            config's ``knapformer.attention_backend`` replaces it under ``deepspeed_knap.initialize``.
        topology: when given, checked against the heads at construction.
        gradient_checkpointing: recompute each block in backward instead of keeping its activations.

    As in diffusers, ``qk_norm`` is not read: every Wan attention norms q and k across heads.
    First-last-frame models (``pos_embed_seq_len``) are refused.

    Raises:
        ValueError: a config this implementation cannot run faithfully.
    """

    spec = WAN

    def __init__(
        self,
        patch_size: Sequence[int] = (1, 2, 2),
        num_attention_heads: int = 40,
        attention_head_dim: int = 128,
        in_channels: int = 16,
        out_channels: int = 16,
        text_dim: int = 4096,
        freq_dim: int = 256,
        ffn_dim: int = 13824,
        num_layers: int = 40,
        cross_attn_norm: bool = True,
        qk_norm: str | None = "rms_norm_across_heads",
        eps: float = 1e-6,
        image_dim: int | None = None,
        added_kv_proj_dim: int | None = None,
        rope_max_seq_len: int = 1024,
        pos_embed_seq_len: int | None = None,
        attention_backend: str = "auto",
        topology: Topology | None = None,
        gradient_checkpointing: bool = False,
    ) -> None:
        arguments = locals()
        super().__init__()
        config = {key: arguments[key] for key in self.config_keys()}
        config["patch_size"] = [int(p) for p in patch_size]
        inner = num_attention_heads * attention_head_dim
        problems = []
        if len(config["patch_size"]) != 3 or min(config["patch_size"]) < 1:
            problems.append(f"patch_size {list(patch_size)} must be 3 positive sizes (frames, height, width)")
        if attention_head_dim % 2 or attention_head_dim < 6:
            problems.append(f"attention_head_dim={attention_head_dim} must be even and at least 6: RoPE rotates "
                            "channel pairs over three axes")  # fmt: skip
        if pos_embed_seq_len is not None:
            problems.append(f"pos_embed_seq_len={pos_embed_seq_len} (first-last-frame models) is not supported")
        if (image_dim is None) != (added_kv_proj_dim is None) or added_kv_proj_dim not in (None, inner):
            problems.append(f"image_dim={image_dim} and added_kv_proj_dim={added_kv_proj_dim}: an I2V model has both, "
                            f"and added_kv_proj_dim equal to the model width {inner}")  # fmt: skip
        if problems:
            raise ValueError("WanTransformer3DModel config: " + "; ".join(problems))
        self.config = config
        self.inner_dim = inner
        self.out_channels = out_channels or in_channels
        self.gradient_checkpointing = gradient_checkpointing
        self.patch_embedding = PatchEmbedding(in_channels, inner, kernel_size=patch_size, stride=patch_size)
        self.condition_embedder = TimeTextImageEmbedding(inner, freq_dim, text_dim, image_dim)
        self.blocks = nn.ModuleList(
            WanBlock(inner, ffn_dim, num_attention_heads, cross_attn_norm, eps, added_kv_proj_dim)
            for _ in range(num_layers)
        )
        self.proj_out = nn.Linear(inner, self.out_channels * math.prod(config["patch_size"]))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, inner) / inner**0.5)
        # One parameterless module shared by every block's self-attention: the balancer's routing
        # decides its groups. Cross-attention uses its local kernel (varlen_attn).
        self.attention = KnapDistributedAttention(num_attention_heads, backend=attention_backend, topology=topology)

    @property
    def embed_text_before_routing(self) -> bool:
        """Whether text travels embedded (``D`` wide, its gradient sent back) rather than as
        text-encoder rows (``Dj`` wide, forward only): whichever is fewer bytes in training
        (:func:`~deepspeed_knap.models.flux.base.route_text_embedded`). Wan 2.1 1.3B yes
        (4096 > 2 * 1536), 14B and 2.2 TI2V-5B no."""
        return route_text_embedded(self.config["text_dim"], self.inner_dim)

    # ---- packing ----

    @property
    def block_stack(self) -> list[nn.Module]:
        """The transformer blocks, in the order they run."""
        return list(self.blocks)

    def pack(self, samples: Sequence[Mapping[str, Tensor]], on_problem: str = "raise") -> WanInputs:
        """Pack per-sample diffusers arguments (unbatched; see the module docstring) into
        :class:`WanInputs`. No samples gives an empty batch with the right columns (a rank may have
        none this step).

        Args:
            on_problem: ``"raise"``: raise on a bad sample, here (local). ``"carry"``: return empty
                inputs whose ``problem`` names it, for a balanced :meth:`forward` to raise on every
                rank together (raising here alone would leave the other ranks waiting in the step's
                first collective).

        Raises:
            ValueError: naming the sample: a missing key, latents whose frames, height or width the
                patch does not divide, a per-token timestep of the wrong length, a shape that does
                not fit the config.
        """
        if (carried := pack_carrying(self.pack, samples, on_problem)) is not None:
            return carried
        config = self.config
        patch = tuple(config["patch_size"])
        grids = tuple(self._check_sample(index, sample) for index, sample in enumerate(samples))
        dtype = self.dtype
        image = config["image_dim"] is not None

        def cat(rows: list[Tensor], width: int, empty_dtype: torch.dtype = dtype) -> Tensor:
            return torch.cat(rows) if rows else torch.zeros(0, width, dtype=empty_dtype)

        latents = [patchify(torch.as_tensor(s["hidden_states"]), patch) for s in samples]
        timesteps = [
            torch.as_tensor(s["timestep"], dtype=torch.float32).reshape(-1).expand(len(rows))
            for s, rows in zip(samples, latents, strict=True)
        ]
        return WanInputs(
            hidden_states=cat(latents, config["in_channels"] * math.prod(patch)),
            positions=cat([grid_positions(*grid) for grid in grids], 3, torch.int64),
            timestep=torch.cat(timesteps) if timesteps else torch.zeros(0),
            encoder_hidden_states=cat(
                [torch.as_tensor(s["encoder_hidden_states"]) for s in samples], config["text_dim"]
            ),
            grids=grids,
            patch_size=patch,
            text_lens=tuple(int(s["encoder_hidden_states"].shape[0]) for s in samples),
            encoder_hidden_states_image=(
                cat([torch.as_tensor(s["encoder_hidden_states_image"]) for s in samples], config["image_dim"])
                if image
                else None
            ),
            image_lens=tuple(int(s["encoder_hidden_states_image"].shape[0]) for s in samples) if image else (),
        )

    def _check_sample(self, index: int, sample: Mapping[str, Tensor]) -> tuple[int, int, int]:
        """The sample's post-patch grid ``(F', H', W')``, or a ValueError naming the sample."""
        config = self.config
        image = config["image_dim"] is not None
        required = ["hidden_states", "encoder_hidden_states", "timestep"] + (["encoder_hidden_states_image"] * image)
        missing = [key for key in required if key not in sample]
        if missing:
            raise ValueError(f"sample {index} has no {missing}; it has {sorted(sample)}")
        if not image and sample.get("encoder_hidden_states_image") is not None:
            raise ValueError(
                f"sample {index} has encoder_hidden_states_image but this model has no image_dim (not an I2V "
                "model); drop it"
            )
        latents = torch.as_tensor(sample["hidden_states"])
        channels = config["in_channels"]
        if latents.dim() != 4 or latents.shape[0] != channels:
            raise ValueError(
                f"sample {index}: 'hidden_states' has shape {list(latents.shape)}; expected latents [C, F, H, W] "
                f"with C = in_channels = {channels} (an image is F = 1)"
            )
        sizes = latents.shape[1:]
        patch = config["patch_size"]
        bad = [f"{axis} {size}" for axis, size, p in zip(("frames", "height", "width"), sizes, patch, strict=True)
               if size == 0 or size % p]  # fmt: skip
        if bad:
            raise ValueError(
                f"sample {index}: latents [C, F, H, W] = {list(latents.shape)}: {', '.join(bad)} not a positive "
                f"multiple of the patch {list(patch)} (frames, height, width); crop or pad the latents"
            )
        grid = tuple(int(size // p) for size, p in zip(sizes, patch, strict=True))
        if max(grid) > config["rope_max_seq_len"]:
            raise ValueError(
                f"sample {index}: post-patch grid {list(grid)} exceeds rope_max_seq_len={config['rope_max_seq_len']} "
                "positions on an axis (diffusers' RoPE table has no rows for them)"
            )
        tokens = math.prod(grid)
        timestep = torch.as_tensor(sample["timestep"])
        if not (timestep.numel() == 1 and timestep.dim() <= 1) and tuple(timestep.shape) != (tokens,):
            raise ValueError(
                f"sample {index}: 'timestep' has shape {list(timestep.shape)}; expected a scalar or one per latent "
                f"token after patching: [{tokens}] = F/{patch[0]} * H/{patch[1]} * W/{patch[2]} = "
                f"{' * '.join(map(str, grid))}"
            )
        contexts = [("encoder_hidden_states", config["text_dim"], "text_dim")]
        if image:
            contexts.append(("encoder_hidden_states_image", config["image_dim"], "image_dim"))
        for key, width, name in contexts:
            shape = list(torch.as_tensor(sample[key]).shape)
            if len(shape) != 2 or shape[1] != width or shape[0] < 1:
                raise ValueError(
                    f"sample {index}: {key!r} has shape {shape}; expected [L, {width}] ({name}={width}) with at least "
                    "one row: every video token cross-attends to it (the pipeline pads text to 512)"
                )
        return grid

    # ---- forward ----

    def forward_samples(
        self, samples: Sequence[Mapping[str, Tensor]], balancer: KnapBalancer | None = None
    ) -> list[Tensor]:
        """:meth:`pack`, :meth:`forward`, split: one ``[C_out, F, H, W]`` output per sample, what
        diffusers returns for that sample alone. Collective when ``balancer`` is given: a bad sample
        on any rank raises on every rank, the same error naming the rank and the sample, in the
        step's first collective (unbalanced: here)."""
        inputs = self.pack(samples, on_problem="carry" if balancer is not None else "raise")
        return inputs.split(self(inputs, balancer))

    def forward(self, inputs: WanInputs, balancer: KnapBalancer | None = None) -> Tensor:
        """``[T, P * C_out]`` predictions for ``inputs.hidden_states``' tokens, in their order
        (:meth:`WanInputs.split` unpatchifies them; :func:`output_rows` lays a target out alike). With
        a ``balancer`` the blocks run on the tokens the step's plan gives this GPU (collective: every
        rank calls it every step, even with no samples).

        Raises:
            ValueError: ``inputs.problem`` (a bad sample :meth:`pack` carried): here without a
                balancer; with one, on every rank, by the step's first collective.
        """
        batch, text, image = self.packed_batch(inputs)
        blocks = functools.partial(self._blocks, inputs=inputs, text=text, image=image)
        return balanced_forward(batch, blocks, balancer, problem=inputs.problem)

    def packed_batch(
        self, inputs: WanInputs
    ) -> tuple[PackedBatch, tuple[Tensor, str], tuple[Tensor | None, str | None]]:
        """What travels (latent patches, positions and timesteps per token, no gradient in training;
        per sample the context lengths, so a GPU knows how many context rows come with a chunk), and
        the home text and image context rows with the names of their per-sample length columns."""
        device = inputs.hidden_states.device
        text, image = inputs.encoder_hidden_states, inputs.encoder_hidden_states_image
        if self.embed_text_before_routing:
            text = self.condition_embedder.text_embedder(text)
        text_key = _context_column("text", text)
        sample_data = {text_key: torch.tensor(inputs.text_lens, dtype=torch.int64, device=device)}
        image_key = None if image is None else _context_column("image", image)
        if image is not None:
            sample_data[image_key] = torch.tensor(inputs.image_lens, dtype=torch.int64, device=device)
        batch = PackedBatch(
            tokens=inputs.hidden_states,
            seq_lens=inputs.seq_lens,
            token_data={"position": inputs.positions.to(device), "timestep": inputs.timestep.to(device)},
            sample_data=sample_data,
        )
        return batch, (text, text_key), (image, image_key)

    def _blocks(self, routed: RoutedBatch, inputs: WanInputs, text: tuple[Tensor, str],
                image: tuple[Tensor | None, str | None]) -> Tensor:  # fmt: skip
        """Embed this GPU's routed tokens, bring each held chunk its sample's context (``text``,
        ``image``: the home rows and their per-sample column), run the blocks and the output layer:
        ``[T, P * C_out]`` in routed order."""
        batch = routed.batch
        embedder = self.condition_embedder
        timesteps, cond_index = torch.unique(batch.token_data["timestep"], return_inverse=True)
        # diffusers casts temb to the dtype of the text it is given.
        temb, timestep_proj = embedder.embed_timesteps(timesteps, inputs.encoder_hidden_states.dtype)

        held_text_lens = batch.sample_data[text[1]].cpu().numpy()
        text = route_sample_rows(text[0], np.array(inputs.text_lens, dtype=np.int64), routed, held_text_lens)
        if not self.embed_text_before_routing:
            text = embedder.text_embedder(text)
        image_rows = image_seqs = None
        if embedder.image_embedder is not None:
            held_image_lens = batch.sample_data[image[1]].cpu().numpy()
            image_rows = route_sample_rows(image[0], np.array(inputs.image_lens, dtype=np.int64), routed,
                                           held_image_lens)  # fmt: skip
            image_rows = embedder.image_embedder(image_rows)
            image_seqs = varlen_seqs(routed, "image", held_image_lens)

        cos, sin = rotary_cos_sin(batch.token_data["position"], self.config["attention_head_dim"])
        step = WanStep(routed, self.attention, cond_index, temb, timestep_proj, cos, sin,
                       varlen_seqs(routed, "chunks", batch.seq_lens), text, varlen_seqs(routed, "text", held_text_lens),
                       image_rows, image_seqs)  # fmt: skip
        x = self.patch_embedding(batch.tokens)
        for block in self.blocks:
            x = self._run(block, x, step)
        shift, scale = output_modulation(self.scale_shift_table, temb)
        x = modulate(fp32_layer_norm(x, self.config["eps"]), cond_index, shift, scale).to(x.dtype)
        return self.proj_out(x)

    def _run(self, block: nn.Module, *args: Any):
        if self.gradient_checkpointing and torch.is_grad_enabled():
            return checkpoint(block, *args, use_reentrant=False)
        return block(*args)
