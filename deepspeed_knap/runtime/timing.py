"""Where one rank's balanced step goes: plan, route, compute, Ulysses all-to-alls, reverse route.

:class:`StepTimes` collects time stamps during one step, forward and backward: the balancer stamps
the plan and the two ends of the block stack (with :func:`stamp`, an identity whose backward stamps
too), and :mod:`~deepspeed_knap.runtime.routing` stamps both ends of every exchange it runs while the
record is active. On CUDA the stamps are events on the current stream, read once the next step has
started (their work is done by then); on CPU, where every op is synchronous, a clock.

No communication here.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

# Exchange kinds as routing.exchange labels them.
EXCHANGE_KINDS = ("route", "reverse_route", "ulysses")
# The parts of a step's plan (StepTimes.plan_parts).
PLAN_PARTS = ("gather", "refit", "solve", "agree")
# The marks of the block stack's two windows, forward and backward: whether each opens one.
_BLOCK_ENDS = {"blocks_start": True, "blocks_end": False, "blocks_grad_start": True, "blocks_grad_end": False}


class _Stamp:
    """A point in time on ``device``'s current stream (CUDA event) or on the host clock."""

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda":
            self.event: torch.cuda.Event | None = torch.cuda.Event(enable_timing=True)
            self.event.record()
            self.clock = 0.0
        else:
            self.event = None
            self.clock = time.perf_counter()

    def seconds_until(self, later: _Stamp) -> float:
        if self.event is not None:
            later.event.synchronize()  # recorded last step: done by now, so this does not wait
            return self.event.elapsed_time(later.event) / 1e3
        return later.clock - self.clock


@dataclass
class StepTimes:
    """Stamps of one rank's balanced step on ``device``.

    Attributes:
        device: where the step's tensors live.
        marks: named stamps: ``plan_start``, ``plan_end``, ``blocks_start``, ``blocks_end``
            (forward), ``blocks_grad_start``, ``blocks_grad_end`` (backward).
        spans: per exchange kind, ``(start, end)`` stamps of every exchange, forward and backward
            (and ``setup``: a group's first exchange, run once untimed before it).
        inside: ``(start, end)`` of every exchange (any kind, its set-up too) that ran while the block
            stack did, forward or backward: Ulysses', the routes some models run between their
            blocks (a sample's rows to its group), and the small gathers of per-sample integers
            (``sample_ints``: FLUX.3's segments, Wan 2.2 A14B's experts). Their time, and the waits for slower ranks in them, is not the rank's
            compute.
        plan_parts: host seconds of the plan by part (:data:`PLAN_PARTS`), the balancer's: ``gather``
            (the lengths all-gather: in the step, or at the prefetch before it), ``refit`` (recording
            the last step's measured times and, with ``online``, refitting the cost model from them,
            after the gather), ``solve`` (the solve in the step, or the wait for the worker's plan) and
            ``agree`` (the all-gather that agrees on a prefetched plan).
    """

    device: torch.device
    marks: dict[str, _Stamp] = field(default_factory=dict)
    spans: dict[str, list[tuple[_Stamp, _Stamp]]] = field(default_factory=lambda: defaultdict(list))
    plan_parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PLAN_PARTS, 0.0))
    inside: list[tuple[_Stamp, _Stamp]] = field(default_factory=list)
    _in_blocks: bool = False  # between a blocks_start / blocks_grad_start mark and its end's

    def mark(self, name: str) -> None:
        self.marks[name] = _Stamp(self.device)
        if name in _BLOCK_ENDS:  # marks come in the stream's order (the host enqueues them so)
            self._in_blocks = _BLOCK_ENDS[name]

    def begin_exchange(self) -> _Stamp:
        return _Stamp(self.device)

    def end_exchange(self, kind: str, start: _Stamp) -> None:
        span = (start, _Stamp(self.device))
        self.spans[kind].append(span)
        if self._in_blocks:
            self.inside.append(span)

    def seconds(self) -> dict[str, float] | None:
        """Seconds of this rank's step by phase, or ``None`` if a stamp is missing (e.g. no backward ran):

        * ``plan``: the lengths gather and the solve, as stamped in the step (a prefetch's gather,
          before it, is not in it);
        * ``gather``, ``refit``, ``solve``, ``agree``: :attr:`plan_parts`, host seconds;
        * ``route``, ``reverse_route``, ``ulysses``: the exchanges of each kind, forward and backward
          (including the time spent waiting for peers);
        * ``setup``: a group's one-time set-up, its first exchange run once untimed
          (:func:`~deepspeed_knap.runtime.routing.exchange`): 0 but in the step that first uses it;
        * ``compute``: the block stack forward and backward, less every exchange inside it
          (:attr:`inside`: Ulysses', the routes between blocks, their groups' set-up).
        """
        needed = ("plan_start", "plan_end", "blocks_start", "blocks_end", "blocks_grad_start", "blocks_grad_end")
        if any(name not in self.marks for name in needed):
            return None
        m = self.marks
        exchanged = {kind: sum(a.seconds_until(b) for a, b in self.spans.get(kind, ()))
                     for kind in (*EXCHANGE_KINDS, "setup")}  # fmt: skip
        blocks = m["blocks_start"].seconds_until(m["blocks_end"]) + m["blocks_grad_start"].seconds_until(
            m["blocks_grad_end"]
        )
        inside = sum(a.seconds_until(b) for a, b in self.inside)
        return {"plan": m["plan_start"].seconds_until(m["plan_end"]), **self.plan_parts, **exchanged,
                "compute": blocks - inside}  # fmt: skip


