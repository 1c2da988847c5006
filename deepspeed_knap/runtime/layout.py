"""What one GPU sends, receives and holds under a :class:`~deepspeed_knap.planner.RoutingPlan`.

Pure index arithmetic (NumPy, no communication), shared by :mod:`~deepspeed_knap.runtime.routing` and
:mod:`~deepspeed_knap.runtime.attention` and testable without processes. Every rank derives its own layout
from the same plan, so the split sizes of every all-to-all agree between senders and receivers.

Dimension names: ``S`` GPUs in the balance group, ``N`` sequences of the step, ``G`` GPUs of an
attention group, ``m`` sequences of a group, ``n`` chunks a GPU holds after routing.

Token order. Before routing a GPU holds its own sequences in order. The route all-to-all sends, for
each destination in rank order, the chunks going there in sequence-id order; since sequence ids are
numbered rank by rank, what a GPU receives (source by source) is already in ascending sequence id:
after routing a GPU holds its non-empty chunks sorted by sequence id, and nothing is permuted on the
receiving side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from deepspeed_knap.cost.model import index_ranges
from deepspeed_knap.planner.plan import RoutingPlan


@dataclass(frozen=True, eq=False)
class AttentionGroup:
    """GPUs that run attention together over some sequences, seen from one of them.

    Attributes:
        start: first GPU of the group (position in the balance group).
        size: ``G``, the Ulysses degree.
        member: this GPU's position in the group, ``0 .. G-1``.
        seq_ids: ``[m]`` int64 sequences the group runs, ascending.
        seq_lens: ``[m]`` int64 their full lengths.
        chunk_lens: ``[G, m]`` int64 tokens of sequence ``j`` held by member ``g`` (may be 0).
        rows: ``[sum(chunk_lens[member])]`` int64 rows of this GPU's routed tokens that belong to the
            group, or ``None`` when this is the GPU's only group (then it is all of them, in order).
        seq_major: ``[sum(seq_lens)]`` int64 permutation that turns the tokens gathered from the members
            (member by member, each member's chunks in sequence order) into whole sequences, or
            ``None`` when that order already is whole sequences (``G == 1`` or ``m == 1``).
    """

    start: int
    size: int
    member: int
    seq_ids: np.ndarray
    seq_lens: np.ndarray
    chunk_lens: np.ndarray
    rows: np.ndarray | None
    seq_major: np.ndarray | None

    @classmethod
    def build(cls, start: int, member: int, seq_ids: np.ndarray, chunk_lens: np.ndarray, rows: np.ndarray | None):
        size, num_seqs = chunk_lens.shape
        seq_major = None
        if size > 1 and num_seqs > 1:
            # Offsets of chunk (g, j) in the member-major buffer, then read it sequence-major.
            member_major_starts = (np.cumsum(chunk_lens.ravel()) - chunk_lens.ravel()).reshape(size, num_seqs)
            seq_major = index_ranges(member_major_starts.T.ravel(), chunk_lens.T.ravel())
        return cls(start, size, member, seq_ids, chunk_lens.sum(axis=0), chunk_lens, rows, seq_major)

    @property
    def num_local_tokens(self) -> int:
        return int(self.chunk_lens[self.member].sum())


@dataclass(frozen=True, eq=False)
class GpuLayout:
    """One GPU's part of a step: the route all-to-all's splits and what it holds afterwards.

    Attributes:
        gpu: this GPU's position in the balance group.
        num_gpus: ``S``.
        home_seq_ids: ``[N_home]`` int64 global ids of the sequences this GPU holds before routing.
        send_rows: ``[T_home]`` int64 home token rows in send order (destination by destination).
        send_counts, recv_counts: ``[S]`` int64 tokens sent to / received from each GPU.
        sample_send_index: ``[R]`` int64 local index (into the home sequences) of every per-sample row
            sent, in send order: one row per (sequence, destination holding a token of it).
        sample_send_counts, sample_recv_counts: ``[S]`` int64 per-sample rows sent to / received from
            each GPU.
        seq_ids: ``[n]`` int64 sequences this GPU holds a non-empty chunk of after routing, ascending.
        chunk_starts: ``[n]`` int64 where each chunk starts inside its sequence.
        chunk_lens: ``[n]`` int64 chunk lengths (the routed batch's ``seq_lens``).
        attention_groups: the groups this GPU is a member of, ordered by ``(size, start)``: its own
            (a group of one GPU: the sequences it runs alone) first, then its pair, its group of
            four, ... (groups nest or are disjoint, so a GPU is in at most one group of a size).

    Smaller groups first, on every GPU: a GPU enters a group's exchange once its smaller groups'
    attention is done, and so has each of its partners, whose smaller groups lie inside this one. In
    ``(start, size)`` order a GPU at the start of a pair ran its own sequences before the pair's
    exchange and its partner after it, so each waited for the other's every layer (2 CPU ranks, a
    tiny Wan step of a 4,725-token clip split over both and a 2,079- and a 99-token one whole on
    each: 3.32-3.40 s against 2.97-3.19 s, as fast as every sequence split, which the cost model
    prices the same: ``docs/bench/refit46/mixed_plan_step.py``), and a group of four would have waited
    so for the pairs inside it.

    Why that order cannot deadlock, however groups nest (``auto`` puts a GPU in a group of each size):
    ``(size, start)`` is one total order on all groups of the step, and every GPU runs its groups'
    all-to-alls in increasing order (a group of one GPU runs none). Take the smallest group, in that
    order, whose exchange has not completed: each of its members has already completed every group it
    runs before this one (they are all smaller), so every member reaches this exchange and it
    completes. By induction all do; no two GPUs can wait on each other in opposite orders. Backward
    runs each GPU's exchanges in reverse (autograd processes the later-created branch of the attention
    output first), which is the reverse of the same total order, so the argument holds there too.
    """

    gpu: int
    num_gpus: int
    home_seq_ids: np.ndarray
    send_rows: np.ndarray
    send_counts: np.ndarray
    recv_counts: np.ndarray
    sample_send_index: np.ndarray
    sample_send_counts: np.ndarray
    sample_recv_counts: np.ndarray
    seq_ids: np.ndarray
    chunk_starts: np.ndarray
    chunk_lens: np.ndarray
    attention_groups: tuple[AttentionGroup, ...]

    @property
    def num_routed_tokens(self) -> int:
        return int(self.chunk_lens.sum())


def gpu_layout(plan: RoutingPlan, gpu: int) -> GpuLayout:
    """Derive GPU ``gpu``'s layout (a position in the balance group) from ``plan``.

    Raises:
        ValueError: ``gpu`` outside the plan, or a plan whose chunks do not sit one per GPU of their
            sequence's group in rank order (not a plan :func:`~deepspeed_knap.planner.plan_routing` makes).
    """
    num_gpus = plan.num_gpus
    if not 0 <= gpu < num_gpus:
        raise ValueError(f"GPU {gpu} is outside the plan's balance group of {num_gpus} GPUs")
    num_seqs = len(plan.seq_lens)
    chunks_per_seq = np.diff(plan.chunk_offsets)
    seq_of_chunk = np.repeat(np.arange(num_seqs, dtype=np.int64), chunks_per_seq)
    position = np.arange(len(plan.chunk_gpu), dtype=np.int64) - plan.chunk_offsets[seq_of_chunk]
    if not (
        np.array_equal(chunks_per_seq, plan.seq_group_size)
        and np.array_equal(plan.chunk_gpu, plan.seq_group_start[seq_of_chunk] + position)
    ):
        raise ValueError("plan chunks must be one per GPU of the sequence's group, in rank order")
    src_of_chunk = plan.seq_src_rank[seq_of_chunk]

    home_first, home_end = np.searchsorted(plan.seq_src_rank, [gpu, gpu + 1])
    home_seq_ids = np.arange(home_first, home_end, dtype=np.int64)
    home_offsets = np.concatenate([[0], np.cumsum(plan.seq_lens[home_first:home_end])])

    # Chunks leaving this GPU, destination by destination, each in sequence order.
    outgoing = np.flatnonzero((src_of_chunk == gpu) & (plan.chunk_len > 0))
    outgoing = outgoing[np.lexsort((seq_of_chunk[outgoing], plan.chunk_gpu[outgoing]))]
    out_seq = seq_of_chunk[outgoing] - home_first
    send_rows = index_ranges(home_offsets[out_seq] + plan.chunk_start[outgoing], plan.chunk_len[outgoing])
    send_counts = np.bincount(plan.chunk_gpu[outgoing], weights=plan.chunk_len[outgoing], minlength=num_gpus)
    sample_send_counts = np.bincount(plan.chunk_gpu[outgoing], minlength=num_gpus)

    # Chunks arriving here: already in ascending sequence id (see the module docstring).
    incoming = np.flatnonzero((plan.chunk_gpu == gpu) & (plan.chunk_len > 0))
    recv_counts = np.bincount(src_of_chunk[incoming], weights=plan.chunk_len[incoming], minlength=num_gpus)
    sample_recv_counts = np.bincount(src_of_chunk[incoming], minlength=num_gpus)

    held_seq = seq_of_chunk[incoming]
    held_rows_start = np.cumsum(plan.chunk_len[incoming]) - plan.chunk_len[incoming]
    groups = []
    member_chunks = np.flatnonzero(plan.chunk_gpu == gpu)  # empty chunks too: members still exchange
    member_seqs = seq_of_chunk[member_chunks]
    keys = np.stack([plan.seq_group_start[member_seqs], plan.seq_group_size[member_seqs]], axis=1)
    # One global order, (size, start), for the collectives of every GPU: see attention_groups.
    group_keys = sorted({(int(a), int(b)) for a, b in keys}, key=lambda key: (key[1], key[0]))
    for start, size in group_keys:
        seq_ids = member_seqs[(keys[:, 0] == start) & (keys[:, 1] == size)]
        chunk_index = plan.chunk_offsets[seq_ids][None, :] + np.arange(size)[:, None]
        chunk_lens = plan.chunk_len[chunk_index]  # [G, m]
        in_group = np.isin(held_seq, seq_ids)
        # With several groups every one lists its rows, even none (a member holding only empty chunks).
        rows = (
            None
            if len(group_keys) == 1
            else index_ranges(held_rows_start[in_group], plan.chunk_len[incoming][in_group])
        )
        groups.append(AttentionGroup.build(start, gpu - start, seq_ids, chunk_lens, rows))

    return GpuLayout(
        gpu=gpu,
        num_gpus=num_gpus,
        home_seq_ids=home_seq_ids,
        send_rows=send_rows,
        send_counts=send_counts.astype(np.int64),
        recv_counts=recv_counts.astype(np.int64),
        sample_send_index=out_seq,
        sample_send_counts=sample_send_counts.astype(np.int64),
        sample_recv_counts=sample_recv_counts.astype(np.int64),
        seq_ids=held_seq,
        chunk_starts=plan.chunk_start[incoming],
        chunk_lens=plan.chunk_len[incoming],
        attention_groups=tuple(groups),
    )


def local_layout(seq_lens: Sequence[int]) -> GpuLayout:
    """The layout of running a GPU's own sequences on it alone (no balancing, no communication)."""
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    seq_ids = np.arange(len(seq_lens), dtype=np.int64)
    total = int(seq_lens.sum())
    group = AttentionGroup.build(0, 0, seq_ids, seq_lens[None, :], None)
    one = np.array([total], dtype=np.int64)
    return GpuLayout(0, 1, seq_ids, np.arange(total, dtype=np.int64), one, one, seq_ids,
                     np.array([len(seq_lens)]), np.array([len(seq_lens)]), seq_ids,
                     np.zeros_like(seq_lens), seq_lens, (group,) if len(seq_lens) else ())  # fmt: skip
