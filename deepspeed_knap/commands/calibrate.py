"""``deepspeed-knap calibrate``: fit the cost model to FLUX or Wan blocks (or any callable) timed on this
device, and write it as JSON for ``"cost_model": {"calibration_file": ...}``
(:func:`deepspeed_knap.cost.calibrate.calibrate` does the timing and the fit).
"""

from __future__ import annotations

import argparse

import numpy as np

from deepspeed_knap.models.wan.spec import WAN
from deepspeed_knap.options import (
    calibration_lengths,
    device,
    int_at_least,
    nonnegative_int,
    output_file,
    plot_file,
    positive_float,
    positive_int,
)
from deepspeed_knap.runtime.timing import check_fits_memory

HELP = "fit the cost model to timed blocks on this device"
# Timed runs per length (and per degree): each repeats every timing.
MAX_REPEATS = 100


def degree_list(text: str) -> list[int]:
    """An argparse type: comma-separated bag sizes, each a whole number >= 2 (checked against the
    blocks' heads before any timing, in :func:`run`)."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() and len(part) <= 6 and int(part) >= 2 for part in parts):
        raise argparse.ArgumentTypeError(f"{text[:80]!r}: give comma-separated bag sizes of 2 or more, e.g. 2,4,8")
    return [int(part) for part in parts]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", required=True, type=output_file, metavar="FILE.json", help="where to write the fitted model"
    )
    parser.add_argument(
        "--seq-lens",
        type=calibration_lengths,
        default="256,512,1024,2048,4096",
        help="comma-separated lengths to time (4 different at least)",
    )
    parser.add_argument("--repeats", type=int_at_least(1, MAX_REPEATS), default=3,
                        help=f"timed runs per length (median), at most {MAX_REPEATS}")  # fmt: skip
    parser.add_argument("--callable", metavar="MODULE:FN", help="time FN(seq_len) instead of FLUX blocks")
    parser.add_argument("--heads", type=positive_int, default=4, help="FLUX blocks: attention heads")
    parser.add_argument("--head-dim", type=positive_int, default=32, help="FLUX blocks: channels per head (even)")
    parser.add_argument("--flux-dims", action="store_true", help="FLUX.1 width: 24 heads of 128 (GPU)")
    parser.add_argument("--wan", metavar="PRESET", choices=list(WAN.presets),
                        help=f"time Wan blocks of a preset's dims instead of FLUX blocks: {', '.join(WAN.presets)}")  # fmt: skip
    parser.add_argument("--double-blocks", type=nonnegative_int, default=19, help="double-stream blocks of the model")
    parser.add_argument("--single-blocks", type=nonnegative_int, default=38, help="single-stream blocks of the model")
    parser.add_argument("--device", type=device, default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--backend", default="auto", help="attention kernel (docs/integration.md, Attention kernels)")
    parser.add_argument("--plot", type=plot_file, metavar="OUT.png", help="plot measured and fitted seconds")
    parser.add_argument("--degrees", type=degree_list, default=None, metavar="2,4,8",
                        help="also time emulated members of bags of these sizes (2 to the heads) and fit their "
                        "efficiency")  # fmt: skip
    parser.add_argument("--alltoall-gbps", type=positive_float, metavar="GB/s",
                        help="all-to-all bandwidth per GPU measured on the job's GPUs (e.g. NCCL's alltoall_perf "
                        "busbw); writes alltoall_coef for the timed blocks' width and count (not timed here: one "
                        "process); without it the file prices Ulysses all-to-alls as free")  # fmt: skip
    parser.add_argument("--route-gbps", type=positive_float, metavar="GB/s",
                        help="all-to-all bandwidth per GPU measured on the job's GPUs (e.g. NCCL's alltoall_perf "
                        "busbw); with --route-token-bytes, writes route_coef (not timed here: one process)")  # fmt: skip
    parser.add_argument("--route-token-bytes", type=positive_int, metavar="BYTES",
                        help="bytes of one routed token's row (its columns x their element sizes)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import torch

    from deepspeed_knap.cost.calibrate import (
        ULYSSES_EXCHANGES,
        alltoall_coef_from_bandwidth,
        calibrate,
        load_callable,
        route_coef_from_bandwidth,
        write_calibration,
    )

    lengths = args.seq_lens
    if (args.route_gbps is None) != (args.route_token_bytes is None):
        raise ValueError(
            f"--route-gbps {args.route_gbps} and --route-token-bytes {args.route_token_bytes}: give both (route_coef "
            "is 4 x a token's row bytes over the bandwidth) or neither"
        )
    if args.alltoall_gbps is not None and args.callable:
        raise ValueError(f"--alltoall-gbps {args.alltoall_gbps} prices the timed blocks' Ulysses traffic; a "
                         "--callable has no known width: give cost_model.alltoall_coef beside the calibration_file "
                         "instead (it replaces the file's)")  # fmt: skip
    from deepspeed_knap.models.flux.calibrate import FluxBlockTimer, flux_blocks_step
    from deepspeed_knap.models.wan.calibrate import wan_blocks_step

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.wan and (args.callable or args.flux_dims or args.degrees):
        raise ValueError(f"--wan {args.wan} times Wan blocks; it goes without --callable, --flux-dims and --degrees")
    if args.degrees and args.callable:
        raise ValueError(f"--degrees {','.join(map(str, args.degrees))} times emulated bag members of FLUX blocks; it "
                         "cannot time a --callable")  # fmt: skip
    wan = WAN.presets[args.wan] if args.wan else None
    heads, head_dim = (24, 128) if args.flux_dims else (args.heads, args.head_dim)
    if wan:
        heads, head_dim = wan["num_heads"], wan["dim"] // wan["num_heads"]
    elif not args.callable and not args.flux_dims and head_dim % 2:
        raise ValueError(f"--head-dim {head_dim}: FLUX blocks rotate a head's channels in pairs (over three axes); "
                         "give an even number, e.g. 32 or 128")  # fmt: skip
    over = [degree for degree in args.degrees or () if degree > heads]
    if over:
        raise ValueError(f"--degrees {','.join(map(str, args.degrees))}: bag sizes must be between 2 and the blocks' "
                         f"{heads} heads (--heads{'' if not args.flux_dims else ', 24 with --flux-dims'}); got {over}")  # fmt: skip
    if not args.callable:
        check_fits_memory(max(lengths), heads, head_dim, getattr(torch, args.dtype), device)
    if args.callable:
        try:
            step = load_callable(args.callable)
        except (ImportError, AttributeError) as error:
            raise ValueError(
                f"--callable {args.callable}: cannot import it ({type(error).__name__}: {error})"
            ) from None
        if not callable(step):
            raise ValueError(f"--callable {args.callable} is a {type(step).__name__}, not a function of seq_len")
        about = {"callable": args.callable}
    elif wan:
        step = wan_blocks_step(heads, head_dim, wan["ffn_dim"], wan["num_layers"], wan["text_len"], device,
                               getattr(torch, args.dtype), args.backend)  # fmt: skip
        about = {"blocks": f"Wan {args.wan}: {wan['num_layers']} blocks, {heads}x{head_dim} heads, "
                           f"{wan['text_len']} text rows", "num_heads": heads}  # fmt: skip
    else:
        step = flux_blocks_step(heads, head_dim, args.double_blocks, args.single_blocks, device,
                                getattr(torch, args.dtype), args.backend)  # fmt: skip
        # No num_heads: these blocks' heads are a timing stand-in (--heads), not the trained model's.
        about = {"blocks": f"FLUX {args.double_blocks}+{args.single_blocks} blocks, {heads}x{head_dim} heads"}
    about.update(device=torch.cuda.get_device_name() if device.startswith("cuda") else device, dtype=args.dtype)
    model, times, fit = calibrate(step, lengths, args.repeats)
    degrees = args.degrees or []
    if degrees:
        from deepspeed_knap.runtime.emulation import calibrate_degrees

        timer = FluxBlockTimer(heads, head_dim, args.double_blocks, args.single_blocks, torch.device(device),
                               getattr(torch, args.dtype), args.backend, args.repeats)  # fmt: skip
        efficiency, by_degree = calibrate_degrees(timer, lengths, degrees, model, fit["overhead_s"])
        about["degree_efficiency"] = [[g, e] for g, e in efficiency.items()]
        about["degree_seconds"] = {str(g): t for g, t in by_degree.items()}
    if args.alltoall_gbps is not None:
        blocks = wan["num_layers"] if wan else args.double_blocks + args.single_blocks
        about.update(alltoall_coef=alltoall_coef_from_bandwidth(heads * head_dim, blocks,
                                                                getattr(torch, args.dtype).itemsize, args.alltoall_gbps),
                     alltoall_gbps=args.alltoall_gbps)  # fmt: skip
    alltoall_coef = about.get("alltoall_coef", 0.0)
    if args.route_gbps is not None:
        about.update(route_coef=route_coef_from_bandwidth(args.route_token_bytes, args.route_gbps),
                     route_gbps=args.route_gbps, route_token_bytes=args.route_token_bytes)  # fmt: skip
    write_calibration(args.out, model, lengths, times, fit, about)

    print(f"{'seq_len':>8}{'measured s':>13}{'model s':>13}{'rel err':>9}")
    for s, t in zip(lengths, times, strict=True):
        fitted = fit["overhead_s"] + model.linear_coef * s + model.quadratic_coef * s * s
        print(f"{s:>8}{t:>13.5g}{fitted:>13.5g}{(fitted - t) / t:>9.1%}")
    print(f"a = {model.linear_coef:.4g} s/token, b = {model.quadratic_coef:.4g} s/token^2, per-step overhead "
          f"{fit['overhead_s']:.4g} s (not used in planning); R^2 = {fit['r2']:.4f}, max rel error "
          f"{fit['max_rel_error']:.1%}; written to {args.out}")  # fmt: skip
    if alltoall_coef:
        print(f"alltoall_coef = {alltoall_coef:.4g} s per token of Ulysses traffic ({ULYSSES_EXCHANGES} exchanges per "
              f"block at {args.alltoall_gbps:g} GB/s, given, not timed)")  # fmt: skip
    else:
        fix = "cost_model.alltoall_coef beside the calibration_file" if args.callable else "--alltoall-gbps"
        print(f"alltoall_coef = 0: the file prices Ulysses all-to-alls as free, so topology auto splits sequences "
              f"freely; give {fix} (measured on the job's GPUs), or turn on cost_model.online")  # fmt: skip
    if "route_coef" in about:
        print(f"route_coef = {about['route_coef']:.4g} s per token's round trip (4 x {args.route_token_bytes} bytes "
              f"at {args.route_gbps:g} GB/s, given, not timed)")  # fmt: skip
    for degree, efficiency in about.get("degree_efficiency", []):
        print(f"bag of {degree}: a member does {efficiency:.0%} of the ideal 1/{degree} share's speed "
              f"(measured {', '.join(f'{t:.4g}' for t in about['degree_seconds'][str(degree)])} s)")  # fmt: skip
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        grid = np.linspace(0, max(lengths), 200)
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(lengths, times, "o", label="measured")
        fitted = fit["overhead_s"] + model.linear_coef * grid + model.quadratic_coef * grid**2
        ax.plot(grid, fitted, label="overhead + a*s + b*s^2")
        ax.set(xlabel="sequence length (tokens)", ylabel="seconds (forward + backward)", title=about.get("blocks", ""))
        ax.legend()
        fig.savefig(args.plot, dpi=120, bbox_inches="tight")
        print(f"plot written to {args.plot}")
    return 0
