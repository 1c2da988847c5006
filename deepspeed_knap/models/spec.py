"""A model family's spec: everything the package knows of one family, declared in its folder.

    # deepspeed_knap/models/wan/spec.py
    SPEC = ModelSpec(name="wan", title="Wan 2.x", diffusers_class="WanTransformer3DModel", ...)

Every command, the trainer, generation, calibration and the benches read a family through its spec
(:mod:`deepspeed_knap.models.registry` holds them): ``--family`` choices, the family of a checkpoint,
cost-model presets and their FLOP formula, synthetic data mixes, LoRA targets, the packed model, the
training hooks, the generator and the calibration timer. A new family is a folder with a ``spec.py``
and one line in the registry (docs/models.md, "Adding a model family").

A spec module is pure: it imports no torch, so ``deepspeed-knap plan`` and the ``"knapformer"``
config block (which names cost-model presets) read specs without loading a model. What needs torch
(the packed model, the training hooks, the generator, the block timer) is named as
``"module:attribute"`` and imported on first use (:meth:`ModelSpec.load`), like a console-script
entry point; ``tests/unit/test_registry.py`` imports every name of every spec.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from deepspeed_knap.cost.model import CostModel
    from deepspeed_knap.data.mixes import SampleShape

    Mix = Callable[[int, np.random.Generator], list[list[SampleShape]]]


@dataclass(frozen=True)
class ModelSpec:
    """One model family.

    Attributes:
        name: the family's name: ``--family`` values, ``PackedX.family``, the registry's key.
        title: how the docs and help name it (``"FLUX.1"``, ``"Wan 2.x"``).
        diffusers_class: the diffusers transformer class (``config.json``'s ``_class_name``): a
            checkpoint's family is the spec with its class.
        lora_loader: the diffusers pipeline (or LoRA loader mixin) whose ``save_lora_weights`` writes
            and ``load_lora_weights`` reads this family's adapter files.
        pipeline: the diffusers pipeline class validation renders and ``generate`` follows, or
            ``None`` where diffusers has none (FLUX.3: modular blocks only).
        model: ``"module:Class"`` of the packed model.
        tiny_config: a config of the packed model small enough for CPU ranks (``--tiny``).
        presets: cost-model presets by name: the dims ``cost_model`` takes.
        cost_model: the FLOP formula, ``cost_model(dims, **rates) -> CostModel`` (``rates``:
            ``tflops``, ``alltoall_gbps``, ``inter_node_alltoall_gbps``, ``frozen_base``,
            ``forward_only``, ...).
        cost_dims: a transformer config (diffusers' names) -> the dims ``cost_model`` takes.
        mixes: the family's synthetic data mixes by name (:mod:`deepspeed_knap.data.mixes`'s form).
        default_mix: the mix synthetic training draws unless told otherwise.
        lora_targets: the linear layers LoRA adapts by default, by diffusers' module names.
        training: ``"module:Class"`` of the family's training hooks
            (:class:`~deepspeed_knap.models.hooks.TrainingHooks`), or ``None``: the trainer does not
            run the family (its packed model runs, trains under a loop of your own, and is balanced).
        generator: ``"module:Class"`` of the family's generator
            (:class:`~deepspeed_knap.generation.generator.Generator`), or ``None``: ``generate``
            does not run the family.
        block_timer: ``"module:function"`` of the family's calibration timer
            (``deepspeed-knap calibrate``), or ``None``.
        block_counts: the config keys that count the transformer's blocks (FLUX: double- and
            single-stream), which the start-up calibration scales its timed copy by.
        step_timer: ``"module:function"`` timing forward and backward of a model of the family at
            its own dims (:func:`~deepspeed_knap.models.timing.model_step_timer`'s signature), for
            the cost model's ``startup_calibration``; the step it returns says what the blocks
            exchange (its ``ulysses_calls``, as ``model_step_timer``'s), or the Ulysses price is
            not timed.
        bench_configs: full-size transformer configs (diffusers' names) by preset name, for the
            commands that run a family at its real dims on a GPU (``calibrate --preset``,
            ``bench flux --preset``); each preset's dims are ``cost_dims`` of its config.
        full_config: the transformer config (diffusers' names) of the family's largest public
            checkpoint, which ``doctor`` times the start-up calibration at on a GPU, or ``None``
            (the tiny config is timed).
        video: the family generates video (clips of frames), not images.
        keep_in_fp32: the modules diffusers' model keeps in float32 when loaded in another dtype (its
            ``_keep_in_fp32_modules``), which the packed model's ``from_pretrained`` keeps so too in
            a dtype below float32.
    """

    name: str
    title: str
    diffusers_class: str
    lora_loader: str
    pipeline: str | None
    model: str
    tiny_config: Mapping[str, Any]
    presets: Mapping[str, Mapping[str, float]]
    cost_model: Callable[..., CostModel]
    cost_dims: Callable[[Mapping[str, Any]], dict[str, float]]
    default_mix: str
    lora_targets: tuple[str, ...]
    training: str | None = None
    generator: str | None = None
    block_timer: str | None = None
    block_counts: tuple[str, ...] = ("num_layers",)
    step_timer: str | None = "deepspeed_knap.models.timing:model_step_timer"
    mixes: Mapping[str, Mix] = field(default_factory=dict)
    bench_configs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    full_config: Mapping[str, Any] | None = None
    video: bool = False
    keep_in_fp32: tuple[str, ...] = ()

    def load(self, attribute: str) -> Any:
        """What ``self.<attribute>`` names (``"module:name"``), imported.

        Raises:
            ValueError: the family has none (``generator=None``).
        """
        target = getattr(self, attribute)
        if target is None:
            raise ValueError(f"the {self.title} family ({self.name!r}) has no {attribute}")
        module, _, name = target.partition(":")
        return getattr(importlib.import_module(module), name)

    @property
    def model_class(self) -> type:
        """The packed model class (imports torch)."""
        return self.load("model")

    def tiny_model(self, **options: Any) -> Any:
        """The packed model of :attr:`tiny_config`, with ``options`` (``gradient_checkpointing``, ...)."""
        return self.model_class(**self.tiny_config, **options)

    def hooks(self) -> Any:
        """The family's training hooks (:class:`~deepspeed_knap.models.hooks.TrainingHooks`).

        Raises:
            ValueError: the family has none (``training=None``).
        """
        return self.load("training")(self)

    def preset_cost_model(self, preset: str, **rates: Any) -> CostModel:
        """``cost_model`` of the preset's dims."""
        return self.cost_model(dict(self.presets[preset]), **rates)

    def config_cost_model(self, config: Mapping[str, Any], **rates: Any) -> CostModel:
        """``cost_model`` of a transformer config's dims (a loaded model's, a tiny one's)."""
        return self.cost_model(self.cost_dims(config), **rates)
