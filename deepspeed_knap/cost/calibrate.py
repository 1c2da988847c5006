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

import dataclasses
import importlib
import json
import math
import statistics
import time
from collections.abc import Callable, Collection, Sequence
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
    times = time_lengths(step, seq_lens, repeats)
    model, fit = fit_times(seq_lens, times)
    return model, times, fit


def time_lengths(step: Step, seq_lens: Sequence[int], repeats: int, progress: bool = True) -> np.ndarray:
    """``[M]`` median seconds of ``step`` at each of ``seq_lens`` (:func:`time_step`), after one run
    at the largest (which grows the allocator and thread pools)."""
    step(max(seq_lens))
    lengths = tqdm(seq_lens, desc="calibrate", leave=False, disable=not progress)
    return np.array([time_step(step, s, repeats) for s in lengths])


def fit_times(seq_lens: Sequence[int], times: Sequence[float]) -> tuple[CostModel, dict[str, float]]:
    """``overhead + a*s + b*s^2`` fitted to ``times`` (seconds at ``seq_lens``) by non-negative least
    squares: the model (``a``, ``b``) and the fit (``overhead_s``, ``r2``, ``max_rel_error``).

    Raises:
        ValueError: times that do not grow with the length.
    """
    s, times = np.asarray(seq_lens, dtype=np.float64), np.asarray(times, dtype=np.float64)
    overhead, a, b = nonnegative_least_squares(np.stack([np.ones_like(s), s, s * s], axis=1), times)
    if a == 0 and b == 0:
        raise ValueError(f"the times {times.tolist()} do not grow with the length; is the step doing any work?")
    predicted = overhead + a * s + b * s * s
    spread = float(np.sum((times - times.mean()) ** 2))
    r2 = 1 - float(np.sum((times - predicted) ** 2)) / spread if spread > 0 else 1.0
    fit = {"overhead_s": float(overhead), "r2": r2, "max_rel_error": float(np.max(np.abs(predicted - times) / times))}
    return CostModel(float(a), float(b)), fit


# A rank's start-up speed departs from 1 only when it does by more than this share and by more than
# SPEED_EVIDENCE standard errors of its per-length ratios: equal ranks time a few percent apart.
SPEED_MARGIN = 0.15
SPEED_EVIDENCE = 3.0
# A start-up speed stays within [1 / r, r] of the median rank's, as the online refit's does by
# default (OnlineSettings.max_speed_ratio): a rank 64x slower would round to a speed of 0.
MAX_START_SPEED_RATIO = 4.0


@dataclasses.dataclass(frozen=True)
class StartupCalibration:
    """What the ranks' timings at start-up gave (:func:`startup_model`).

    Attributes:
        model: the prior with the fitted ``a``, ``b`` and ``overhead_s`` (the seconds a step costs
            whatever its tokens: kernel launches, which dominate short steps on a GPU; every GPU pays
            it, so with equal speeds it moves no plan, but the modeled seconds match the measured),
            its all-to-all price timed, scaled as the compute was, or given, its per-sequence price
            scaled, and ``gpu_speed`` where a rank was shown off the others (every rank timed;
            :func:`~deepspeed_knap.runtime.calibration.calibrate_at_start` keeps its balance group's).
        speeds: ``[S]`` each timed rank's speed (1: the median rank's; within ``[1/4, 4]``).
        scale: the fitted compute over the prior's at the longest length.
        fit: the fit of the ranks' median times (:func:`fit_times`); ``shape``: ``"fitted"``, or
            ``"prior"`` where the fit put ``a`` or ``b`` at 0 and the prior's ratio of the two was
            scaled to the times instead; ``alltoall``: ``"timed"`` (the ranks' Ulysses exchanges),
            ``"scaled"`` (the prior's, scaled) or ``"given"`` (the user's, kept).
    """

    model: CostModel
    speeds: tuple[float, ...]
    scale: float
    fit: dict[str, float]


