"""Packed FLUX against diffusers run sample by sample: time and memory of forward + backward.

    deepspeed-knap bench flux --mix kf_mixed_res --token-scale 0.0625

One rank's samples of a bundled mix go through both models with the same weights: diffusers'
``FluxTransformer2DModel`` (``--family flux2``: ``Flux2Transformer2DModel``) once per sample
(different sizes cannot share its batch), and the packed model once on the packed batch. One model
is on the device at a time (the packed copy is made once diffusers' runs are done, and replaces it),
so ``--flux-dims --dtype bfloat16`` fits an 80 GB GPU. Reported
per model: median wall time of forward + backward, activation bytes autograd keeps for backward
(parameters excluded; any device), and on CUDA the peak memory allocated during a run above what
was allocated before it (weights, inputs), and what was allocated before the model's first run
(an earlier model's leftovers would show there). Needs the ``diffusers`` extra.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from deepspeed_knap.models.registry import sample_shapes, spec
from deepspeed_knap.options import (
    add_family_argument,
    add_mix_argument,
    device,
    flux_head_dim,
    nonnegative_int,
    positive_float,
    positive_int,
)
from deepspeed_knap.runtime.attention import BACKENDS, VarlenAttention
from deepspeed_knap.runtime.timing import backward_seconds

HELP = "packed FLUX against diffusers sample by sample: time and memory"


def saved_activation_bytes(run: Callable[[], Tensor], model: nn.Module) -> int:
    """Bytes of the distinct tensors autograd saves while ``run()`` builds its graph, parameters
    excluded (what training keeps in memory between forward and backward)."""
    parameters = {p.data_ptr() for p in model.parameters()}
    storages: dict[int, torch.UntypedStorage] = {}  # kept alive until counted, so no address is reused

    # The graph holds nothing: it is never run backward. A pack hook returning the tensor itself
    # leaked every saved output (exp, softmax: the output holds its grad_fn, which then holds the
    # output, a cycle through C++ that Python's gc cannot see): 14.4 GiB of diffusers' activations
    # stayed allocated through the packed model's runs on an H100.
    def pack(t: Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage

    def unpack(_: None) -> Tensor:
        raise RuntimeError("saved_activation_bytes builds a graph only to count what it saves")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = run()
    del out
    return sum(storage.nbytes() for storage in storages.values())


def measure(run: Callable[[], Tensor], model: nn.Module, device: torch.device, repeats: int) -> dict[str, float]:
    """Median seconds of ``run().backward()``, saved activation bytes, and on CUDA the peak bytes
    allocated during a run above those allocated before it (the models' weights and the inputs;
    the gradients are freed first, so they count in the peak), and the bytes allocated before the
    first run (on CUDA: weights and inputs, and whatever an earlier measurement left allocated)."""
    cuda, times, starts, peaks = device.type == "cuda", [], [], []
    for _ in range(repeats + 1):  # the first is a warm-up
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            starts.append(torch.cuda.memory_allocated())
        times.append(backward_seconds(run, device))
        if cuda:
            peaks.append(torch.cuda.max_memory_allocated() - starts[-1])
    model.zero_grad(set_to_none=True)  # the next model's peak must not hold this one's gradients
    return {"seconds": statistics.median(times[1:]), "saved_mb": saved_activation_bytes(run, model) / 2**20,
            "peak_mb": max(peaks[1:]) / 2**20 if peaks else float("nan"), "before_mb": starts[0] / 2**20 if starts else float("nan")}  # fmt: skip


def bench_flux(
    family: str,
    config: dict,
    mix: str,
    ranks: int,
    token_scale: float,
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
    repeats: int,
    backend: str = "auto",
) -> dict[str, dict[str, float]]:
    """Both models of ``family`` (``flux``, ``flux2``) on every sample ``ranks`` ranks of ``mix``
    hold in one step (a mix of sizes)."""
    import diffusers

    from deepspeed_knap.models.auto import model_class
    from deepspeed_knap.models.flux.data import rectified_flow, synthetic_samples

    torch.manual_seed(seed)
    reference_class = getattr(diffusers, spec(family).diffusers_class)
    # Initialised where it runs, in its dtype: FLUX.1 [dev] built in float32 on the host took minutes.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            reference = reference_class(**config)
    finally:
        torch.set_default_dtype(default_dtype)
    shapes = [shape for rank in sample_shapes(mix, ranks, seed) for shape in rank]
    latents = synthetic_samples(shapes, config, seed, token_scale, dtype)
    samples, _ = rectified_flow(
        latents, torch.Generator().manual_seed(seed), 1.0 if config["guidance_embeds"] else None
    )
    samples = [{key: t.to(device) for key, t in s.items()} for s in samples]

    def run_diffusers(model: nn.Module) -> Tensor:
        total = 0
        for s in samples:
            pooled = {"pooled_projections": s["pooled_projections"][None]} if "pooled_projections" in s else {}
            out = model(
                hidden_states=s["hidden_states"][None], encoder_hidden_states=s["encoder_hidden_states"][None],
                timestep=s["timestep"].reshape(1), guidance=s["guidance"].reshape(1) if "guidance" in s else None,
                img_ids=s["img_ids"], txt_ids=s["txt_ids"], **pooled,
            ).sample  # fmt: skip
            total = total + out.float().square().mean()
        return total

    def run_packed(model: nn.Module) -> Tensor:
        return sum(out.float().square().mean() for out in model.forward_samples(samples))

    tokens = sum(s["hidden_states"].shape[0] + s["encoder_hidden_states"].shape[0] for s in samples)
    # On an H100 (torch 2.11, CUDA 13) cuDNN's attention backward failed inside diffusers' model at
    # kf_mixed_res's lengths ("mha_graph.execute(...).is_good()"), poisoning the context: both models
    # run with SDPA's other kernels, so neither is measured on cuDNN's.
    kernels = (
        sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
        if device.type == "cuda"
        else contextlib.nullcontext()
    )
    with kernels:
        results = {"diffusers": measure(functools.partial(run_diffusers, reference), reference, device, repeats)}
        # One model on the device at a time: FLUX.1 [dev]'s 12B parameters twice, and the gradients
        # of one, do not fit an 80 GB GPU.
        packed = model_class(family).from_diffusers(reference, attention_backend=backend)
        del reference
        results["packed"] = measure(functools.partial(run_packed, packed), packed, device, repeats)
    return {**results, "mix": {"samples": len(samples), "tokens": tokens}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_family_argument(parser, "the packed model and its diffusers reference", having="bench_configs")
    add_mix_argument(parser, "kf_mixed_res")
    parser.add_argument("--ranks", type=positive_int, default=8, help="pool the samples of this many ranks' step")
    parser.add_argument("--token-scale", type=positive_float, default=1 / 16)
    parser.add_argument("--layers", type=positive_int, default=2, help="double-stream blocks")
    parser.add_argument("--single-layers", type=positive_int, default=4, help="single-stream blocks")
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument(
        "--head-dim", type=flux_head_dim, default=32, help="even; FLUX.1: 24 heads of 128 (use --flux-dims)"
    )
    parser.add_argument("--flux-dims", action="store_true",
                        help="[dev]'s width and blocks: FLUX.1 24 x 128, 19 + 38; FLUX.2 48 x 128, 8 + 48 (GPU)")  # fmt: skip
    parser.add_argument("--seed", type=nonnegative_int, default=0)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--backend", default="auto", choices=BACKENDS,
                        help="the packed model's attention kernel (docs/integration.md)")  # fmt: skip
    parser.add_argument("--device", type=device, default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def run(args: argparse.Namespace) -> int:
    from deepspeed_knap.models.flux.flux1 import rope_axes

    flux2 = args.family == "flux2"
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.flux_dims:
        args.layers, args.single_layers, args.heads, args.head_dim = (8, 48, 48, 128) if flux2 else (19, 38, 24, 128)
    if flux2 and args.head_dim % 8:
        raise ValueError(f"--head-dim {args.head_dim}: FLUX.2 splits a head's channels into 4 RoPE axes of an even "
                         "size each; give a multiple of 8")  # fmt: skip
    config = dict(patch_size=1, num_layers=args.layers, num_single_layers=args.single_layers,
                  attention_head_dim=args.head_dim, num_attention_heads=args.heads, guidance_embeds=True)  # fmt: skip
    if flux2:  # four RoPE axes (t, h, w, l) of equal size, as FLUX.2 [dev]'s (32, 32, 32, 32)
        config.update(in_channels=128, joint_attention_dim=15360 if args.flux_dims else 256,
                      axes_dims_rope=(args.head_dim // 4,) * 4)  # fmt: skip
    else:
        config.update(in_channels=64, joint_attention_dim=4096 if args.flux_dims else 256,
                      pooled_projection_dim=768 if args.flux_dims else 64, axes_dims_rope=rope_axes(args.head_dim))  # fmt: skip
    # The packed model's kernel is built after diffusers' model is timed: a kernel that cannot run
    # here is refused first, not after minutes of timing at --flux-dims.
    VarlenAttention(args.backend).resolve(torch.device(device), getattr(torch, args.dtype))
    result = bench_flux(args.family, config, args.mix, args.ranks, args.token_scale, args.seed, torch.device(device),
                        getattr(torch, args.dtype), args.repeats, args.backend)  # fmt: skip
    work = result["mix"]
    print(f"{args.family} {args.mix} x{args.token_scale:g}: {work['samples']} samples, {work['tokens']} tokens; "
          f"{args.layers}+{args.single_layers} blocks, {args.heads}x{args.head_dim} heads, {args.dtype} on {device}")  # fmt: skip
    print(f"{'model':<10} {'fwd+bwd s':>10} {'saved MiB':>10} {'peak MiB':>10} {'before MiB':>11}")
    for name in ("diffusers", "packed"):
        r = result[name]
        print(f"{name:<10} {r['seconds']:>10.3f} {r['saved_mb']:>10.2f} {r['peak_mb']:>10.1f} {r['before_mb']:>11.1f}")
    return 0
