"""Timing FLUX blocks on this device, for calibration (``deepspeed-knap calibrate``, ``doctor``,
``bench step``): the FLUX.1 spec's ``block_timer``.

* :func:`flux_blocks_step`: ``step(s)``, one double- and one single-stream block, forward and backward,
  on one sequence of ``s`` tokens, scaled to the model's block counts.
* :class:`FluxBlockTimer`: the same blocks on what an emulated rank holds under a plan
  (:func:`~deepspeed_knap.runtime.emulation.emulated_rank_batch`), for ``bench step`` and
  ``calibrate --degrees``.
"""

from __future__ import annotations

import dataclasses
import statistics

import torch
from torch import Tensor

from deepspeed_knap.cost.calibrate import Step
from deepspeed_knap.models.flux.data import grid_ids
from deepspeed_knap.models.flux.flux1 import rope_axes
from deepspeed_knap.models.flux.layers import FluxDoubleBlock, FluxSingleBlock, FluxStep
from deepspeed_knap.runtime.attention import KnapDistributedAttention
from deepspeed_knap.runtime.emulation import EmulatedUlyssesAttention
from deepspeed_knap.runtime.packing import PackedBatch
from deepspeed_knap.runtime.routing import RoutedBatch, local_batch
from deepspeed_knap.runtime.timing import backward_seconds


def flux_blocks_step(
    dim_heads: int = 4,
    head_dim: int = 32,
    double_blocks: int = 19,
    single_blocks: int = 38,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: str = "auto",
) -> Step:
    """``step(s)``: times forward + backward of one double- and one single-stream FLUX block on one
    sequence of ``s`` tokens (an eighth of them text) and returns the whole transformer's modeled
    seconds, ``double_blocks * t_double + single_blocks * t_single``."""
    dim = dim_heads * head_dim
    rope = rope_axes(head_dim)
    double = FluxDoubleBlock(dim, dim_heads, head_dim).to(device, dtype)
    single = FluxSingleBlock(dim, dim_heads, head_dim).to(device, dtype)
    attention = KnapDistributedAttention(dim_heads, backend=backend)

    def step_fn(seq_len: int) -> float:
        text = seq_len // 8
        is_text = torch.arange(seq_len, device=device) < text
        ids = torch.cat([torch.zeros(text, 3), grid_ids(seq_len - text, 1)]).to(device)
        tokens = torch.randn(seq_len, dim, device=device, dtype=dtype, requires_grad=True)
        temb = torch.randn(1, dim, device=device, dtype=dtype)
        routed = local_batch(PackedBatch(tokens, (seq_len,), {"ids": ids, "is_text": is_text}, {"temb": temb}))
        step = FluxStep.build(routed, attention, rope)
        t_double = backward_seconds(lambda: sum(t.sum() for t in double(tokens[:text], tokens[text:], step)), device)
        t_single = backward_seconds(lambda: single(tokens, step).sum(), device)
        return double_blocks * t_double + single_blocks * t_single

    return step_fn


@dataclasses.dataclass
class FluxBlockTimer:
    """Times one FLUX double- and one single-stream block, forward + backward, on a routed batch and
    returns the modeled whole-transformer seconds ``double_blocks * t_double + single_blocks * t_single``."""

    heads: int
    head_dim: int
    double_blocks: int
    single_blocks: int
    device: torch.device
    dtype: torch.dtype
    backend: str = "auto"
    repeats: int = 3

    def __post_init__(self) -> None:
        dim = self.heads * self.head_dim
        self.double = FluxDoubleBlock(dim, self.heads, self.head_dim).to(self.device, self.dtype)
        self.single = FluxSingleBlock(dim, self.heads, self.head_dim).to(self.device, self.dtype)
        self.attention = EmulatedUlyssesAttention(self.heads, backend=self.backend)

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim

    def __call__(self, routed: RoutedBatch) -> float:
        if routed.batch.num_tokens == 0:
            return 0.0
        step = FluxStep.build(routed, self.attention, rope_axes(self.head_dim))
        x = routed.batch.tokens

        def double() -> Tensor:
            txt, img = x.index_select(0, step.txt_rows), x.index_select(0, step.img_rows)
            out_txt, out_img = self.double(txt, img, step)
            return out_txt.sum() + out_img.sum()

        times = []
        for _ in range(self.repeats + 1):  # the first run warms up
            t_double = backward_seconds(double, self.device)
            t_single = backward_seconds(lambda: self.single(x, step).sum(), self.device)
            times.append(self.double_blocks * t_double + self.single_blocks * t_single)
        return statistics.median(times[1:])
