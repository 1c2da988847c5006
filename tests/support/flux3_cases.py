"""FLUX.3 for tests: tiny configs, diffusers' ``Flux3Transformer2DModel`` as the reference, random
samples with and without reference images.

The reference is diffusers' model run on each sample alone (a batch of one), which is how diffusers
must run samples of different sizes and reference counts.
"""

from __future__ import annotations

import torch

# 6 heads so that groups of 4 split them unevenly (2, 2, 1, 1); text routed raw (12 < 2 * 48).
FLUX3_CONFIG = dict(in_channels=8, cond_in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=8,
                    num_attention_heads=6, joint_attention_dim=12, timestep_channels=16, mlp_ratio=3.0,
                    axes_dims_rope=(2, 2, 2, 2))  # fmt: skip
# Another shape: references narrower than the image latents, text wider than twice the model (routed
# embedded, as FLUX.3's 20480 > 2 * 3072), its own MLP ratio, RoPE base and eps.
FLUX3_NARROW_REFS = dict(in_channels=8, cond_in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=8,
                         num_attention_heads=4, joint_attention_dim=100, timestep_channels=8, mlp_ratio=2.5,
                         axes_dims_rope=(2, 2, 2, 2), rope_theta=2000, eps=1e-5)  # fmt: skip
CONFIGS = {
    "flux3": FLUX3_CONFIG,
    "flux3_narrow_refs": FLUX3_NARROW_REFS,
    "flux3_flow_map": {**FLUX3_CONFIG, "flow_map": True},
}

# (height, width, text tokens, reference images as (height, width)): mixed sizes, with and without
# references, one with two references of different sizes.
SHAPES = [(3, 4, 5, ()), (2, 2, 1, ((2, 3),)), (2, 3, 7, ((3, 3), (1, 2))), (1, 1, 2, ()), (4, 4, 3, ((2, 2),))]


def reference_model(case: str, dtype: torch.dtype, seed: int = 0):
    """diffusers' model with weights large enough that every path matters."""
    import diffusers

    torch.manual_seed(seed)
    model = diffusers.Flux3Transformer2DModel(**CONFIGS[case]).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)
    return model


def random_samples(case: str, shapes, seed: int, dtype: torch.dtype, requires_grad: bool = False) -> list[dict]:
    """Samples with diffusers' modular pipeline's positions (half positions on the grid): image at
    ``(0, h / 2, w / 2, 0)``, reference ``i`` at ``(0, h / 2, w / 2, -1 - i)``, text at ``(0, 0, 0, l)``."""
    from deepspeed_knap.models.flux.base import text_ids
    from deepspeed_knap.models.flux3.data import flux3_image_ids

    config = CONFIGS[case]
    g = torch.Generator().manual_seed(seed)
    samples = []
    for height, width, text, refs in shapes:
        sample = {
            "hidden_states": torch.randn(height * width, config["in_channels"], generator=g, dtype=dtype),
            "encoder_hidden_states": torch.randn(text, config["joint_attention_dim"], generator=g, dtype=dtype),
            "timestep": torch.rand((), generator=g, dtype=dtype),
            "img_ids": flux3_image_ids(height, width),
            "txt_ids": text_ids(text),
        }
        if refs:
            tokens = sum(h * w for h, w in refs)
            sample["image_cond_hidden_states"] = torch.randn(tokens, config["cond_in_channels"], generator=g,
                                                             dtype=dtype)  # fmt: skip
            sample["image_cond_ids"] = torch.cat([flux3_image_ids(h, w, i) for i, (h, w) in enumerate(refs)])
        if config.get("flow_map"):
            sample["target_timestep"] = sample["timestep"] * torch.rand((), generator=g, dtype=dtype)
        if requires_grad:
            for key in ("hidden_states", "encoder_hidden_states", "image_cond_hidden_states"):
                if key in sample:
                    sample[key].requires_grad_()
        samples.append(sample)
    return samples


def diffusers_output(model, sample: dict) -> torch.Tensor:
    """diffusers' prediction for one sample alone."""
    refs = sample.get("image_cond_hidden_states")
    target = sample.get("target_timestep")
    return model(
        hidden_states=sample["hidden_states"][None],
        encoder_hidden_states=sample["encoder_hidden_states"][None],
        timestep=sample["timestep"].reshape(1),
        img_ids=sample["img_ids"],
        txt_ids=sample["txt_ids"],
        image_cond_hidden_states=None if refs is None else refs[None],
        image_cond_ids=sample.get("image_cond_ids"),
        target_timestep=None if target is None else target.reshape(1),
    ).sample[0]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def save_flux3_folder(path, generator) -> None:
    """A FLUX.3 folder as a modular pipeline's repository holds it, downloaded, of a
    :class:`~deepspeed_knap.models.flux3.generate.Flux3Generator`'s parts: the transformer (diffusers'
    ``Flux3Transformer2DModel`` of the packed weights), text encoder, tokenizer and VAE in
    subfolders, and ``modular_model_index.json`` naming each as the repository's (the modular
    pipeline loads those found in the folder from it; the scheduler and guider are the blocks'
    defaults). Loading its tokenizer as the text encoder step's processor needs torchvision, or
    :func:`tokenizer_as_processor`."""
    import json

    pipe, model = generator.pipeline, generator.model
    type(model).diffusers_model({key: model.config[key] for key in model.config_keys()},
                                model.state_dict()).save_pretrained(path / "transformer")  # fmt: skip
    pipe.text_encoder.save_pretrained(path / "text_encoder")
    pipe.tokenizer.tokenizer.save_pretrained(path / "tokenizer")
    pipe.vae.save_pretrained(path / "vae")
    parts = {"transformer": ("diffusers", "Flux3Transformer2DModel"),
             "text_encoder": ("transformers", "Qwen3VLForConditionalGeneration"),
             "tokenizer": ("transformers", "AutoProcessor"), "vae": ("diffusers", "AutoencoderKLFlux2")}  # fmt: skip
    index = {"_class_name": "Flux3ModularPipeline", "_blocks_class_name": "Flux3AutoBlocks"}
    for name, (library, class_name) in parts.items():
        index[name] = [library, class_name, {"pretrained_model_name_or_path": "example/flux3", "subfolder": name,
                                             "type_hint": [library, class_name], "variant": None, "revision": None}]  # fmt: skip
    (path / "modular_model_index.json").write_text(json.dumps(index))


def _tokenizer_in_a_processor(cls, path, subfolder=None, **kwargs):
    import transformers

    from deepspeed_knap.models.flux3.generate import TokenizerProcessor

    return TokenizerProcessor(transformers.AutoTokenizer.from_pretrained(path, subfolder=subfolder))


def tokenizer_as_processor(monkeypatch=None) -> None:
    """Have ``AutoProcessor.from_pretrained`` give a folder's tokenizer inside a
    :class:`~deepspeed_knap.models.flux3.generate.TokenizerProcessor`, what the text encoder step
    uses of a Qwen3-VL processor: without torchvision transformers builds no Qwen3-VL processor (it
    gives the tokenizer alone, which FLUX.3's loading refuses). Through ``monkeypatch`` (undone after
    the test), or for good in a rank's process (``train(..., setup=tokenizer_as_processor)``)."""
    import transformers

    patched = classmethod(_tokenizer_in_a_processor)
    if monkeypatch is None:
        transformers.AutoProcessor.from_pretrained = patched
    else:
        monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", patched)