def startup_model(
    prior: CostModel,
    seq_lens: Sequence[int],
    times_by_rank: Sequence[Sequence[float]],
    alltoall_by_rank: Sequence[float | None] | None = None,
    given: Collection[str] = (),
) -> StartupCalibration:
    """One cost model from every rank's timings of its block stack at ``seq_lens`` (the same on every
    rank: pure, and every rank calls it on the same all-gathered times).

    The fit is of the ranks' median times per length (the lower median: with 2 ranks the faster's;
    :func:`fit_times`), so one slow rank does not move it; where it puts ``a`` or ``b`` at 0 (the
    lengths did not show that term), the prior's ``a : b`` is scaled to the times instead. A rank's
    speed is the median over the lengths of that median time over its own, called (rounded to
    1/32) only when it departs from 1 by more than :data:`SPEED_MARGIN` and
    :data:`SPEED_EVIDENCE` standard errors of those ratios; else 1. The per-sequence cost
    (``sequence_coef``) is scaled by the fitted compute over the prior's at the longest length. So
    are the all-to-all prices (``alltoall_coef``, ``inter_node_alltoall_coef``), as the online refit
    scales them before it times an exchange (a FLOP preset guesses the links as it guesses the GPU),
    unless the ranks timed their Ulysses exchanges: then ``alltoall_coef`` is the lower median of
    their prices, and ``inter_node_alltoall_coef`` keeps its ratio to it. The prices in ``given``
    stay the prior's (the user's measurements, not a preset's guesses); with ``alltoall_coef``
    given, so does ``inter_node_alltoall_coef`` (its ratio to ``c`` kept).

    Args:
        prior: the configured model (its degree efficiency, route prices and heads are kept).
        seq_lens: ``[M]`` lengths timed, at least 3 different.
        times_by_rank: ``[S][M]`` seconds of rank ``r`` at ``seq_lens[m]``.
        alltoall_by_rank: ``[S]`` each rank's timed ``alltoall_coef`` (seconds per unit of
            ``s * (G - 1) / G**2``: :func:`~deepspeed_knap.runtime.calibration.time_ulysses_exchanges`),
            ``None`` for a rank that timed none; ``None``: none timed.
        given: names of the prior's prices the user gave (``alltoall_coef``,
            ``inter_node_alltoall_coef``, ``sequence_coef``), kept as they are (``0`` included).

    Raises:
        ValueError: fewer than 3 lengths, ragged or non-positive times, times that do not grow, or
            timed prices that are not positive.
    """
    times = np.asarray(times_by_rank, dtype=np.float64)
    if len(set(seq_lens)) < 3 or times.ndim != 2 or times.shape[1] != len(seq_lens) or not (times > 0).all():
        raise ValueError(f"start-up calibration needs >= 3 different lengths and positive seconds per rank and "
                         f"length; got lengths {list(seq_lens)} and times {times.tolist()}")  # fmt: skip
    median = np.sort(times, axis=0)[(len(times) - 1) // 2]  # [M] a rank's own times: the lower median
    fitted, fit = fit_times(seq_lens, median)
    shape = "fitted"
    if (fitted.linear_coef == 0 or fitted.quadratic_coef == 0) and prior.linear_coef > 0 and prior.quadratic_coef > 0:
        # A coefficient at its bound: the lengths did not show it (a fixed cost hid the linear work at
        # the short ones, on an H200 at FLUX.1's width). The prior's ratio of the two stands, scaled.
        s = np.asarray(seq_lens, dtype=np.float64)
        work = prior.linear_coef * s + prior.quadratic_coef * s * s
        overhead, k = nonnegative_least_squares(np.stack([np.ones_like(s), work], axis=1), median)
        if k > 0:
            fitted, shape = CostModel(prior.linear_coef * k, prior.quadratic_coef * k), "prior"
            fit = {**fit, "overhead_s": float(overhead)}
    ratios = median[None, :] / times  # [S, M]: > 1 where a rank is faster than the median rank
    speeds = []
    for row in ratios:
        speed = float(np.median(row))
        error = float(np.std(row, ddof=1) / np.sqrt(len(row))) if len(row) > 1 else 0.0
        shown = abs(speed - 1) > max(SPEED_MARGIN, SPEED_EVIDENCE * error)
        bounded = min(max(speed, 1 / MAX_START_SPEED_RATIO), MAX_START_SPEED_RATIO)
        speeds.append(round(bounded * 32) / 32 if shown else 1.0)
    longest = float(max(seq_lens))
    priced = prior.linear_coef * longest + prior.quadratic_coef * longest**2
    scale = (fitted.linear_coef * longest + fitted.quadratic_coef * longest**2) / priced if priced > 0 else 1.0
    scaled = {name: getattr(prior, name) * scale for name in ("alltoall_coef", "inter_node_alltoall_coef",
                                                              "sequence_coef") if getattr(prior, name) is not None}  # fmt: skip
    timed = sorted(c for c in alltoall_by_rank or () if c is not None)
    alltoall = "scaled"
    if timed:
        if not all(math.isfinite(c) and c > 0 for c in timed):
            raise ValueError(f"start-up calibration needs positive all-to-all prices; got {list(alltoall_by_rank)}. "
                             'Set "startup_calibration": false, or give measured coefficients with alltoall_coef')  # fmt: skip
        measured, alltoall = timed[(len(timed) - 1) // 2], "timed"  # the lower median, as for the times
        scaled["alltoall_coef"] = measured
        if prior.inter_node_alltoall_coef is not None and prior.alltoall_coef > 0:  # c' keeps its ratio to c
            scaled["inter_node_alltoall_coef"] = prior.inter_node_alltoall_coef * measured / prior.alltoall_coef
    for name in given:
        scaled.pop(name, None)
    if "alltoall_coef" in given:
        alltoall = "given"
        scaled.pop("inter_node_alltoall_coef", None)  # c' keeps its ratio to the given c: c stays, so c' does
    model = dataclasses.replace(prior, linear_coef=fitted.linear_coef, quadratic_coef=fitted.quadratic_coef, **scaled,
                                overhead_s=fit["overhead_s"],
                                gpu_speed=tuple(speeds) if any(speed != 1.0 for speed in speeds) else None)  # fmt: skip
    return StartupCalibration(model, tuple(speeds), float(scale), {**fit, "shape": shape, "alltoall": alltoall})


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
                         num_heads=data.get("num_heads"), **coefficients)  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"calibration file {path!r} is unreadable ({error}); it must be a JSON object with linear_coef, "
            f"quadratic_coef and optionally {', '.join(COEFFICIENTS[2:])}, degree_efficiency and num_heads, as "
            "deepspeed-knap calibrate writes"
        ) from None
