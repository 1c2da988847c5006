"""Timing a model's own blocks on this device, for the cost model's calibration at start-up (every
family's spec names :func:`model_step_timer` as its ``step_timer``).

A copy of the model with a fraction of its blocks (the same dims, attention kernel and dtype,
random weights: a step's time does not depend on the values) runs forward and backward on one
synthetic sample of ``s`` tokens, with no balancer (no communication); the seconds are scaled to the
model's block count. With ZeRO-3 the model's own parameters are partitioned, and its gradients feed
the optimizer: a copy of a few blocks times the same kernels without touching either.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from deepspeed_knap.cost.calibrate import Step
from deepspeed_knap.data.mixes import SampleShape
from deepspeed_knap.models.registry import sample_shapes, spec
from deepspeed_knap.planner.topology import Topology
from deepspeed_knap.runtime.attention import KnapDistributedAttention


def block_fraction(config: Mapping[str, Any], block_counts: tuple[str, ...]) -> tuple[dict[str, int], float]:
    """The block counts of the timed copy and the factor that scales its time to ``config``'s: each
    count over the smallest, rounded (FLUX.1's 19 double and 38 single blocks: 1 and 2, times 19;
    Wan 14B's 40: 1, times 40). Counts of 0 stay 0."""
    counts = {key: int(config[key]) for key in block_counts if int(config.get(key) or 0) > 0}
    if not counts:
        raise ValueError(f"the config gives no blocks ({', '.join(block_counts)}): nothing to time")
    unit = min(counts.values())
    copy = {key: max(1, round(count / unit)) for key, count in counts.items()}
    return copy, sum(counts.values()) / sum(copy.values())


def model_step_timer(model: nn.Module, device: torch.device | str, dtype: torch.dtype,
                     topology: Topology | None = None, backend: str | None = None) -> Step:  # fmt: skip
    """``step(s)``: the seconds of forward and backward of ``model``'s whole block stack on one
    sequence of ``s`` tokens on ``device``, from a copy of a fraction of its blocks
    (:func:`block_fraction`) with the attention kernel ``backend`` under ``topology`` (as
    :meth:`~deepspeed_knap.runtime.attention.KnapDistributedAttention.configure` sets the model's).
    The sample is the family's default mix's first one's text (in-sequence, and cross-attention
    text) with ``s`` less that in visual tokens, in one latent frame."""
    family = spec(model.family)
    config = dict(model.config)
    counts, factor = block_fraction(config, family.block_counts)
    with torch.random.fork_rng(devices=[]):  # the user's seeds draw as before
        torch.manual_seed(0)
        copy = family.model_class(**{**config, **counts}).to(device, dtype)
    if topology is not None:
        for module in copy.modules():
            if isinstance(module, KnapDistributedAttention):
                module.configure(topology, backend)
    hooks = family.hooks()
    latents = hooks.synthetic_data(family.default_mix, config, 1.0, 0)
    typical = sample_shapes(family.default_mix, 1, 0)[0][0]
    guidance = 1.0 if config.get("guidance_embeds") else None
    synchronize = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def step(seq_len: int) -> float:
        shape = SampleShape(typical.text, max(1, seq_len - typical.text), 1, typical.cross_text)
        samples = type(latents).make_samples([shape], config, seq_len, 1.0, dtype)
        objective = hooks.objective(samples, torch.Generator().manual_seed(seq_len), config, guidance)
        inputs = copy.pack(objective.samples).to(device)
        synchronize()
        start = time.perf_counter()
        copy(inputs, None).float().square().mean().backward()
        synchronize()
        seconds = time.perf_counter() - start
        copy.zero_grad(set_to_none=True)
        return seconds * factor

    return step
