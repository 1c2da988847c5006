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
from deepspeed_knap.models.registry import sample_shapes, spec
from deepspeed_knap.planner.topology import Topology
from deepspeed_knap.runtime.attention import KnapDistributedAttention


class ConfigModel(nn.Module):
    """What a step timer (:func:`model_step_timer`) reads of a model, without the model: its
    ``family``, its ``config`` and its parameters' dtype (no blocks: none frozen, none
    checkpointed). ``doctor`` times a family's full-size config with it, which it never builds whole."""

    def __init__(self, family: str, config: Mapping[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        self.family, self.config = family, dict(config)
        self.block_stack = nn.ModuleList()
        self.dtype_holder = nn.Parameter(torch.zeros(1, dtype=dtype), requires_grad=False)


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
    """``step(s)``: the seconds of forward and backward of ``model`` on one sequence of ``s``
    tokens on ``device`` (what the balancer measures as a rank's compute), timed on a copy of a
    fraction of its blocks (:func:`block_fraction`): the copy's whole forward and backward, plus its
    blocks' share (from the first module the blocks run to the last, forward and backward:
    :func:`_outer_leaves`) times the blocks it lacks. The copy runs the attention kernel
    ``backend`` under ``topology`` (as
    :meth:`~deepspeed_knap.runtime.attention.KnapDistributedAttention.configure` sets the model's),
    with the model's gradient checkpointing, and with its blocks' weights frozen where most of the
    model's are (LoRA: the backward computes no weight gradient for them). The sample is the
    family's default mix's sample of the most frames (the longest of those), scaled to ``s``
    tokens: its frames kept, its text and references in proportion.

    After its first call, ``step.ulysses_calls`` holds what the start-up calibration times the
    Ulysses exchanges with (:func:`~deepspeed_knap.runtime.calibration.time_ulysses_exchanges`):
    ``[heads, head_dim, dtype, calls]`` of the ``KnapDistributedAttention`` calls of one forward and
    backward of the whole model (the copy's, scaled as its blocks are; :func:`_outer_leaves`), one
    row per kind of call."""
    family = spec(model.family)
    config = dict(model.config)
    counts, factor = block_fraction(config, family.block_counts)
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    checkpointing = any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())
    # Built on the device: FLUX.2's seven blocks took 46 s to initialise on an H200 host's CPU. The
    # user's seeds (this GPU's too) draw as before.
    with torch.random.fork_rng(devices=[device.index] if cuda else []), device:
        torch.manual_seed(0)
        copy = family.model_class(**{**config, **counts}, gradient_checkpointing=checkpointing).to(device, dtype)
    for module in copy.modules() if topology is not None else ():
        if isinstance(module, KnapDistributedAttention):
            module.configure(topology, backend)
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for b in model.block_stack for p in b.parameters()]
    if 2 * sum(size for size, trained in sizes if not trained) > sum(size for size, _ in sizes):  # ZeRO-3: ds_numel
        for block in copy.block_stack:
            block.requires_grad_(False)
    hooks = family.hooks()
    latents = hooks.synthetic_data(family.default_mix, config, 1.0, 0)
    # Attention's cost depends on a sequence's tokens, not on its layout; a video's frames keep a
    # long sequence's grid within the RoPE tables (a one-frame 4,725-token Wan "video" overflows the
    # tiny model's 64 rows a side).
    pool = [shape for seed in range(8) for rank in sample_shapes(family.default_mix, 8, seed) for shape in rank]
    model_shape = max(pool, key=lambda shape: (shape.frames, shape.length))
    guidance = 1.0 if config.get("guidance_embeds") else None
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    marks: dict[str, float] = {}
    timed: list[nn.Module] = []  # where the blocks' work starts and ends, once found

    def inputs_of(seq_len: int) -> Any:
        samples = type(latents).make_samples([model_shape], config, seq_len, seq_len / model_shape.length, dtype)
        objective = hooks.objective(samples, torch.Generator().manual_seed(seq_len), config, guidance)
        return copy.pack(objective.samples).to(device)

    def mark(name: str, first: bool):
        def hook(*_: Any) -> None:
            if first and name in marks:  # a checkpointed block runs its forward again in the backward
                return
            synchronize()
            marks[name] = time.perf_counter()

        return hook

    def step(seq_len: int) -> float:
        inputs = inputs_of(seq_len)
        if not timed:
            calls: dict[tuple[int, int, str], float] = {}
            starts, ends = _outer_leaves(copy, inputs, calls)
            step.ulysses_calls = [[*kind, count * factor] for kind, count in calls.items()]
            starts[0].register_forward_pre_hook(mark("forward_start", first=True))
            ends[0].register_forward_hook(mark("forward_end", first=True))
            starts[1].register_full_backward_pre_hook(mark("backward_start", first=True))
            ends[1].register_full_backward_hook(mark("backward_end", first=False))
            timed.extend((*starts, *ends))
        marks.clear()
        synchronize()
        start = time.perf_counter()
        copy(inputs, None).float().square().mean().backward()
        synchronize()
        whole = time.perf_counter() - start
        copy.zero_grad(set_to_none=True)
        blocks = (marks["forward_end"] - marks["forward_start"]) + (marks["backward_end"] - marks["backward_start"])
        return whole + (factor - 1) * blocks

    return step


