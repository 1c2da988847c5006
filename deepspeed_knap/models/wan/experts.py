"""Wan 2.2 A14B's two experts as one balanced model: :class:`PackedWanExperts`.

A Wan 2.2 A14B pipeline (T2V or I2V) holds two transformers of one shape: ``transformer`` runs the
high-noise steps and ``transformer_2`` the low-noise ones, switched where the scheduler's timestep
falls below ``boundary_ratio * 1000`` (``WanPipeline``: ``t >= boundary_timestep`` runs
``transformer``). Training with both draws each sample's noise level as usual, and the level picks
the sample's expert, as the pipeline does at inference.

One step makes one plan over all of its sequences (the two experts have the same shape, so a
sequence costs the same on either: the planner needs no expert), routes once, and on every GPU runs
each expert's block stack on the chunks of its own samples (:meth:`RoutedBatch.subset
<deepspeed_knap.runtime.routing.RoutedBatch.subset>`: the sequences of one expert with their own
attention groups), then routes back once. Every rank runs both experts every step, on no tokens
where it holds none of an expert's (ZeRO-3 gathers every module on every rank).

Shapes: ``N`` samples on a rank, ``T`` video tokens, ``P * C`` a token's output channels.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from deepspeed_knap.models.loading import names_second_transformer, pipeline_index
from deepspeed_knap.models.wan.spec import WAN
from deepspeed_knap.models.wan.wan import PackedWanTransformer, WanInputs
from deepspeed_knap.runtime.balancer import KnapBalancer, balanced_forward
from deepspeed_knap.runtime.routing import RoutedBatch, gather_sample_ints

# Which transformer of a two-expert pipeline serves which noise levels (diffusers' names).
EXPERTS = ("transformer", "transformer_2")  # high noise, low noise
# Wan 2.2 A14B T2V's boundary (diffusers' converter; the I2V pipeline's is 0.9): for tiny models.
DEFAULT_BOUNDARY_RATIO = 0.875


def pipeline_experts(path: str | Path | None) -> tuple[float | None, bool]:
    """``(boundary_ratio, has transformer_2)`` of a pipeline directory's ``model_index.json``
    (``(None, False)`` for a transformer directory or ``None``).

    Raises:
        ValueError: an unreadable ``model_index.json``, naming it.
    """
    index = Path(path or ".") / "model_index.json"
    if path is None or not index.is_file():
        return None, False
    config = pipeline_index(path)
    return config.get("boundary_ratio"), names_second_transformer(config)


def image_to_video_pipeline(pipeline: Any) -> Any:
    """``WanImageToVideoPipeline`` of a ``WanPipeline``'s parts and its ``boundary_ratio`` and
    ``expand_timesteps``: what diffusers runs Wan 2.2 TI2V-5B's requests from an image with (the
    parts share their weights, LoRA loaded into them included)."""
    from diffusers import WanImageToVideoPipeline

    return WanImageToVideoPipeline(**pipeline.components, boundary_ratio=pipeline.config.get("boundary_ratio"),
                                   expand_timesteps=bool(pipeline.config.get("expand_timesteps")))  # fmt: skip


def expand_timesteps(path: str | Path | None) -> bool:
    """Whether a pipeline directory's ``model_index.json`` sets ``expand_timesteps`` (Wan 2.2 TI2V-5B:
    a timestep per token, the first frame clean when generating from an image).

    Raises:
        ValueError: an unreadable ``model_index.json``, naming it.
    """
    index = Path(path or ".") / "model_index.json"
    if path is None or not index.is_file():
        return False
    return bool(pipeline_index(path).get("expand_timesteps"))


class PackedWanExperts(nn.Module):
    """Two Wan experts over packed samples, balanced or not: each sample runs through
    ``transformer`` when its timestep (its tokens' largest) is at least ``boundary_ratio * 1000``,
    else through ``transformer_2``. The two have one config; ``state_dict`` names are the pipeline's
    (``transformer.blocks.0...``, ``transformer_2.blocks.0...``).

    Args:
        transformer, transformer_2: the high- and low-noise experts.
        boundary_ratio: the pipeline's ``boundary_ratio``.

    Raises:
        ValueError: experts of different configs, a boundary outside ``(0, 1)``, or a config whose
            text is embedded before routing (each expert embeds it with its own weights).
    """

    spec = WAN
    family = WAN.name
    diffusers_class = WAN.diffusers_class

    def __init__(self, transformer: PackedWanTransformer, transformer_2: PackedWanTransformer,
                 boundary_ratio: float) -> None:  # fmt: skip
        super().__init__()
        if transformer.config != transformer_2.config:
            keys = sorted(set(transformer.config) | set(transformer_2.config))
            differ = "; ".join(f"{k}: {transformer.config.get(k)!r} in transformer, {transformer_2.config.get(k)!r} in "
                               "transformer_2" for k in keys if transformer.config.get(k) != transformer_2.config.get(k))  # fmt: skip
            raise ValueError(f"the two experts' configs differ ({differ}); a two-expert pipeline's have one shape")
        if not 0 < boundary_ratio < 1:
            raise ValueError(f"boundary_ratio {boundary_ratio} must lie in (0, 1)")
        if transformer.embed_text_before_routing:
            raise ValueError(
                f"text_dim {transformer.config['text_dim']} travels embedded for this width; two experts would "
                "each embed it: not supported (Wan 2.2 A14B's text travels raw)"
            )
        self.transformer, self.transformer_2 = transformer, transformer_2
        self.boundary_ratio = float(boundary_ratio)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the experts compute in (:attr:`PackedWanTransformer.dtype`)."""
        return self.transformer.dtype

    @property
    def experts(self) -> tuple[PackedWanTransformer, PackedWanTransformer]:
        return self.transformer, self.transformer_2

    @property
    def config(self) -> dict[str, Any]:
        """The experts' config (one shape)."""
        return self.transformer.config

    @property
    def block_stack(self) -> list[nn.Module]:
        return [*self.transformer.block_stack, *self.transformer_2.block_stack]

    def pack(self, samples: Sequence[Mapping[str, Tensor]], on_problem: str = "raise") -> WanInputs:
        """:meth:`PackedWanTransformer.pack` (the experts pack alike)."""
        return self.transformer.pack(samples, on_problem)

    def expert_of(self, inputs: WanInputs) -> np.ndarray:
        """``[N]`` int64: 0 for a sample ``transformer`` runs, 1 for ``transformer_2``'s."""
        boundary = self.boundary_ratio * 1000
        return np.array([0 if t >= boundary else 1 for t in inputs.sample_timesteps()], dtype=np.int64)

    def forward_samples(self, samples: Sequence[Mapping[str, Tensor]],
                        balancer: KnapBalancer | None = None) -> list[Tensor]:  # fmt: skip
        """:meth:`pack`, :meth:`forward`, split: one ``[C_out, F, H, W]`` output per sample, what
        the pipeline's expert of the sample's timestep returns for it alone."""
        inputs = self.pack(samples, on_problem="carry" if balancer is not None else "raise")
        return inputs.split(self(inputs, balancer))

    def forward(self, inputs: WanInputs, balancer: KnapBalancer | None = None) -> Tensor:
        """``[T, P * C_out]`` predictions for ``inputs``' tokens, in their order, each sample's by its
        expert (collective with a ``balancer``: every rank calls it every step, even with no samples)."""
        batch, text, image = self.transformer.packed_batch(inputs)
        experts = self.expert_of(inputs)

        def blocks(routed: RoutedBatch) -> Tensor:
            # Every GPU holding or attending over a chunk must know its sequence's expert: one all-gather.
            expert_of_seq = gather_sample_ints(experts[:, None], routed)[:, 0]
            outputs, rows = [], []
            for index, expert in enumerate(self.experts):
                part, part_rows = routed.subset(expert_of_seq == index)
                mine = inputs.subset(experts == index)
                part_text = (mine.encoder_hidden_states, text[1])
                part_image = (mine.encoder_hidden_states_image, image[1])
                outputs.append(expert._blocks(part, mine, part_text, part_image))
                rows.append(part_rows)
            # Keyed by the experts: generation reuses a step's routes while its requests' experts change.
            order = routed.device_array(("expert_order", expert_of_seq.tobytes()),
                                        np.argsort(np.concatenate(rows), kind="stable"))  # fmt: skip
            return torch.cat(outputs).index_select(0, order)

        return balanced_forward(batch, blocks, balancer, problem=inputs.problem)

    # ---- checkpoints ----

    @classmethod
    def from_pretrained(cls, path: str | Path, ds_config: Any = None, **kwargs: Any) -> PackedWanExperts:
        """Both experts of a two-expert pipeline directory (``transformer/``, ``transformer_2/``,
        ``boundary_ratio`` from ``model_index.json``), each loaded as
        :meth:`PackedWanTransformer.from_pretrained` does (collective with ``ds_config``; under ZeRO-3
        each rank reads only its partitions of either)."""
        boundary, two = pipeline_experts(path)
        if not two or boundary is None:
            missing = " and ".join(name for name, given in (("transformer_2", two), ("boundary_ratio", boundary))
                                   if not given)  # fmt: skip
            raise ValueError(f"{path} is not a two-expert Wan pipeline: its model_index.json names no {missing}")
        experts = [PackedWanTransformer.from_pretrained(Path(path) / name, ds_config=ds_config, **kwargs)
                   for name in EXPERTS]  # fmt: skip
        return cls(*experts, boundary)

    def save_pretrained(self, path: str | Path, state_dict: Mapping[str, Tensor] | None = None) -> Path:
        """Each expert in diffusers' format under ``path/transformer`` and ``path/transformer_2`` (a
        pipeline's layout). ``state_dict``: the pipeline-named full state (ZeRO-3's consolidated one)."""
        state = self.state_dict() if state_dict is None else state_dict
        for name, expert in zip(EXPERTS, self.experts, strict=True):
            expert.save_pretrained(Path(path) / name, expert_state(state, name))
        return Path(path)

    @classmethod
    def pipeline_transformers(cls, config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> dict[str, nn.Module]:
        """diffusers' two ``WanTransformer3DModel`` holding the experts' weights, by the pipeline's names."""
        return {name: PackedWanTransformer.diffusers_model(config, expert_state(state_dict, name)) for name in EXPERTS}


def expert_state(state_dict: Mapping[str, Tensor], name: str) -> dict[str, Tensor]:
    """One expert's part of a two-expert state dict (``name.`` prefix removed)."""
    prefix = f"{name}."
    return {key[len(prefix) :]: t for key, t in state_dict.items() if key.startswith(prefix)}
