"""What ``cost_model.startup_calibration`` costs at the real families' widths on one GPU: the
seconds of its timing (a copy of a fraction of the blocks, forward and backward, at each
length: :func:`~deepspeed_knap.models.timing.model_step_timer`, one warm-up run, then the median of
``--repeats``) and the fit it gives, per family.

    python3 docs/bench/gpu/startup_calibration.py --json startup_calibration.json

The timer reads only the model's ``family``, ``config`` and parameters' dtype, so a
:class:`~deepspeed_knap.models.timing.ConfigModel` carrying the family's ``full_config`` (FLUX.1
[dev]'s 19 + 38 blocks, FLUX.2 [dev]'s 8 + 48, Wan 14B's 40, Qwen-Image's 60) is timed without
building the full model. ``--tiny`` runs the tiny configs, for a
CPU check of the script.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from deepspeed_knap.cost.calibrate import fit_times, time_lengths
from deepspeed_knap.models.registry import spec
from deepspeed_knap.models.timing import ConfigModel, model_step_timer

FAMILIES = ("flux", "flux2", "wan", "qwen-image")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", default="1024,2048,4096,8192")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    rows = []
    for family in FAMILIES:
        base = spec(family)
        config = dict(base.tiny_config if args.tiny else base.full_config)
        start = time.perf_counter()
        step = model_step_timer(ConfigModel(family, config, dtype), device, dtype)
        built = time.perf_counter() - start
        times = time_lengths(step, seq_lens, args.repeats, progress=False)
        timed = time.perf_counter() - start - built
        try:
            model, fit = fit_times(seq_lens, times)
        except ValueError as error:  # times that do not grow: noise on a tiny model
            print(f"{family:10s} {error}")
            continue
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
        rows.append(dict(family=family, build_s=built, timing_s=timed, seq_lens=seq_lens, seconds=times.tolist(),
                         linear_coef=model.linear_coef, quadratic_coef=model.quadratic_coef, peak_gib=peak, **fit))  # fmt: skip
        print(f"{family:10s} copy built in {built:5.1f} s, timed in {timed:5.1f} s (peak {peak:5.1f} GiB): "
              f"modeled block stack {', '.join(f'{s}: {t:.3f} s' for s, t in zip(seq_lens, times, strict=True))}; "
              f"a = {model.linear_coef:.3g}, b = {model.quadratic_coef:.3g}, r2 {fit['r2']:.4f}", flush=True)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    if args.json:
        with open(args.json, "w") as file:
            name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
            json.dump({"device": name, "dtype": str(dtype), "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
