"""Both FLUX families side by side for tests: tiny configs, diffusers' own model as the reference,
random samples of mixed sizes, and the error measures the conformance tests share.

The reference is diffusers' code run on each sample alone (a batch of one), which is how diffusers
must run samples of different sizes.
"""

from __future__ import annotations

import torch

# Tiny FLUX.1: 6 heads so that bags of 4 split them unevenly (2, 2, 1, 1).
FLUX_CONFIG = dict(patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=8,
                   num_attention_heads=6, joint_attention_dim=12, pooled_projection_dim=6, guidance_embeds=True,
                   axes_dims_rope=(2, 2, 4))  # fmt: skip

# Tiny FLUX.2: 6 heads as well; MLP ratio, RoPE base and timestep channels of its own, and text wider
# than twice the model (as FLUX.2 [dev]'s 15360 > 2 * 6144), so that text is routed embedded.
FLUX2_CONFIG = dict(patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=8,
                    num_attention_heads=6, joint_attention_dim=100, timestep_guidance_channels=16, mlp_ratio=2.5,
                    axes_dims_rope=(2, 2, 2, 2), rope_theta=2000, eps=1e-6, guidance_embeds=True)  # fmt: skip

CONFIGS = {"flux": FLUX_CONFIG, "flux2": FLUX2_CONFIG}

# (frames, height, width, text tokens): images of several sizes, a multi-frame sample (video for
# FLUX.1, an image with reference images for FLUX.2), a sample without text.
SHAPES = [(1, 3, 4, 5), (1, 2, 2, 0), (3, 2, 3, 7), (1, 5, 5, 3), (1, 1, 1, 2)]

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def diffusers_class(family: str):
    import diffusers

    return {"flux": diffusers.FluxTransformer2DModel, "flux2": diffusers.Flux2Transformer2DModel}[family]


def packed_class(family: str):
    from deepspeed_knap.models.auto import model_class

    return model_class(family)


def reference_model(family: str, dtype: torch.dtype, guidance: bool = True, seed: int = 0):
    """diffusers' model with weights large enough that every path matters (its init zeroes none here)."""
    torch.manual_seed(seed)
    model = diffusers_class(family)(**{**CONFIGS[family], "guidance_embeds": guidance}).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)
    return model


def sample_ids(family: str, frames: int, height: int, width: int, text: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(img_ids, txt_ids)`` as each family's pipeline makes them: FLUX.1 ``(t, h, w)`` with text at
    0; FLUX.2 ``(t, h, w, 0)`` with reference images at ``t = 10, 20, ...`` and text at ``(0, 0, 0, l)``."""
    if family == "flux":
        from deepspeed_knap.models.flux import latent_ids

        return latent_ids(frames, height, width), torch.zeros(text, 3)
    from deepspeed_knap.models.flux.base import text_ids
    from deepspeed_knap.models.flux.flux2 import image_ids

    return torch.cat([image_ids(height, width, 10 * frame) for frame in range(frames)]), text_ids(text)


def random_samples(family: str, shapes, seed: int, dtype: torch.dtype, guidance: bool = True) -> list[dict]:
    config = CONFIGS[family]
    g = torch.Generator().manual_seed(seed)
    samples = []
    for frames, height, width, text in shapes:
        img_ids, txt_ids = sample_ids(family, frames, height, width, text)
        sample = {
            "hidden_states": torch.randn(len(img_ids), config["in_channels"], generator=g, dtype=dtype),
            "encoder_hidden_states": torch.randn(text, config["joint_attention_dim"], generator=g, dtype=dtype),
        }
        if "pooled_projection_dim" in config:
            sample["pooled_projections"] = torch.randn(config["pooled_projection_dim"], generator=g, dtype=dtype)
        sample.update(timestep=torch.rand((), generator=g, dtype=dtype), img_ids=img_ids, txt_ids=txt_ids)
        if guidance:
            sample["guidance"] = 1 + 3 * torch.rand((), generator=g, dtype=dtype)
        samples.append(sample)
    return samples


def diffusers_output(model, sample: dict) -> torch.Tensor:
    """diffusers' prediction for one sample alone."""
    guidance = sample.get("guidance")
    pooled = {"pooled_projections": sample["pooled_projections"][None]} if "pooled_projections" in sample else {}
    return model(
        hidden_states=sample["hidden_states"][None],
        encoder_hidden_states=sample["encoder_hidden_states"][None],
        timestep=sample["timestep"].reshape(1),
        guidance=None if guidance is None else guidance.reshape(1),
        img_ids=sample["img_ids"],
        txt_ids=sample["txt_ids"],
        **pooled,
    ).sample[0]


def output_weights(samples, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s["hidden_states"].shape, generator=g, dtype=torch.float64) for s in samples]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def norm_relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in the Frobenius norm: for fp32 gradients, which sum many rounded terms in an
    order that packing changes. Measured over seeds: the whole gradient agrees with diffusers' to
    ~3e-6, single tensors to up to 1e-5 (RMSNorm weights, sums over every token with cancellation),
    and their single worst element to up to ~1.5e-5 of the tensor's largest."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}
