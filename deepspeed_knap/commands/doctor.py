"""``deepspeed-knap doctor``: what this machine runs, whether it computes right, and how fast.

    deepspeed-knap doctor --out doctor/      # doctor.json, doctor.txt and calibration.json

1. Versions: Python, torch (with its CUDA, cuDNN and NCCL), DeepSpeed and its accelerator, the
   optional packages (flash-attn, diffusers, transformers, peft), the devices.
2. Attention kernels: for each backend of ``KnapDistributedAttention`` (``flash``, ``torch_varlen``,
   ``sdpa``) whether it runs here in the chosen dtype, and why not; which one ``auto`` picks.
3. Kernel check: every kernel that runs, on packed sequences of uneven lengths (one of a single
   token), against attention computed per sequence in float64: output and q, k, v gradients.
4. Kernel speed: forward + backward of one FLUX double- and one single-stream block per kernel at
   each ``--compare-lens`` length, scaled to the whole transformer. Which kernel runs is not which
   is fastest: on an H100 (torch 2.11, CUDA 13) per-sequence SDPA ran FLUX.1 blocks at 32k tokens in
   7.7 s against ``varlen_attn``'s 11.2 s, so the report names the fastest and the setting to use.
5. Calibration: ``calibrate`` of FLUX blocks at the model's dims with the fastest kernel; its JSON is
   what ``"cost_model": {"calibration_file": ...}`` reads.
6. Start-up calibration: what ``"cost_model": {"startup_calibration": ...}`` would make here for a
   model of ``--family`` (one rank): whether ``"auto"`` turns it on on this machine, the seconds its
   timing takes, and the fit it gives against the family's FLOP prior. On CUDA it times the family's
   ``full_config`` (FLUX.1 [dev], FLUX.2 [dev], Wan 14B, Qwen-Image) at the option's default lengths
   and repeats; FLUX.3, which has none, and every family on a CPU, at its tiny config.

On a CPU it reports the same, at small dims unless told otherwise (``sdpa`` is the only kernel).
The exit status is 1 when a kernel check fails, else 0. A calibration whose times do not grow with
the length (noise at short lengths) writes no ``calibration.json`` and is reported as a finding.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import torch
from tqdm import tqdm

from deepspeed_knap.cost.calibrate import calibrate, startup_model, time_lengths, write_calibration
from deepspeed_knap.models.flux.calibrate import flux_blocks_step
from deepspeed_knap.models.registry import spec
from deepspeed_knap.models.timing import ConfigModel
from deepspeed_knap.options import (
    add_family_argument,
    calibration_lengths,
    device,
    flux_head_dim,
    nonnegative_int,
    output_folder,
    positive_int,
    seq_lens,
)
from deepspeed_knap.runtime.attention import BACKENDS, VarlenAttention, VarlenSeqs
from deepspeed_knap.runtime.config import KnapCostModelConfig

HELP = "versions, attention kernels, a kernel check and a calibration here"

KERNELS = tuple(backend for backend in BACKENDS if backend != "auto")
# Largest relative error (to the largest reference value) a kernel may show against float64.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
CHECK_LENS = (37, 1, 128, 300)  # uneven, and a sequence of one token
PACKAGES = ("torch", "deepspeed", "deepspeed_knap", "numpy", "flash-attn", "diffusers", "transformers", "peft")


def versions() -> dict:
    """Python, packages (``None`` when not installed), torch's CUDA stack, DeepSpeed's accelerator, devices."""
    from deepspeed.accelerator import get_accelerator

    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    cuda = torch.cuda.is_available()
    report = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {package: version(package) for package in PACKAGES},
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "deepspeed_accelerator": get_accelerator().device_name(),
        "devices": [],
    }
    for index in range(torch.cuda.device_count() if cuda else 0):
        props = torch.cuda.get_device_properties(index)
        report["devices"].append({"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                                  "capability": f"{props.major}.{props.minor}"})  # fmt: skip
    return report


def kernel_availability(device: torch.device, dtype: torch.dtype) -> dict:
    """``{backend: None or why it cannot run}`` for tensors on ``device`` of ``dtype``, and ``auto``'s pick."""
    report = {}
    for backend in KERNELS:
        try:
            VarlenAttention(backend).resolve(device, dtype)
            report[backend] = None
        except ValueError as error:
            report[backend] = str(error)
    return {"unusable": report, "auto": VarlenAttention("auto").resolve(device, dtype)}


