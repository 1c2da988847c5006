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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


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


class StepBatcher:
    """The steps of a run: the set of each, joins and leaves at boundaries, one solve per set.

    Args:
        jobs: the accepted requests, in file order.
        world_size: ranks that balance together.
        max_tokens_per_gpu: the per-GPU token budget, or ``None`` (every request joins at once).
        solve: ``solve(seq_lens_per_rank) -> plan``: one list of sequence lengths per rank, the
            sequences of the rank's requests of the set in ascending index; raises ``ValueError`` when no plan fits.
    """

    def __init__(self, jobs: Sequence[Job], world_size: int, max_tokens_per_gpu: int | None,
                 solve: Callable[[list[list[int]]], Any]) -> None:  # fmt: skip
        self.jobs = {job.index: job for job in jobs}
        self.world_size = world_size
        self.capacity = None if max_tokens_per_gpu is None else max_tokens_per_gpu * world_size
        self.solve = solve
        self.solves = 0  # plans made: one per change of the set
        self.back_offs = 0  # sets the planner refused (each gave back its newest joiner)
        self._waiting = deque(sorted(self.jobs))
        self._remaining: dict[int, int] = {}  # active request -> steps still to run, this one included
        self._plan: Any = None
        self._active: tuple[int, ...] | None = None  # the last step's set, planned by self._plan
        self._blocked = False  # a back-off since the last leave: nothing joins until a request leaves
        self._steps = 0

    @property
    def total_request_steps(self) -> int:
        """Steps summed over every request: what a progress bar counts."""
        return sum(job.steps for job in self.jobs.values())

    @property
    def steps_taken(self) -> int:
        """Steps :meth:`next_step` has given so far."""
        return self._steps

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
        joined = []
        tokens = sum(self.jobs[i].tokens for i in self._remaining)
        # The first waiting request joins while it fits the budget, or when nothing would run without
        # it; after a back-off, only once a request has left.
        while self._waiting and (
            (not self._remaining and not joined)
            or (not self._blocked and (self.capacity is None or tokens + self.jobs[self._waiting[0]].tokens
                                       <= self.capacity))
        ):  # fmt: skip
            index = self._waiting.popleft()
            joined.append(index)
            tokens += self.jobs[index].tokens
        active = tuple(sorted([*self._remaining, *joined]))
        if not active:
            return None
        active = self._solve(active, joined)
        changed = active != self._active
        self._active = active
        self._remaining.update({i: self.jobs[i].steps for i in active if i not in self._remaining})
        for index in active:
            self._remaining[index] -= 1
        self._steps += 1
        return Step(self._steps - 1, active, tuple(i for i in joined if i in active), left, self._plan, changed)

    def _solve(self, active: tuple[int, ...], joined: list[int]) -> tuple[int, ...]:
        """Plan ``active`` unless it is the last step's set (whose plan stays); while the planner
        refuses it, give back the newest joiner (to the front of the queue) and plan again. Returns
        the set planned."""
        while active != self._active:
            try:
                plan = self.solve(self.seq_lens_per_rank(active))
            except ValueError:
                if not joined or len(active) == 1:
                    raise
                self.back_offs += 1
                self._blocked = True
                newest = joined.pop()
                self._waiting.appendleft(newest)
                active = tuple(i for i in active if i != newest)
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
