"""The planner's output: :class:`RoutingPlan`, where every token of one step goes."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, fields

import numpy as np


@dataclass(frozen=True, eq=False)
class RoutingPlan:
    """Where every token of one step goes, and the modeled loads that result.

    Sequence ``i``'s tokens are cut into contiguous chunks, one per GPU of its group, in rank order:
    chunk ``k`` in ``chunk_offsets[i]:chunk_offsets[i+1]`` holds tokens
    ``[chunk_start[k], chunk_start[k] + chunk_len[k])`` on rank ``chunk_gpu[k]``. A chunk may be empty
    when the sequence is shorter than its group. The group (``seq_group_start``, ``seq_group_size``)
    is the GPUs that run the sequence's attention together; for topology bags it is one bag.
    All ranks are positions inside the balance group (0 .. S-1).

    Attributes:
        topology_spec: topology the plan was made for.
        solver: solver name.
        seq_lens: ``[N]`` int64 token counts.
        seq_src_rank: ``[N]`` int64 rank that holds the sequence before routing.
        seq_group_start: ``[N]`` int64 first rank of the sequence's group.
        seq_group_size: ``[N]`` int64 GPUs in that group (the Ulysses degree).
        chunk_offsets: ``[N + 1]`` int64 CSR offsets into the chunk arrays.
        chunk_gpu, chunk_start, chunk_len: ``[K]`` int64 chunk placement.
        gpu_loads: ``[S]`` float64 modeled seconds per GPU.
        lower_bound: modeled seconds no plan can beat, over plans that use the topology's bags or keep
            every sequence alone on its home GPU (0.0 when ``N == 0``).
        max_tokens_per_gpu: the memory cap the plan was asked to honour, or ``None``.
    """

    topology_spec: str
    solver: str
    seq_lens: np.ndarray
    seq_src_rank: np.ndarray
    seq_group_start: np.ndarray
    seq_group_size: np.ndarray
    chunk_offsets: np.ndarray
    chunk_gpu: np.ndarray
    chunk_start: np.ndarray
    chunk_len: np.ndarray
    gpu_loads: np.ndarray
    lower_bound: float
    max_tokens_per_gpu: int | None

    @property
    def num_gpus(self) -> int:
        return len(self.gpu_loads)

    @property
    def max_load(self) -> float:
        """Modeled step time: the busiest GPU's seconds."""
        return float(self.gpu_loads.max()) if self.gpu_loads.size else 0.0

    @property
    def imbalance(self) -> float:
        """Max over mean modeled GPU load (1.0 is perfect; 1.0 when every load is 0)."""
        mean = float(self.gpu_loads.mean()) if self.gpu_loads.size else 0.0
        return self.max_load / mean if mean > 0 else 1.0

    @property
    def gpu_tokens(self) -> np.ndarray:
        """``[S]`` int64 tokens each GPU holds after routing."""
        return np.bincount(self.chunk_gpu, weights=self.chunk_len, minlength=self.num_gpus).astype(np.int64)

    @functools.cached_property
    def tokens_moved(self) -> int:
        """Tokens that leave their home rank (each comes back in the reverse route)."""
        home = np.repeat(self.seq_src_rank, np.diff(self.chunk_offsets))
        return int(self.chunk_len[self.chunk_gpu != home].sum())

    @property
    def tokens_moved_fraction(self) -> float:
        """Fraction of all tokens that leave their home rank."""
        total = int(self.seq_lens.sum())
        return self.tokens_moved / total if total else 0.0

    @functools.cached_property
    def fingerprint(self) -> int:
        """A 63-bit digest of where every token goes: equal plans have equal fingerprints, and ranks
        compare them to catch one rank routing with a plan from another step."""
        digest = hashlib.blake2b(self.topology_spec.encode(), digest_size=8)
        for array in (self.seq_lens, self.seq_src_rank, self.seq_group_start, self.seq_group_size):
            digest.update(array.tobytes())
        return int.from_bytes(digest.digest(), "little") >> 1

    def subset(self, keep: np.ndarray) -> RoutingPlan:
        """The plan of the sequences ``keep`` (``[N]`` bool) marks, renumbered in order, each placed
        as here: what runs one part of a step on its own (a two-expert model's samples of one expert)
        with the layout, attention groups and routes of exactly those sequences. Loads and the bound
        are the whole step's.

        Raises:
            ValueError: ``keep`` is not one bool per sequence.
        """
        keep = np.asarray(keep)
        if keep.dtype != np.bool_ or keep.shape != self.seq_lens.shape:
            raise ValueError(f"keep must be [N] = [{len(self.seq_lens)}] bools; got {keep.dtype} {keep.shape}")
        chunks_per_seq = np.diff(self.chunk_offsets)
        kept_chunks = np.repeat(keep, chunks_per_seq)
        offsets = np.concatenate([[0], np.cumsum(chunks_per_seq[keep])]).astype(np.int64)
        return RoutingPlan(self.topology_spec, self.solver, self.seq_lens[keep], self.seq_src_rank[keep],
                           self.seq_group_start[keep], self.seq_group_size[keep], offsets, self.chunk_gpu[kept_chunks],
                           self.chunk_start[kept_chunks], self.chunk_len[kept_chunks], self.gpu_loads,
                           self.lower_bound, self.max_tokens_per_gpu)  # fmt: skip

    def __eq__(self, other: object) -> bool:
        """Bitwise equality of every field (arrays compared element by element, dtypes included)."""
        if not isinstance(other, RoutingPlan):
            return NotImplemented
        for field in fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if isinstance(mine, np.ndarray):
                if mine.dtype != theirs.dtype or mine.shape != theirs.shape or mine.tobytes() != theirs.tobytes():
                    return False
            elif mine != theirs:
                return False
        return True

    __hash__ = None  # mutable-looking arrays inside: plans are compared, not hashed