def _seqs(seq_lens: Sequence[int], device: torch.device) -> VarlenSeqs:
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return VarlenSeqs(tuple(seq_lens), cu, max(seq_lens))


def _reference_attention(q, k, v, seq_lens: Sequence[int], scale: float):
    """Softmax attention of each sequence alone, written out (no kernel): ``[L, H, Dh]`` each."""
    outs = []
    for qs, ks, vs in zip(*(t.split(list(seq_lens)) for t in (q, k, v)), strict=True):
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), vs))
    return torch.cat(outs)


def kernel_check(backend: str, heads: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> dict:
    """Output and q, k, v gradients of ``backend`` on :data:`CHECK_LENS` packed sequences against
    :func:`_reference_attention` in float64 on the CPU: largest error relative to the largest
    reference value, for each, and whether all are within :data:`TOLERANCE`."""
    generator = torch.Generator().manual_seed(0)
    total = sum(CHECK_LENS)
    q64, k64, v64, grad64 = (torch.randn(total, heads, head_dim, generator=generator, dtype=torch.float64)
                             for _ in range(4))  # fmt: skip
    leaves64 = [t.clone().requires_grad_() for t in (q64, k64, v64)]
    reference = _reference_attention(*leaves64, CHECK_LENS, head_dim**-0.5)
    reference.backward(grad64)
    leaves = [t.to(device, dtype).requires_grad_() for t in (q64, k64, v64)]
    out = VarlenAttention(backend)(*leaves, _seqs(CHECK_LENS, device))
    out.backward(grad64.to(device, dtype))

    def error(got, want) -> float:
        return ((got.double().cpu() - want).abs().max() / want.abs().max()).item()

    errors = {"output": error(out.detach(), reference.detach())}
    errors.update(
        {f"grad_{name}": error(t.grad, t64.grad) for name, t, t64 in zip("qkv", leaves, leaves64, strict=True)}
    )
    return {"errors": errors, "tolerance": TOLERANCE[dtype], "ok": max(errors.values()) <= TOLERANCE[dtype]}


def compare_kernels(backends, heads, head_dim, double_blocks, single_blocks, device, dtype, seq_lens, repeats) -> dict:
    """``{seq_len: {backend: seconds}}``: forward + backward of the whole transformer, modeled from
    one double- and one single-stream block per kernel (median of ``repeats`` after a warm-up)."""
    times: dict[int, dict[str, float]] = {}
    for backend in backends:
        step = flux_blocks_step(heads, head_dim, double_blocks, single_blocks, str(device), dtype, backend)
        for seq_len in tqdm(seq_lens, desc=f"speed {backend}", leave=False):
            step(seq_len)
            times.setdefault(seq_len, {})[backend] = statistics.median(step(seq_len) for _ in range(repeats))
    return times


def startup_calibration(family: str, device: torch.device, dtype: torch.dtype, seq_lens: Sequence[int],
                        repeats: int) -> dict:  # fmt: skip
    """What the start-up calibration would make on this device for a model of ``family`` (one rank:
    :func:`~deepspeed_knap.cost.calibrate.startup_model` of this rank's times).

    Returns:
        ``family``; ``config`` (``"full"``: the spec's ``full_config``, on CUDA; ``"tiny"``);
        ``auto_runs_it`` (``"auto"`` turns it on here: a GPU); ``seq_lens`` ``[M]``; ``repeats``;
        and either ``error`` (why the timing or the fit failed) or ``build_s`` and ``timing_s`` (the
        copy's seconds to build and to time), ``seconds`` ``[M]`` (the modeled block stack's
        forward and backward at each length), the fit's ``linear_coef``, ``quadratic_coef`` and
        ``overhead_s``, ``scale`` (its compute over the FLOP prior's), ``shape``, ``r2`` and
        ``max_rel_error``.
    """
    cuda = device.type == "cuda"
    model_spec = spec(family)
    full = cuda and model_spec.full_config is not None
    name, config = ("full", model_spec.full_config) if full else ("tiny", model_spec.tiny_config)
    # What training decides with the default cost model (a preset source) on this accelerator.
    auto_runs_it = KnapCostModelConfig().calibrates_at_start(cuda, family)
    report = {"family": family, "config": name, "auto_runs_it": auto_runs_it, "seq_lens": list(seq_lens),
              "repeats": repeats}  # fmt: skip
    start = time.perf_counter()
    try:
        step = model_spec.load("step_timer")(ConfigModel(family, config, dtype), device, dtype)
        built = time.perf_counter() - start
        times = time_lengths(step, seq_lens, repeats, progress=False)
        calibration = startup_model(model_spec.config_cost_model(config), seq_lens, [times.tolist()])
    except Exception as error:  # out of memory, times that do not grow: a finding; the checks above still stand
        return {**report, "error": f"{type(error).__name__}: {error}"}
    model = calibration.model
    return {**report, "build_s": built, "timing_s": time.perf_counter() - start - built, "seconds": times.tolist(),
            "linear_coef": model.linear_coef, "quadratic_coef": model.quadratic_coef, "overhead_s": model.overhead_s,
            "scale": calibration.scale, "shape": calibration.fit["shape"], "r2": calibration.fit["r2"],
            "max_rel_error": calibration.fit["max_rel_error"]}  # fmt: skip


def run_doctor(
    out: str | Path,
    device: str | None = None,
    dtype: torch.dtype | None = None,
    heads: int | None = None,
    head_dim: int | None = None,
    double_blocks: int = 19,
    single_blocks: int = 38,
    seq_lens: Sequence[int] | None = None,
    compare_lens: Sequence[int] | None = None,
    repeats: int = 3,
    family: str = "flux",
) -> dict:
    """Every check of the module docstring; writes ``out/doctor.json``, ``out/doctor.txt`` and
    ``out/calibration.json`` and returns the report. Defaults: on CUDA, FLUX.1's 24 heads of 128 in
    bfloat16, calibration at 1k to 16k tokens, kernels compared at 4k and 32k; on a CPU, 4 heads of
    32 in float32 at 128 to 1,024 tokens. The start-up calibration of ``family`` times the lengths and
    repeats ``"startup_calibration"`` defaults to on CUDA, the calibration's on a CPU."""
    cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    device = torch.device(device or ("cuda" if cuda else "cpu"))
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    heads, head_dim = heads or (24 if cuda else 4), head_dim or (128 if cuda else 32)
    seq_lens = list(seq_lens or ((1024, 2048, 4096, 8192, 16384) if cuda else (128, 256, 512, 1024)))
    compare_lens = list(compare_lens or ((4096, 32768) if cuda else (256,)))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    report = {"versions": versions(), "device": str(device), "dtype": str(dtype).removeprefix("torch."),
              "dims": {"heads": heads, "head_dim": head_dim, "double_blocks": double_blocks,
                       "single_blocks": single_blocks}}  # fmt: skip
    report["kernels"] = kernel_availability(device, dtype)
    runnable = [backend for backend, why in report["kernels"]["unusable"].items() if why is None]
    report["kernel_check"] = {backend: kernel_check(backend, heads, head_dim, device, dtype) for backend in runnable}
    report["speed_s"] = compare_kernels(runnable, heads, head_dim, double_blocks, single_blocks, device, dtype,
                                        compare_lens, repeats)  # fmt: skip
    longest = report["speed_s"][max(compare_lens)]
    fastest = min(longest, key=longest.get)
    report["fastest"] = {str(seq_len): min(times, key=times.get) for seq_len, times in report["speed_s"].items()}

    step = flux_blocks_step(heads, head_dim, double_blocks, single_blocks, str(device), dtype, fastest)
    try:
        model, times, fit = calibrate(step, seq_lens, repeats)
    except ValueError as error:  # timing noise at short lengths: the checks above still stand, so report it
        report["calibration"] = {"backend": fastest, "error": str(error)}
        (out / "calibration.json").unlink(missing_ok=True)  # an earlier run's file must not pass for this one's
    else:
        about = {"blocks": f"FLUX {double_blocks}+{single_blocks} blocks, {heads}x{head_dim} heads",
                 "device": report["versions"]["devices"][0]["name"] if cuda else "cpu", "dtype": report["dtype"],
                 "backend": fastest}  # fmt: skip
        write_calibration(out / "calibration.json", model, seq_lens, times, fit, about)
        report["calibration"] = {"backend": fastest, "linear_coef": model.linear_coef,
                                 "quadratic_coef": model.quadratic_coef, **fit,
                                 "file": str(out / "calibration.json")}  # fmt: skip
    # On CUDA what training runs by default; on a CPU ("auto" leaves it off) the calibration's lengths.
    defaults = KnapCostModelConfig().startup_calibration
    startup = (defaults.seq_lens, defaults.repeats) if cuda else (seq_lens, repeats)
    report["startup_calibration"] = startup_calibration(family, device, dtype, *startup)
    report["findings"] = findings(report)
    report["ok"] = all(check["ok"] for check in report["kernel_check"].values())
    (out / "doctor.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "doctor.txt").write_text(render(report))
    return report


def findings(report: dict) -> list[str]:
    """What a user should act on, in words."""
    notes = []
    auto = report["kernels"]["auto"]
    for backend, check in report["kernel_check"].items():
        if not check["ok"]:
            notes.append(f"kernel {backend!r} is off by {max(check['errors'].values()):.2g} against float64 "
                         f"(tolerance {check['tolerance']:.0e}): do not train with it here")  # fmt: skip
    for seq_len, times in report["speed_s"].items():
        best = min(times, key=times.get)
        if best != auto:
            notes.append(f"at {seq_len} tokens {best!r} runs the model {times[auto] / times[best]:.2f}x faster than "
                         f"{auto!r}, which 'auto' picks: consider \"attention_backend\": \"{best}\"")  # fmt: skip
    if "error" in report["calibration"]:
        notes.append(f"calibration failed, no calibration.json written: {report['calibration']['error']} "
                     "Rerun with more --repeats or longer --seq-lens")  # fmt: skip
    startup = report["startup_calibration"]
    if "error" in startup and startup["auto_runs_it"]:
        notes.append(f"the start-up calibration of a {startup['family']} model ({startup['config']} config) failed "
                     f"here ({startup['error']}): \"auto\" would warn and plan with the FLOP prior; give shorter "
                     "\"seq_lens\" (or max_tokens_per_gpu) for a measured model, or a calibration_file")  # fmt: skip
    elif "error" in startup:
        notes.append(f"the start-up calibration of a {startup['family']} model failed here ({startup['error']}); "
                     "\"auto\" leaves it off on this machine")  # fmt: skip
    for backend, why in report["kernels"]["unusable"].items():
        if why is not None and "not installed" in why:
            notes.append(f"{backend!r} unavailable: {why}")
    return notes


def render(report: dict) -> str:
    """The report as text for people."""
    v = report["versions"]
    lines = [f"deepspeed-knap doctor: {report['device']}, {report['dtype']}", "", "versions"]
    lines.append(f"  python {v['python']} on {v['platform']}")
    lines += [f"  {package} {version or '(not installed)'}" for package, version in v["packages"].items()]
    lines.append(f"  torch CUDA {v['torch_cuda']}, cuDNN {v['cudnn']}, NCCL {v['nccl']}; "
                 f"DeepSpeed accelerator {v['deepspeed_accelerator']}")  # fmt: skip
    lines += [f"  device {i}: {d['name']}, {d['memory_gib']} GiB, compute {d['capability']}"
              for i, d in enumerate(v["devices"])]  # fmt: skip
    lines += ["", f"attention kernels ('auto' runs {report['kernels']['auto']!r})"]
    for backend, why in report["kernels"]["unusable"].items():
        check = report["kernel_check"].get(backend)
        if check is None:
            lines.append(f"  {backend:<13} cannot run: {why}")
        else:
            worst = max(check["errors"].values())
            verdict = "ok" if check["ok"] else "FAILED"
            lines.append(
                f"  {backend:<13} runs; vs float64: max rel error {worst:.2g} (tolerance {check['tolerance']:.0e}) {verdict}"
            )
    d = report["dims"]
    lines += ["", f"model forward + backward, {d['double_blocks']}+{d['single_blocks']} blocks of {d['heads']}x"
              f"{d['head_dim']} heads, seconds by kernel"]  # fmt: skip
    for seq_len, times in report["speed_s"].items():
        cells = ", ".join(f"{backend} {seconds:.4g}" for backend, seconds in times.items())
        lines.append(f"  {seq_len:>7} tokens: {cells}; fastest {report['fastest'][str(seq_len)]}")
    c = report["calibration"]
    if "error" in c:
        lines += ["", f"calibration with {c['backend']!r} FAILED: {c['error']}"]
    else:
        lines += ["", f"calibration with {c['backend']!r}: a = {c['linear_coef']:.4g} s/token, "
                  f"b = {c['quadratic_coef']:.4g} s/token^2, overhead {c['overhead_s']:.4g} s, R^2 = {c['r2']:.4f}, "
                  f"max rel error {c['max_rel_error']:.1%}; written to {c['file']}"]  # fmt: skip
    lines += ["", render_startup(report["startup_calibration"])]
    lines += ["", "findings"] + [f"  - {note}" for note in report["findings"] or ["none"]]
    lines.append("")
    lines.append("all kernel checks passed" if report["ok"] else "A KERNEL CHECK FAILED")
    return "\n".join(lines) + "\n"


def render_startup(startup: dict) -> str:
    """The start-up calibration's lines of the report."""
    runs = ("runs here (\"auto\": a GPU)" if startup["auto_runs_it"]
            else "is off here with \"auto\" (no GPU); true turns it on")  # fmt: skip
    head = (f"start-up calibration of a {startup['family']} model ({startup['config']} config) at "
            f"{startup['seq_lens']} tokens: {runs}")  # fmt: skip
    if "error" in startup:
        return f"{head}\n  FAILED: {startup['error']}"
    seconds = ", ".join(f"{s}: {t:.4g} s" for s, t in zip(startup["seq_lens"], startup["seconds"], strict=True))
    return (f"{head}\n  copy built in {startup['build_s']:.1f} s, timed in {startup['timing_s']:.1f} s; "
            f"forward + backward {seconds}\n  a = {startup['linear_coef']:.4g} s/token, b = "
            f"{startup['quadratic_coef']:.4g} s/token^2, overhead {startup['overhead_s']:.4g} s ({startup['shape']} "
            f"shape), {startup['scale']:.3g}x the FLOP prior's compute, R^2 = {startup['r2']:.4f}, "
            f"max rel error {startup['max_rel_error']:.1%}")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=output_folder,
        default="doctor",
        metavar="DIR",
        help="writes doctor.json, doctor.txt, calibration.json",
    )
    parser.add_argument("--device", type=device, default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="default: bfloat16 on CUDA, float32 on CPU")  # fmt: skip
    parser.add_argument(
        "--heads", type=positive_int, default=None, help="attention heads (default: 24 on CUDA, 4 on CPU)"
    )
    parser.add_argument(
        "--head-dim", type=flux_head_dim, default=None, help="channels per head, even (default: 128 on CUDA, 32 on CPU)"
    )
    parser.add_argument("--double-blocks", type=nonnegative_int, default=19, help="double-stream blocks of the model")
    parser.add_argument("--single-blocks", type=nonnegative_int, default=38, help="single-stream blocks of the model")
    parser.add_argument(
        "--seq-lens",
        type=calibration_lengths,
        default=None,
        help="calibration lengths, 4 different at least (default: 1k-16k on CUDA, 128-1,024 on CPU)",
    )
    parser.add_argument(
        "--compare-lens",
        type=seq_lens,
        default=None,
        help="lengths to compare kernels at (default: 4096,32768 on CUDA)",
    )
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per measurement (median)")
    add_family_argument(parser, "the family whose start-up calibration is reported", having="step_timer")


def run(args: argparse.Namespace) -> int:
    report = run_doctor(args.out, args.device, getattr(torch, args.dtype) if args.dtype else None, args.heads,
                        args.head_dim, args.double_blocks, args.single_blocks, args.seq_lens,
                        args.compare_lens, args.repeats, args.family)  # fmt: skip
    print((Path(args.out) / "doctor.txt").read_text(), end="")
    print(f"report written to {Path(args.out) / 'doctor.json'} and doctor.txt")
    return 0 if report["ok"] else 1
