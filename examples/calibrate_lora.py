"""Steps for ``deepspeed-knap calibrate --callable``: forward + backward of the packed FLUX on one
sequence, fine-tuning every weight or LoRA on a frozen base, to measure what a frozen base changes
in the cost model (no weight gradients for the base: its backward skips a third of the matmuls).

    PYTHONPATH=examples deepspeed-knap calibrate --callable calibrate_lora:lora_step --out lora.json
    PYTHONPATH=examples deepspeed-knap calibrate --callable calibrate_lora:full_step --out full.json

The model's dims come from ``CALIBRATE_FLUX="heads,head_dim,double_blocks,single_blocks"`` (default
``4,32,2,4`` on a CPU, FLUX.1's ``24,128,19,38`` on CUDA, in bfloat16) and the LoRA rank from
``CALIBRATE_LORA_RANK`` (16). Each sequence is an eighth text, the rest image tokens.
"""

import functools
import os

import torch

from deepspeed_knap.models.flux import PackedFluxTransformer, rope_axes
from deepspeed_knap.models.flux.data import grid_ids
from deepspeed_knap.models.lora import add_lora

CUDA = torch.cuda.is_available()
DEVICE, DTYPE = ("cuda", torch.bfloat16) if CUDA else ("cpu", torch.float32)


@functools.cache
def _model(lora: bool) -> PackedFluxTransformer:
    heads, head_dim, double, single = map(
        int, os.environ.get("CALIBRATE_FLUX", "24,128,19,38" if CUDA else "4,32,2,4").split(",")
    )
    torch.manual_seed(0)
    model = PackedFluxTransformer(in_channels=64, num_layers=double, num_single_layers=single,
                                  attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=4096,
                                  pooled_projection_dim=768, axes_dims_rope=rope_axes(head_dim))  # fmt: skip
    if lora:
        add_lora(model, int(os.environ.get("CALIBRATE_LORA_RANK", "16")))
    return model.to(DEVICE, DTYPE)


def _step(seq_len: int, lora: bool) -> None:
    model = _model(lora)
    text = seq_len // 8
    sample = {
        "hidden_states": torch.randn(seq_len - text, 64, dtype=DTYPE),
        "encoder_hidden_states": torch.randn(text, 4096, dtype=DTYPE),
        "pooled_projections": torch.randn(768, dtype=DTYPE),
        "timestep": torch.tensor(0.5, dtype=DTYPE),
        "img_ids": grid_ids(seq_len - text, 1),
        "txt_ids": torch.zeros(text, 3),
    }
    model.zero_grad(set_to_none=True)
    out = model(model.pack([sample]).to(DEVICE))
    out.float().square().mean().backward()
    if CUDA:
        torch.cuda.synchronize()


def lora_step(seq_len: int) -> None:
    """Forward + backward with LoRA adapters on a frozen base."""
    _step(seq_len, lora=True)


def full_step(seq_len: int) -> None:
    """Forward + backward with every weight trained."""
    _step(seq_len, lora=False)
