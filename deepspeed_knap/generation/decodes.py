"""Which rank decodes each request that finishes at a step.

A request's VAE decode is seconds where a denoising step is tenths (a 17-frame Wan clip: 6-7 s on
a CPU rank), and the requests that finish at a step all have their decodes between that step and
the next, while every other rank waits for the next step's collectives. Left on the home ranks,
the decodes of a step stack on whichever ranks own the finishing requests. :func:`place_decodes`
spreads them instead: longest first, each to the rank that would finish the step's decodes
soonest, so the step's decoding ends when its busiest rank's does (list scheduling, at most 4/3 of
the best spread); among ranks that finish alike (a step with a single decode), to the rank that
has been least busy in the run, so the ranks' busy seconds even out over the run; then to the
home rank, whose latents need not move.

Only the decodes' relative prices matter for that: the placement compares the decodes of one step
with each other, never a decode with transformer work, so a decode's price is its latents'
elements (:meth:`~deepspeed_knap.generation.denoising.Denoising.decode_work`: a VAE decode's time
grows with them), no fitted seconds. Pure Python: every rank calls it on the same agreed inputs and
gets the same placement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def place_decodes(works: Mapping[int, float], homes: Mapping[int, int], busy_s: Sequence[float]) -> dict[int, int]:
    """The rank that decodes each request finishing at a step.

    Args:
        works: request index -> the decode's price (:meth:`Denoising.decode_work`), for every
            request that finishes at the step, on every rank alike.
        homes: request index -> its home rank (where its latents are).
        busy_s: each rank's busy seconds in the run so far, by rank (agreed: the same list on every rank).

    Returns:
        request index -> the rank that decodes it.

    Raises:
        ValueError: a price that is negative or not finite, or a home that is not a rank.
    """
    world = len(busy_s)
    for index, work in works.items():
        if not work >= 0 or work == float("inf"):
            raise ValueError(f"request {index}'s decode price is {work}; a price is a finite number >= 0")
        if not 0 <= homes[index] < world:
            raise ValueError(f"request {index}'s home is rank {homes[index]}; there are {world} ranks")
    pending = [0.0] * world  # the step's decodes placed on each rank, priced
    placed = {}
    for index in sorted(works, key=lambda i: (-works[i], i)):
        rank = min(range(world), key=lambda r: (pending[r] + works[index], busy_s[r], r != homes[index], r))
        pending[rank] += works[index]
        placed[index] = rank
    return placed
