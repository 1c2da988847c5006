"""What the packed FLUX families share: packed inputs, the route-less forward, diffusers checkpoints.

A family (FLUX.1 in :mod:`~deepspeed_knap.models.flux`, FLUX.2 in :mod:`~deepspeed_knap.models.flux.flux2`)
subclasses :class:`PackedFluxBase` and supplies only what differs: its ``__init__`` (diffusers' config
arguments, with diffusers' names and defaults, and the layers), how per-sample conditioning becomes
``temb`` (:meth:`~PackedFluxBase.embed_conditioning`), and its block stack
(:meth:`~PackedFluxBase.transform`). Packing, sample checks, routing and diffusers checkpoints are here.

Route less. The balancer moves each rank's tokens to the GPUs that run them. What moves is the raw
input, and the embedders run after routing: image/video tokens travel as their latent rows (64
channels for FLUX.1, 128 for FLUX.2) instead of ``D``-wide states (3072, 6144), conditioning travels
as timestep, guidance and pooled text (per sample), and none of it needs a gradient, so the
backward pass sends nothing back along the route. Text tokens travel as whichever is fewer bytes in
training: the text-encoder rows (``Dj`` wide, no gradient) or their embedding (``D`` wide, plus its
``D``-wide gradient back): raw for FLUX.1 (4096 < 2 * 3072), embedded for FLUX.2 [dev]
(15360 > 2 * 6144). ``deepspeed-knap bench routing`` reports the bytes.

Shapes: ``N`` samples on a rank, ``T`` tokens (``Tt`` text, ``Ti`` image/video), ``C`` latent
channels, ``Dj`` text-encoder width, ``A`` position axes, ``D`` model width, ``n`` chunks held after
routing.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from deepspeed_knap.models.flux.layers import FluxStep
from deepspeed_knap.models.inputs import PackedInputs, pack_carrying, route_text_embedded
from deepspeed_knap.models.loading import DiffusersCheckpoint
from deepspeed_knap.planner.topology import Topology
from deepspeed_knap.runtime.attention import KnapDistributedAttention
from deepspeed_knap.runtime.balancer import KnapBalancer, balanced_forward
from deepspeed_knap.runtime.packing import PackedBatch
from deepspeed_knap.runtime.routing import RoutedBatch, route_subset_rows


@dataclass(frozen=True, eq=False)
class FluxInputs(PackedInputs):
    """One rank's samples, packed per stream; the names are diffusers' forward arguments.

    Attributes:
        hidden_states: ``[Ti, C]`` image/video latent tokens of every sample, sample after sample.
        encoder_hidden_states: ``[Tt, Dj]`` text-encoder tokens, sample after sample.
        timestep: ``[N]`` in ``[0, 1]`` (the model scales by 1000, as diffusers does).
        img_ids: ``[Ti, A]`` positions: FLUX.1 ``(t, h, w)``, FLUX.2 ``(t, h, w, l)``.
        txt_ids: ``[Tt, A]`` text positions.
        img_lens, txt_lens: ``N`` per-sample token counts of each stream.
        guidance: ``[N]`` guidance scales for guidance-distilled models, else ``None``.
        pooled_projections: ``[N, Dp]`` pooled text embedding per sample (FLUX.1), else ``None``.
        problem: why the samples given could not be packed (naming the sample), or ``None``; inputs
            with a problem hold no samples, and :meth:`PackedFluxBase.forward` raises it on every
            rank of the step (``pack(samples, on_problem="carry")``).
    """

    hidden_states: Tensor
    encoder_hidden_states: Tensor
    timestep: Tensor
    img_ids: Tensor
    txt_ids: Tensor
    img_lens: tuple[int, ...]
    txt_lens: tuple[int, ...]
    guidance: Tensor | None = None
    pooled_projections: Tensor | None = None
    problem: str | None = None

    @property
    def seq_lens(self) -> tuple[int, ...]:
        """``N`` joint lengths (text + image tokens per sample): what the balancer plans."""
        return tuple(t + i for t, i in zip(self.txt_lens, self.img_lens, strict=True))

    @property
    def output_lens(self) -> tuple[int, ...]:
        """The model predicts the image tokens: ``img_lens``."""
        return self.img_lens

    @functools.cached_property
    def _joint_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Rows of the text and of the image tokens in joint order (per sample: text, then image)."""
        txt_lens, img_lens = np.array(self.txt_lens, dtype=np.int64), np.array(self.img_lens, dtype=np.int64)
        starts = np.cumsum(txt_lens + img_lens) - (txt_lens + img_lens)
        txt_rows = np.repeat(starts, txt_lens) + _ranks_within(txt_lens)
        img_rows = np.repeat(starts + txt_lens, img_lens) + _ranks_within(img_lens)
        return txt_rows, img_rows

    def conditioning(self) -> dict[str, Tensor]:
        """The per-sample rows the embedders turn into ``temb``: ``timestep``, and ``guidance`` and
        ``pooled_projections`` where the model has them."""
        rows = {"timestep": self.timestep, "guidance": self.guidance, "pooled_projections": self.pooled_projections}
        return {name: row for name, row in rows.items() if row is not None}


