"""Qwen-Image fine-tuning: the family's training hooks (:class:`QwenImageTraining`), validation images
through diffusers' own ``QwenImagePipeline`` (an edit model's: its edit pipeline) over the trained
weights, and tiny random pipeline parts for runs without downloaded weights. LoRA is every
family's (:mod:`deepspeed_knap.models.lora`); the adapter is written in the format
``QwenImagePipeline.load_lora_weights`` reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from deepspeed_knap.models.hooks import Objective, TrainingHooks, ValidationHooks, ValidationSettings
from deepspeed_knap.models.latents import LatentDirectory, SyntheticMixLatents
from deepspeed_knap.models.qwenimage.data import SyntheticQwenImageLatents, flow_matching, latent_directory
from deepspeed_knap.models.spec import ModelSpec

# Qwen-Image's scheduler_config.json (the released checkpoints): dynamic, exponential shifting from
# the image's tokens, ending at sigma 0.02. The tiny pipeline uses it, so its schedule is the real one.
QWEN_IMAGE_SCHEDULER = dict(base_image_seq_len=256, max_image_seq_len=8192, base_shift=0.5, max_shift=0.9,
                            use_dynamic_shifting=True, time_shift_type="exponential", shift_terminal=0.02,
                            shift=1.0, num_train_timesteps=1000)  # fmt: skip
# The pipelines of Qwen-Image's edit models (validation renders edits through them).
EDIT_PIPELINES = ("QwenImageEditPlusPipeline", "QwenImageEditPipeline")
# Qwen2.5-VL's chat markers: each must stay one token for the pipelines' templates.
_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                   "<|image_pad|>", "<|video_pad|>")  # fmt: skip


def tiny_qwen_image_components(config: Mapping[str, Any], seed: int = 0) -> dict[str, Any]:
    """Small random parts of a ``QwenImagePipeline`` that fit a packed Qwen-Image ``config``, built
    locally with no download: a 2-layer Qwen2.5-VL text encoder of width ``joint_attention_dim``, a
    character tokenizer that keeps Qwen's chat markers whole (so the pipeline's template and its
    dropped 34-token prefix work as written), an ``AutoencoderKLQwenImage`` of ``in_channels / 4``
    latent channels (4x spatial: 16 px per token with the 2x2 patches) whose ``latents_mean`` and
    ``latents_std`` are not 0 and 1 (so the normalisation shows), and Qwen-Image's scheduler config.
    A function of ``seed``."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    width, channels = config["joint_attention_dim"], config["in_channels"] // 4
    if config["in_channels"] % 4 or width % 16:
        raise ValueError(f"in_channels={config['in_channels']} must be 4 x the VAE's latent channels (2x2 patches) "
                         f"and joint_attention_dim={width} a multiple of 16 (the tiny text encoder's 2 heads)")  # fmt: skip
    tokenizer = tiny_qwen_tokenizer()
    vocab = tokenizer.get_vocab()
    torch.manual_seed(seed)
    head = width // 2
    text = dict(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, vocab_size=len(vocab),
                rope_scaling={"mrope_section": [head // 8, head // 8, head // 2 - head // 4], "rope_type": "default",
                              "type": "default"})  # fmt: skip
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=width)
    markers = dict(bos_token_id=vocab["<|im_start|>"], eos_token_id=vocab["<|im_end|>"],
                   pad_token_id=vocab["<|endoftext|>"])  # fmt: skip
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={**text, **markers}, vision_config=vision, vocab_size=len(vocab), **markers,
        image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"], vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"]))  # fmt: skip
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=channels, dim_mult=[1, 2, 2], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.1] * channels,
                                 latents_std=[2.0] * channels)  # fmt: skip
    return {"scheduler": FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER), "vae": vae.eval(),
            "text_encoder": text_encoder.eval(), "tokenizer": tokenizer}  # fmt: skip


