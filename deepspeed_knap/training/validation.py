"""Validation renders during training: rank 0 renders each prompt through the family's own diffusers
pipeline with the current weights (a LoRA adapter loaded the way a user loads the exported one),
while the other ranks wait in a barrier of their own, longer than a collective's deadline allows (a
14B clip of 81 frames takes minutes)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed
from torch import nn

from deepspeed_knap.generation.requests import text_lines
from deepspeed_knap.models.hooks import ValidationHooks, ValidationSettings
from deepspeed_knap.models.lora import base_state_dict, lora_config


def read_prompts(path: str | Path) -> list[str]:
    """Validation prompts: one per non-empty line of a text file.

    Raises:
        ValueError: a file without prompts.
    """
    # Bytes decoded as UTF-8: read as text, a lone "\r" would end a line too, and the locale decide the encoding.
    prompts = [line.strip() for line in text_lines(Path(path).read_bytes().decode("utf-8-sig")) if line.strip()]
    if not prompts:
        raise ValueError(f"{path} holds no prompts; write one prompt per line")
    return prompts


class Validator:
    """Renders validation prompts on rank 0 every so many steps.

    Args:
        hooks: the family's validation hooks.
        prompts: the pipeline's arguments of each render (:meth:`ValidationHooks.call` of a line).
        settings: sizes, steps and guidance as the user gave them.
        model_path: the checkpoint (its pipeline's parts are loaded once, on rank 0), or ``None``:
            tiny random parts.
        out: where the renders go.
        seed: render ``i`` draws from ``seed + i``.
        timeout_minutes: how long the other ranks wait for rank 0's renders.
        save_adapters: writes a LoRA model's adapters as the pipeline loads them (the family's
            :meth:`~deepspeed_knap.models.hooks.TrainingHooks.save_adapters`).
    """

    def __init__(self, hooks: ValidationHooks, prompts: list[dict[str, Any]], settings: ValidationSettings,
                 model_path: str | None, out: str | Path, seed: int, timeout_minutes: float,
                 save_adapters: Callable[[nn.Module, Mapping, Path], list[tuple[Path, dict]]]) -> None:  # fmt: skip
        self.hooks, self.prompts, self.model_path, self.out, self.seed = hooks, prompts, model_path, Path(out), seed
        self.save_adapters = save_adapters
        self.options = hooks.options(settings)
        # Collective: every rank creates the group (gloo, on the host: the wait is long, not a step's).
        self.wait_group = torch.distributed.new_group(backend="gloo", timeout=timedelta(minutes=timeout_minutes))
        self._components: dict[str, Any] | None = None  # VAE, text encoders, tokenizers, scheduler: rank 0, CPU

    @torch.no_grad()
    def render(self, model: nn.Module, state: dict, steps_done: int, device: torch.device,
               dtype: torch.dtype) -> list[tuple[Path, str]]:  # fmt: skip
        """Rank 0: one render per prompt with the weights ``state`` (the full state dict of ``model``),
        named by ``steps_done``. Returns each file written and its prompt."""
        import diffusers

        # Quiet diffusers' note that the text encoders get no LoRA weights (we train none).
        diffusers.utils.logging.set_verbosity_error()
        if self._components is None:
            self._components = self.hooks.components(self.model_path, model, self.seed, dtype)
            for part in ("transformer", "transformer_2"):
                self._components.pop(part, None)
        self.out.mkdir(parents=True, exist_ok=True)
        lora = lora_config(model)
        transformers = type(model).pipeline_transformers(model.config, base_state_dict(state) if lora else state)
        pipe = self.hooks.build_pipeline(model, self._components, transformers).to(device)
        pipe.set_progress_bar_config(disable=True)  # one line per render instead
        if lora:
            for adapter, load in self.save_adapters(model, state, self.out / f"step{steps_done:06d}_adapter"):
                pipe.load_lora_weights(adapter.parent, **load)
        files, options = [], {**self.options, **self.hooks.render_options(model)}
        for index, call in enumerate(self.prompts):
            generator = torch.Generator().manual_seed(self.seed + index)
            path = self.hooks.render(pipe, call, generator, options,
                                     self.out / f"step{steps_done:06d}_prompt{index:02d}")  # fmt: skip
            files.append((path, call["prompt"]))
        pipe.to("cpu")  # the text encoders and VAE wait on the CPU, off the training GPU
        return files

    def wait(self) -> None:
        """Every rank: wait for rank 0's renders (a barrier with the long deadline)."""
        torch.distributed.barrier(group=self.wait_group)
