"""Calibrate the cost model ``a*s + b*s^2`` on this device by timing real blocks.

    deepspeed-knap calibrate --out calibration.json                  # FLUX blocks, small dims (CPU)
    deepspeed-knap calibrate --flux-dims --dtype bfloat16 --out flux_h100.json   # on a GPU
    deepspeed-knap calibrate --callable mypkg.timing:step --out mine.json

For each sequence length ``s`` it times forward + backward of one FLUX double-stream block and one
single-stream block on one sequence of ``s`` tokens, and models the whole transformer as
``double_blocks * t_double(s) + single_blocks * t_single(s)``. A user callable ``step(s)`` must run
one forward + backward of whatever it models on ``s`` tokens (synchronising the device).

The fit is ``t(s) = overhead + a*s + b*s^2`` by non-negative least squares. The overhead (kernel
launches, Python: seconds a GPU spends per step whatever its tokens) is fitted so that it does not
bias ``a`` and ``b`` at short lengths; every busy GPU pays it, so it changes no plan and the
planner's model leaves it out. The JSON written is what ``"cost_model": {"calibration_file": ...}``
reads; it records the overhead too.

The route coefficient is not timed here: this runs on one process, and a route needs ranks. Given an
all-to-all bandwidth measured on the job's GPUs (e.g. NCCL's ``alltoall_perf``) and the bytes of a
routed token's row, :func:`route_coef_from_bandwidth` turns them into ``route_coef``.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from deepspeed_knap.cost.model import CostModel, nonnegative_least_squares

DEFAULT_LENGTHS = (256, 512, 1024, 2048, 4096)


Step = Callable[[int], "float | None"]


def time_step(step: Step, seq_len: int, repeats: int) -> float:
    """Median seconds of ``step(seq_len)`` over ``repeats`` runs after one warm-up. A step that
    returns a number reports its own (modeled) seconds; one that returns ``None`` is timed here."""
    step(seq_len)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        reported = step(seq_len)
        times.append(time.perf_counter() - start if reported is None else reported)
    return statistics.median(times)


def backward_seconds(run: Callable[[], torch.Tensor], device: torch.device | str) -> float:
    """Wall seconds of ``run().backward()``, the device synchronised before and after."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    run().backward()
    sync()
    return time.perf_counter() - start


def timing_bytes(seq_len: int, heads: int, head_dim: int, element_bytes: int, scores_materialised: bool) -> int:
    """A generous estimate of the memory :func:`flux_blocks_step` needs at ``seq_len`` tokens: ~64
    model-wide activations per token kept for the backward of one double- and one single-stream block
    (their MLPs are 4x wide), and, where the attention kernel materialises the scores (sdpa's math
    path on CPU), ``[heads, s, s]`` three times (scores, probabilities, their gradient)."""
    activations = 64 * seq_len * heads * head_dim * element_bytes
    scores = 3 * heads * seq_len * seq_len * element_bytes if scores_materialised else 0
    return activations + scores


def check_fits_memory(seq_len: int, heads: int, head_dim: int, dtype: torch.dtype, device: str) -> None:
    """Refuse, before allocating anything, a timing that cannot fit the device's memory.

    Raises:
        ValueError: naming the length, the estimate and the memory there is.
    """
    element = torch.empty((), dtype=dtype).element_size()
    if device.startswith("cuda"):
        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        needed = timing_bytes(seq_len, heads, head_dim, element, scores_materialised=False)
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        needed = timing_bytes(seq_len, heads, head_dim, element, scores_materialised=True)
    if needed > total:
        raise ValueError(
            f"--seq-lens: timing {seq_len:,} tokens with {heads} heads of {head_dim} needs about {needed / 2**30:,.1f} GiB "
            f"and {device} has {total / 2**30:,.1f} GiB; time shorter lengths (the fit extrapolates)"
        )


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
    from deepspeed_knap.models.flux.data import grid_ids
    from deepspeed_knap.models.flux.flux1 import rope_axes
    from deepspeed_knap.models.flux.layers import FluxDoubleBlock, FluxSingleBlock, FluxStep
    from deepspeed_knap.runtime.attention import KnapDistributedAttention
    from deepspeed_knap.runtime.packing import PackedBatch
    from deepspeed_knap.runtime.routing import local_batch

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
    from deepspeed_knap.models.wan.wan import PackedWanTransformer

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


