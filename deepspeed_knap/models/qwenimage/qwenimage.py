"""Qwen-Image on packed, balanced batches, loading and saving diffusers' ``QwenImageTransformer2DModel``
weights: text-to-image, Edit and Edit-2509 (reference images in the sequence) and Edit-2511
(``zero_cond_t``: reference tokens modulated by timestep 0).

    model = PackedQwenImageTransformer.from_pretrained("/models/Qwen-Image-Edit-2509", ds_config=ds_config)
    outputs = model.forward_samples(samples, balancer)  # one [L_target, patch^2 * C] prediction per sample

diffusers' model runs a batch of samples of one shape: one ``img_shapes`` list and one RoPE table
for the batch (its ``QwenEmbedRope`` uses the first sample's), text padded with a mask. Here a
sample is one balanced sequence ``[text, target image, reference images]``, the joint attention's
order: the planner sees its length, the route carries its latents (text rows travel separately, raw
or embedded, whichever is fewer bytes: :func:`~deepspeed_knap.models.inputs.route_text_embedded`),
and each GPU computes the RoPE rows and the modulation of the tokens it holds from per-token
positions and kinds that travel with them. The blocks are FLUX's double-stream machinery
(:mod:`.layers`).

A sample (:meth:`PackedQwenImageTransformer.pack`), diffusers' forward-argument names, unbatched:

* ``hidden_states [L, C]``: the target image's packed latent tokens, then each reference image's,
  in ``img_shapes`` order (the pipelines' ``cat([latents, image_latents])``);
* ``img_shapes``: the images' post-patch grids ``(frames, height, width)``, target first (one
  sample's entry of diffusers' ``img_shapes``), ``L = sum(f * h * w)``;
* ``encoder_hidden_states [Lt, Dj]``: the text encoder's rows, without padding (no mask);
* ``timestep``: a scalar in ``[0, 1]``, the pipelines' ``t / 1000``.

The output is the target's tokens only, ``[f0 * h0 * w0, patch^2 * C_out]``: what the pipelines keep
(``noise_pred[:, :latents.size(1)]``) and what a flow-matching loss compares; reference tokens'
predictions are never used, so ``norm_out`` and ``proj_out`` skip them.

Bad input (a missing key, latent rows that ``img_shapes`` does not count, a padding mask, positions
outside diffusers' RoPE tables, ...): :meth:`~PackedQwenImageTransformer.pack` raises, naming the
sample; balanced, :meth:`~PackedQwenImageTransformer.forward_samples` (or ``pack(samples,
on_problem="carry")``) raises it on every rank of the step together.

Shapes: ``N`` samples on a rank, ``T`` tokens (``Tt`` text, ``Ti`` image: target and references,
``Tg`` target), ``C`` latent channels (after 2x2 patching), ``Dj`` text-encoder width, ``D`` model
width, ``n`` chunks held after routing.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from deepspeed_knap.models.flux.base import PackedFluxBase, _ranks_within
from deepspeed_knap.models.flux.layers import AdaNormOut
from deepspeed_knap.models.inputs import PackedInputs, pack_carrying
from deepspeed_knap.models.qwenimage.layers import (
    ROPE_POSITIONS,
    QwenImageBlock,
    QwenImageStep,
    RMSNorm,
    TimestepEmbedding,
)
from deepspeed_knap.models.qwenimage.spec import QWEN_IMAGE
from deepspeed_knap.planner.topology import Topology
from deepspeed_knap.runtime.balancer import KnapBalancer, balanced_forward
from deepspeed_knap.runtime.routing import RoutedBatch, route_subset_rows

__all__ = ["PackedQwenImageTransformer", "QwenImageInputs", "image_positions"]

Grid = tuple[int, int, int]
# What travels with each token (QwenImageInputs.token_columns): a GPU computes its tokens' RoPE rows
# and modulation from them.
ROUTED_COLUMNS = ("positions", "is_text", "is_reference")


def image_positions(img_shapes: Sequence[Grid]) -> tuple[np.ndarray, int]:
    """One sample's RoPE positions as diffusers' ``QwenEmbedRope`` (``scale_rope=True``) gives them:
    ``[L, 3]`` int64 ``(frame, row, column)`` of its image tokens in order (image ``i``'s frames at
    ``i, i + 1, ...``; rows and columns centred, ``-(h - h // 2) .. h // 2 - 1``), and the first text
    position ``m``: the text's token ``j`` is at ``m + j`` on every axis, ``m`` the largest
    ``max(h // 2, w // 2)`` of the images."""
    blocks = []
    for index, (frames, height, width) in enumerate(img_shapes):
        f, h, w = np.meshgrid(np.arange(frames) + index, np.arange(height) - (height - height // 2),
                              np.arange(width) - (width - width // 2), indexing="ij")  # fmt: skip
        blocks.append(np.stack([f, h, w], axis=-1).reshape(-1, 3))
    text_start = max(max(height // 2, width // 2) for _, height, width in img_shapes)
    return np.concatenate(blocks).astype(np.int64), text_start


def rope_range_problem(img_shapes: Sequence[Grid], text_rows: int) -> str | None:
    """Why one sample's RoPE positions (:func:`image_positions`, and its ``text_rows`` from the first
    text position on) fall outside diffusers' tables (``-ROPE_POSITIONS .. ROPE_POSITIONS - 1``),
    or ``None``; from the grids alone, without building the positions."""
    text_start = max(max(height // 2, width // 2) for _, height, width in img_shapes)
    low = min(text_start, *(-(side - side // 2) for _, height, width in img_shapes for side in (height, width)))
    high = max(text_start + text_rows - 1,
               *(max(index + frames - 1, height // 2 - 1, width // 2 - 1)
                 for index, (frames, height, width) in enumerate(img_shapes)))  # fmt: skip
    if low >= -ROPE_POSITIONS and high < ROPE_POSITIONS:
        return None
    return (f"RoPE positions {low}..{high} (img_shapes {[tuple(grid) for grid in img_shapes]}, {text_rows} text rows) "
            f"fall outside diffusers' tables of positions {-ROPE_POSITIONS}..{ROPE_POSITIONS - 1}; shorten the text or "
            "shrink the images")  # fmt: skip


@dataclass(frozen=True, eq=False)
class QwenImageInputs(PackedInputs):
    """One rank's samples, packed per stream; the names are diffusers' forward arguments.

    Attributes:
        hidden_states: ``[Ti, C]`` image latent tokens (each sample's target, then its references),
            sample after sample.
        encoder_hidden_states: ``[Tt, Dj]`` text-encoder rows, sample after sample.
        timestep: ``[N]`` in ``[0, 1]``, in the model's dtype (diffusers casts it so first).
        img_shapes: ``N`` tuples of post-patch grids ``(frames, height, width)``, target first.
        txt_lens: ``N`` text rows per sample.
        problem: why the samples given could not be packed (naming the sample), or ``None``; inputs
            with a problem hold no samples, and :meth:`PackedQwenImageTransformer.forward` raises it
            on every rank of the step (``pack(samples, on_problem="carry")``).
    """

    hidden_states: Tensor
    encoder_hidden_states: Tensor
    timestep: Tensor
    img_shapes: tuple[tuple[Grid, ...], ...]
    txt_lens: tuple[int, ...]
    problem: str | None = None

    @property
    def img_lens(self) -> tuple[int, ...]:
        """``N`` image tokens (target and references) per sample."""
        return tuple(sum(math.prod(grid) for grid in shapes) for shapes in self.img_shapes)

    @property
    def seq_lens(self) -> tuple[int, ...]:
        """``N`` joint lengths (text + image tokens per sample): what the balancer plans."""
        return tuple(t + i for t, i in zip(self.txt_lens, self.img_lens, strict=True))

    @property
    def output_lens(self) -> tuple[int, ...]:
        """The model predicts the target's tokens: the first image's ``f * h * w``."""
        return tuple(math.prod(shapes[0]) for shapes in self.img_shapes)

    @functools.cached_property
    def token_columns(self) -> dict[str, np.ndarray]:
        """Per token of the joint order (per sample: text, then images), as routed: ``positions``
        ``[T, 3]`` int64 RoPE positions, ``is_text`` and ``is_reference`` ``[T]`` bool; and the joint
        rows of the image tokens (``img_rows``, in ``hidden_states`` order) and of the target tokens
        (``target_rows``)."""
        txt_lens, img_lens = np.array(self.txt_lens, dtype=np.int64), np.array(self.img_lens, dtype=np.int64)
        starts = np.cumsum(txt_lens + img_lens) - (txt_lens + img_lens)
        txt_rows = np.repeat(starts, txt_lens) + _ranks_within(txt_lens)
        img_rows = np.repeat(starts + txt_lens, img_lens) + _ranks_within(img_lens)
        total = int((txt_lens + img_lens).sum())
        positions = np.zeros((total, 3), dtype=np.int64)
        is_reference = np.zeros(total, dtype=bool)
        for start, text, shapes in zip(starts, txt_lens, self.img_shapes, strict=True):
            image, text_start = image_positions(shapes)
            positions[start : start + text] = (text_start + np.arange(text))[:, None]
            positions[start + text : start + text + len(image)] = image
            is_reference[start + text + math.prod(shapes[0]) : start + text + len(image)] = True
        is_text = np.zeros(total, dtype=bool)
        is_text[txt_rows] = True
        target_rows = np.flatnonzero(~is_text & ~is_reference)
        return {"positions": positions, "is_text": is_text, "is_reference": is_reference, "img_rows": img_rows,
                "target_rows": target_rows}  # fmt: skip


class PackedQwenImageTransformer(PackedFluxBase):
    """Qwen-Image (double-stream blocks) over packed samples, balanced or not.

    The constructor takes ``QwenImageTransformer2DModel``'s config (defaults: Qwen-Image, 20B), so
    ``state_dict`` names and shapes are diffusers', plus:

    Args:
        attention_backend: local kernel of every block's attention (see ``VarlenAttention``); the
            config's ``knapformer.attention_backend`` replaces it under ``deepspeed_knap.initialize``.
        topology: when given, checked against the heads at construction.
        gradient_checkpointing: recompute each block in backward instead of keeping its activations.

    ``guidance_embeds`` builds nothing in diffusers (its forward fails when given a guidance), so it
    is read and has no effect here either. Qwen-Image-Layered's ``use_additional_t_cond`` and
    ``use_layer3d_rope`` are refused.

    Raises:
        ValueError: a config this implementation cannot run faithfully.
    """

    spec = QWEN_IMAGE

    def __init__(
        self,
        patch_size: int = 2,
        in_channels: int = 64,
        out_channels: int | None = 16,
        num_layers: int = 60,
        attention_head_dim: int = 128,
        num_attention_heads: int = 24,
        joint_attention_dim: int = 3584,
        guidance_embeds: bool = False,
        axes_dims_rope: Sequence[int] = (16, 56, 56),
        zero_cond_t: bool = False,
        use_additional_t_cond: bool = False,
        use_layer3d_rope: bool = False,
        attention_backend: str = "auto",
        topology: Topology | None = None,
        gradient_checkpointing: bool = False,
    ) -> None:
        arguments = locals()
        super().__init__()
        config = {key: arguments[key] for key in self.config_keys()}
        layered = [key for key in ("use_additional_t_cond", "use_layer3d_rope") if config[key]]
        if layered or len(axes_dims_rope) != 3:
            raise ValueError(
                "QwenImageTransformer2DModel config: "
                + (f"{' and '.join(layered)} (Qwen-Image-Layered) not supported" if layered else
                   f"axes_dims_rope {list(axes_dims_rope)} must be 3 sizes (frame, height, width)")
            )  # fmt: skip
        self._init_common(config, attention_backend, topology, gradient_checkpointing)
        dim = self.inner_dim
        self.time_text_embed = TimestepEmbedding(dim)
        self.txt_norm = RMSNorm(joint_attention_dim)
        self.img_in = nn.Linear(in_channels, dim)
        self.txt_in = nn.Linear(joint_attention_dim, dim)
        self.transformer_blocks = nn.ModuleList(
            QwenImageBlock(dim, num_attention_heads, attention_head_dim) for _ in range(num_layers)
        )
        self.norm_out = AdaNormOut(dim)
        self.proj_out = nn.Linear(dim, patch_size * patch_size * self.out_channels)

    @property
    def block_stack(self) -> list[nn.Module]:
        """The transformer blocks, in the order they run."""
        return list(self.transformer_blocks)

    def context_embedder(self, text: Tensor) -> Tensor:
        """``[Tt, Dj]`` text-encoder rows -> ``[Tt, D]``: ``txt_in(txt_norm(text))``."""
        return self.txt_in(self.txt_norm(text))

    # ---- packing ----

    def sample_shapes(self, image_tokens: int, text_tokens: int) -> dict[str, tuple[int, ...]]:
        """The shape of every tensor of one unbatched sample with these token counts (``img_shapes``
        is a list, not a tensor)."""
        config = self.config
        return {"hidden_states": (image_tokens, config["in_channels"]),
                "encoder_hidden_states": (text_tokens, config["joint_attention_dim"]), "timestep": ()}  # fmt: skip

    def pack(self, samples: Sequence[Mapping], on_problem: str = "raise") -> QwenImageInputs:
        """Pack per-sample diffusers arguments (unbatched; see the module docstring) into
        :class:`QwenImageInputs`. No samples gives an empty batch with the right columns (a rank may
        have none this step).

        Args:
            samples: this rank's samples.
            on_problem: ``"raise"``: raise on a bad sample, here (local). ``"carry"``: return empty
                inputs whose ``problem`` names it, for a balanced :meth:`forward` to raise on every
                rank together (raising here alone would leave the other ranks waiting in the step's
                first collective).

        Raises:
            ValueError: naming the sample (with ``"raise"``): a missing key, ``img_shapes`` that are
                not positive ``(frames, height, width)`` grids or do not count the latent rows, a
                padding mask, a shape that does not fit the config, RoPE positions outside
                diffusers' tables.
        """
        if (carried := pack_carrying(self.pack, samples, on_problem)) is not None:
            return carried
        shapes = tuple(self._check_sample(index, sample) for index, sample in enumerate(samples))
        config = self.config
        dtype = next(self.parameters()).dtype

        def cat(key: str, width: int) -> Tensor:
            rows = [torch.as_tensor(s[key]) for s in samples]
            return torch.cat(rows) if rows else torch.zeros(0, width, dtype=dtype)

        timesteps = [torch.as_tensor(s["timestep"]).reshape(()) for s in samples]
        return QwenImageInputs(
            hidden_states=cat("hidden_states", config["in_channels"]),
            encoder_hidden_states=cat("encoder_hidden_states", config["joint_attention_dim"]),
            # diffusers' first cast, so that every rank routes the same dtype
            timestep=(torch.stack(timesteps) if timesteps else torch.zeros(0)).to(dtype),
            img_shapes=shapes,
            txt_lens=tuple(int(s["encoder_hidden_states"].shape[0]) for s in samples),
        )

    def _check_sample(self, index: int, sample: Mapping) -> tuple[Grid, ...]:
        """The sample's ``img_shapes`` as a tuple of grids, or a ValueError naming the sample."""
        missing = [key for key in ("hidden_states", "img_shapes", "encoder_hidden_states", "timestep")
                   if sample.get(key) is None]  # fmt: skip
        if missing:
            raise ValueError(f"sample {index} has no {missing}; it has {sorted(sample)}")
        if sample.get("encoder_hidden_states_mask") is not None:
            raise ValueError(
                f"sample {index} has an encoder_hidden_states_mask; pack its text without padding instead (the "
                "rows the mask keeps: a right-padded text's first rows) and drop the mask"
            )
        grids = sample["img_shapes"]
        try:
            grids = tuple(tuple(int(size) for size in grid) for grid in grids)
        except TypeError:
            grids = ()
        if not grids or any(len(grid) != 3 or min(grid) < 1 for grid in grids):
            raise ValueError(
                f"sample {index}: img_shapes {sample['img_shapes']!r} must be a non-empty list of positive "
                "(frames, height, width) post-patch grids, the target's first (e.g. [(1, 64, 64)] for 1024x1024 px)"
            )
        tokens = sum(math.prod(grid) for grid in grids)
        text = torch.as_tensor(sample["encoder_hidden_states"])
        expected = self.sample_shapes(tokens, text.shape[0] if text.dim() else -1)
        for key, shape in expected.items():
            actual = tuple(torch.as_tensor(sample[key]).shape)
            if actual != shape and not (shape == () and actual == (1,)):
                what = f"{tokens} = the tokens img_shapes {list(grids)} count" if key == "hidden_states" else "rows"
                raise ValueError(
                    f"sample {index}: {key!r} has shape {list(actual)}; expected {list(shape)} (one unbatched sample: "
                    f"{what}; in_channels={self.config['in_channels']}, "
                    f"joint_attention_dim={self.config['joint_attention_dim']})"
                )
        if problem := rope_range_problem(grids, text.shape[0]):
            raise ValueError(f"sample {index}: {problem}")
        return grids

    # ---- forward ----

    def forward_samples(self, samples: Sequence[Mapping], balancer: KnapBalancer | None = None) -> list[Tensor]:
        """:meth:`pack`, :meth:`forward`, split: one ``[f0 * h0 * w0, patch^2 * C_out]`` output per
        sample, the target's rows of what diffusers returns for that sample alone. Collective when
        ``balancer`` is given: a bad sample on any rank raises on every rank, the same error naming
        the rank and the sample, in the step's first collective (unbalanced: here).

        Raises:
            ValueError: a bad sample (:meth:`pack`), on every rank of the step.
        """
        inputs = self.pack(samples, on_problem="carry" if balancer is not None else "raise")
        return inputs.split(self(inputs, balancer))

    def forward(self, inputs: QwenImageInputs, balancer: KnapBalancer | None = None) -> Tensor:
        """``[Tg, patch^2 * C_out]`` predictions for the target tokens of ``inputs.hidden_states``, in
        their order. With a ``balancer`` the blocks run on the tokens the step's plan gives this GPU
        (collective: every rank calls it every step, even with no samples).

        Raises:
            ValueError: ``inputs.problem`` (a bad sample :meth:`pack` carried): here without a
                balancer; with one, on every rank, by the step's first collective.
        """
        device = inputs.hidden_states.device
        columns = inputs.token_columns
        img_rows = torch.as_tensor(columns["img_rows"], device=device)
        token_data = {name: torch.as_tensor(columns[name], device=device) for name in ROUTED_COLUMNS}
        batch, text = self._joint_batch(inputs, img_rows, len(columns["is_text"]), token_data,
                                        {"timestep": inputs.timestep.to(device)})  # fmt: skip
        blocks = functools.partial(self._blocks, text=text, home_is_text=columns["is_text"])
        out = balanced_forward(batch, blocks, balancer, problem=inputs.problem)
        return out.index_select(0, torch.as_tensor(columns["target_rows"], device=device))

    def embed_conditioning(self, conditioning: Mapping[str, Tensor], dtype: torch.dtype) -> Tensor:
        """``temb [n, D]`` of ``conditioning["timestep"] [n]`` (in ``[0, 1]``), cast to ``dtype``
        first as diffusers casts it to the latents' embedding's."""
        return self.time_text_embed(conditioning["timestep"].to(dtype))

    def _blocks(self, routed: RoutedBatch, text: Tensor, home_is_text: np.ndarray) -> Tensor:
        """Embed this GPU's routed tokens and run :meth:`transform`: ``[T, patch^2 * C_out]`` in
        routed order (zero rows for text and reference tokens, which have no output)."""
        batch = routed.batch
        dtype = batch.tokens.dtype
        temb = self.embed_conditioning(batch.sample_data, dtype)  # [n, D]
        zero = None
        if self.config["zero_cond_t"]:  # diffusers: cat([timestep, timestep * 0])
            zero = self.embed_conditioning({"timestep": batch.sample_data["timestep"] * 0}, dtype)
        step = QwenImageStep.from_routed(routed, self.attention, self.config["axes_dims_rope"], temb, zero)
        txt = route_subset_rows(text, home_is_text, routed, step.txt_rows)
        if not self.embed_text_before_routing:
            txt = self.context_embedder(txt)
        img = self.img_in(batch.tokens.index_select(0, step.img_rows))
        out = self.transform(txt, img, step)  # [Tg, patch^2 * C_out]
        rows = step.img_rows.index_select(0, step.target_rows)
        return out.new_zeros(batch.num_tokens, out.shape[1]).index_copy(0, rows, out)

    def transform(self, txt: Tensor, img: Tensor, step: QwenImageStep) -> Tensor:
        """The blocks and the output layers: embedded ``txt [Tt, D]`` and ``img [Ti, D]`` of this
        GPU's routed tokens -> ``[Tg, patch^2 * C_out]`` predictions of its target tokens."""
        for block in self.transformer_blocks:
            txt, img = self._run(block, txt, img, step)
        target = img.index_select(0, step.target_rows)
        return self.proj_out(self.norm_out(target, step.img_seq.index_select(0, step.target_rows), step.temb))
