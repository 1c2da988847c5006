"""Wan 2.x for tests: tiny configs, diffusers' ``WanTransformer3DModel`` as the reference, random
samples of mixed frame counts and sizes, and the error measures the conformance tests share.

The reference is diffusers' model run on each sample alone (a batch of one), which is how diffusers
must run samples of different sizes.
"""

from __future__ import annotations

import torch

# Wan 2.1 T2V (scalar timesteps): 12 heads as the 1.3B has (groups of 4 run 3 each; of 8, 2 or 1),
# text routed raw (24 < 2 * 72).
WAN21 = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=6, in_channels=4, out_channels=4,
             text_dim=24, freq_dim=16, ffn_dim=40, num_layers=2, rope_max_seq_len=32)  # fmt: skip

# Wan 2.2 TI2V (a timestep per token): 6 heads, so groups of 4 split them unevenly (2, 2, 1, 1); text
# wider than twice the model, as Wan 2.1 1.3B's (4096 > 2 * 1536), so it is routed embedded.
WAN22_TI2V = dict(patch_size=(1, 2, 2), num_attention_heads=6, attention_head_dim=8, in_channels=6, out_channels=6,
                  text_dim=100, freq_dim=16, ffn_dim=56, num_layers=2, rope_max_seq_len=32)  # fmt: skip

# Wan 2.1 I2V: image context through add_k_proj / add_v_proj; without cross_attn_norm (no Wan
# checkpoint has that, but diffusers supports it and it is a separate path).
WAN21_I2V = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4,
                 text_dim=16, freq_dim=16, ffn_dim=40, num_layers=2, rope_max_seq_len=32, image_dim=12,
                 added_kv_proj_dim=32, cross_attn_norm=False)  # fmt: skip

CONFIGS = {"wan21": WAN21, "wan22_ti2v": WAN22_TI2V, "wan21_i2v": WAN21_I2V}

# (latent frames, height, width, text rows): an image (one frame), videos of 2-5 frames, odd grids.
SHAPES = [(1, 4, 6, 5), (3, 4, 4, 7), (2, 6, 2, 3), (5, 2, 4, 4), (1, 2, 2, 1)]

# diffusers' I2V attention splits its context at 512 text rows: the pipeline's padded text.
I2V_TEXT, I2V_IMAGE = 512, 9

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}

# Gradients diffusers rounds to fp32 even in an fp64 model after a sum over tokens that packing and
# balancing partition differently: FP32LayerNorm's weights (weight.float(), summed in fp32), the
# timestep embedders (temb.float() in every block: its gradient summed over a sample's tokens, or per
# token for TI2V, then rounded) and the I2V image embedder (its output rows' gradient is a sum over
# the sample's query tokens, rounded by its FP32LayerNorms). Here they are summed and passed on in
# fp64 (models/wan/layers.py): they differ from diffusers' by its fp32 rounding, and balanced from
# unbalanced by fp64 rounding only. The image context's input gradient is one of them.
FP32_ROUNDED = ("norm2.weight", "norm2.bias", "condition_embedder.image_embedder",
                "condition_embedder.time_embedder", "condition_embedder.time_proj")  # fmt: skip


