"""FLUX.1 and FLUX.2 fine-tuning: the families' training hooks (:class:`FluxTraining`,
:class:`Flux2Training`), diffusers' own ``FluxPipeline`` over trained weights (validation images),
and tiny random pipeline components for runs without downloaded weights. LoRA is every family's
(:mod:`deepspeed_knap.models.lora`). No function here communicates: under ZeRO-3 the trainer
gathers the weights and passes them in.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from deepspeed_knap.models.flux.data import SyntheticLatents, latent_directory, rectified_flow
from deepspeed_knap.models.hooks import Objective, TrainingHooks, ValidationHooks
from deepspeed_knap.models.latents import LatentDirectory, SyntheticMixLatents
from deepspeed_knap.models.loading import pipeline_index


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
    return {**_tiny_flux2_latent_parts(config), "text_encoder": text_encoder.eval(), "tokenizer": tokenizer}


# Qwen3's chat template as Flux2KleinPipeline applies it (a user turn, then the assistant's turn opened
# with thinking off: an empty think block).
_QWEN3_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                        "{% endif %}{% endif %}")  # fmt: skip


def tiny_flux2_klein_pipeline_components(config: Mapping[str, Any], seed: int = 0) -> dict[str, Any]:
    """Small random ``AutoencoderKLFlux2``, Qwen3 text encoder, tokenizer and scheduler that fit a
    packed FLUX.2 ``config`` (``in_channels`` = 4 x the VAE's latent channels, ``joint_attention_dim``
    = 3 x the text encoder's width: ``Flux2KleinPipeline`` stacks its hidden states 9, 18 and 27, so
    it has 27 layers), built locally with no download: with a transformer (FLUX.2 [klein]'s has no
    guidance embedding) they make a ``Flux2KleinPipeline`` for CPU tests and demos. The VAE and the
    scheduler are :func:`tiny_flux2_pipeline_components`'; the tokenizer is tiny Qwen-Image's
    character one (:func:`~deepspeed_knap.models.qwenimage.finetune.tiny_qwen_tokenizer`) with Qwen3's
    chat template, so the prompt comes after 6 tokens of template and ahead of 32; the text encoder
    takes 512 positions."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from deepspeed_knap.models.qwenimage.finetune import tiny_qwen_tokenizer

    if config["in_channels"] % 4 or config["joint_attention_dim"] % 6:
        raise ValueError(f"in_channels={config['in_channels']} must be 4 x the VAE's latent channels (2x2 patches) "
                         f"and joint_attention_dim={config['joint_attention_dim']} 3 x the text encoder's width "
                         "(three stacked hidden states), which its 2 heads split evenly")  # fmt: skip
    tokenizer = tiny_qwen_tokenizer(_QWEN3_CHAT_TEMPLATE)
    vocab = tokenizer.get_vocab()
    torch.manual_seed(seed)
    width = config["joint_attention_dim"] // 3
    text = Qwen3Config(vocab_size=len(vocab), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=27,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=width // 2, max_position_embeddings=512,
                       pad_token_id=vocab["<|endoftext|>"], bos_token_id=vocab["<|im_start|>"],
                       eos_token_id=vocab["<|im_end|>"])  # fmt: skip
    text_encoder = Qwen3ForCausalLM(text)
    return {**_tiny_flux2_latent_parts(config), "text_encoder": text_encoder.eval(), "tokenizer": tokenizer}


