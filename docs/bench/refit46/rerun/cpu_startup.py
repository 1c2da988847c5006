"""What the start-up calibration costs on a CPU rank at its default lengths and repeats: per family,
``doctor``'s ``startup_calibration`` of the tiny config (one rank, float32), the seconds to build the
copy and to time it, and the modeled forward and backward at each length.

    OMP_NUM_THREADS=1 .venv/bin/python docs/bench/refit46/rerun/cpu_startup.py
"""

from __future__ import annotations

import torch

from deepspeed_knap.commands.doctor import startup_calibration
from deepspeed_knap.runtime.config import KnapCostModelConfig

if __name__ == "__main__":
    torch.set_num_threads(1)
    defaults = KnapCostModelConfig().startup_calibration
    for family in ("flux", "flux2", "flux3", "wan", "qwen-image"):
        report = startup_calibration(family, torch.device("cpu"), torch.float32, defaults.seq_lens, defaults.repeats)
        if "error" in report:
            print(f"{family}: {report['error']}")
            continue
        times = ", ".join(f"{s}:{t * 1e3:.0f}ms" for s, t in zip(report["seq_lens"], report["seconds"], strict=True))
        print(f"{family}: build {report['build_s']:.2f} s, timing {report['timing_s']:.2f} s, fwd+bwd {times}, "
              f"r2 {report['r2']:.4f}")  # fmt: skip