def _ranks_within(lens: np.ndarray) -> np.ndarray:
    """``0..n-1`` for each length ``n``, concatenated."""
    return np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)


def text_ids(length: int) -> Tensor:
    """``[length, 4]`` positions ``(0, 0, 0, l)`` of text tokens (diffusers' FLUX.2 pipeline)."""
    ids = torch.zeros(length, 4)
    ids[:, 3] = torch.arange(length)
    return ids


def position_ids(config: Mapping[str, Any], grid: Tensor, text_tokens: int) -> tuple[Tensor, Tensor]:
    """``(img_ids [L, A], txt_ids [Tt, A])`` as each family's diffusers pipeline makes them, for a
    model ``config`` and latent positions ``grid [L, 3]`` ``(t, h, w)``. FLUX.1 (3 axes): the grid,
    and text at 0. FLUX.2 (4 axes, the last the text position ``l``): latents at ``(t, h, w, 0)``,
    text at ``(0, 0, 0, l)``."""
    axes = len(config["axes_dims_rope"])
    if axes == 3:
        return grid.float(), torch.zeros(text_tokens, 3)
    if axes == 4:
        return torch.cat([grid.float(), torch.zeros(len(grid), 1)], dim=1), text_ids(text_tokens)
    raise ValueError(f"no FLUX family has {axes} position axes (axes_dims_rope {config['axes_dims_rope']})")


