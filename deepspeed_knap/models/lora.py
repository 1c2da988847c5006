"""LoRA for every family through ``peft``, and the adapter in the file format diffusers'
``load_lora_weights`` reads.

LoRA targets are module names as diffusers names them (``"attn.to_q"``, ``"ff.net.2"``, ...): the
packed models have diffusers' module trees, so the same names match the same layers in both, and an
adapter trained here loads into the family's diffusers transformer unchanged (each family names its
default targets in its spec, ``lora_targets``, and the pipeline whose loader reads its adapter files,
``lora_loader``). No function here communicates: under ZeRO-3 the trainer gathers the weights and
passes them in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from torch import Tensor, nn

ADAPTER_FILE = "pytorch_lora_weights.safetensors"  # the name diffusers' save/load_lora_weights use


def add_lora(model: nn.Module, rank: int, alpha: float | None = None, targets: Sequence[str] | None = None):
    """Freeze ``model`` and add LoRA adapters of ``rank`` (scale ``alpha / rank``; ``alpha``
    defaults to ``rank``) to the linear layers whose names end in one of ``targets`` (default: the
    family's ``lora_targets``). The adapters' ``A`` is random (seed torch first, identically on every
    rank), ``B`` zero, so the model's output is unchanged until training moves ``B``. Returns the
    ``peft.LoraConfig``.

    Raises:
        ValueError: a rank below 1, an alpha that is not a positive number, or a target that names no
            linear layer of the model.
    """
    from peft import LoraConfig, inject_adapter_in_model

    if rank < 1:
        raise ValueError(f"LoRA rank must be at least 1; got {rank}")
    if alpha is not None and not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"LoRA alpha {alpha}: the scale is alpha / rank, so alpha must be a positive number (0 scales "
                         "the adapters to nothing); give None for alpha = rank")  # fmt: skip
    defaults = model.spec.lora_targets
    modules = dict(model.named_modules())
    target_modules = []
    for target in defaults if targets is None else targets:
        named = [name for name in modules if name == target or name.endswith(f".{target}")]
        linear = [name for name in named if isinstance(modules[name], nn.Linear)]
        if not linear:
            raise ValueError(
                f"LoRA target {target!r} names no linear layer of the model; use diffusers' module names of "
                f"{type(model).__name__} such as {', '.join(defaults[:4])}, ..."
            )
        # peft adapts every module a name ends in: where that is more than linear layers (FLUX.2's
        # attn.to_out is also a list in other blocks), name the layers one by one.
        target_modules += [target] if len(linear) == len(named) else linear
    config = LoraConfig(
        r=rank, lora_alpha=rank if alpha is None else alpha, target_modules=target_modules, init_lora_weights=True
    )
    model.requires_grad_(False)
    inject_adapter_in_model(config, model)
    return config


def lora_config(model: nn.Module):
    """The ``peft.LoraConfig`` :func:`add_lora` put on ``model``, or ``None`` for a model without LoRA."""
    return getattr(model, "peft_config", {}).get("default")


def adapter_state_dict(model: nn.Module, state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The LoRA weights of ``model``'s full ``state_dict`` (peft's names, e.g.
    ``transformer_blocks.0.attn.to_q.lora_A.weight``): what diffusers' FLUX LoRA files hold, less
    the ``transformer.`` prefix."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, state_dict=dict(state_dict))


def base_state_dict(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A LoRA model's ``state_dict`` without the adapters, under the base model's names."""
    return {name.replace(".base_layer.", "."): t for name, t in state_dict.items() if ".lora_" not in name}


def save_adapter(directory: str | Path, adapter: Mapping[str, Tensor], config, pipeline: str) -> Path:
    """Write ``adapter`` (:func:`adapter_state_dict`) and its ``LoraConfig`` as diffusers'
    ``pipeline.save_lora_weights`` does (the family's ``lora_loader``: ``FluxPipeline``,
    ``Flux2Pipeline``, ``WanPipeline``, or for FLUX.3, which has no pipeline class, the LoRA loader
    ``Flux3LoraLoaderMixin``): ``directory/pytorch_lora_weights.safetensors``, which that pipeline's
    ``load_lora_weights(directory)`` reads (alpha included, in the file's metadata), and the diffusers
    transformer's ``load_lora_adapter(directory, prefix="transformer")``."""
    import diffusers
    import diffusers.loaders

    loader = getattr(diffusers, pipeline, None) or getattr(diffusers.loaders, pipeline)
    loader.save_lora_weights(
        directory,
        transformer_lora_layers={name: t.detach().contiguous().cpu() for name, t in adapter.items()},
        transformer_lora_adapter_metadata=config.to_dict(),
    )
    return Path(directory) / ADAPTER_FILE
