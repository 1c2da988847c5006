"""Online refit of the cost model from measured step times, identical on every rank.

Every step each rank measures how long its share of the block stack took to compute (forward and
backward, Ulysses exchanges excluded: :mod:`~deepspeed_knap.runtime.timing`) and ships the microseconds
with the next step's lengths. Every rank therefore sees the same (plan, measured microseconds per
GPU) every step and refits the same model from them:

    measured[g] = (overhead + a * X[g] + b * Y[g] + e * W[g]) / speed[g]

where ``X[g] = sum s / (G * efficiency(G))`` and ``Y[g] = sum s**2 * heads(G) / (G * efficiency(G))``
over the sequences whose group holds GPU ``g`` (the planner's own per-GPU terms; ``heads(G)`` the
cost model's :meth:`~deepspeed_knap.cost.model.CostModel.head_factor`), ``W[g]`` the number of
those sequences and ``e`` the prior's per-sequence cost every member repeats (``sequence_coef``,
known, not refit: Wan's text projections), ``speed[g]`` is a per-rank
speed factor (a throttled GPU, an older GPU in a mixed pool) and ``overhead`` the fixed cost of a
rank per step (launches, Python; on a slow rank it is larger, so the planner gives that rank less
work: :attr:`~deepspeed_knap.cost.model.CostModel.overhead_s`). Past steps count with weight
``forgetting ** age``, kept as running sums per GPU (the refit costs ``O(S)`` whatever the
history). The refit alternates: with the speeds fixed, ``overhead, a, b >= 0`` by weighted
non-negative least squares on those sums; with ``a, b`` fixed, each rank's speed is its predicted
over its measured time summed over the history (once refit, a step counts at most
``max_speed_ratio`` times off the prediction, so one noisy step moves it little), divided by the
median rank's (speeds are relative: ``a, b`` carry the common scale), clamped to
``[1 / max_speed_ratio, max_speed_ratio]`` and rounded to a multiple of 1/32 (so that
the planner sees few distinct speeds: it prices groups by class of size and speed). A rank's speed
departs from the median rank's only when the measurements show it: when the two differ by more than
``EVIDENCE`` standard errors (a speed's relative variance is the scatter of one step about
its fitted speed, pooled over the ranks, over the rank's effective number of steps under the
forgetting; the scatter includes the model's misfit of the plan). Otherwise noise would be planned
as speed: on 2 CPU ranks with equal cores, step-to-step timer noise of ~5% made the refit call one
rank 6-12% slower, and the plan then gave it 6-12% fewer tokens than the balanced plan, losing more
than the planner gained (``bench train``, kf_mixed_res). The pooled scatter is weighed with a
prior (``PRIOR_SCATTER``, 10% a step, worth ``PRIOR_SCATTER_DOF`` = 4 degrees of freedom: the
conjugate update of a normal variance), and the speed test takes the t quantile of the prior's and
the measured degrees of freedom together. Measured alone, the scatter of the first steps is itself
so uncertain (2 GPUs of two steps each: about 2 degrees of freedom, 6.75 standard errors at 3's
tail) that a 2x slower rank on 2 GPUs at 10% noise was called after two measured steps in 7 of 20
seeds; with the prior in 15, and equal GPUs no more often (none of 1,600 decisions at 5% or 10%
noise either way; at 20%, twice the prior's, 2 against none). No speed is called or dropped on
less than one measured degree of freedom (one step per GPU): the prior alone is no evidence, and
the speeds stay as they were (the start-up calibration's at the first refit). A speed is called
only where the planned coefficients and a fit of the same ratio of ``a`` to ``b`` with an overhead
fitted free (``h + k (a X + b Y)``, both ``>= 0``, its one more parameter taken from the scatter's
degrees of freedom) both show it. The planned overhead is the prior's until its test shows another
(below), and a misfit the same for one rank step after step is bias, not scatter: where one rank
always held the long sequences and the other the short ones (every sequence home, 5% noise), a
prior with half of a true 20 ms overhead had equal GPUs called unequal in 200 of 300 refits, the
short rank at 0.84-0.91; with the free overhead's test, in none, and a 2x slower rank holding the
long ones is still called in 282 of 300 (290 before), one holding the short ones no more (its times
are an overhead's too). Plans that give every rank a mix of sizes, as balanced ones do, tell the
two apart, and call as before. Likewise the overhead
is fitted only when it exceeds ``OVERHEAD_EVIDENCE`` (5)
standard errors in the full model, else ``a, b`` are fitted without it: balanced plans give every GPU
about the same work step after step, so the data cannot tell a fixed cost from per-token work, and
noise once called 60 of a 62 ms step overhead (``a = 0``, 2 CPU ranks), which priced moving work at
nothing and kept every sequence home for two steps. This test takes Student's t quantile for the
degrees of freedom the residual was measured with. A prior that has an overhead (the start-up
calibration's fixed cost, most of a short step on a GPU) keeps it in proportion instead: the
overhead is ``k o0``, with ``k`` the scale fitted to ``a, b`` below, and departs from it (either way)
only beyond ``OVERHEAD_EVIDENCE`` standard errors (below 0: none), also where the shape departs;
dropped, the steps' spread in tokens is all per-token work and the model misprices the smaller and
larger steps (synthetic, a 20 ms overhead, a third of a step: 1.1% against 0.6% median error; one
H200 at FLUX.1's width: 3.5-4.0% against 1.0-1.9%). Likewise the ratio of ``a`` to ``b``: it departs
from the prior's only when the free fit's ``d`` in ``h + k (o0 + a0 X + b0 Y) + d X`` (``+ d Y``
when ``b0 = 0``) exceeds ``SHAPE_EVIDENCE`` (2) standard errors; otherwise ``a, b`` are the prior's
times one fitted scale. On near-balanced plans ``X`` and ``Y`` rise together: noise moved ``b / a`` between 0
and 5x the prior's from refit to refit (2 CPU ranks, kf_mixed_res x1/4, where the free fit settled
on the prior's ratio after 13 steps), and ``auto`` balanced worse than knapformer's plans from the
prior (kf_mixed_res and kf_image_video x1/4 on 2 CPU ranks of a 16-core host: compute max/mean
1.06-1.11 against knapformer on g1n2's 1.04-1.07). The forgetting keeps about 19 steps in the
fit at 0.9, so that noise never averages out. The all-to-all
coefficient ``c`` is refit from the Ulysses exchange times: the smallest ``ulysses[g] / Z[g]`` of a
step, its least waiting rank, with ``Z[g] = sum s * (G - 1) / G**2``. Until a step has measured
one, the prior's ``c`` keeps its proportion to the compute: it is scaled by the refit's compute
scale (the fitted per-token seconds ``a X + b Y`` of the measured work over the prior's). A prior's
``c`` from a preset is a guess at the link as its ``a, b`` are at the GPU; left as it was next to a
refit 17,000 times the prior's (2 CPU ranks against the H100 FLOP prior), it priced gloo's
all-to-alls like NVLink's, and ``auto`` split sequences until a measured exchange taught it
otherwise (two steps of 20-30 ms of all-to-alls on 100 ms steps in ``bench train``). A measured
prior (a calibration file, given coefficients) has a scale near 1 and keeps its ``c``. The
inter-node ``c'`` keeps its ratio to ``c`` (to the compute when the prior's ``c`` is 0). A scaled
``c`` that keeps every sequence whole is never timed: it stays the prior's in proportion.

Evidence expires: a GPU's sums once their weight is under ``_EVIDENCE_EXPIRED`` (1%: it has not
been measured busy for 44 steps at forgetting 0.9; never at 1), the timed Ulysses exchanges
likewise (the scaled prior's ``c`` returns), and the route fit below. Left to decay, the weights end
in subnormal floats whose ratios are noise (``c`` of 1 s per token after 8,000 steps).

With ``fit_route``, the route coefficient (:attr:`~deepspeed_knap.cost.model.CostModel.route_coef`,
seconds of one token's round trip) and the route latency (``route_latency_s``, what the phase costs
once anything moves) are refit from the route phases (the route and reverse-route exchanges, forward
and backward) by least squares on weighted running sums::

    route_phase[g] = route_latency_s + route_coef * x[g],   x[g] = max(sent[g], received[g])

``x[g]`` the tokens GPU ``g`` moves under the plan (:func:`~deepspeed_knap.planner.route.moved_tokens`)
and ``route_phase[g]`` its measured route-phase seconds, which include its wait for its partners.
Each step gives one pair ``(x, t)``: of the GPUs that moved tokens, the one whose seconds per own
moved token are least (it waited least). A GPU's time is paired with its own traffic, not with the
busiest GPU's: a GPU outside the route (nothing to send or receive) finishes its all-to-alls at once,
and pairing its time with the busiest GPU's tokens would price routes near zero (measured on 3 gloo
ranks: 2 ms against 170 ms). Both are fitted ``>= 0``, and the latency only where it is shown
(``EVIDENCE`` standard errors, as a rank's speed): otherwise through the origin,
``route_coef = sum x*t / sum x**2``, the latency counted per token at the steps' ``x`` (an upper
estimate of what one more moved token costs, so the planner errs towards keeping sequences home);
a latency the prior gives is then kept, and the rest of the phase fitted per token.
From step to step the moved tokens may vary by a few percent only (3% on ``kf_mixed_res`` at 8
GPUs), too little to tell the two apart. Where they vary more (on 2 CPU ranks of ``kf_lowres``
x1/4, 160 to 1,350 tokens, route phases of 2-12 ms) the fit through the origin, ruled by the large
moves, priced a move of 160 tokens at 1.2 ms against 2-7 ms measured; the free fit there gave
``L`` 2-4 ms, though not yet at 3 standard errors in 17 steps. A plan that keeps every token home
runs none of the route's all-to-alls
(:attr:`~deepspeed_knap.runtime.routing.RoutedBatch.stays_home`), so the latency is a real price of
moving anything. The coefficients are refit once
``warmup_steps`` observed steps moved tokens, and it replaces the prior's even when that is 0: route
pricing turns on from the measurements. Steps that move nothing say nothing; but a price that keeps
every sequence home would never be measured again, so the fit expires: once the newest step that
moved tokens weighs under ``_EVIDENCE_EXPIRED``, the prior's coefficient and latency return and the next step
that moves tokens (with a prior of 0, the next plan moves some) refits it at once. Every token
counts as staying inside its
node (as ``c`` is fitted); ``inter_node_route_coef`` stays the prior's (given: as given; ``None``:
follows the fitted ``route_coef``).

Determinism: inputs are integers (tokens, microseconds); the per-GPU arithmetic is NumPy
elementwise operations (each one IEEE operation, the same bits on every machine) and its sums over
GPUs and sequences are taken left to right (``np.bincount``, ``np.add.accumulate``: never
``np.sum``'s pairwise order or BLAS, whose reduction order can differ between machines); the fits
are plain Python floats in a fixed order (:func:`~deepspeed_knap.cost.model.nonnegative_normal_equations`),
and weights decay by multiplication, not ``pow``. So every rank computes a bit-identical model and
the planner a bit-identical plan. The per-GPU work is NumPy so that the refit, which every rank runs
in every step, stays small at scale (``bench planner``'s refit column on a 2-core host: 0.6-0.8 ms a
step at 32 GPUs, 1.7-3.3 ms at 1,024). No torch, no communication.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from deepspeed_knap.cost.model import (
    CostModel,
    index_ranges,
    nonnegative_normal_equations,
    normal_equations_residual,
    solve_linear,
    unit_norm_gram,
)

# Refits alternate at most this many times between the coefficients and the speeds, stopping once the
# speeds come back unchanged (with equal ranks, after the first: half the refit's time at 2 GPUs).
_ALTERNATIONS = 3
# Evidence whose weight has decayed below this is dropped (module docstring): a GPU's measured steps,
# the timed Ulysses exchanges, the steps that moved tokens. 44 steps at forgetting 0.9; never at 1.
_EVIDENCE_EXPIRED = 0.01
# Speeds are rounded to multiples of 1 / this (no libm: log and pow may differ in the last bit
# between machines, and a rounding boundary would then split the ranks).
_SPEED_GRID = 32
# A rank's speed departs from the median rank's only beyond this many standard errors (module
# docstring): 3, so that equal ranks are called unequal about once in 400.
EVIDENCE = 3.0
# The prior of a step's relative scatter about its rank's speed (variance, as 10% per step), worth
# PRIOR_SCATTER_DOF degrees of freedom of measured scatter: the measured scatter is weighed with it
# (the conjugate update of a normal variance) instead of standing alone, so that the first refits,
# whose few steps estimate it badly, test a speed against a scatter known at least this well (module
# docstring). 10%: twice the timer noise of 2 CPU ranks (5%), so the prior errs towards not calling.
PRIOR_SCATTER = 0.01
PRIOR_SCATTER_DOF = 4.0
# A fixed overhead is planned with only beyond this many: a false one costs more than a missed one
# (it takes its share from the per-token terms, so moving work looks cheaper to skip than it is,
# where a missed overhead is folded into a and b and changes a plan of equal speeds little).
OVERHEAD_EVIDENCE = 5.0
# The ratio of a to b departs from the prior's only beyond this many (module docstring). Simulated on
# 2 GPUs of whole sequences, 5-10% noise, 30 steps: with a prior's ratio within 1.25x of the truth's,
# 2 or 3 kept the plans' modeled max load within 0.12% of the truth's plans on average (1.3% at
# worst), the free fit 0.2-0.8% (3-7%); with a ratio 7x off, 2 cost 0.8-2%, 3 1.1-2.7%, free 0.2-1%.
SHAPE_EVIDENCE = 2.0


# The coefficients (cost.model.COEFFICIENTS) the refit fits from measured steps; the others it plans
# with as the prior gives them.
FITTED = ("linear_coef", "quadratic_coef", "alltoall_coef", "inter_node_alltoall_coef", "route_coef", "route_latency_s")


class Placement(Protocol):
    """Where a step's sequences ran: what the refit reads of a plan
    (:class:`~deepspeed_knap.planner.plan.RoutingPlan` is one)."""

    num_gpus: int
    seq_lens: np.ndarray  # [N] tokens
    seq_group_start: np.ndarray  # [N] first GPU of each sequence's group
    seq_group_size: np.ndarray  # [N] its group's size


def _critical(evidence: float, degrees_of_freedom: float) -> float:
    """``evidence`` standard errors of a variance estimated with ``degrees_of_freedom``: Student's t
    quantile of the same tail, to first order in ``1 / dof`` (Cornish-Fisher; for 3, 4.1 at 7 where
    the exact quantile is 4.5): a scatter measured over few steps is itself uncertain."""
    return evidence * (1 + (evidence * evidence + 1) / (4 * degrees_of_freedom))


@dataclass(frozen=True)
class OnlineSettings:
    """Knobs of the online refit (the ``"cost_model"`` block's ``"online"`` object).

    Attributes:
        warmup_steps: steps observed before the first refit; until then the prior model plans.
            The balancer observes every step but a run's first, whose one-time costs (allocator
            growth, lazy initialisation, the first collectives' connections) are not the model's:
            with 1, the second step's times refit the model (the third step plans with it, the
            fourth where plans are solved a step ahead). What the measurements do not yet show (a
            rank's speed: two steps at least; the shape, an overhead) stays the prior's until its
            evidence test passes.
        forgetting: weight of a step relative to the next newer one (1: all steps count alike;
            below 0.01 every older step has expired by the next: the last step's busy GPUs refit
            ``a``, ``b`` and an overhead they show, two GPUs at least, and rank speeds, which need
            the scatter of two steps, stay as they were).
        refit_interval: refit every this many observed steps.
        max_speed_ratio: a rank's speed factor stays within ``[1/r, r]`` of the median rank's.
        fit_route: refit ``route_coef`` and ``route_latency_s`` from the measured route phases
            (module docstring); off: the prior's are kept.
    """

    warmup_steps: int = 1
    forgetting: float = 0.9
    refit_interval: int = 1
    max_speed_ratio: float = 4.0
    fit_route: bool = True

    def __post_init__(self) -> None:
        if self.warmup_steps < 1 or self.refit_interval < 1:
            raise ValueError(
                f"online refit needs warmup_steps and refit_interval >= 1; got {self.warmup_steps}, "
                f"{self.refit_interval}"
            )
        if not 0 < self.forgetting <= 1 or not self.max_speed_ratio > 1:
            raise ValueError(
                f"online refit needs 0 < forgetting <= 1 and max_speed_ratio > 1; got {self.forgetting}, "
                f"{self.max_speed_ratio}"
            )


def plan_terms(
    plan: Placement, cost_model: CostModel, segment_squares: list[float] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per GPU ``X, Y, Z, W`` (module docstring) of ``plan``: four ``[S]`` float64 arrays.
    ``segment_squares``: ``[N]`` ``sum_k l_k**2`` of each sequence's attention segments
    (:func:`~deepspeed_knap.cost.model.segment_square_sums`), or ``None``: ``Y`` then sums the
    squared lengths the planner priced (:meth:`~deepspeed_knap.cost.model.CostModel.attention_squares`,
    with the prior's ``segment_attention_share``, kept as it is).

    Each GPU's terms add its sequences' in plan order, one IEEE operation at a time (``np.bincount``
    adds its weights in input order), so they are bit-identical on every machine."""
    seq_lens = np.asarray(plan.seq_lens, dtype=np.int64)
    starts = np.asarray(plan.seq_group_start, dtype=np.int64)
    sizes = np.asarray(plan.seq_group_size, dtype=np.int64)
    share = sizes.astype(np.float64) * cost_model.efficiency(sizes)
    lengths = seq_lens.astype(np.float64)  # exact: lengths are below 2**40
    squares = (lengths * lengths if segment_squares is None
               else np.asarray(cost_model.attention_squares(seq_lens, np.asarray(segment_squares)), np.float64))  # fmt: skip
    x = lengths / share
    y = squares * cost_model.head_factor(sizes) / share
    z = (seq_lens * (sizes - 1)).astype(np.float64) / (sizes * sizes).astype(np.float64)
    gpus, num_gpus = index_ranges(starts, sizes), plan.num_gpus  # each sequence's group, sequence by sequence
    return (
        np.bincount(gpus, weights=np.repeat(x, sizes), minlength=num_gpus).astype(np.float64),  # (int64 when empty)
        np.bincount(gpus, weights=np.repeat(y, sizes), minlength=num_gpus).astype(np.float64),
        np.bincount(gpus, weights=np.repeat(z, sizes), minlength=num_gpus).astype(np.float64),
        np.bincount(gpus, minlength=num_gpus).astype(np.float64),
    )


# Per-GPU running sums (rows of an [R, S] array), over past steps weighted by forgetting ** age: the
# weight, the terms and the measured seconds (t) of every busy, measured step, and their products.
# The W terms (u) enter only through the known e * W, moved to the measured side of the fit.
_SUMS = ("w", "x", "y", "xx", "xy", "yy", "t", "tx", "ty", "tt", "u", "ux", "uy", "ut", "uu")
# ... and the squared weights (forgetting ** (2 * age)), for the effective number of steps w**2 / ww.
_SQUARED_WEIGHT = "ww"
_ROWS = (*_SUMS, _SQUARED_WEIGHT)
# The route fit's running sums (module docstring), weighted alike, and its squared weight.
_ROUTE_SUMS = ("w", "x", "xx", "t", "xt", "tt", "ww")


class OnlineCostModel:
    """The cost model, refit every step from the measured steps (see the module docstring).

    Args:
        prior: the model to plan with until the first refit (and its ``degree_efficiency``, kept).
        num_gpus: ``S``, GPUs of the balance group.
        settings: the refit's knobs.
    """

    def __init__(self, prior: CostModel, num_gpus: int, settings: OnlineSettings | None = None) -> None:
        self.prior = prior
        self.num_gpus = num_gpus
        self.settings = settings or OnlineSettings()
        self.sums = np.zeros((len(_ROWS), num_gpus))  # [R, S], rows named by _ROWS
        self.rows = np.zeros(num_gpus, dtype=np.int64)  # [S] steps each GPU's sums hold, undecayed
        forgetting = self.settings.forgetting
        self._decay = np.array([[forgetting]] * len(_SUMS) + [[forgetting * forgetting]])  # [R, 1] a step's
        self.alltoall_sums = [0.0, 0.0]  # weighted least-waiting Ulysses rate, weight
        # Weighted sums over the measured steps that moved tokens (module docstring): the weight and
        # squared weight, x, x**2, t, x*t and t**2 of the pair (x moved tokens, t route seconds).
        self.route_sums = dict.fromkeys(_ROUTE_SUMS, 0.0)
        self.route_steps = 0  # measured steps that moved tokens
        self.route_fitted = False  # route_coef refit at least once
        self.route_evidence = 0.0  # the weight of the newest step that moved tokens (1: this step)
        self.observed = 0
        self.speeds = list(prior.gpu_speed) if prior.gpu_speed is not None else [1.0] * num_gpus  # start-up's
        self.current = prior
        self.compute_fitted = False  # a, b, overhead and speeds refit at least once

    def observe(self, plan: Placement, compute_us: list[int], ulysses_us: list[int],
                segment_squares: list[float] | None = None, route_us: list[int] | None = None,
                moved_tokens: list[int] | None = None) -> list[float]:  # fmt: skip
        """Add one step: ``plan`` and the microseconds every GPU measured for it (negative: none).
        ``segment_squares``: the step's attention segments, as :func:`plan_terms` takes them.
        ``route_us``: ``[S]`` each GPU's route and reverse-route microseconds, forward and backward
        (negative: none), or ``None``: not measured; ``moved_tokens``: ``[S]`` the tokens each GPU
        sends or receives under ``plan``, the larger (:func:`~deepspeed_knap.planner.route.moved_tokens`),
        given with ``route_us``. Refits when due. Returns what the model
        predicted for the step before it was added (:meth:`predicted_s`)."""
        if not plan.num_gpus == len(compute_us) == len(ulysses_us) == self.num_gpus:
            raise ValueError(f"observe takes a plan of the refit's {self.num_gpus} GPUs and one compute and one Ulysses "
                             f"time per GPU; got a plan of {plan.num_gpus} GPUs and {len(compute_us)} and "
                             f"{len(ulysses_us)} times")  # fmt: skip
        forgetting = self.settings.forgetting
        terms = plan_terms(plan, self.current, segment_squares)
        x, y, z, u = terms
        predicted = self._predicted(terms)
        sums = self.sums
        sums *= self._decay
        expired = sums[0] < _EVIDENCE_EXPIRED  # the weight: older than that is forgotten, not decayed
        if expired.any():  # (forever decaying weights end in subnormal noise)
            sums[:, expired] = 0.0
            self.rows[expired] = 0
        measured_us = np.asarray(compute_us, dtype=np.float64)
        busy = (measured_us > 0) & (x > 0)  # measured, busy GPUs (a busy GPU's 0 us is no measurement)
        self.rows[busy] += 1
        t = measured_us[busy] / 1e6
        # Once refit, a step counts at most max_speed_ratio times off the model's prediction: one
        # stalled step cannot swing a rank's speed (before, the prior's scale may be anything).
        if self.compute_fitted:
            bound, expected = self.settings.max_speed_ratio, np.asarray(predicted)[busy]
            t = np.where(expected > 0, np.minimum(np.maximum(t, expected / bound), expected * bound), t)
        x, y, u, one = x[busy], y[busy], u[busy], np.ones(len(t))
        sums[:, busy] += np.stack((one, x, y, x * x, x * y, y * y, t, t * x, t * y, t * t, u, u * x, u * y, u * t,
                                   u * u, one))  # in _ROWS' order  # fmt: skip
        exchange_us = np.asarray(ulysses_us, dtype=np.float64)
        timed = (exchange_us > 0) & (z > 0)  # (0 us for planned traffic is no measurement either)
        self.alltoall_sums = [self.alltoall_sums[0] * forgetting, self.alltoall_sums[1] * forgetting]
        if self.alltoall_sums[1] < _EVIDENCE_EXPIRED:  # expired: the prior's (scaled) price returns
            self.alltoall_sums = [0.0, 0.0]
        if timed.any():  # the least waiting GPU's rate
            rate = float((exchange_us[timed] / 1e6 / z[timed]).min())
            self.alltoall_sums = [self.alltoall_sums[0] + rate, self.alltoall_sums[1] + 1.0]
        if self.settings.fit_route:
            self._observe_route(route_us, moved_tokens)
        self.observed += 1
        warm = self.observed >= self.settings.warmup_steps
        if warm and (self.observed - self.settings.warmup_steps) % self.settings.refit_interval == 0:
            self._refit()
            if self.settings.fit_route:
                self._refit_route()
        return predicted

    def _observe_route(self, route_us: list[int] | None, moved: list[int] | None) -> None:
        """Add the step's least-waiting moving GPU: its route-phase seconds against its own moved
        tokens (module docstring)."""
        forgetting = self.settings.forgetting
        sums = self.route_sums
        for key in _ROUTE_SUMS:
            sums[key] *= forgetting * forgetting if key == "ww" else forgetting
        self.route_evidence *= forgetting
        if not route_us:
            return
        if moved is None:
            raise ValueError("route_us needs moved_tokens: the tokens each GPU moved under the plan")
        tokens, seconds = np.asarray(moved, dtype=np.float64), np.asarray(route_us, dtype=np.float64) / 1e6
        if len(tokens) != len(seconds):
            raise ValueError(f"route_us has {len(seconds)} entries and moved_tokens {len(tokens)}; give one per GPU")
        pairs = np.flatnonzero((tokens > 0) & (seconds > 0))  # (0 us for moved tokens is no measurement)
        if not len(pairs):
            return  # nothing moved, or no timer: through the origin, the step says nothing
        least = pairs[np.argmin(seconds[pairs] / tokens[pairs])]  # the first of equals: the same on every rank
        x, t = float(tokens[least]), float(seconds[least])
        predicted = self.current.route_latency_s + self.current.route_coef * x
        if self.route_fitted and predicted > 0:  # one stalled step counts boundedly
            bound = self.settings.max_speed_ratio
            t = min(max(t, predicted / bound), predicted * bound)
        for key, value in zip(_ROUTE_SUMS, (1.0, x, x * x, t, x * t, t * t, 1.0), strict=True):
            sums[key] += value
        self.route_steps += 1
        self.route_evidence = 1.0

    def _refit_route(self) -> None:
        """``route_coef`` and ``route_latency_s`` from the route sums (module docstring), once enough
        steps moved tokens; the prior's again once that evidence has expired."""
        sums = self.route_sums
        if self.route_fitted and self.route_evidence < _EVIDENCE_EXPIRED:
            # route_steps is kept: the next step that moves tokens refits at once, so a prior of 0
            # prices moving as free for one step, not for warmup_steps.
            self.current = dataclasses.replace(self.current, route_coef=self.prior.route_coef,
                                               route_latency_s=self.prior.route_latency_s)  # fmt: skip
            self.route_sums, self.route_fitted = dict.fromkeys(_ROUTE_SUMS, 0.0), False
        elif self.route_steps >= self.settings.warmup_steps and sums["xx"] > 0:  # > 0: not decayed away
            gram, rhs = [[sums["w"], sums["x"]], [sums["x"], sums["xx"]]], [sums["t"], sums["xt"]]
            latency, coef = nonnegative_normal_equations(gram, rhs, sums["tt"])
            if latency <= 0 or not _shown(gram, rhs, sums["tt"], [latency, coef], 0, EVIDENCE, sums["w"], sums["ww"]):
                # Not shown: the prior's latency (0 unless given), the rest per token through the
                # origin (with a prior of 0, sum x*t / sum x**2 bit for bit, as before the latency).
                latency = self.prior.route_latency_s
                coef = max((sums["xt"] - latency * sums["x"]) / sums["xx"], 0.0)
            self.current = dataclasses.replace(self.current, route_coef=coef, route_latency_s=latency)
            self.route_fitted = True

    def model(self) -> CostModel:
        """The model to plan the next step with."""
        return self.current

    @property
    def overhead_s(self) -> float:
        """The fitted fixed seconds of a rank of speed 1 per step (the prior's until the first refit)."""
        return self.current.overhead_s

    def predicted_s(self, plan: Placement, segment_squares: list[float] | None = None) -> list[float]:
        """``[S]`` seconds the current model predicts each GPU computes under ``plan``, its fixed
        overhead included (an idle GPU still runs every block). ``segment_squares``: as
        :func:`plan_terms`'s."""
        return self._predicted(plan_terms(plan, self.current, segment_squares))

    def _predicted(self, terms: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]) -> list[float]:
        """:meth:`predicted_s` from the plan's :func:`plan_terms` under the current model."""
        linear, quadratic, _, sequences = terms
        m = self.current
        work = m.overhead_s + m.linear_coef * linear + m.quadratic_coef * quadratic + m.sequence_coef * sequences
        return (work / np.asarray(self.speeds, dtype=np.float64)).tolist()

    def _refit(self) -> None:
        busy = np.flatnonzero(self.sums[0] > 0)  # a weight
        if int(self.rows[busy].sum()) < 2:  # two rows at least, however decayed (forgetting <= 0.5, one GPU busy)
            return
        speeds = list(self.speeds)
        for _ in range(_ALTERNATIONS):
            fits = self._fit_coefficients(busy, speeds)
            if fits is None:
                return  # the measurements say nothing usable yet: keep the current model
            coef, overhead_free = fits
            called = self._fit_speeds(busy, coef)
            if any(v != 1.0 for v in called):  # (equal ranks, most refits, need no second fit's word)
                # A speed is called only where the fit with a free overhead calls it too, the same way
                # (module docstring).
                shown = self._fit_speeds(busy, overhead_free, 1 + (overhead_free[0] > 0))
                called = [v if (v - 1.0) * (u - 1.0) > 0 else 1.0 for v, u in zip(called, shown, strict=True)]
            fitted, speeds = speeds, called
            if speeds == fitted:  # a fixed point (equal ranks: every refit): the rest would repeat it
                break
        self.speeds = speeds
        prior, scale = self.prior, self._compute_scale(busy, coef)
        if self.alltoall_sums[1]:  # measured
            alltoall = self.alltoall_sums[0] / self.alltoall_sums[1]
        else:  # the prior's price, in the same proportion to the compute as the prior had it
            alltoall = prior.alltoall_coef * scale
        inter_node = prior.inter_node_alltoall_coef
        if inter_node is not None:  # c' keeps its ratio to c
            inter_node *= alltoall / prior.alltoall_coef if prior.alltoall_coef > 0 else scale
        self.current = dataclasses.replace(self.current, linear_coef=coef[1], quadratic_coef=coef[2],
                                           alltoall_coef=alltoall, inter_node_alltoall_coef=inter_node,
                                           gpu_speed=tuple(speeds), overhead_s=coef[0])  # fmt: skip
        self.compute_fitted = True

    def _compute_scale(self, busy: np.ndarray, coef: list[float]) -> float:
        """The fitted per-token seconds of the measured work over the prior's (``a X + b Y`` at speed
        1; the overhead, which a prior from FLOPs or a calibration file leaves out, and the known
        ``e * W`` are not work an all-to-all scales with); 1 when the prior prices that work at nothing."""
        prior, x, y = self.prior, self.sums[_ROWS.index("x"), busy], self.sums[_ROWS.index("y"), busy]
        fitted = _ordered_sum(coef[1] * x + coef[2] * y)
        priced = _ordered_sum(prior.linear_coef * x + prior.quadratic_coef * y)
        return fitted / priced if priced > 0 else 1.0

    def _fit_coefficients(self, busy: np.ndarray, speeds: list[float]) -> tuple[list[float], list[float]] | None:
        """``[overhead, a, b]`` for ``measured * speed - e*W = overhead + a*X + b*Y``, from the running
        sums, twice: as planned (an overhead and a shape of their own only where shown), and with the
        planned ratio of ``a`` to ``b`` and an overhead fitted free (``>= 0``, untested); ``None`` where
        the measurements price no work."""
        e = self.prior.sequence_coef
        sums = self._sums_of(busy)
        v = np.asarray(speeds, dtype=np.float64)[busy]
        w, x, y, xx, xy, yy, t, tx, ty, tt, ww = _ordered_sums(np.stack((
            sums["w"], sums["x"], sums["y"], sums["xx"], sums["xy"], sums["yy"], v * sums["t"] - e * sums["u"],
            v * sums["tx"] - e * sums["ux"], v * sums["ty"] - e * sums["uy"],
            v * v * sums["tt"] - 2 * v * e * sums["ut"] + e * e * sums["uu"], sums[_SQUARED_WEIGHT])))  # fmt: skip
        gram, rhs = [[w, x, y], [x, xx, xy], [y, xy, yy]], [t, tx, ty]
        # A prior with an overhead (module docstring): the free fit keeps its overhead as fitted, to be tested
        # beside the prior's shape; a fit of all overhead is fitted per token instead.
        coef = nonnegative_normal_equations(gram, rhs, tt) if self.prior.overhead_s > 0 else [0.0] * 3
        if coef[1] <= 0 and coef[2] <= 0:
            coef = _overhead_if_shown(gram, rhs, tt, w, ww)
        if coef[1] > 0 or coef[2] > 0:
            coef = self._prior_shape_unless_shown(gram, rhs, tt, coef, w, ww)
        if coef[1] <= 0 and coef[2] <= 0:
            return None
        # h + k P, P = a X + b Y the planned per-token seconds: the normal equations in the columns (1, P).
        a, b = coef[1], coef[2]
        work = a * x + b * y
        h, k = nonnegative_normal_equations([[w, work], [work, a * a * xx + 2 * a * b * xy + b * b * yy]],
                                            [t, a * tx + b * ty], tt)  # fmt: skip
        return coef, ([h, k * a, k * b] if k > 0 else coef)

    def _prior_shape_unless_shown(self, gram: list[list[float]], rhs: list[float], target_norm: float,
                                  coef: list[float], weight: float, squared_weight: float) -> list[float]:  # fmt: skip
        """``coef`` (``[overhead, a, b]``, fitted free) where the measurements show the ratio of
        ``a`` to ``b`` departs from the prior's by :data:`SHAPE_EVIDENCE` standard errors; else the
        prior's ``overhead, a, b`` times one fitted scale ``k``. In the basis ``(1, P, D)``, ``P =
        o0 + a0 X + b0 Y`` the prior's seconds and ``D`` the other term (``X``, or ``Y`` when ``b0 =
        0``), the free fit is ``h + k P + d D``: the shape's test is of ``d``. A prior with an
        overhead (``o0 > 0``) keeps it at ``k o0`` either way, unless ``h`` is shown
        (:data:`OVERHEAD_EVIDENCE`; where that puts the overhead below 0, it is 0). A prior without
        one (``o0 = 0``: FLOPs, a calibration file) has ``h`` where the free fit had one and it is
        still shown beside ``k P``."""
        o0, a0, b0 = self.prior.overhead_s, self.prior.linear_coef, self.prior.quadratic_coef
        if a0 <= 0 and b0 <= 0:
            return coef  # the prior prices no work: it has no shape to keep
        other = (0.0, 1.0, 0.0) if b0 > 0 else (0.0, 0.0, 1.0)
        basis = [(1.0, 0.0, 0.0), (o0, a0, b0), other]  # each a combination of the columns (1, X, Y)
        free_scale = coef[2] / b0 if b0 > 0 else coef[1] / a0
        # (h, k, d) with overhead = h + k o0, a = k a0 + d, b = k b0 (b0 > 0), or a = k a0, b = d (b0 = 0).
        shaped = [coef[0] - free_scale * o0, free_scale, coef[1] - free_scale * a0 if b0 > 0 else coef[2]]
        shaped_gram = [[sum(u[i] * gram[i][j] * v[j] for i in range(3) for j in range(3)) for v in basis]
                       for u in basis]  # fmt: skip
        shaped_rhs = [sum(u[i] * rhs[i] for i in range(3)) for u in basis]
        columns = [0, 1, 2] if coef[0] > 0 or o0 > 0 else [1, 2]  # with the overhead where the fit or the prior has one
        sub = [[shaped_gram[i][j] for j in columns] for i in columns]
        sub_rhs, sub_coef = [shaped_rhs[i] for i in columns], [shaped[i] for i in columns]
        if _shown(sub, sub_rhs, target_norm, sub_coef, len(columns) - 1, SHAPE_EVIDENCE, weight, squared_weight):
            if o0 <= 0 or _shown(sub, sub_rhs, target_norm, sub_coef, 0, OVERHEAD_EVIDENCE, weight, squared_weight):
                return coef  # (with o0 = 0, its overhead was tested by _overhead_if_shown)
            # The shape departs, the overhead is not shown to: k P + d D, the overhead k o0.
            fit = solve_linear([row[1:] for row in shaped_gram[1:]], shaped_rhs[1:])
            if fit is not None and fit[0] > 0:
                k, d = fit
                a, b = (k * a0 + d, k * b0) if b0 > 0 else (k * a0, d)
                if a >= 0 and b >= 0:
                    return [k * o0, a, b]
            alone = shaped_rhs[1] / shaped_gram[1][1]  # k of P alone (its column is not all zero)
            return [alone * o0, alone * a0, alone * b0] if alone > 0 else coef
        pair = [[shaped_gram[0][0], shaped_gram[0][1]], [shaped_gram[1][0], shaped_gram[1][1]]]
        h, k = 0.0, shaped_rhs[1] / shaped_gram[1][1]  # P alone (its column is not all zero)
        if o0 > 0:  # h beside k P, either sign, planned with only if shown
            free = solve_linear(pair, shaped_rhs[:2])
            if free is not None and _shown(pair, shaped_rhs[:2], target_norm, free, 0, OVERHEAD_EVIDENCE, weight,
                                           squared_weight):  # fmt: skip
                h, k = free
                if k > 0 and h + k * o0 < 0:  # below no overhead: none, a and b in the prior's ratio
                    work = a0 * a0 * gram[1][1] + 2 * a0 * b0 * gram[1][2] + b0 * b0 * gram[2][2]
                    k = (a0 * rhs[1] + b0 * rhs[2]) / work
                    return [0.0, k * a0, k * b0] if k > 0 else coef
        elif coef[0] > 0:  # the overhead beside P, planned with only if shown there too
            h, k = _overhead_if_shown(pair, shaped_rhs[:2], target_norm, weight, squared_weight)
        # k <= 0 only if measured time falls as work rises: the free fit then says more than the prior.
        return [h + k * o0, k * a0, k * b0] if k > 0 else coef

    def _fit_speeds(self, busy: np.ndarray, coef: list[float], fitted: int = 1) -> list[float]:
        """Each rank's predicted over measured seconds under ``coef``, relative to the median rank's
        where the measurements tell them apart (:data:`EVIDENCE`; 1 where they do not), bounded, on a
        grid. ``fitted``: the parameters ``coef`` was fitted with beside the speeds (1: one scale)."""
        known = busy[self.sums[_ROWS.index("t"), busy] > 0]  # GPUs with a measured step
        speed, scatter, steps = self._speed_fits(known, coef)
        # The relative scatter per step, pooled over the GPUs and weighed with the prior's (a rank's
        # own few steps estimate it badly), or a rank's own where larger (one stalled step is that
        # rank's scatter, not all's).
        measured_dof = _ordered_sum(steps - 1)
        if measured_dof < 1:  # one step each (or all but expired): the prior's scatter alone is no evidence
            return list(self.speeds)  # the start-up calibration's, or the last refit's
        # Parameters beyond one common scale were fitted to the same steps: their freedom is not scatter.
        dof = PRIOR_SCATTER_DOF + max(measured_dof - (fitted - 1), 0.0)
        pooled = (PRIOR_SCATTER * PRIOR_SCATTER_DOF + _ordered_sum(scatter * (steps - 1))) / dof
        middle = np.lexsort((steps, scatter, speed))[len(known) // 2]  # the median of the sorted fits
        median, median_scatter, median_steps = speed[middle], scatter[middle], steps[middle]
        bound, critical = self.settings.max_speed_ratio, _critical(EVIDENCE, dof)
        # Var(speed) = speed**2 * scatter / steps, for each rank and the median one.
        variance = (np.maximum(scatter, pooled) * speed * speed / steps
                    + max(median_scatter, pooled) * median * median / median_steps)  # fmt: skip
        difference = speed - median
        called = difference * difference > critical * critical * variance
        relative = np.ones(self.num_gpus)
        relative[known[called]] = np.minimum(np.maximum(speed[called] / median, 1 / bound), bound)
        return (np.maximum(np.rint(relative * _SPEED_GRID), 1) / _SPEED_GRID).tolist()

    def _sums_of(self, gpus: np.ndarray) -> dict[str, np.ndarray]:
        """The running sums of ``gpus``, by name: ``[len(gpus)]`` each."""
        return dict(zip(_ROWS, self.sums[:, gpus], strict=True))

    def _speed_fits(self, gpus: np.ndarray, coef: list[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``[len(gpus)]`` each measured GPU's speed, scatter and steps: its speed ``v = sum p / sum t``
        (``p`` its predicted seconds at speed 1 under ``coef``, ``t`` its measured ones, over its
        weighted steps), the scatter of its steps about ``v``, ``sum (p - v t)**2 / sum (v t)**2``
        times ``steps / (steps - 1)`` (relative: the variance of one step's ``p / (v t)``), and its
        effective number of steps ``w**2 / ww``; where that is at most 1, or ``v`` is not above 0,
        scatter 0 and steps 1 (one step shows no scatter, and adds no degree of freedom)."""
        sums = self._sums_of(gpus)
        e = self.prior.sequence_coef
        overhead, a, b = coef
        # sum p, sum p**2 and sum p*t from the sums of the terms: p = overhead + a X + b Y + e W.
        p = overhead * sums["w"] + a * sums["x"] + b * sums["y"] + e * sums["u"]
        pp = (overhead * overhead * sums["w"] + a * a * sums["xx"] + b * b * sums["yy"] + e * e * sums["uu"]
              + 2 * (overhead * a * sums["x"] + overhead * b * sums["y"] + overhead * e * sums["u"]
                     + a * b * sums["xy"] + a * e * sums["ux"] + b * e * sums["uy"]))  # fmt: skip
        pt = overhead * sums["t"] + a * sums["tx"] + b * sums["ty"] + e * sums["ut"]
        speed = p / sums["t"]
        steps = sums["w"] * sums["w"] / sums[_SQUARED_WEIGHT]
        shows = (steps > 1.0) & (speed > 0)
        scatter = np.zeros(len(gpus))
        v, tt, n = speed[shows], sums["tt"][shows], steps[shows]
        scatter[shows] = np.maximum(pp[shows] - 2 * v * pt[shows] + v * v * tt, 0.0) / (v * v * tt) * n / (n - 1)
        return speed, scatter, np.where(shows, steps, 1.0)


def _ordered_sum(values: np.ndarray) -> float:
    """The sum of ``[n]`` ``values`` left to right, as a Python loop adds them (``np.sum`` adds
    pairwise, in an order of its own): the refit's totals are bit-identical on every machine."""
    return float(np.add.accumulate(values)[-1]) if len(values) else 0.0


def _ordered_sums(rows: np.ndarray) -> list[float]:
    """:func:`_ordered_sum` of each row of ``[R, n]`` ``rows`` (``n >= 1``)."""
    return np.add.accumulate(rows, axis=1)[:, -1].tolist()


def _overhead_if_shown(
    gram: list[list[float]], rhs: list[float], target_norm: float, weight: float, squared_weight: float
) -> list[float]:
    """``[overhead, *per-token coefficients]`` >= 0 from the normal equations over the columns
    ``(1, ...)``: the overhead only where it is shown (:data:`OVERHEAD_EVIDENCE`, :func:`_shown`)
    beside per-token terms, else those terms fitted without it."""
    coef = nonnegative_normal_equations(gram, rhs, target_norm)
    per_token = any(c > 0 for c in coef[1:])
    if coef[0] > 0 and (not per_token or not _shown(gram, rhs, target_norm, coef, 0, OVERHEAD_EVIDENCE, weight,
                                                      squared_weight)):  # fmt: skip
        # Balanced plans give every GPU about the same work, step after step: the data then
        # cannot tell a fixed cost from a per-token one, and noise may call most of the step
        # overhead (measured on 2 CPU ranks: 60 of 62 ms, a = 0), which prices moving work at
        # nothing and keeps every sequence home. Without evidence, take it all as per token (and
        # when the fit is all overhead: a model that prices no work cannot plan).
        coef = [0.0, *nonnegative_normal_equations([row[1:] for row in gram[1:]], rhs[1:], target_norm)]
    return coef


def _shown(
    gram: list[list[float]],
    rhs: list[float],
    target_norm: float,
    coef: list[float],
    index: int,
    evidence: float,
    weight: float,
    squared_weight: float,
) -> bool:
    """Whether the fitted ``coef[index]`` exceeds ``evidence`` standard errors of itself in the full
    model (every column: were the fit free to trade it for the other terms, how far could it).
    ``gram``, ``rhs`` and ``target_norm`` are the normal equations of the weighted fit over
    observations of total weight ``weight`` and squared weight ``squared_weight``:
    ``Var(coef[index]) = sigma**2 * (gram^-1)[index][index] * squared_weight / weight``, ``sigma**2``
    the residual of ``coef`` per unit weight over ``n - K`` of the ``n = weight**2 / squared_weight``
    effective observations. Not shown when the columns are (nearly) collinear."""
    columns = [i for i in range(len(coef)) if gram[i][i] > 0]
    steps = weight * weight / squared_weight if squared_weight > 0 else 0.0
    if index not in columns or steps <= len(columns):
        return False
    sub = [[gram[i][j] for j in columns] for i in columns]
    residual = normal_equations_residual(sub, [rhs[i] for i in columns], target_norm, [coef[i] for i in columns])
    sigma2 = max(residual, 0.0) / weight * steps / (steps - len(columns))
    # (gram^-1)[index][index], with the columns scaled to unit norm.
    position = columns.index(index)
    scaled, norms = unit_norm_gram(gram, columns)
    column = solve_linear(scaled, [1.0 if i == position else 0.0 for i in range(len(columns))])
    if column is None or column[position] <= 0:
        return False
    if residual <= 1e-12 * target_norm:  # a perfect fit (rounding may leave it below 0): no scatter to doubt it
        return coef[index] != 0
    variance = sigma2 * column[position] / (norms[position] * norms[position]) * squared_weight / weight
    critical = _critical(evidence, steps - len(columns))
    return coef[index] * coef[index] > critical * critical * variance