def calibrate(step: Step, seq_lens: Sequence[int], repeats: int = 3) -> tuple[CostModel, np.ndarray, dict[str, float]]:
    """Time ``step`` at ``seq_lens`` and fit ``overhead + a*s + b*s^2``.

    Returns:
        ``(model, times, fit)``: the model (``a``, ``b``), ``[M]`` measured seconds, and the fit:
        ``overhead_s``, and its quality (``r2``, ``max_rel_error``) with the overhead included.
    """
    step(max(seq_lens))  # the first run at the largest size grows the allocator and thread pools
    times = np.array([time_step(step, s, repeats) for s in tqdm(seq_lens, desc="calibrate", leave=False)])
    s = np.asarray(seq_lens, dtype=np.float64)
    overhead, a, b = nonnegative_least_squares(np.stack([np.ones_like(s), s, s * s], axis=1), times)
    if a == 0 and b == 0:
        raise ValueError(f"the times {times.tolist()} do not grow with the length; is the step doing any work?")
    predicted = overhead + a * s + b * s * s
    r2 = 1 - float(np.sum((times - predicted) ** 2) / np.sum((times - times.mean()) ** 2))
    fit = {"overhead_s": float(overhead), "r2": r2, "max_rel_error": float(np.max(np.abs(predicted - times) / times))}
    return CostModel(float(a), float(b)), times, fit


# A token's round trip off its home GPU: the route and the reverse route, forward and backward.
ROUTE_EXCHANGES = 4


def route_coef_from_bandwidth(token_bytes: int, alltoall_gbps: float) -> float:
    """Seconds of one token's round trip (:attr:`~deepspeed_knap.cost.model.CostModel.route_coef`)
    over links of ``alltoall_gbps`` (10**9 bytes/s per GPU, measured) for rows of ``token_bytes``:
    ``4 * token_bytes / bandwidth``. An upper estimate where a backward moves no gradient for some
    columns (integer positions, latents that need none)."""
    return ROUTE_EXCHANGES * token_bytes / (alltoall_gbps * 1e9)


# Ulysses all-to-alls of a training step per block: q, k, v in and the output back, forward and
# backward (as CostModel.from_model_dims prices them).
ULYSSES_EXCHANGES = 8


def alltoall_coef_from_bandwidth(hidden: int, blocks: int, bytes_per_element: int, alltoall_gbps: float) -> float:
    """Seconds per token of a group's Ulysses traffic (:attr:`~deepspeed_knap.cost.model.CostModel.alltoall_coef`)
    over links of ``alltoall_gbps`` (10**9 bytes/s per GPU, measured) for ``blocks`` blocks of width
    ``hidden`` in activations of ``bytes_per_element``: ``8 * hidden * bytes * blocks / bandwidth``."""
    return ULYSSES_EXCHANGES * hidden * bytes_per_element * blocks / (alltoall_gbps * 1e9)


def load_callable(spec: str) -> Step:
    """``"package.module:function"`` -> the function."""
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"--callable {spec!r} must look like package.module:function")
    return getattr(importlib.import_module(module), name)


def write_calibration(path: str | Path, model: CostModel, seq_lens, times, fit: dict, about: dict) -> None:
    Path(path).write_text(json.dumps({
        "linear_coef": model.linear_coef,
        "quadratic_coef": model.quadratic_coef,
        "alltoall_coef": 0.0,  # unless about gives one (measured elsewhere): one process times no all-to-all
        **fit,
        "seq_lens": [int(s) for s in seq_lens],
        "seconds": [float(t) for t in times],
        **about,
    }, indent=2) + "\n")  # fmt: skip
