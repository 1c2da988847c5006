"""Calibrate the cost model ``a*s + b*s^2`` from timed steps (pure: no torch; the timers are the
families', ``deepspeed_knap/models/<family>/calibrate.py``, through their specs' ``block_timer``).

    deepspeed-knap calibrate --out calibration.json                  # FLUX blocks, small dims (CPU)
    deepspeed-knap calibrate --flux-dims --dtype bfloat16 --out flux_h100.json   # on a GPU
    deepspeed-knap calibrate --callable mypkg.timing:step --out mine.json

For each sequence length ``s`` a step times forward + backward of the model's blocks on one sequence
of ``s`` tokens and returns the whole transformer's modeled seconds (FLUX:
``double_blocks * t_double(s) + single_blocks * t_single(s)``). A user callable ``step(s)`` must run
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
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from deepspeed_knap.cost.model import COEFFICIENTS, CostModel, degree_efficiency_pairs, nonnegative_least_squares

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
    """Write a calibration file: ``model``'s coefficients (:data:`~deepspeed_knap.cost.model.COEFFICIENTS`;
    ``about`` may give an ``alltoall_coef`` or ``route_coef`` measured elsewhere: one process times no
    all-to-all), the fit (its ``overhead_s``, which no plan reads, and its quality), the timings and
    what was timed."""
    coefficients = {name: getattr(model, name) for name in COEFFICIENTS if getattr(model, name) is not None}
    Path(path).write_text(json.dumps({
        **coefficients,
        **fit,
        "seq_lens": [int(s) for s in seq_lens],
        "seconds": [float(t) for t in times],
        **about,
    }, indent=2) + "\n")  # fmt: skip


def read_calibration(path: str | Path) -> CostModel:
    """The cost model of a calibration file (:func:`write_calibration`'s, or one written by hand): the
    coefficients it gives (:data:`~deepspeed_knap.cost.model.COEFFICIENTS`; ``linear_coef`` and
    ``quadratic_coef`` required), ``degree_efficiency`` and ``num_heads`` (the heads of the blocks
    timed, pricing groups they do not divide).

    Raises:
        ValueError: an unreadable file, or one without ``linear_coef`` and ``quadratic_coef`` (the
            message names the file and what it must hold).
    """
    try:
        data = json.loads(Path(path).read_text())
        coefficients = {name: None if data[name] is None else float(data[name]) for name in COEFFICIENTS
                        if name in data}  # fmt: skip
        linear, quadratic = coefficients.pop("linear_coef"), coefficients.pop("quadratic_coef")
        return CostModel(linear, quadratic, degree_efficiency=degree_efficiency_pairs(data.get("degree_efficiency")),
                         num_heads=int(data["num_heads"]) if data.get("num_heads") else None, **coefficients)  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"calibration file {path!r} is unreadable ({error}); it must be a JSON object with linear_coef, "
            f"quadratic_coef and optionally {', '.join(COEFFICIENTS[2:])}, degree_efficiency and num_heads, as "
            "deepspeed-knap calibrate writes"
        ) from None