def _tiny_flux2_latent_parts(config: Mapping[str, Any]) -> dict[str, Any]:
    """The tiny FLUX.2 pipelines' VAE (:func:`tiny_flux2_vae`, its statistics drawn from torch's global
    generator) and scheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    # Dynamic shifting as in FLUX.1's config; the FLUX.2 pipelines give mu themselves (compute_empirical_mu).
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)  # fmt: skip
    return {"scheduler": scheduler, "vae": tiny_flux2_vae(config["in_channels"] // 4)}


def tiny_flux2_vae(latent_channels: int) -> Any:
    """A tiny random ``AutoencoderKLFlux2`` (2x spatial) of ``latent_channels``, in eval mode, whose
    batch-norm statistics are random (not 0 and 1), so that the pipelines' latent normalisation
    shows: FLUX.2's and FLUX.3's tiny pipelines (draws from torch's global generator)."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                             block_out_channels=(8, 16), layers_per_block=1, latent_channels=latent_channels,
                             norm_num_groups=8, use_quant_conv=False, use_post_quant_conv=False)  # fmt: skip
    with torch.no_grad():
        vae.bn.running_mean.normal_(std=0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    return vae.eval()


class FluxValidation(ValidationHooks):
    """Validation images through diffusers' ``FluxPipeline`` (FLUX.1)."""

    def tiny_components(self, model: nn.Module, seed: int) -> dict[str, Any]:
        return tiny_pipeline_components(model.config, seed)


class Flux2Validation(ValidationHooks):
    """Validation images through the FLUX.2 pipeline ``--model-path``'s ``model_index.json`` names:
    diffusers' ``Flux2Pipeline``, or ``Flux2KleinPipeline`` (FLUX.2 [klein]: its Qwen3 text encoder,
    its ``guidance`` classifier-free); ``Flux2Pipeline`` for tiny runs."""

    default_guidance = 4.0
    pipelines = ("Flux2Pipeline", "Flux2KleinPipeline")

    @functools.cached_property
    def _index(self) -> dict:
        """The pipeline folder's ``model_index.json``, read once: by :meth:`options`, at start-up on
        every rank (a read at a render would be rank 0's alone)."""
        return pipeline_index(self.model_path)

    def pipeline(self, model: nn.Module) -> tuple[str, dict[str, Any]]:
        if self.model_path is None:
            return self.spec.pipeline, {}
        index = self._index
        name = index.get("_class_name")
        # A step-distilled klein (is_distilled) runs without guidance; the parts alone do not say so.
        return name, {"is_distilled": bool(index.get("is_distilled"))} if name == "Flux2KleinPipeline" else {}

    def options(self, settings: Any) -> dict[str, Any]:
        options = super().options(settings)
        if not settings.steps and not settings.tiny:
            options["num_inference_steps"] = 50  # Flux2Pipeline's and Flux2KleinPipeline's default
        if settings.guidance is None and self.model_path is not None and self._index.get("is_distilled"):
            options["guidance_scale"] = 1.0  # a step-distilled klein's own: no guidance
        return options

    def model_path_problem(self, model_path: str) -> str | None:
        if problem := super().model_path_problem(model_path):
            return problem
        try:
            name = pipeline_index(model_path).get("_class_name")
        except ValueError as error:
            return str(error)
        if name not in self.pipelines:
            return (f"--validation-every renders FLUX.2 through {' or '.join(self.pipelines)}; the model_index.json "
                    f"of {model_path} names {name!r}")  # fmt: skip
        return None

    def tiny_components(self, model: nn.Module, seed: int) -> dict[str, Any]:
        return tiny_flux2_pipeline_components(model.config, seed)


class FluxTraining(TrainingHooks):
    """FLUX.1 training: prepared latents (``examples/prepare_flux_latents.py``) or a synthetic mix,
    FLUX's rectified flow (:func:`~deepspeed_knap.models.flux.data.rectified_flow`), validation
    images through ``FluxPipeline``."""

    validation = FluxValidation

    def synthetic_data(self, mix: str, config: Mapping, token_scale: float, seed: int) -> SyntheticMixLatents:
        return SyntheticLatents(mix, config, token_scale, seed)

    def latent_directory(self, path: str | Path, samples_per_rank: int, repeat: bool) -> LatentDirectory:
        return latent_directory(path, samples_per_rank, repeat)

    def objective(self, latents: Sequence[Mapping[str, Tensor]], generator: torch.Generator, config: Mapping,
                  guidance: float | None) -> Objective:  # fmt: skip
        return Objective(*rectified_flow(latents, generator, guidance))


class Flux2Training(FluxTraining):
    """FLUX.2 training: FLUX.1's data and objective, validation images through ``Flux2Pipeline``."""

    validation = Flux2Validation
