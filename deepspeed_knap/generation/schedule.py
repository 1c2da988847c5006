"""Step-level batching: which requests run each denoising step, and the plan of each request set.

Every rank runs the same :class:`StepBatcher` on the same agreed request table (index, home rank,
tokens, steps), so every rank knows every step's set with no communication. A request runs its
``steps`` consecutive steps once it joins; at a step boundary the finished requests leave, and
waiting ones join in file order while the set's tokens fit the token budget (``max_tokens_per_gpu``
times the ranks). A request's length is fixed over its steps, so the plan depends only on the set:
it is solved when the set changes and reused until it changes again (:attr:`StepBatcher.solves`).

A set whose plan the planner cannot make (the budget is per GPU, and a set whose total fits may
still not pack) gives back its newest joiners, newest first, until it can: the planner is
deterministic, so every rank backs off alike. After a back-off no request joins until one leaves
(the set that was refused would be refused again), and a set that backed off to the last step's
keeps that step's plan: no new plan, no change of the set. Pure Python: ``solve`` is the planner.

**Planning ahead.** A set changes only when a request leaves (a join without a leave would have
joined at the step before: the running tokens are the same), so while a set runs the batcher knows
the step of the next change (its first request to finish) and the next set (the leaves, then the
joins in file order under the budget). Given a ``plan_ahead`` (:class:`PlanAhead`, e.g.
:class:`~deepspeed_knap.generation.balancer.WorkerPlanAhead`), it submits that set's planner input
at the step that starts the current set, and collects the plan at the change: the solve overlaps
the steps in between. A set the planner refuses there backs off as above, the smaller sets solved
in the step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Job:
    """What the batcher knows of an accepted request: ``index`` (file order), ``home`` rank,
    ``seq_lens`` (the tokens of each sequence the transformer runs for it every step: one, or with
    classifier-free guidance the conditional and the unconditional branch, which the planner places
    apart or together as they cost) and denoising ``steps``."""

    index: int
    home: int
    seq_lens: tuple[int, ...]
    steps: int

    @property
    def tokens(self) -> int:
        """Tokens the request holds while it runs: its sequences' together."""
        return sum(self.seq_lens)


@dataclass(frozen=True)
class Step:
    """One denoising step of the whole world.

    Attributes:
        number: steps run before this one.
        active: indices of the requests that run it, ascending (each rank packs its own in this order).
        joined: indices that start with this step.
        left: indices that finished with the step before.
        plan: the planner's plan of the set (solved at this step when ``changed``, else reused).
        changed: the set differs from the last step's.
    """

    number: int
    active: tuple[int, ...]
    joined: tuple[int, ...]
    left: tuple[int, ...]
    plan: Any
    changed: bool


class PlanAhead(Protocol):
    """Where the batcher plans a set ahead of the step that runs it (one set at a time)."""

    def submit(self, seq_lens_per_rank: list[list[int]]) -> None:
        """Start planning ``seq_lens_per_rank`` (as ``solve`` takes it); returns at once."""

    def collect(self) -> Any | None:
        """The plan of the last :meth:`submit` (never ``None``), waiting for it if need be; ``None``:
        no plan came (the planner refused the set, or planning failed): the batcher then solves the
        set in the step, and backs off if ``solve`` refuses it too. Called once per submit, at the
        step the set starts."""


