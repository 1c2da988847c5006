"""The cost model's calibration at start-up (``"cost_model": {"startup_calibration": ...}``): every
rank times its model's blocks (its family's ``step_timer``), the ranks gather the times, and every
rank fits the same model from them (:func:`~deepspeed_knap.cost.calibrate.startup_model`)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger
from torch import nn

from deepspeed_knap.cost.calibrate import StartupCalibration, startup_model, time_lengths
from deepspeed_knap.cost.model import CostModel
from deepspeed_knap.models.registry import spec
from deepspeed_knap.planner.topology import Topology
from deepspeed_knap.runtime.groups import all_gather_bytes, raise_together


def calibrate_at_start(model: nn.Module, prior: CostModel, seq_lens: Sequence[int], repeats: int,
                       topology: Topology, backend: str | None = None) -> StartupCalibration:  # fmt: skip
    """Time ``model``'s blocks at ``seq_lens`` on this rank's device, in the dtype of its parameters,
    with its attention ``backend`` under ``topology``, and fit one cost model from every rank's
    times. Collective over the world: every rank calls it; a rank whose timing fails makes every
    rank raise. Rank 0 logs the fit, the speeds and the seconds it took.

    Raises:
        ValueError: on every rank, naming the ranks whose timing failed and why.
    """
    import deepspeed.comm as dist

    start = time.perf_counter()
    device = torch.device(get_accelerator().current_device_name())
    dtype = next(model.parameters()).dtype
    times, problem = [], None
    try:
        step = spec(model.family).load("step_timer")(model, device, dtype, topology, backend)
        times = time_lengths(step, seq_lens, repeats, progress=dist.get_rank() == 0).tolist()
    except Exception as error:  # raised here alone, it would leave the other ranks in the gather
        problem = f"{type(error).__name__}: {error}"
    raise_together(problem, "knapformer.cost_model.startup_calibration (timing the model's blocks)")
    times_by_rank = [json.loads(data) for data in all_gather_bytes(json.dumps(times).encode())]
    calibration = startup_model(prior, seq_lens, times_by_rank)
    if dist.get_rank() == 0:
        model_now = calibration.model
        logger.info(f"knapformer: start-up calibration at {list(seq_lens)} tokens in {time.perf_counter() - start:.1f} s: "
                    f"a = {model_now.linear_coef:.4g} s/token, b = {model_now.quadratic_coef:.4g} s/token^2 "
                    f"({calibration.scale:.3g}x the prior's compute), rank speeds {list(calibration.speeds)}")  # fmt: skip
    return calibration
