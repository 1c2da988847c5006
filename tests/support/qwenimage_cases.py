"""Qwen-Image for tests: tiny configs, diffusers' ``QwenImageTransformer2DModel`` as the reference, random
samples with and without reference images.

The reference is diffusers' model run on each sample alone (a batch of one: diffusers' RoPE follows
the first sample's ``img_shapes`` for the whole batch), its output cut to the target's tokens as the
pipelines cut it.
"""

from __future__ import annotations

import torch

# 6 heads so that groups of 4 split them unevenly (2, 2, 1, 1); text routed raw (12 < 2 * 48).
QWEN_IMAGE = dict(patch_size=2, in_channels=8, out_channels=2, num_layers=2, attention_head_dim=8,
                  num_attention_heads=6, joint_attention_dim=12, axes_dims_rope=(2, 2, 4))  # fmt: skip
# Text wider than twice the model, so it is routed embedded; other RoPE axes, patch and channels.
QWEN_IMAGE_WIDE_TEXT = dict(patch_size=1, in_channels=6, out_channels=None, num_layers=1, attention_head_dim=8,
                            num_attention_heads=4, joint_attention_dim=100, axes_dims_rope=(4, 2, 2))  # fmt: skip
CONFIGS = {
    "qwen_image": QWEN_IMAGE,
    # Edit-2511: reference image tokens modulated by timestep 0.
    "qwen_image_zero_cond": {**QWEN_IMAGE, "zero_cond_t": True},
    "qwen_image_wide_text": QWEN_IMAGE_WIDE_TEXT,
}

# (img_shapes, text rows): odd grids, no, one and two references of other sizes than the target, a
# two-frame target, text of 1 to 7 rows.
SHAPES = [
    (((1, 3, 5),), 4),
    (((1, 2, 3), (1, 3, 3)), 6),
    (((1, 4, 4), (1, 1, 2), (1, 3, 1)), 1),
    (((1, 1, 1),), 3),
    (((2, 2, 3), (1, 2, 2)), 7),
]

# float32: a gradient's sums round by the host's vector width (measured below 9e-6 on one 2-core
# host, 1.01e-5 on another with AVX-512: the zero_cond case's text input gradient).
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5}
INPUTS = ("hidden_states", "encoder_hidden_states")


def reference_model(case: str, dtype: torch.dtype, seed: int = 0):
    """diffusers' model with weights large enough that every path matters."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(**CONFIGS[case]).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)
    return model


def random_samples(case: str, shapes, seed: int, dtype: torch.dtype, requires_grad: bool = False) -> list[dict]:
    """Samples as the pipelines give the transformer: the target's and the references' latent tokens
    concatenated, their grids, unpadded text, a timestep in ``[0, 1]``."""
    config = CONFIGS[case]
    g = torch.Generator().manual_seed(seed)
    samples = []
    for img_shapes, text in shapes:
        tokens = sum(f * h * w for f, h, w in img_shapes)
        sample = {
            "hidden_states": torch.randn(tokens, config["in_channels"], generator=g, dtype=dtype),
            "img_shapes": list(img_shapes),
            "encoder_hidden_states": torch.randn(text, config["joint_attention_dim"], generator=g, dtype=dtype),
            "timestep": torch.rand((), generator=g, dtype=dtype),
        }
        if requires_grad:
            for key in INPUTS:
                sample[key].requires_grad_()
        samples.append(sample)
    return samples


def diffusers_output(model, sample: dict) -> torch.Tensor:
    """diffusers' prediction of the target's tokens for one sample alone."""
    f, h, w = sample["img_shapes"][0]
    return model(
        hidden_states=sample["hidden_states"][None],
        encoder_hidden_states=sample["encoder_hidden_states"][None],
        timestep=sample["timestep"].reshape(1),
        img_shapes=[sample["img_shapes"]],
    ).sample[0, : f * h * w]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()