class StepBatcher:
    """The steps of a run: the set of each, joins and leaves at boundaries, one solve per set.

    Args:
        jobs: the accepted requests, in file order.
        world_size: ranks that balance together.
        max_tokens_per_gpu: the per-GPU token budget, or ``None`` (every request joins at once).
        solve: ``solve(seq_lens_per_rank) -> plan``: one list of sequence lengths per rank, the
            sequences of the rank's requests of the set in ascending index; raises ``ValueError`` when no plan fits.
        plan_ahead: plans each set after the first during the steps before it (the same plan as
            ``solve``'s), or ``None``: every set is solved at the step that starts it.
    """

    def __init__(self, jobs: Sequence[Job], world_size: int, max_tokens_per_gpu: int | None,
                 solve: Callable[[list[list[int]]], Any], plan_ahead: PlanAhead | None = None) -> None:  # fmt: skip
        self.jobs = {job.index: job for job in jobs}
        self.world_size = world_size
        self.capacity = None if max_tokens_per_gpu is None else max_tokens_per_gpu * world_size
        self.solve = solve
        self.plan_ahead = plan_ahead
        self.solves = 0  # plans made: one per change of the set
        self.planned_ahead = 0  # of those, collected from plan_ahead (the others solved in the step)
        self.solve_s = 0.0  # seconds in ``solve`` (refused sets included): the planning the steps waited for
        self.back_offs = 0  # sets the planner refused (each gave back its newest joiner)
        self._waiting = deque(sorted(self.jobs))
        self._remaining: dict[int, int] = {}  # active request -> steps still to run, this one included
        self._plan: Any = None
        self._active: tuple[int, ...] | None = None  # the last step's set, planned by self._plan
        self._blocked = False  # a back-off since the last leave: nothing joins until a request leaves
        self._submitted: tuple[int, ...] | None = None  # the set submitted to plan_ahead, not collected yet
        self._steps = 0

    @property
    def total_request_steps(self) -> int:
        """Steps summed over every request: what a progress bar counts."""
        return sum(job.steps for job in self.jobs.values())

    @property
    def steps_taken(self) -> int:
        """Steps :meth:`next_step` has given so far."""
        return self._steps

    def finishing(self) -> tuple[int, ...]:
        """The requests whose last step is the step :meth:`next_step` gave last, ascending: they
        leave at the next."""
        return tuple(sorted(i for i, remaining in self._remaining.items() if remaining == 0))

    def next_step(self) -> Step | None:
        """The next step's set (and plan), or ``None`` when every request is done.

        Raises:
            ValueError: the planner finds no plan for a set even with no request joining (the
                budget is too small for the requests already running).
        """
        left = tuple(i for i, remaining in self._remaining.items() if remaining == 0)
        for index in left:
            del self._remaining[index]
        if left:
            self._blocked = False
        joined = self._joiners(self._remaining, self._blocked)
        for _ in joined:
            self._waiting.popleft()
        active = tuple(sorted([*self._remaining, *joined]))
        if not active:
            return None
        submitted = None
        if left:  # the step a set was submitted for, if any: its first leave
            submitted, self._submitted = self._submitted, None
        active = self._solve(active, joined, submitted)
        changed = active != self._active
        self._active = active
        self._remaining.update({i: self.jobs[i].steps for i in active if i not in self._remaining})
        for index in active:
            self._remaining[index] -= 1
        self._steps += 1
        if self.plan_ahead is not None and self._submitted is None:
            self._submit_next_set()
        return Step(self._steps - 1, active, tuple(i for i in joined if i in active), left, self._plan, changed)

    def _joiners(self, running: Collection[int], blocked: bool) -> list[int]:
        """The waiting requests that join a step whose requests still running are ``running``, in
        queue order (left in the queue). The first waiting request joins while it fits the budget,
        or when nothing would run without it; after a back-off (``blocked``), only once a request
        has left."""
        joined: list[int] = []
        tokens = sum(self.jobs[i].tokens for i in running)
        for index in self._waiting:
            fits = self.capacity is None or tokens + self.jobs[index].tokens <= self.capacity
            if not ((not running and not joined) or (not blocked and fits)):
                break
            joined.append(index)
            tokens += self.jobs[index].tokens
        return joined

    def _submit_next_set(self) -> None:
        """Submit the set that follows the running one (if a request is still to run): at the step
        where its first request has finished, those leave (a leave lifts a back-off's block) and the
        waiting ones join. Nothing changes until then: no request leaves, and none joins (what did
        not fit stays unfit with the same requests running)."""
        finish = min(self._remaining.values())  # steps until the first leave
        staying = [i for i, remaining in self._remaining.items() if remaining > finish]
        next_set = tuple(sorted([*staying, *self._joiners(staying, blocked=False)]))
        if next_set:
            self.plan_ahead.submit(self.seq_lens_per_rank(next_set))
            self._submitted = next_set

    def _solve(self, active: tuple[int, ...], joined: list[int], submitted: tuple[int, ...] | None) -> tuple[int, ...]:
        """Plan ``active`` unless it is the last step's set (whose plan stays): the plan ahead's when
        ``active`` is the set ``submitted`` to it and it came, else solved here; while the planner
        refuses it, give back the newest joiner (to the front of the queue) and plan again. Returns
        the set planned."""
        while active != self._active:
            try:
                plan = self.plan_ahead.collect() if active == submitted else None
                if plan is None:
                    clock = time.perf_counter()
                    try:
                        plan = self.solve(self.seq_lens_per_rank(active))
                    finally:
                        self.solve_s += time.perf_counter() - clock
                else:
                    self.planned_ahead += 1
            except ValueError:
                if not joined or len(active) == 1:
                    raise
                self.back_offs += 1
                self._blocked = True
                newest = joined.pop()
                self._waiting.appendleft(newest)
                active = tuple(i for i in active if i != newest)
                submitted = None
            else:
                self.solves += 1
                self._plan = plan
                return active
        return active

    def seq_lens_per_rank(self, active: Sequence[int]) -> list[list[int]]:
        """The planner's input for a set: each rank's requests' sequences, in ascending index (a
        request's sequences in its own order)."""
        lengths: list[list[int]] = [[] for _ in range(self.world_size)]
        for index in sorted(active):
            lengths[self.jobs[index].home].extend(self.jobs[index].seq_lens)
        return lengths