class PackedFluxBase(DiffusersCheckpoint, nn.Module):
    """A FLUX family over packed samples, balanced or not; subclasses define the layers.

    Subclass contract:

    * ``__init__`` takes diffusers' config arguments (same names and defaults) then
      :data:`~deepspeed_knap.models.loading.EXTRA_ARGS`, calls :meth:`_init_common`, and builds modules with diffusers' names,
      including ``x_embedder``, ``context_embedder``, ``norm_out`` and ``proj_out``.
    * :meth:`embed_conditioning` and :meth:`transform`.
    * ``spec``: the family's :class:`~deepspeed_knap.models.spec.ModelSpec` (its name, diffusers
      class, LoRA targets and loader, ...).
    """

    @property
    def block_stack(self) -> list[nn.Module]:
        """The transformer blocks, in the order they run."""
        return [*self.transformer_blocks, *self.single_transformer_blocks]

    def _init_common(
        self, config: dict, attention_backend: str, topology: Topology | None, gradient_checkpointing: bool
    ):
        axes = config["axes_dims_rope"]
        if any(dim <= 0 or dim % 2 for dim in axes):
            raise ValueError(f"axes_dims_rope {list(axes)} must be positive and even: RoPE rotates channel pairs")
        if sum(axes) != config["attention_head_dim"]:
            raise ValueError(
                f"axes_dims_rope {list(axes)} sum to {sum(axes)}, but RoPE rotates every channel of a head: they "
                f"must sum to attention_head_dim={config['attention_head_dim']}"
            )
        self.config = {**config, "axes_dims_rope": list(axes)}
        self.inner_dim = config["num_attention_heads"] * config["attention_head_dim"]
        self.out_channels = config["out_channels"] or config["in_channels"]
        self.gradient_checkpointing = gradient_checkpointing
        # One parameterless module shared by every block: the balancer's routing decides its groups.
        self.attention = KnapDistributedAttention(
            config["num_attention_heads"], backend=attention_backend, topology=topology
        )

    @property
    def embed_text_before_routing(self) -> bool:
        """Whether text tokens travel embedded (:func:`route_text_embedded`)."""
        return route_text_embedded(self.config["joint_attention_dim"], self.inner_dim)

    # ---- what a family defines ----

    def embed_conditioning(self, conditioning: Mapping[str, Tensor], dtype: torch.dtype) -> Tensor:
        """``temb [n, D]`` from per-sample rows (``timestep [n]`` and, where the model has them,
        ``guidance [n]`` and ``pooled_projections [n, Dp]``); ``dtype`` is the latents', which
        diffusers casts the timestep and guidance to before scaling them by 1000."""
        raise NotImplementedError

    def transform(self, txt: Tensor, img: Tensor, step: FluxStep) -> Tensor:
        """The blocks and the output layers: embedded ``txt [Tt, D]`` and ``img [Ti, D]`` of this
        GPU's routed tokens -> ``[Ti, patch^2 * C_out]`` predictions."""
        raise NotImplementedError

    # ---- packing ----

    def sample_shapes(self, image_tokens: int, text_tokens: int) -> dict[str, tuple[int, ...]]:
        """The shape of every tensor of one unbatched sample with these token counts."""
        config = self.config
        axes = len(config["axes_dims_rope"])
        shapes = {
            "hidden_states": (image_tokens, config["in_channels"]),
            "encoder_hidden_states": (text_tokens, config["joint_attention_dim"]),
            "img_ids": (image_tokens, axes),
            "txt_ids": (text_tokens, axes),
            "timestep": (),
        }
        if config["guidance_embeds"]:
            shapes["guidance"] = ()
        if "pooled_projection_dim" in config:
            shapes["pooled_projections"] = (config["pooled_projection_dim"],)
        return shapes

    def pack(self, samples: Sequence[Mapping[str, Tensor]], on_problem: str = "raise") -> FluxInputs:
        """Pack per-sample diffusers arguments (unbatched; keys and shapes: :meth:`sample_shapes`)
        into :class:`FluxInputs`. No samples gives an empty batch with the right columns (a rank may
        have none this step).

        Args:
            on_problem: ``"raise"``: raise on a bad sample, here (local). ``"carry"``: return empty
                inputs whose ``problem`` names it, for a balanced :meth:`forward` to raise on every
                rank together (raising here alone would leave the other ranks waiting in the step's
                first collective).

        Raises:
            ValueError: (with ``"raise"``) a missing key or a shape that does not fit this model's config.
        """
        if (carried := pack_carrying(self.pack, samples, on_problem)) is not None:
            return carried
        for index, sample in enumerate(samples):
            self._check_sample(index, sample)
        shapes = self.sample_shapes(0, 0)
        dtype = next(self.parameters()).dtype

        def cat(key: str) -> Tensor:
            rows = [torch.as_tensor(s[key]) for s in samples]
            return torch.cat(rows) if rows else torch.zeros(shapes[key], dtype=dtype)

        def stack(key: str) -> Tensor | None:
            if key not in shapes:
                return None
            rows = [torch.as_tensor(s[key]).reshape(1, *shapes[key]) for s in samples]
            return torch.cat(rows).reshape(-1, *shapes[key]) if rows else torch.zeros(0, *shapes[key], dtype=dtype)

        return FluxInputs(
            hidden_states=cat("hidden_states"),
            encoder_hidden_states=cat("encoder_hidden_states"),
            timestep=stack("timestep"),
            img_ids=cat("img_ids"),
            txt_ids=cat("txt_ids"),
            img_lens=tuple(int(s["hidden_states"].shape[0]) for s in samples),
            txt_lens=tuple(int(s["encoder_hidden_states"].shape[0]) for s in samples),
            guidance=stack("guidance"),
            pooled_projections=stack("pooled_projections"),
        )

    def _check_sample(self, index: int, sample: Mapping[str, Tensor]) -> None:
        guided = self.config["guidance_embeds"]
        if "hidden_states" not in sample or "encoder_hidden_states" not in sample:
            raise ValueError(
                f"sample {index} needs 'hidden_states' and 'encoder_hidden_states'; it has {sorted(sample)}"
            )
        expected = self.sample_shapes(sample["hidden_states"].shape[0], sample["encoder_hidden_states"].shape[0])
        missing = [key for key in expected if key not in sample]
        if missing:
            hint = " (this model has guidance_embeds=True: pass a guidance scale)" if "guidance" in missing else ""
            raise ValueError(f"sample {index} has no {missing}{hint}; it has {sorted(sample)}")
        if not guided and sample.get("guidance") is not None:
            raise ValueError(
                f"sample {index} has a guidance value but this model has guidance_embeds=False; drop it (or load a "
                "guidance-distilled model)"
            )
        for key, shape in expected.items():
            actual = tuple(torch.as_tensor(sample[key]).shape)
            if actual != shape and not (shape == () and actual == (1,)):
                dims = ", ".join(f"{k}={self.config[k]}" for k in ("in_channels", "joint_attention_dim",
                                                                  "pooled_projection_dim") if k in self.config)  # fmt: skip
                raise ValueError(
                    f"sample {index}: {key!r} has shape {list(actual)}; expected {list(shape)} (one unbatched "
                    f"sample: {dims}, {len(self.config['axes_dims_rope'])} position axes)"
                )

    # ---- forward ----

    def forward_samples(
        self, samples: Sequence[Mapping[str, Tensor]], balancer: KnapBalancer | None = None
    ) -> list[Tensor]:
        """:meth:`pack`, :meth:`forward`, split: one ``[L_i, patch^2 * C_out]`` output per sample,
        what diffusers returns for that sample alone. Collective when ``balancer`` is given: a bad
        sample on any rank raises on every rank, the same error naming the rank and the sample, in
        the step's first collective (unbalanced: here)."""
        inputs = self.pack(samples, on_problem="carry" if balancer is not None else "raise")
        return inputs.split(self(inputs, balancer))

    def forward(self, inputs: FluxInputs, balancer: KnapBalancer | None = None) -> Tensor:
        """``[Ti, patch^2 * C_out]`` predictions for ``inputs.hidden_states``' tokens, in their order.
        With a ``balancer`` the blocks run on the tokens the step's plan gives this GPU (collective:
        every rank calls it every step, even with no samples).

        Raises:
            ValueError: ``inputs.problem`` (a bad sample :meth:`pack` carried): here without a
                balancer; with one, on every rank, by the step's first collective.
        """
        device = inputs.hidden_states.device
        txt_rows, img_rows = inputs._joint_rows
        is_text = np.zeros(len(txt_rows) + len(img_rows), dtype=bool)
        is_text[txt_rows] = True
        img_rows_t = torch.as_tensor(img_rows, device=device)
        joint_order = torch.as_tensor(np.argsort(np.concatenate([txt_rows, img_rows])), device=device)
        token_data = {"ids": torch.cat([inputs.txt_ids, inputs.img_ids]).float().index_select(0, joint_order),
                      "is_text": torch.as_tensor(is_text, device=device)}  # fmt: skip
        batch, text = self._joint_batch(inputs, img_rows_t, len(is_text), token_data, inputs.conditioning())
        blocks = functools.partial(self._blocks, text=text, home_is_text=is_text)
        return balanced_forward(batch, blocks, balancer, problem=inputs.problem).index_select(0, img_rows_t)

    def _joint_batch(self, inputs: Any, img_rows: Tensor, tokens: int, token_data: dict[str, Tensor],
                     sample_data: dict[str, Tensor]) -> tuple[PackedBatch, Tensor]:  # fmt: skip
        """The batch the route carries for joint text + image sequences, and the text that travels
        beside it. The route carries raw latents at their rows of the joint sequences (``[tokens,
        C]``: text rows zero, their input travels separately, raw or embedded, whichever is fewer
        bytes) and no gradient."""
        latents = inputs.hidden_states
        routed = latents.new_zeros(tokens, latents.shape[1]).index_copy(0, img_rows, latents)
        text = inputs.encoder_hidden_states
        if self.embed_text_before_routing:
            text = self.context_embedder(text)
        batch = PackedBatch(tokens=routed, seq_lens=inputs.seq_lens, token_data=token_data, sample_data=sample_data)
        return batch, text

    def _blocks(self, routed: RoutedBatch, text: Tensor, home_is_text: np.ndarray) -> Tensor:
        """Embed this GPU's routed tokens and run :meth:`transform`: ``[T, C_out]`` in routed order
        (zero rows for text tokens, which have no output)."""
        batch = routed.batch
        temb = self.embed_conditioning(batch.sample_data, batch.tokens.dtype)  # [n, D]
        config = self.config
        step = FluxStep.build(routed, self.attention, config["axes_dims_rope"], temb, config.get("rope_theta", 10000))
        txt = route_subset_rows(text, home_is_text, routed, step.txt_rows)
        if not self.embed_text_before_routing:
            txt = self.context_embedder(txt)
        img = self.x_embedder(batch.tokens.index_select(0, step.img_rows))
        out = self.transform(txt, img, step)  # [Ti, C_out]
        return out.new_zeros(batch.num_tokens, out.shape[1]).index_copy(0, step.img_rows, out)

    def _run(self, block: nn.Module, *args: Any):
        if self.gradient_checkpointing and torch.is_grad_enabled():
            return checkpoint(block, *args, use_reentrant=False)
        return block(*args)