def reference_model(case: str, dtype: torch.dtype, seed: int = 0):
    """diffusers' model with weights large enough that every path matters (its init zeroes none here)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(**CONFIGS[case]).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)
    return model


def random_samples(
    case: str, shapes, seed: int, dtype: torch.dtype, requires_grad: bool = False, i2v_text: int = I2V_TEXT
) -> list[dict]:
    """Samples as diffusers' pipelines give them. Wan 2.2 TI2V: a timestep per latent token, the
    pipeline's ``expand_timesteps`` (0 on the first, conditioning, frame of a video; ``t`` elsewhere),
    and one sample with a random timestep on every token. I2V samples have ``i2v_text`` text rows."""
    config = CONFIGS[case]
    g = torch.Generator().manual_seed(seed)
    pt, ph, pw = config["patch_size"]
    samples = []
    for index, (frames, height, width, text) in enumerate(shapes):
        if "image_dim" in config:
            text = i2v_text
        sample = {
            "hidden_states": torch.randn(config["in_channels"], frames, height, width, generator=g, dtype=dtype),
            "encoder_hidden_states": torch.randn(text, config["text_dim"], generator=g, dtype=dtype),
        }
        t = 1000 * torch.rand((), generator=g, dtype=torch.float32)
        if case == "wan22_ti2v":
            grid = (frames // pt, height // ph, width // pw)
            if index == 2:
                sample["timestep"] = 1000 * torch.rand(grid, generator=g, dtype=torch.float32).flatten()
            else:
                mask = torch.ones(grid)
                mask[0] = 0 if frames > 1 else 1  # an image is generated, not conditioned on
                sample["timestep"] = (mask * t).flatten()
        else:
            sample["timestep"] = t
        if "image_dim" in config:
            sample["encoder_hidden_states_image"] = torch.randn(I2V_IMAGE, config["image_dim"], generator=g,
                                                                dtype=dtype)  # fmt: skip
        for key in ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_image"):
            if key in sample:
                sample[key].requires_grad_(requires_grad)
        samples.append(sample)
    return samples


def diffusers_output(model, sample: dict) -> torch.Tensor:
    """diffusers' prediction ``[C, F, H, W]`` for one sample alone."""
    image = sample.get("encoder_hidden_states_image")
    return model(
        hidden_states=sample["hidden_states"][None],
        timestep=sample["timestep"][None] if sample["timestep"].dim() else sample["timestep"].reshape(1),
        encoder_hidden_states=sample["encoder_hidden_states"][None],
        encoder_hidden_states_image=None if image is None else image[None],
    ).sample[0]


def output_weights(outputs, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in outputs]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def norm_relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


# Tiny pipelines of the Wan kinds people train and generate with, saved as diffusers folders.
WAN22_I2V = dict(in_channels=12, out_channels=4)  # noise (4) | first-frame mask (4) | first-frame latents (4)
WAN22_KINDS = {
    # Boundaries of 0.5, not A14B's 0.875 and 0.9: in 3 training steps both experts get samples
    # (logit-normal noise levels are above 0.875 2.6% of the time), and a few denoising steps run both.
    "a14b": dict(pipeline="WanPipeline", experts=2, config={}, boundary=0.5),
    "i2v21": dict(pipeline="WanImageToVideoPipeline", experts=1,
                  config={**WAN22_I2V, "image_dim": 8, "added_kv_proj_dim": 72}, clip=8),
    "i2v_a14b": dict(pipeline="WanImageToVideoPipeline", experts=2, config=WAN22_I2V, boundary=0.5),
    "ti2v": dict(pipeline="WanPipeline", experts=1, config={}, expand_timesteps=True, first_frame_share=1.0),
}  # fmt: skip


def save_wan22_pipeline(directory, kind: dict) -> None:
    """A tiny pipeline of ``kind`` (a :data:`WAN22_KINDS` value) saved in ``directory``: the
    pipeline class, one or two random ``WanTransformer3DModel`` (``TINY_WAN`` with the kind's
    changes), ``boundary_ratio`` and ``expand_timesteps`` as the kind says."""
    from diffusers import WanTransformer3DModel

    from deepspeed_knap.models.wan.data import tiny_wan_pipeline
    from deepspeed_knap.models.wan.spec import TINY_WAN

    image_to_video = kind["pipeline"] == "WanImageToVideoPipeline"
    pipe = tiny_wan_pipeline(image_to_video=image_to_video, image_dim=kind.get("clip"))
    parts = pipe.components
    for index, name in enumerate(("transformer", "transformer_2")[: kind["experts"]]):
        torch.manual_seed(index)
        parts[name] = WanTransformer3DModel(**{**TINY_WAN, **kind["config"]})
    config = {"boundary_ratio": kind["boundary"]} if "boundary" in kind else {}
    if kind.get("expand_timesteps"):
        config["expand_timesteps"] = True
    type(pipe)(**parts, **config).save_pretrained(directory)
