"""Online refit of the cost model from measured step times, identical on every rank.

Every step each rank measures how long its share of the block stack took to compute (forward and
backward, Ulysses exchanges excluded: :mod:`~deepspeed_knap.timing`) and ships the microseconds
with the next step's lengths. Every rank therefore holds the same history of (plan, measured
microseconds per GPU) and refits the same model from it:

    measured[g] = (overhead + a * X[g] + b * Y[g]) / speed[g]

where ``X[g] = sum s / (G * efficiency(G))`` and ``Y[g] = sum s**2 / (G * efficiency(G))`` over the
sequences whose group holds GPU ``g`` (the planner's own per-GPU terms), ``speed[g]`` is a per-rank
speed factor (a throttled GPU, an older GPU in a mixed pool) and ``overhead`` the fixed cost of a
busy rank. The refit alternates: with the speeds fixed, ``overhead, a, b >= 0`` by weighted
non-negative least squares (weights decay by ``forgetting`` per step of age); with ``a, b`` fixed,
each rank's speed is its predicted over its measured time summed over the history (so one noisy step
moves it little), divided by the median rank's (speeds are relative: ``a, b`` carry the common
scale) and clamped to ``[1 / max_speed_ratio, max_speed_ratio]``. The all-to-all coefficient ``c``
is refit from the Ulysses exchange times: the smallest ``ulysses[g] / Z[g]`` of a step, its least
waiting rank, with ``Z[g] = sum s * (G - 1) / G**2``.

Determinism: inputs are integers (tokens, microseconds), the arithmetic is plain Python floats in a
fixed order (:func:`~deepspeed_knap.workload.nonnegative_least_squares` uses no BLAS, whose reduction
order can differ between machines), so every rank computes a bit-identical model and the planner a
bit-identical plan. No torch, no communication.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass

import numpy as np

from deepspeed_knap.planner import RoutingPlan
from deepspeed_knap.workload import WorkloadModel, nonnegative_least_squares

# Refits alternate this many times between the coefficients and the speeds.
_ALTERNATIONS = 3


@dataclass(frozen=True)
class OnlineSettings:
    """Knobs of the online refit (the ``"workload"`` block's ``online`` keys).

    Attributes:
        warmup_steps: steps observed before the first refit; until then the prior model plans.
        forgetting: weight of a step relative to the next newer one (1: all steps count alike).
        refit_interval: refit every this many observed steps.
        max_speed_ratio: a rank's speed factor stays within ``[1/r, r]`` of the median rank's.
        window: most recent steps kept.
    """

    warmup_steps: int = 5
    forgetting: float = 0.9
    refit_interval: int = 1
    max_speed_ratio: float = 4.0
    window: int = 64

    def __post_init__(self) -> None:
        if self.warmup_steps < 1 or self.refit_interval < 1 or self.window < 1:
            raise ValueError(
                f"online refit needs warmup_steps, refit_interval and window >= 1; got {self.warmup_steps}, "
                f"{self.refit_interval}, {self.window}"
            )
        if not 0 < self.forgetting <= 1 or not self.max_speed_ratio > 1:
            raise ValueError(
                f"online refit needs 0 < forgetting <= 1 and max_speed_ratio > 1; got {self.forgetting}, "
                f"{self.max_speed_ratio}"
            )


@dataclass(frozen=True)
class Observation:
    """One step as the refit sees it: per GPU the planner's terms and the measured times.

    Attributes:
        linear, quadratic, alltoall: ``[S]`` the terms ``X``, ``Y``, ``Z`` of the module docstring.
        compute_us, ulysses_us: ``[S]`` measured microseconds; ``None`` where a rank's timer failed.
    """

    linear: tuple[float, ...]
    quadratic: tuple[float, ...]
    alltoall: tuple[float, ...]
    compute_us: tuple[int | None, ...]
    ulysses_us: tuple[int | None, ...]


def plan_terms(plan: RoutingPlan, workload: WorkloadModel) -> tuple[list[float], list[float], list[float]]:
    """Per GPU ``X, Y, Z`` (module docstring) of ``plan``, in plain floats, sequence by sequence."""
    linear, quadratic, alltoall = ([0.0] * plan.num_gpus for _ in range(3))
    efficiency = {int(g): float(e) for g, e in workload.degree_efficiency or ()}
    for s, start, size in zip(plan.seq_lens.tolist(), plan.seq_group_start.tolist(), plan.seq_group_size.tolist(),
                              strict=True):  # fmt: skip
        share = size * efficiency.get(size, 1.0)
        x, y, z = s / share, s * s / share, s * (size - 1) / (size * size)
        for gpu in range(start, start + size):
            linear[gpu] += x
            quadratic[gpu] += y
            alltoall[gpu] += z
    return linear, quadratic, alltoall


class OnlineWorkload:
    """The cost model, refit every step from the measured history (see the module docstring).

    Args:
        prior: the model to plan with until the first refit (and its ``degree_efficiency``, kept).
        num_gpus: ``S``, GPUs of the balance group.
        settings: the refit's knobs.
    """

    def __init__(self, prior: WorkloadModel, num_gpus: int, settings: OnlineSettings | None = None) -> None:
        self.prior = prior
        self.num_gpus = num_gpus
        self.settings = settings or OnlineSettings()
        self.history: deque[Observation] = deque(maxlen=self.settings.window)
        self.observed = 0
        self.speeds = [1.0] * num_gpus
        self.current = prior
        self.overhead_s = 0.0

    def observe(self, plan: RoutingPlan, compute_us: list[int], ulysses_us: list[int]) -> None:
        """Add one step: ``plan`` and the microseconds every GPU measured for it (negative: none).
        Refits when due."""
        valid = [t if t >= 0 else None for t in compute_us]
        linear, quadratic, alltoall = plan_terms(plan, self.current)
        self.history.append(Observation(tuple(linear), tuple(quadratic), tuple(alltoall), tuple(valid),
                                         tuple(u if u >= 0 else None for u in ulysses_us)))  # fmt: skip
        self.observed += 1
        warm = self.observed >= self.settings.warmup_steps
        if warm and (self.observed - self.settings.warmup_steps) % self.settings.refit_interval == 0:
            self._refit()

    def model(self) -> WorkloadModel:
        """The model to plan the next step with."""
        return self.current

    def predicted_s(self, plan: RoutingPlan) -> list[float]:
        """``[S]`` seconds the current model predicts each GPU computes under ``plan`` (with overhead)."""
        linear, quadratic, _ = plan_terms(plan, self.current)
        m = self.current
        return [
            (self.overhead_s + m.linear_coef * x + m.quadratic_coef * y) / speed if x > 0 else 0.0
            for x, y, speed in zip(linear, quadratic, self.speeds, strict=True)
        ]

    def _weighted_rows(self):
        """``(weight, X, Y, measured seconds, gpu)`` of every busy GPU with a measurement, newest last."""
        ages = len(self.history) - 1
        for age, obs in enumerate(self.history):
            weight = self.settings.forgetting ** (ages - age)
            for gpu, (x, y, t) in enumerate(zip(obs.linear, obs.quadratic, obs.compute_us, strict=True)):
                if t is not None and x > 0:
                    yield weight, x, y, t / 1e6, gpu

    def _refit(self) -> None:
        rows = list(self._weighted_rows())
        if len(rows) < 3:
            return
        speeds, coef = list(self.speeds), (0.0, self.current.linear_coef, self.current.quadratic_coef)
        weights = np.array([w for w, *_ in rows])
        for _ in range(_ALTERNATIONS):
            targets = np.array([t * speeds[g] for _, _, _, t, g in rows])
            coef = nonnegative_least_squares(
                np.array([(1.0, x, y) for _, x, y, _, _ in rows]), targets, weights
            ).tolist()
            if coef[1] == 0 and coef[2] == 0:
                # All overhead: the steps so far gave every GPU the same work (a balanced start), so
                # the data cannot tell a fixed cost from a per-token one. Take it all as per token.
                a, b = nonnegative_least_squares(np.array([(x, y) for _, x, y, _, _ in rows]), targets, weights)
                coef = [0.0, float(a), float(b)]
            if coef[1] == 0 and coef[2] == 0:
                return  # the measurements say nothing usable yet: keep the current model
            speeds = self._fit_speeds(rows, coef)
        self.overhead_s = coef[0]
        self.speeds = speeds
        self.current = dataclasses.replace(self.prior, linear_coef=coef[1], quadratic_coef=coef[2],
                                           alltoall_coef=self._fit_alltoall(), gpu_speed=tuple(speeds))  # fmt: skip

    def _fit_speeds(self, rows, coef) -> list[float]:
        predicted, measured = [0.0] * self.num_gpus, [0.0] * self.num_gpus
        for w, x, y, t, g in rows:
            predicted[g] += w * (coef[0] + coef[1] * x + coef[2] * y)
            measured[g] += w * t
        raw = [p / m if m > 0 else None for p, m in zip(predicted, measured, strict=True)]
        known = sorted(r for r in raw if r is not None)
        median = known[len(known) // 2] if known else 1.0
        bound = self.settings.max_speed_ratio
        return [min(max((r if r is not None else median) / median, 1 / bound), bound) for r in raw]

    def _fit_alltoall(self) -> float:
        """Weighted mean over steps of the least-waiting rank's Ulysses seconds per unit of ``Z``."""
        total = weight_sum = 0.0
        ages = len(self.history) - 1
        for age, obs in enumerate(self.history):
            rates = [u / 1e6 / z for z, u in zip(obs.alltoall, obs.ulysses_us, strict=True) if u is not None and z > 0]
            if rates:
                weight = self.settings.forgetting ** (ages - age)
                total += weight * min(rates)
                weight_sum += weight
        return total / weight_sum if weight_sum else self.current.alltoall_coef
