"""The cost model's calibration at start-up (``"cost_model": {"startup_calibration": ...}``): every
rank times its model's blocks (its family's ``step_timer``), the ranks gather the times, and every
rank fits the same model from them (:func:`~deepspeed_knap.cost.calibrate.startup_model`)."""

from __future__ import annotations

import gc
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
from deepspeed_knap.runtime.groups import all_gather_bytes, gather_problems


def calibrate_at_start(model: nn.Module, prior: CostModel, seq_lens: Sequence[int], repeats: int,
                       topology: Topology, backend: str | None = None,
                       required: bool = True) -> StartupCalibration | None:  # fmt: skip
    """Time ``model``'s blocks at ``seq_lens`` on this rank's device, in the dtype of its parameters,
    with its attention ``backend`` under ``topology``, and fit one cost model from every rank's
    times. Collective over the world: every rank calls it, and every rank gets the same outcome.
    Rank 0 logs the fit, the speeds and the seconds it took. The copy's memory goes back to the
    device before it returns (the training's allocations start from what they had before).

    ``required``: a rank's failed timing (out of memory at the longest length, say), or times the
    fit refuses, make every rank raise. ``False`` (``enabled: "auto"``, which the user did not ask
    for by name): every rank returns ``None`` instead, to plan with ``prior``, and rank 0 logs why.

    Raises:
        ValueError: with ``required``, on every rank, naming the ranks whose timing failed and why,
            or why the times cannot be fitted.
    """
    import deepspeed.comm as dist

    start = time.perf_counter()
    device = torch.device(get_accelerator().current_device_name())
    dtype = next(model.parameters()).dtype
    times, problem, step = [], None, None
    try:
        step = spec(model.family).load("step_timer")(model, device, dtype, topology, backend)
        times = time_lengths(step, seq_lens, repeats, progress=dist.get_rank() == 0).tolist()
    except Exception as error:  # raised here alone, it would leave the other ranks in the gather
        problem = f"{type(error).__name__}: {error}"
    step = None  # the copy of the blocks, held by the step's closure
    gc.collect()  # and by a failed timing's frames, with its activations
    get_accelerator().empty_cache()
    what = "knapformer.cost_model.startup_calibration (timing the model's blocks)"
    details = gather_problems(problem)
    calibration = None
    if details is None:
        times_by_rank = [json.loads(data) for data in all_gather_bytes(json.dumps(times).encode())]
        try:  # the same times on every rank: a refused fit is refused on every rank alike
            calibration = startup_model(prior, seq_lens, times_by_rank)
        except Exception as error:
            details = f"{type(error).__name__}: {error}"
    if details is not None:
        if required:
            raise ValueError(f"{what} failed:\n{details}")
        if dist.get_rank() == 0:
            logger.warning(f"knapformer: {what} failed; the first steps plan with the cost model's prior. "
                           '"startup_calibration": false skips the timing; shorter seq_lens need less memory. '
                           f"Why:\n{details}")  # fmt: skip
        return None
    if dist.get_rank() == 0:
        model_now = calibration.model
        logger.info(f"knapformer: start-up calibration at {list(seq_lens)} tokens in {time.perf_counter() - start:.1f} s: "
                    f"a = {model_now.linear_coef:.4g} s/token, b = {model_now.quadratic_coef:.4g} s/token^2 "
                    f"({calibration.scale:.3g}x the prior's compute), rank speeds {list(calibration.speeds)}")  # fmt: skip
    return calibration
