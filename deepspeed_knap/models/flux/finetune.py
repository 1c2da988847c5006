"""FLUX fine-tuning around :class:`~deepspeed_knap.models.flux.PackedFluxTransformer`: LoRA through
``peft``, the adapter in the file format diffusers' ``load_lora_weights`` reads, and diffusers'
own ``FluxPipeline`` over trained weights (validation images), with tiny random pipeline
components for runs without downloaded weights.

LoRA targets are module names as diffusers names them (``"attn.to_q"``, ``"ff.net.2"``, ...): the
packed models have diffusers' module trees, so the same names match the same layers in both, and an
adapter trained here loads into diffusers' ``FluxTransformer2DModel`` or ``Flux2Transformer2DModel``
unchanged (each family names its default targets, ``lora_targets``). Validation images use
``FluxPipeline``: FLUX.1 only. No function here communicates: under ZeRO-3 the training script
gathers the weights and passes them in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

# A FLUX small enough for CPU ranks (``train_dit.py --tiny``): every kind of block and guidance, 4
# heads for bags of up to 4; :func:`tiny_pipeline_components` fit it.
TINY_FLUX = dict(in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=4,
                 joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(4, 6, 6))  # fmt: skip

ADAPTER_FILE = "pytorch_lora_weights.safetensors"  # the name diffusers' save/load_lora_weights use


def add_lora(model: nn.Module, rank: int, alpha: float | None = None, targets: Sequence[str] | None = None):
    """Freeze ``model`` and add LoRA adapters of ``rank`` (scale ``alpha / rank``; ``alpha``
    defaults to ``rank``) to the linear layers whose names end in one of ``targets`` (default: the
    family's ``lora_targets``). The adapters' ``A`` is random (seed torch first, identically on every
    rank), ``B`` zero, so the model's output is unchanged until training moves ``B``. Returns the
    ``peft.LoraConfig``.

    Raises:
        ValueError: a rank below 1, or a target that names no linear layer of the model.
    """
    from peft import LoraConfig, inject_adapter_in_model

    if rank < 1:
        raise ValueError(f"LoRA rank must be at least 1; got {rank}")
    defaults = model.lora_targets
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
    config = LoraConfig(r=rank, lora_alpha=alpha or rank, target_modules=target_modules, init_lora_weights=True)
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


def save_adapter(directory: str | Path, adapter: Mapping[str, Tensor], config, pipeline: str = "FluxPipeline") -> Path:
    """Write ``adapter`` (:func:`adapter_state_dict`) and its ``LoraConfig`` as diffusers'
    ``pipeline.save_lora_weights`` does (the model's ``diffusers_pipeline``: ``FluxPipeline``,
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


def diffusers_transformer(config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> nn.Module:
    """diffusers' ``FluxTransformer2DModel`` of ``config`` (the packed model's) holding ``state_dict``
    (the packed model's names, which are diffusers'), in the state dict's dtype."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(**config)
    model.load_state_dict(dict(state_dict), strict=True, assign=True)
    return model.eval()


def tiny_pipeline_components(config: Mapping[str, Any], seed: int = 0) -> dict[str, Any]:
    """Small random VAE, CLIP and T5 text encoders, tokenizers and scheduler that fit a packed FLUX
    ``config`` (``in_channels`` = 4 x the VAE's latent channels, ``pooled_projection_dim`` = CLIP's
    width, ``joint_attention_dim`` = T5's), built locally with no download: with a transformer they
    make a ``FluxPipeline`` for CPU tests and demos. Tokenizers split text into characters."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast, T5Config, T5EncoderModel

    if config["in_channels"] % 4:
        raise ValueError(f"in_channels={config['in_channels']} must be 4 x the VAE's latent channels (2x2 patches)")
    vocab = {
        "<pad>": 0,
        "<unk>": 1,
        "</s>": 2,
        **{c: i + 3 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz0123456789")},
    }

    def tokenizer(max_length: int) -> PreTrainedTokenizerFast:
        characters = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        characters.pre_tokenizer = pre_tokenizers.Split("", "isolated")
        return PreTrainedTokenizerFast(tokenizer_object=characters, pad_token="<pad>", unk_token="<unk>",
                                       eos_token="</s>", model_max_length=max_length)  # fmt: skip

    torch.manual_seed(seed)
    clip = CLIPTextConfig(vocab_size=len(vocab), hidden_size=config["pooled_projection_dim"], intermediate_size=32,
                          num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77,
                          bos_token_id=2, eos_token_id=2, pad_token_id=0)  # fmt: skip
    t5 = T5Config(vocab_size=len(vocab), d_model=config["joint_attention_dim"], d_kv=8, d_ff=32, num_layers=1,
                  num_heads=2)  # fmt: skip
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                        latent_channels=config["in_channels"] // 4, norm_num_groups=8, shift_factor=0.0609,
                        scaling_factor=1.5035, use_quant_conv=False, use_post_quant_conv=False)  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)  # fmt: skip
    return {
        "scheduler": scheduler,
        "vae": vae.eval(),
        "text_encoder": CLIPTextModel(clip).eval(),
        "tokenizer": tokenizer(77),
        "text_encoder_2": T5EncoderModel(t5).eval(),
        "tokenizer_2": tokenizer(512),
    }


def tiny_flux2_pipeline_components(config: Mapping[str, Any], seed: int = 0) -> dict[str, Any]:
    """Small random ``AutoencoderKLFlux2``, Mistral 3 text encoder, tokenizer and scheduler that fit a
    packed FLUX.2 ``config`` (``in_channels`` = 4 x the VAE's latent channels, ``joint_attention_dim``
    = 3 x the text encoder's width: ``Flux2Pipeline`` stacks its hidden states 10, 20 and 30, so it has
    30 layers), built locally with no download: with a transformer they make a ``Flux2Pipeline`` for
    CPU tests and demos. The VAE's batch-norm statistics are random (not 0 and 1), so that the
    pipeline's latent normalisation shows. The tokenizer splits text into characters, and its chat
    template keeps the user's text only (not ``Flux2Pipeline``'s long system message), so that a
    short ``max_sequence_length`` still holds the prompt; the text encoder takes 512 positions."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralVisionConfig,
        PreTrainedTokenizerFast,
    )

    if config["in_channels"] % 4 or config["joint_attention_dim"] % 3:
        raise ValueError(f"in_channels={config['in_channels']} must be 4 x the VAE's latent channels (2x2 patches) "
                         f"and joint_attention_dim={config['joint_attention_dim']} 3 x the text encoder's width "
                         "(three stacked hidden states)")  # fmt: skip
    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz0123456789 ")}}  # fmt: skip
    characters = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    characters.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=characters, pad_token="<pad>", unk_token="<unk>",
                                        eos_token="</s>", model_max_length=512)  # fmt: skip
    tokenizer.chat_template = ("{% for message in messages %}{% if message['role'] == 'user' %}"
                               "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}"
                               "{% endif %}{% endfor %}")  # fmt: skip
    torch.manual_seed(seed)
    text = MistralConfig(vocab_size=len(vocab), hidden_size=config["joint_attention_dim"] // 3, intermediate_size=32,
                         num_hidden_layers=30, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=512, pad_token_id=0)  # fmt: skip
    vision = PixtralVisionConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=1,
                                 image_size=32, patch_size=16)  # fmt: skip
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(text_config=text, vision_config=vision))
    vae = AutoencoderKLFlux2(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                             block_out_channels=(8, 16), layers_per_block=1, latent_channels=config["in_channels"] // 4,
                             norm_num_groups=8, use_quant_conv=False, use_post_quant_conv=False)  # fmt: skip
    with torch.no_grad():
        vae.bn.running_mean.normal_(std=0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    # Dynamic shifting as in FLUX.1's config; Flux2Pipeline gives mu itself (compute_empirical_mu).
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)  # fmt: skip
    return {"scheduler": scheduler, "vae": vae.eval(), "text_encoder": text_encoder.eval(), "tokenizer": tokenizer}


def read_prompts(path: str | Path) -> list[str]:
    """Validation prompts: one per non-empty line of a text file.

    Raises:
        ValueError: a file without prompts.
    """
    prompts = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{path} holds no prompts; write one prompt per line")
    return prompts