def tiny_qwen_tokenizer(chat_template: str | None = None) -> Any:
    """A character tokenizer (printable ASCII and newline) that keeps Qwen's chat markers whole, so
    that a pipeline's template around a prompt tokenises as written; ``<|endoftext|>`` pads. Tiny
    Qwen-Image's, and with a ``chat_template`` (Jinja) tiny FLUX.2 [klein]'s Qwen3 one. Built locally
    with no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*_SPECIAL_TOKENS, "<unk>", *map(chr, range(32, 127)), "\n"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|endoftext|>", unk_token="<unk>",
                                        additional_special_tokens=list(_SPECIAL_TOKENS[1:]))  # fmt: skip
    tokenizer.chat_template = chat_template
    return tokenizer


def tiny_qwen2vl_processor(tokenizer: Any) -> Any:
    """The ``Qwen2VLProcessor`` of the edit pipelines for :func:`tiny_qwen_image_components`'
    ``tokenizer``: Qwen2-VL's image processor (its PIL backend, the same with or without torchvision;
    14 px patches merged 2x2, as the tiny text encoder's vision tower takes them) bounded to 56 x 56
    to 112 x 112 px, so an image is 4 to 16 vision tokens in the text. No video processor:
    transformers' check of one looks its class up, which needs torchvision, so the check is skipped
    for it alone while the processor is built."""
    from transformers import Qwen2VLImageProcessorPil, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class

    def without_video(self: Any, name: str, argument: Any) -> Any:
        return None if argument is None else check(self, name, argument)

    ProcessorMixin.check_argument_for_proper_class = without_video
    try:
        return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112),
                                tokenizer=tokenizer)  # fmt: skip
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


class QwenImageValidation(ValidationHooks):
    """Validation images through diffusers' ``QwenImagePipeline`` (text to image), with its true
    classifier-free guidance: a negative prompt of one space and ``true_cfg_scale`` (4.0, the
    pipeline's default; ``--validation-guidance`` sets it), as Qwen-Image's model card renders.

    An edit checkpoint (``--model-path`` a ``QwenImageEditPlusPipeline`` folder, Qwen-Image-Edit-2509
    and -2511, or a ``QwenImageEditPipeline`` one, Qwen-Image-Edit) renders edits through its own
    pipeline, as it trains: a line is ``IMAGE<TAB>PROMPT`` (Edit-Plus: ``IMAGE<TAB>IMAGE<TAB>...
    <TAB>PROMPT``, its references in order), the paths relative to the prompts file; without
    ``--validation-resolution`` the edit's size is the pipeline's, from its last reference."""

    default_guidance = 4.0

    def __init__(self, spec: ModelSpec, model_path: str | None = None) -> None:
        super().__init__(spec, model_path)
        self._pipeline_class: str | None = None  # the folder's, read once at the start-up check

    def model_path_problem(self, model_path: str) -> str | None:
        problem = super().model_path_problem(model_path)
        if problem is None:
            from deepspeed_knap.models.loading import pipeline_index

            try:
                self._pipeline_class = pipeline_index(model_path).get("_class_name")
            except ValueError as error:
                return str(error)
        return problem

    @property
    def edits(self) -> bool:
        """Whether the checkpoint is an edit model's (:data:`EDIT_PIPELINES`)."""
        return self._pipeline_class in EDIT_PIPELINES

    def pipeline(self, model: nn.Module) -> tuple[str, dict[str, Any]]:
        return (self._pipeline_class if self.edits else self.spec.pipeline), {}

    def options(self, settings: ValidationSettings) -> dict[str, Any]:
        options = super().options(settings)
        options["true_cfg_scale"] = options.pop("guidance_scale")  # the model is not guidance-distilled
        if not settings.steps and not settings.tiny:
            options["num_inference_steps"] = 50  # the pipelines' default
        if self.edits and not settings.height:  # the edit pipelines' size: the last reference's aspect
            options.update(height=None, width=settings.width)
        return {**options, "negative_prompt": " "}

    def call(self, line: str, directory: Path, model: nn.Module) -> dict[str, Any]:
        """Text to image: the line is the prompt. An edit model: its references, then the prompt,
        separated by tabs (class docstring)."""
        if not self.edits:
            return {"prompt": line}
        *names, prompt = line.split("\t")
        one = self._pipeline_class == "QwenImageEditPipeline"
        if not names or not prompt.strip() or (one and len(names) > 1):
            form = "IMAGE<TAB>PROMPT" if one else "IMAGE<TAB>PROMPT (or IMAGE<TAB>IMAGE<TAB>...<TAB>PROMPT)"
            raise ValueError(f"{line[:60]!r}: a {self._pipeline_class} checkpoint edits reference images: write {form}, "
                             "the paths relative to the prompts file")  # fmt: skip
        from deepspeed_knap.generation.requests import read_image

        images = [read_image(directory / name) for name in names]
        return {"image": images[0] if one else images, "prompt": prompt}

    def tiny_components(self, model: nn.Module, seed: int) -> dict[str, Any]:
        return tiny_qwen_image_components(model.config, seed)


class QwenImageTraining(TrainingHooks):
    """Qwen-Image training (text to image and editing): files of precomputed latents, references and
    text embeddings (:mod:`deepspeed_knap.models.qwenimage.data`'s format) or a synthetic mix
    (``qwen_edit``); the flow-matching velocity of the target's tokens; a sample the model cannot
    pack is raised on every rank by the step's first collective; validation images through
    ``QwenImagePipeline``, or an edit model's own edit pipeline (:class:`QwenImageValidation`)."""

    validation = QwenImageValidation

    def synthetic_data(self, mix: str, config: Mapping, token_scale: float, seed: int) -> SyntheticMixLatents:
        return SyntheticQwenImageLatents(mix, config, token_scale, seed)

    def latent_directory(self, path: str | Path, samples_per_rank: int, repeat: bool) -> LatentDirectory:
        return latent_directory(path, samples_per_rank, repeat)

    def objective(self, latents: Sequence[Mapping[str, Tensor]], generator: torch.Generator, config: Mapping,
                  guidance: float | None) -> Objective:  # fmt: skip
        return Objective(*flow_matching(latents, generator))
