"""Timing a Wan block on this device, for calibration (``deepspeed-knap calibrate --wan PRESET``): the
Wan spec's ``block_timer``."""

from __future__ import annotations

import torch

from deepspeed_knap.cost.calibrate import Step
from deepspeed_knap.models.wan.wan import PackedWanTransformer
from deepspeed_knap.runtime.timing import backward_seconds


def wan_blocks_step(
    heads: int = 12,
    head_dim: int = 128,
    ffn_dim: int = 8960,
    num_layers: int = 30,
    text_len: int = 512,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: str = "auto",
) -> Step:
    """``step(s)``: times forward + backward of one Wan block (self-attention over ``s`` video
    tokens, cross-attention to ``text_len`` text rows, the FFN ``ffn_dim`` wide) and returns the
    whole transformer's modeled seconds, ``num_layers * t_block``. The block's inputs are what
    ``PackedWanTransformer`` gives its first block for one sample (captured once per length)."""
    dim = heads * head_dim
    model = PackedWanTransformer(num_attention_heads=heads, attention_head_dim=head_dim, in_channels=16,
                                 out_channels=16, text_dim=dim, ffn_dim=ffn_dim, num_layers=1,
                                 rope_max_seq_len=1024, attention_backend=backend).to(device, dtype)  # fmt: skip
    block = model.blocks[0]
    captured: dict[int, tuple] = {}

    def capture(_module, args):
        captured["args"] = args

    def step_fn(seq_len: int) -> float:
        if seq_len > 1024 and seq_len % 1024:
            raise ValueError(f"Wan calibration lengths above 1024 must be multiples of 1024; got {seq_len}")
        if captured.get("seq_len") != seq_len:  # frames of one row of up to 1024 2 x 2 patches
            width = min(seq_len, 1024)
            frames = seq_len // width
            sample = {"hidden_states": torch.randn(16, frames, 2, 2 * width, device=device, dtype=dtype),
                      "encoder_hidden_states": torch.randn(text_len, dim, device=device, dtype=dtype),
                      "timestep": torch.tensor(500.0)}  # fmt: skip
            handle = block.register_forward_pre_hook(capture)
            with torch.no_grad():
                model(model.pack([sample]).to(device))
            handle.remove()
            x, wan_step = captured["args"]
            captured.update(seq_len=seq_len, x=x.detach().requires_grad_(), step=wan_step)
        x, wan_step = captured["x"], captured["step"]
        return num_layers * backward_seconds(lambda: block(x, wan_step).sum(), device)

    return step_fn
