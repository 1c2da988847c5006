"""FLUX.3 on packed, balanced batches, loading and saving diffusers' ``Flux3Transformer2DModel`` weights.

    model = PackedFlux3Transformer.from_pretrained("/models/FLUX.3", ds_config=ds_config)
    outputs = model.forward_samples(samples, balancer)  # one [L_i, C] prediction per sample

FLUX.3 has three token modes: the noisy image, optional reference images (editing) and the text.
Each mode first runs through per-mode blocks with weights of its own, attending only within its
mode; then joint single blocks attend over ``[text, image, references]``; only image tokens reach
the output. Modulation is per token: image tokens at the flow timestep, text and references at 0,
each mode with its own heads (early and single-stream); a flow-map checkpoint (``flow_map``) adds
the embedding of the target timestep to all of them.

Here a sample is one balanced sequence ``[text, image, references]``: the route sees its total
length, the planner its length and its segments (``Flux3Inputs.segments``, gathered with the
lengths; the ``flux3`` cost model prices the per-mode blocks' attention by mode and the joint
blocks' by the whole sequence), and the per-mode blocks attend by segment
(``KnapDistributedAttention``'s ``segments``: one all-to-all carries the whole sequence, attention
is block-diagonal by mode).

Bad input (a reference without its ids, a missing or unexpected ``target_timestep``, a text of zero
tokens, ids of the wrong width, ...): :meth:`PackedFlux3Transformer.pack` raises, naming the sample.
Balanced, that would leave the other ranks waiting in the step's first collective, so
:meth:`~PackedFlux3Transformer.forward_samples` (or ``pack(samples, on_problem="carry")``, then
``forward``) carries the problem into that collective instead (the lengths gather): every rank
raises the same error, naming the rank and the sample, together.

A sample (:meth:`PackedFlux3Transformer.pack`), diffusers' forward-argument names, unbatched:
``hidden_states [L, C]``, ``encoder_hidden_states [Lt, Dj]`` (at least one row), ``img_ids [L, 4]``,
``txt_ids [Lt, 4]``, ``timestep`` (a scalar in ``[0, 1]``), optionally ``image_cond_hidden_states
[Lr, Cr]`` with ``image_cond_ids [Lr, 4]`` (one or more reference images concatenated, as diffusers
takes them), and ``target_timestep`` for, and only for, flow-map checkpoints.

Shapes: ``N`` samples on a rank, ``T`` tokens (``Tt`` text, ``Ti`` image, ``Tr`` reference), ``C`` /
``Cr`` latent channels, ``Dj`` text-encoder width, ``D`` model width, ``n`` chunks held after routing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepspeed_knap.models.flux.base import PackedFluxBase, _ranks_within
from deepspeed_knap.models.flux.layers import AdaNormOut, rotary_cos_sin
from deepspeed_knap.models.flux3.layers import MODES, Flux3Block, Flux3Modulation, Flux3Step, mode_layer, single_layer
from deepspeed_knap.models.flux3.spec import FLUX3
from deepspeed_knap.models.inputs import PACK_ERRORS, PackedInputs
from deepspeed_knap.models.layers import MLPEmbedder, timestep_features
from deepspeed_knap.planner.topology import Topology
from deepspeed_knap.runtime.attention import KnapDistributedAttention
from deepspeed_knap.runtime.balancer import KnapBalancer, balanced_forward
from deepspeed_knap.runtime.packing import PackedBatch
from deepspeed_knap.runtime.routing import RoutedBatch, gather_sample_ints, route_subset_rows

__all__ = ["Flux3Inputs", "PackedFlux3Transformer"]


@dataclass(frozen=True, eq=False)
class Flux3Inputs(PackedInputs):
    """One rank's samples, packed per mode; the names are diffusers' forward arguments.

    Attributes:
        hidden_states: ``[Ti, C]`` image latent tokens, sample after sample.
        encoder_hidden_states: ``[Tt, Dj]`` text-encoder rows, sample after sample.
        image_cond_hidden_states: ``[Tr, Cr]`` reference latent tokens, sample after sample (``Tr``
            may be 0).
        timestep: ``[N]`` in ``[0, 1]``.
        img_ids, txt_ids, image_cond_ids: ``[Ti, 4]``, ``[Tt, 4]``, ``[Tr, 4]`` positions.
        img_lens, txt_lens, ref_lens: ``N`` per-sample token counts of each mode.
        target_timestep: ``[N]`` for flow-map models, else ``None``.
        problem: why the samples given could not be packed (naming the sample), or ``None``; inputs
            with a problem hold no samples, and :meth:`PackedFlux3Transformer.forward` raises it on
            every rank of the step (``pack(samples, on_problem="carry")``).
    """

    hidden_states: Tensor
    encoder_hidden_states: Tensor
    image_cond_hidden_states: Tensor
    timestep: Tensor
    img_ids: Tensor
    txt_ids: Tensor
    image_cond_ids: Tensor
    img_lens: tuple[int, ...]
    txt_lens: tuple[int, ...]
    ref_lens: tuple[int, ...]
    target_timestep: Tensor | None = None
    problem: str | None = None

    @property
    def output_lens(self) -> tuple[int, ...]:
        """The model predicts the image tokens: ``img_lens``."""
        return self.img_lens

    @property
    def segments(self) -> np.ndarray:
        """``[N, 3]`` tokens of each mode per sample, in sequence order (text, image, references)."""
        return np.array([self.txt_lens, self.img_lens, self.ref_lens], dtype=np.int64).reshape(3, -1).T

    @property
    def seq_lens(self) -> tuple[int, ...]:
        """``N`` sequence lengths (all modes): what the balancer plans."""
        return tuple(int(n) for n in self.segments.sum(axis=1))


class PackedFlux3Transformer(PackedFluxBase):
    """FLUX.3 (per-mode blocks, then joint single blocks) over packed samples, balanced or not.

    The constructor takes ``Flux3Transformer2DModel``'s config (same names and defaults), so
    ``state_dict`` names and shapes are diffusers', plus:

    Args:
        attention_backend: local kernel of every block's attention (see ``VarlenAttention``).
        topology: when given, checked against the heads at construction.
        gradient_checkpointing: recompute each layer in backward instead of keeping its activations.
    """

    spec = FLUX3

    def __init__(
        self,
        in_channels: int = 128,
        cond_in_channels: int = 128,
        num_layers: int = 5,
        num_single_layers: int = 28,
        attention_head_dim: int = 128,
        num_attention_heads: int = 24,
        joint_attention_dim: int = 20480,
        timestep_channels: int = 256,
        mlp_ratio: float = 3.0,
        axes_dims_rope: Sequence[int] = (32, 32, 32, 32),
        rope_theta: int = 10000,
        eps: float = 1e-6,
        flow_map: bool = False,
        attention_backend: str = "auto",
        topology: Topology | None = None,
        gradient_checkpointing: bool = False,
    ) -> None:
        arguments = locals()
        super().__init__()
        config = {key: arguments[key] for key in self.config_keys()}
        if any(d <= 0 or d % 2 for d in axes_dims_rope) or sum(axes_dims_rope) != attention_head_dim:
            raise ValueError(
                f"axes_dims_rope {list(axes_dims_rope)} must be positive, even and sum to attention_head_dim="
                f"{attention_head_dim}: RoPE rotates every channel pair of a head"
            )
        self.config = {**config, "axes_dims_rope": list(axes_dims_rope)}
        dim = self.inner_dim = num_attention_heads * attention_head_dim
        self.out_channels = in_channels
        self.gradient_checkpointing = gradient_checkpointing
        self.attention = KnapDistributedAttention(num_attention_heads, backend=attention_backend, topology=topology)

        self.timestep_embedder = MLPEmbedder(timestep_channels, dim, bias=False)
        self.target_timestep_embedder = MLPEmbedder(timestep_channels, dim, bias=False) if flow_map else None
        self.early_stream_modulations = nn.ModuleDict({m: Flux3Modulation(dim) for m in ("image", "image_cond", "txt")})
        self.single_stream_modulations = nn.ModuleDict(
            {m: Flux3Modulation(dim) for m in ("image", "image_cond", "txt")}
        )
        self.x_embedders = nn.ModuleDict(
            {
                "image": nn.Linear(in_channels, dim, bias=False),
                "image_cond": nn.Linear(cond_in_channels, dim, bias=False),
            }
        )
        self.context_embedder = nn.Linear(joint_attention_dim, dim, bias=False)

        def blocks(count: int) -> nn.ModuleList:
            return nn.ModuleList(
                Flux3Block(dim, num_attention_heads, attention_head_dim, mlp_ratio, eps) for _ in range(count)
            )

        self.mode_blocks = nn.ModuleDict({m: blocks(num_layers) for m in ("image", "image_cond")})
        self.txt_mode_blocks = blocks(num_layers)
        self.single_transformer_blocks = blocks(num_single_layers)
        self.norm_out = AdaNormOut(dim, bias=False, eps=eps)
        self.proj_out = nn.Linear(dim, in_channels, bias=False)

    @property
    def block_stack(self) -> list[nn.Module]:
        """The transformer blocks: each mode's, then the joint single blocks."""
        modes = [*self.txt_mode_blocks, *(block for blocks in self.mode_blocks.values() for block in blocks)]
        return [*modes, *self.single_transformer_blocks]

    # ---- packing ----

    def sample_shapes(self, image_tokens: int, text_tokens: int, ref_tokens: int = 0) -> dict[str, tuple[int, ...]]:
        """The shape of every tensor of one unbatched sample with these token counts."""
        config, axes = self.config, len(self.config["axes_dims_rope"])
        shapes = {
            "hidden_states": (image_tokens, config["in_channels"]),
            "encoder_hidden_states": (text_tokens, config["joint_attention_dim"]),
            "img_ids": (image_tokens, axes),
            "txt_ids": (text_tokens, axes),
            "timestep": (),
        }
        if ref_tokens:
            shapes["image_cond_hidden_states"] = (ref_tokens, config["cond_in_channels"])
            shapes["image_cond_ids"] = (ref_tokens, axes)
        if config["flow_map"]:
            shapes["target_timestep"] = ()
        return shapes

    def pack(self, samples: Sequence[Mapping[str, Tensor]], on_problem: str = "raise") -> Flux3Inputs:
        """Pack per-sample diffusers arguments (unbatched; see the module docstring) into
        :class:`Flux3Inputs`. No samples gives an empty batch with the right columns.

        Args:
            samples: this rank's samples.
            on_problem: ``"raise"``: raise on a bad sample, here (local). ``"carry"``: return empty
                inputs whose ``problem`` names it, for :meth:`forward` to raise on every rank of a
                balanced step together (what :meth:`forward_samples` does).

        Raises:
            ValueError: naming the sample (with ``"raise"``): a missing key, reference latents
                without their ids (or ids without them), ``target_timestep`` missing on a flow-map
                model or given to another, a text or image of zero tokens, a shape (ids of the wrong
                width included) that does not fit the config.
        """
        if on_problem not in ("raise", "carry"):
            raise ValueError(f"on_problem must be 'raise' or 'carry'; got {on_problem!r}")
        problem = self.check_samples(samples)
        if problem is not None:
            if on_problem == "raise":
                raise ValueError(problem)
            return dataclasses.replace(self.pack([]), problem=problem)
        config, axes = self.config, len(self.config["axes_dims_rope"])
        dtype = self.dtype

        def cat(key: str, width: int) -> Tensor:
            rows = [torch.as_tensor(s[key]) for s in samples if s.get(key) is not None]
            return torch.cat(rows) if rows else torch.zeros(0, width, dtype=dtype)

        def stack(key: str) -> Tensor:
            rows = [torch.as_tensor(s[key]).reshape(()) for s in samples]
            return torch.stack(rows) if rows else torch.zeros(0, dtype=dtype)  # the dtype others route

        def count(key: str) -> tuple[int, ...]:
            return tuple(int(torch.as_tensor(s[key]).shape[0]) if s.get(key) is not None else 0 for s in samples)

        return Flux3Inputs(
            hidden_states=cat("hidden_states", config["in_channels"]),
            encoder_hidden_states=cat("encoder_hidden_states", config["joint_attention_dim"]),
            image_cond_hidden_states=cat("image_cond_hidden_states", config["cond_in_channels"]),
            timestep=stack("timestep"),
            img_ids=cat("img_ids", axes),
            txt_ids=cat("txt_ids", axes),
            image_cond_ids=cat("image_cond_ids", axes),
            img_lens=count("hidden_states"),
            txt_lens=count("encoder_hidden_states"),
            ref_lens=count("image_cond_hidden_states"),
            target_timestep=stack("target_timestep") if config["flow_map"] else None,
        )

    def check_samples(self, samples: Sequence[Mapping[str, Tensor]]) -> str | None:
        """Why ``samples`` cannot be packed, naming the first bad sample (:meth:`pack`'s errors), or
        ``None``. Local: no collective."""
        for index, sample in enumerate(samples):
            try:
                self._check_sample(index, sample)
            except PACK_ERRORS as error:
                return (
                    str(error) if isinstance(error, ValueError) else f"sample {index}: {type(error).__name__}: {error}"
                )
        return None

    def forward_samples(
        self, samples: Sequence[Mapping[str, Tensor]], balancer: KnapBalancer | None = None
    ) -> list[Tensor]:
        """:meth:`pack`, :meth:`forward`, split: one ``[L_i, C]`` output per sample, what diffusers
        returns for that sample alone. Collective when ``balancer`` is given: a bad sample on any
        rank raises on every rank, the same error naming the rank and the sample, in the step's
        first collective (unbalanced: here).

        Raises:
            ValueError: a bad sample (:meth:`pack`), on every rank of the step.
        """
        inputs = self.pack(samples, on_problem="carry" if balancer is not None else "raise")
        return inputs.split(self(inputs, balancer))

    def _check_sample(self, index: int, sample: Mapping[str, Tensor]) -> None:
        required = ["hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids"]
        missing = [key for key in required if sample.get(key) is None]
        if missing:
            raise ValueError(f"sample {index} has no {missing}; it has {sorted(sample)}")
        has_refs, has_ref_ids = (sample.get(k) is not None for k in ("image_cond_hidden_states", "image_cond_ids"))
        if has_refs != has_ref_ids:
            given, absent = ("image_cond_hidden_states", "image_cond_ids")[:: 1 if has_refs else -1]
            raise ValueError(
                f"sample {index} has {given} without {absent}: reference latents and their position ids come "
                "together (diffusers' ids put reference image i at (0, h / 2, w / 2, -1 - i))"
            )
        has_target = sample.get("target_timestep") is not None
        if has_target != bool(self.config["flow_map"]):
            raise ValueError(
                f"sample {index}: "
                + ("this flow-map model (flow_map=True) needs a target_timestep" if not has_target else
                   "target_timestep given, but this model is not a flow map (flow_map=False); drop it")
            )  # fmt: skip
        lens = {key: int(torch.as_tensor(sample[key]).shape[0]) if torch.as_tensor(sample[key]).dim() else -1
                for key in ("hidden_states", "encoder_hidden_states")}  # fmt: skip
        if lens["encoder_hidden_states"] == 0 or lens["hidden_states"] == 0:
            empty = "text" if lens["encoder_hidden_states"] == 0 else "image"
            raise ValueError(
                f"sample {index} has a {empty} of zero tokens; FLUX.3 needs at least one of each (its {empty} tokens "
                "attend only among themselves in the per-mode blocks)"
            )
        refs = int(torch.as_tensor(sample["image_cond_hidden_states"]).shape[0]) if has_refs else 0
        expected = self.sample_shapes(max(lens["hidden_states"], 0), max(lens["encoder_hidden_states"], 0), refs)
        for key, shape in expected.items():
            actual = tuple(torch.as_tensor(sample[key]).shape)
            if actual != shape and not (shape == () and actual == (1,)):
                raise ValueError(
                    f"sample {index}: {key!r} has shape {list(actual)}; expected {list(shape)} (one unbatched sample: "
                    f"in_channels={self.config['in_channels']}, cond_in_channels={self.config['cond_in_channels']}, "
                    f"joint_attention_dim={self.config['joint_attention_dim']}, "
                    f"{len(self.config['axes_dims_rope'])} position axes)"
                )

    # ---- forward ----

    def forward(self, inputs: Flux3Inputs, balancer: KnapBalancer | None = None) -> Tensor:
        """``[Ti, C]`` predictions for ``inputs.hidden_states``' tokens, in their order. With a
        ``balancer`` the blocks run on the tokens the step's plan gives this GPU (collective: every
        rank calls it every step, even with no samples), planned with the samples' segments.

        Raises:
            ValueError: ``inputs.problem`` (a bad sample :meth:`pack` carried): here without a
                balancer; with one, on every rank, by the step's first collective (this rank runs the
                same collectives as the others up to it, on no samples).
        """
        latents, refs = inputs.hidden_states, inputs.image_cond_hidden_states
        device = latents.device
        segments = inputs.segments  # [N, 3]
        starts = np.cumsum(segments.sum(axis=1)) - segments.sum(axis=1)
        # Home rows of each mode in sequence order (per sample: text, image, references).
        offsets = np.concatenate([np.zeros((len(starts), 1), dtype=np.int64), np.cumsum(segments, axis=1)], axis=1)
        mode_rows = [
            np.repeat(starts + offsets[:, m], segments[:, m]) + _ranks_within(segments[:, m]) for m in range(3)
        ]
        total = int(segments.sum())
        mode = np.zeros(total, dtype=np.int64)
        for m, rows in enumerate(mode_rows):
            mode[rows] = m
        rows_t = [torch.as_tensor(rows, device=device) for rows in mode_rows]
        order = torch.argsort(torch.cat(rows_t))  # mode-major -> sequence order
        # The route carries raw latents, image and reference rows in one tensor (text rows zero: the
        # text travels separately), padded to the wider of the two (FLUX.3: both 128).
        width = max(latents.shape[1], refs.shape[1])
        tokens = latents.new_zeros(total, width)
        tokens = tokens.index_copy(0, rows_t[1], F.pad(latents, (0, width - latents.shape[1])))
        tokens = tokens.index_copy(0, rows_t[2], F.pad(refs.to(latents.dtype), (0, width - refs.shape[1])))
        ids = torch.cat([inputs.txt_ids, inputs.img_ids, inputs.image_cond_ids]).float().index_select(0, order)
        sample_data = {"timestep": inputs.timestep.to(device)}
        if inputs.target_timestep is not None:
            sample_data["target_timestep"] = inputs.target_timestep.to(device)
        batch = PackedBatch(
            tokens=tokens,
            seq_lens=inputs.seq_lens,
            token_data={"ids": ids, "mode": torch.as_tensor(mode, device=device)},
            sample_data=sample_data,
        )
        text = inputs.encoder_hidden_states
        if self.embed_text_before_routing:
            text = self.context_embedder(text)
        blocks = functools.partial(self._blocks, text=text, home_is_text=mode == 0, segments=segments)
        out = balanced_forward(batch, blocks, balancer, segments=segments, problem=inputs.problem)
        return out.index_select(0, rows_t[1])

    def embed_timesteps(self, conditioning: Mapping[str, Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(image_temb, zero_temb) [n, D]``: the conditioning of image tokens (flow timestep) and of
        text and reference tokens (timestep 0), per sequence held, plus the target timestep's
        embedding in both for flow maps. ``dtype``: the latents', as diffusers casts to."""
        channels = self.config["timestep_channels"]
        timestep = conditioning["timestep"].to(dtype)
        image = self.timestep_embedder(timestep_features(timestep * 1000, channels).to(dtype))
        zero = self.timestep_embedder(timestep_features(torch.zeros_like(timestep), channels).to(dtype))
        if self.target_timestep_embedder is not None:
            target = conditioning["target_timestep"].to(dtype) * 1000
            target = self.target_timestep_embedder(timestep_features(target, channels).to(dtype))
            image, zero = image + target, zero + target
        return image, zero

    def _blocks(self, routed: RoutedBatch, text: Tensor, home_is_text: np.ndarray, segments: np.ndarray) -> Tensor:
        """Embed this GPU's routed tokens, run the per-mode and the joint blocks and the output
        layers: ``[T, C]`` in routed order (zero rows for text and reference tokens)."""
        batch = routed.batch
        mode = batch.token_data["mode"]
        rows = [(mode == m).nonzero().squeeze(1) for m in range(len(MODES))]  # routed rows of each mode
        to_modes = torch.cat(rows)
        seq = batch.seq_index
        mode_seq = tuple(seq.index_select(0, r) for r in rows)
        n = batch.num_seqs
        config = self.config
        cos, sin = rotary_cos_sin(
            batch.token_data["ids"].index_select(0, to_modes), config["axes_dims_rope"], config["rope_theta"]
        )
        step = Flux3Step(
            routed=routed,
            attention=self.attention,
            counts=tuple(len(r) for r in rows),
            mode_seq=mode_seq,
            mod_index=torch.cat([m * n + s for m, s in enumerate(mode_seq)]),
            to_routed=torch.argsort(to_modes),
            to_modes=to_modes,
            cos=cos,
            sin=sin,
            segments=gather_sample_ints(segments, routed),  # collective: every rank, every step
        )
        txt = route_subset_rows(text, home_is_text, routed, rows[0])
        if not self.embed_text_before_routing:
            txt = self.context_embedder(txt)
        img = self.x_embedders["image"](batch.tokens.index_select(0, rows[1])[:, : config["in_channels"]])
        ref = self.x_embedders["image_cond"](batch.tokens.index_select(0, rows[2])[:, : config["cond_in_channels"]])

        image_temb, zero_temb = self.embed_timesteps(batch.sample_data, batch.tokens.dtype)  # [n, D]
        activated = {"txt": F.silu(zero_temb), "image": F.silu(image_temb), "image_cond": F.silu(zero_temb)}
        early = [self.early_stream_modulations[m](activated[m]) for m in MODES]  # [n, 3D] each
        x = torch.cat([txt, img, ref])  # mode-major
        for depth in range(config["num_layers"]):
            layer = (
                self.txt_mode_blocks[depth],
                self.mode_blocks["image"][depth],
                self.mode_blocks["image_cond"][depth],
            )
            x = self._run(mode_layer, layer, x, early, step)
        single = [self.single_stream_modulations[m](activated[m]).chunk(3, dim=1) for m in MODES]
        table = tuple(torch.cat([mod[i] for mod in single]) for i in range(3))  # shift, scale, gate [3n, D]
        for block in self.single_transformer_blocks:
            x = self._run(single_layer, block, x, table, step)
        img = x[step.counts[0] : step.counts[0] + step.counts[1]]
        out = self.proj_out(self.norm_out(img, mode_seq[1], image_temb))  # [Ti, C]
        return out.new_zeros(batch.num_tokens, out.shape[1]).index_copy(0, rows[1], out)