def _outer_leaves(model: nn.Module, inputs: Any, attention_calls: dict[tuple[int, int, str], float]
                  ) -> tuple[tuple[nn.Module, nn.Module], tuple[nn.Module, nn.Module]]:  # fmt: skip
    """Where the blocks' work starts and ends, forward and backward: ``((first module called,
    first module whose backward starts), (last module to return, last module whose backward
    ends))``, of the modules without children in ``model.block_stack``, whether the model calls its
    blocks as modules or, as FLUX.3 does, calls their parts from functions of its own (a double-stream
    model's last text modules run forward but get no gradient). One forward and backward of
    ``inputs``, untimed.

    The same pass fills ``attention_calls``, ``{(heads, head_dim, dtype): calls}``, with the calls of
    ``model``'s ``KnapDistributedAttention`` modules, from each call's query (``[..., H, Dh]``). A
    call's exchanges are four all-to-alls (q, k and v out, the output back, and the reverse of both
    in the backward); a checkpointed block's recompute in the backward runs the forward two again,
    and counts half a call. Cross-attention that calls the kernel alone (Wan's) runs no exchange and
    is not counted."""
    called: list[nn.Module] = []
    returned: list[nn.Module] = []
    backward_starts: list[nn.Module] = []
    backward_ends: list[nn.Module] = []
    recording = [True]  # forward calls only until the backward (a checkpointed block runs again there)
    leaves = [module for block in model.block_stack for module in block.modules() if not list(module.children())]
    handles = []
    for leaf in leaves:
        handles += [
            leaf.register_forward_pre_hook(lambda module, _: called.append(module) if recording[0] else None),
            leaf.register_forward_hook(lambda module, *_: returned.append(module) if recording[0] else None),
            leaf.register_full_backward_pre_hook(lambda module, _: backward_starts.append(module)),
            leaf.register_full_backward_hook(lambda module, *_: backward_ends.append(module)),
        ]

    def count(_module: nn.Module, args: tuple) -> None:
        query = args[0]
        kind = (int(query.shape[-2]), int(query.shape[-1]), str(query.dtype).removeprefix("torch."))
        attention_calls[kind] = attention_calls.get(kind, 0.0) + (1.0 if recording[0] else 0.5)

    handles += [module.register_forward_pre_hook(count) for module in model.modules()
                if isinstance(module, KnapDistributedAttention)]  # fmt: skip
    try:
        loss = model(inputs, None).float().square().mean()
        recording[0] = False
        loss.backward()
        model.zero_grad(set_to_none=True)
    finally:
        for handle in handles:
            handle.remove()
    if not called or not backward_starts:
        raise ValueError(f"a forward and backward of the {type(model).__name__} ran none of its blocks' modules: "
                         "nothing to time")  # fmt: skip
    return (called[0], backward_starts[0]), (returned[-1], backward_ends[-1])