class _Stamped(torch.autograd.Function):
    """Identity on ``x`` that stamps ``forward_name`` in forward and ``backward_name`` in backward.
    ``anchor`` (a scalar that needs a gradient) makes autograd run the backward even when ``x``
    needs none (the routed raw latents)."""

    @staticmethod
    def forward(ctx, x: Tensor, anchor: Tensor, times: StepTimes, forward_name: str, backward_name: str) -> Tensor:
        times.mark(forward_name)
        ctx.times, ctx.backward_name = times, backward_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.times.mark(ctx.backward_name)
        return grad, None, None, None, None


def stamp(x: Tensor, times: StepTimes, forward_name: str, backward_name: str) -> Tensor:
    """``x``, stamping ``forward_name`` now and ``backward_name`` when its gradient arrives. A
    floating ``x`` gets a gradient path even if it had none, so the backward stamp is taken."""
    if not x.is_floating_point():
        raise ValueError(f"stamp needs a floating-point tensor to carry a gradient; got {x.dtype}")
    anchor = torch.zeros((), dtype=x.dtype, device=x.device, requires_grad=True)
    return _Stamped.apply(x, anchor, times, forward_name, backward_name)


# ---- timing blocks on this device (calibration) ----


def backward_seconds(run: Callable[[], torch.Tensor], device: torch.device | str) -> float:
    """Wall seconds of ``run().backward()``, the device synchronised before and after."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    run().backward()
    sync()
    return time.perf_counter() - start


def timing_bytes(seq_len: int, heads: int, head_dim: int, element_bytes: int, scores_materialised: bool) -> int:
    """A generous estimate of the memory :func:`flux_blocks_step` needs at ``seq_len`` tokens: ~64
    model-wide activations per token kept for the backward of one double- and one single-stream block
    (their MLPs are 4x wide), and, where the attention kernel materialises the scores (sdpa's math
    path on CPU), ``[heads, s, s]`` three times (scores, probabilities, their gradient)."""
    activations = 64 * seq_len * heads * head_dim * element_bytes
    scores = 3 * heads * seq_len * seq_len * element_bytes if scores_materialised else 0
    return activations + scores


def check_fits_memory(seq_len: int, heads: int, head_dim: int, dtype: torch.dtype, device: str) -> None:
    """Refuse, before allocating anything, a timing that cannot fit the device's memory.

    Raises:
        ValueError: naming the length, the estimate and the memory there is.
    """
    element = torch.empty((), dtype=dtype).element_size()
    if device.startswith("cuda"):
        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        needed = timing_bytes(seq_len, heads, head_dim, element, scores_materialised=False)
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        needed = timing_bytes(seq_len, heads, head_dim, element, scores_materialised=True)
    if needed > total:
        raise ValueError(
            f"--seq-lens: timing {seq_len:,} tokens with {heads} heads of {head_dim} needs about {needed / 2**30:,.1f} GiB "
            f"and {device} has {total / 2**30:,.1f} GiB; time shorter lengths (the fit extrapolates)"
        )
