"""KnapDistributedAttention: DeepSpeed-Ulysses attention over whole variable-length sequences.

Dimension names: ``T`` routed tokens on this GPU, ``H`` attention heads, ``Dh`` head dim, ``G`` GPUs
in an attention group (bag), ``h`` heads a member runs (``H`` split near-equally over ``G``), ``L``
tokens of whole sequences a member runs attention over.

After routing, a GPU holds one contiguous chunk of each sequence of its bag. For each attention
group it belongs to (one bag, in plans of :func:`~deepspeed_knap.planner.plan_routing`), attention is:

1. one all-to-all inside the bag: every member sends each member that member's share of heads of
   q, k and v for all its tokens; with uneven chunks the split sizes differ per member;
2. reorder what arrived (member by member) into whole sequences;
3. variable-length attention over those sequences (``cu_seqlens``) on ``h`` heads;
4. one all-to-all back, and concatenate the heads again.

A group of one GPU runs step 3 alone, with no communication.

A sequence may carry several attention segments (FLUX.3's modes: text, image, reference images,
each attending only within itself in its per-mode blocks). Given ``segments``, a table of segment
lengths per sequence, step 1 is unchanged (one all-to-all carries the whole sequence) and step 3
runs over the segments as if they were sequences of their own: ``cu_seqlens`` over segments, exact
block-diagonal attention with no mask.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from deepspeed.sequence.layer import DistributedAttention
from deepspeed.utils import logger
from torch import Tensor

from deepspeed_knap.planner.topology import Topology
from deepspeed_knap.runtime.layout import AttentionGroup
from deepspeed_knap.runtime.routing import RoutedBatch, exchange

BACKENDS = ("auto", "flash", "torch_varlen", "sdpa")
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class VarlenSeqs:
    """Sequence boundaries of a packed q/k/v.

    Attributes:
        seq_lens: ``m`` lengths, summing to ``L``.
        cu_seqlens: ``[m + 1]`` int32 cumulative lengths on the tensors' device.
        max_seqlen: the largest length (0 when ``m == 0``).
    """

    seq_lens: tuple[int, ...]
    cu_seqlens: Tensor
    max_seqlen: int


@functools.cache
def _flash_varlen() -> Callable | str:
    """flash-attn's ``flash_attn_varlen_func``, or why there is none here."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ModuleNotFoundError as error:
        if error.name == "flash_attn":
            return "flash-attn is not installed (pip install flash-attn)"
        problem = error
    except Exception as error:  # a build for another torch or CUDA: "undefined symbol" (an ImportError)
        problem = error
    else:
        return flash_attn_varlen_func
    return (
        f"flash-attn fails to import ({type(problem).__name__}: {problem}); reinstall it for torch {torch.__version__}"
    )


@functools.cache
def _torch_varlen() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _sdpa(q: Tensor, k: Tensor, v: Tensor, seqs: VarlenSeqs, scale: float | None, kv: VarlenSeqs) -> Tensor:
    """Per-sequence ``scaled_dot_product_attention``: runs everywhere, the reference and CPU path."""
    # [1, H, L, Dh]: PyTorch's fused CPU kernel needs a batch dimension; 3-d inputs take the math
    # path, which keeps the [H, L, L] probabilities for backward.
    pieces = zip(torch.split(q, list(seqs.seq_lens)), *(torch.split(t, list(kv.seq_lens)) for t in (k, v)), strict=True)
    outs = [F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in qkv), scale=scale)[0] for qkv in pieces]
    return torch.cat([o.transpose(0, 1) for o in outs]) if outs else q + k.sum() + v.sum()


def _flash(q: Tensor, k: Tensor, v: Tensor, seqs: VarlenSeqs, scale: float | None, kv: VarlenSeqs) -> Tensor:
    return _flash_varlen()(q, k, v, seqs.cu_seqlens, kv.cu_seqlens, seqs.max_seqlen, kv.max_seqlen,
                           softmax_scale=scale)  # fmt: skip


def _torch_varlen_attn(q: Tensor, k: Tensor, v: Tensor, seqs: VarlenSeqs, scale: float | None,
                       kv: VarlenSeqs) -> Tensor:  # fmt: skip
    return _torch_varlen()(q, k, v, seqs.cu_seqlens, kv.cu_seqlens, seqs.max_seqlen, kv.max_seqlen, scale=scale)


_KERNELS = {"flash": _flash, "torch_varlen": _torch_varlen_attn, "sdpa": _sdpa}


def _unusable(backend: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``backend`` cannot run on these tensors, or ``None``."""
    if backend_problem(backend):
        return backend_problem(backend)
    if backend in ("flash", "torch_varlen") and (device.type != "cuda" or dtype not in _HALF):
        return f"it needs CUDA tensors in float16 or bfloat16, got {dtype} on {device}"
    return None


def backend_problem(backend: str) -> str | None:
    """Why ``backend`` cannot be used on this machine at all (not installed), or ``None``. Differs
    between nodes when packages do, so :func:`deepspeed_knap.initialize` agrees on it first."""
    if backend == "flash" and isinstance(found := _flash_varlen(), str):
        return found
    if backend == "torch_varlen" and _torch_varlen() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    return None


def backend_view(backend: str) -> str:
    """What ``backend`` finds on this machine, which must be the same on every rank
    (:func:`deepspeed_knap.initialize` agrees on it): why it cannot run (:func:`backend_problem`),
    or for ``"auto"`` which of the kernels it prefers to ``sdpa`` are usable, since it runs the
    first usable one: nodes with flash-attn and nodes without would run different kernels within
    one attention group (a missing and a broken flash-attn alike leave the next)."""
    if backend != "auto":
        return backend_problem(backend) or "usable"
    return "; ".join(
        f"{name} {'unusable' if backend_problem(name) else 'usable'}" for name in ("flash", "torch_varlen")
    )


class VarlenAttention:
    """Local attention over packed variable-length sequences with a choice of kernel.

    A plain callable, not an ``nn.Module``: a GPU calls it once per attention group it is in, which
    differs between ranks, and ZeRO-3 requires every rank to call every submodule equally often.

    Args:
        backend: ``"flash"`` (flash-attn's ``flash_attn_varlen_func``), ``"torch_varlen"`` (torch's
            ``varlen_attn``), ``"sdpa"`` (``scaled_dot_product_attention`` per sequence, any device and
            dtype) or ``"auto"``: the first of those that can run on the tensors it is given, logged
            once per device and dtype.
        softmax_scale: scale of ``q @ k^T``; default ``1 / sqrt(Dh)``.

    Raises:
        ValueError: an unknown backend, or flash/torch_varlen when not installed.
    """

    def __init__(self, backend: str = "auto", softmax_scale: float | None = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if backend in ("flash", "torch_varlen"):
            problem = _unusable(backend, torch.device("cuda"), torch.bfloat16)
            if problem:
                raise ValueError(f"attention backend {backend!r} is unavailable: {problem}; use 'auto' or 'sdpa'")
        self.backend = backend
        self.softmax_scale = softmax_scale
        self._resolved: dict[tuple[str, torch.dtype], str] = {}

    def resolve(self, device: torch.device, dtype: torch.dtype) -> str:
        """The kernel this module runs for tensors on ``device`` of ``dtype``."""
        key = (device.type, dtype)
        if key not in self._resolved:
            if self.backend == "auto":
                choice = next(b for b in ("flash", "torch_varlen", "sdpa") if _unusable(b, device, dtype) is None)
                logger.info(f"deepspeed_knap attention backend 'auto' runs {choice!r} for {dtype} on {device.type}")
            else:
                problem = _unusable(self.backend, device, dtype)
                if problem:
                    raise ValueError(f"attention backend {self.backend!r} cannot run here: {problem}")
                choice = self.backend
            self._resolved[key] = choice
        return self._resolved[key]

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, seqs: VarlenSeqs, kv_seqs: VarlenSeqs | None = None) -> Tensor:
        """``q, k, v``: ``[L, h, Dh]`` whole sequences back to back. Returns ``[L, h, Dh]``.

        With ``kv_seqs``, cross-attention: query sequence ``i`` (``seqs``) attends to key/value
        sequence ``i`` (``kv_seqs``, as many, each at least one token), ``k, v`` ``[Lk, h, Dh]``."""
        kernel = _KERNELS[self.resolve(q.device, q.dtype)]
        return kernel(q.contiguous(), k.contiguous(), v.contiguous(), seqs, self.softmax_scale, kv_seqs or seqs)


def _check_segments(segments: np.ndarray, routed: RoutedBatch) -> None:
    """Raise on a segment table that does not cover every sequence of the step exactly: ``[N, K]``
    non-negative lengths, each row summing to its sequence's length. The table and the lengths are
    the same on every rank, so every rank raises, not only the members of the group holding a bad row.
    """
    lens = routed.plan.seq_lens if routed.plan is not None else np.asarray(routed.batch.seq_lens, dtype=np.int64)
    table = np.asarray(segments)
    if (table.ndim != 2 or len(table) != len(lens) or not np.issubdtype(table.dtype, np.integer) or np.any(table < 0)
            or not np.array_equal(table.sum(axis=1), lens)):  # fmt: skip
        raise ValueError(
            f"attention segments of shape {table.shape} with row sums {table.sum(axis=-1).tolist()[:8]}... do not "
            f"cover the step's {len(lens)} sequences of lengths {lens.tolist()[:8]}...; segments are [N, K] "
            "non-negative integer lengths by sequence id, each row summing to its sequence's length"
        )


def head_splits(num_heads: int, group_size: int) -> list[int]:
    """Heads each member of a group of ``group_size`` runs: near-equal, the first ones one more."""
    base, extra = divmod(num_heads, group_size)
    return [base + (i < extra) for i in range(group_size)]


def ulysses_counts(member_tokens: Sequence[int], heads: Sequence[int], member: int,
                   head_dim: int) -> tuple[list[int], list[int], list[int], list[int]]:  # fmt: skip
    """Elements ``member`` of a Ulysses group sends to and receives from each member, by member:
    ``(qkv_send, qkv_recv, out_send, out_recv)``. Forward, q, k and v go to their heads' members
    (scatter heads, gather sequence), then the output comes back (scatter sequence, gather heads);
    the backward runs both reversed. ``member_tokens``: ``[G]`` tokens each member holds;
    ``heads``: ``[G]`` heads each runs (:func:`head_splits`)."""
    my_tokens, my_heads = member_tokens[member], heads[member]
    return ([3 * my_tokens * h * head_dim for h in heads], [3 * n * my_heads * head_dim for n in member_tokens],
            [n * my_heads * head_dim for n in member_tokens], [my_tokens * h * head_dim for h in heads])  # fmt: skip


# The routed batch whose blocks run now, for drop-in modules (DeepSpeed's call carries none).
_balanced_step: RoutedBatch | None = None


def set_balanced_step(routed: RoutedBatch | None) -> None:
    """Make ``routed`` the step every :class:`KnapDistributedAttention` built and called the DeepSpeed
    way balances (``None``: none; they behave exactly like DeepSpeed's). The balancer does, while a
    step's blocks run (:func:`balanced_blocks`) and while their gradient runs
    (:func:`balanced_in_backward` to :func:`balanced_backward_end`), and only then: a drop-in call
    outside them is DeepSpeed's."""
    global _balanced_step
    _balanced_step = routed


def balanced_step_in_flight() -> RoutedBatch | None:
    """The routed batch :func:`set_balanced_step` made current, if any."""
    return _balanced_step


@contextlib.contextmanager
def balanced_blocks(routed: RoutedBatch) -> Iterator[None]:
    """``routed`` is the balanced step while the block stack runs forward over it (none after, even
    where an earlier step's backward failed before clearing its own)."""
    set_balanced_step(routed)
    try:
        yield
    finally:
        set_balanced_step(None)


class _BalancedInBackward(torch.autograd.Function):
    """Identity whose backward makes ``routed`` the balanced step (``None``: none): on the blocks'
    output (the gradient reaches it first, then runs through the blocks, where activation
    checkpointing recomputes their forward) and on their input (reached last)."""

    @staticmethod
    def forward(ctx, x: Tensor, anchor: Tensor, routed: RoutedBatch | None) -> Tensor:
        ctx.routed = routed
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        set_balanced_step(ctx.routed)
        if ctx.routed is not None:  # a backward that never reaches the input still ends with none
            torch.autograd.Variable._execution_engine.queue_callback(lambda: set_balanced_step(None))
        return grad, None, None


def _scoped(x: Tensor, routed: RoutedBatch | None) -> Tensor:
    anchor = torch.zeros((), dtype=x.dtype, device=x.device, requires_grad=True)  # a backward even without grad
    return _BalancedInBackward.apply(x, anchor, routed)


def balanced_in_backward(out: Tensor, routed: RoutedBatch) -> Tensor:
    """The blocks' output ``out`` (``[T_routed, ...]``, floating), unchanged, with ``routed`` the
    balanced step once the gradient reaches it, until it reaches the blocks' input
    (:func:`balanced_backward_end`): a step's own recomputation sees its own routing even when another
    step ran forward since (two forwards, then each one's backward), and a drop-in module elsewhere
    in the model is DeepSpeed's. The step is kept without its tokens: the graph holds it as long as
    the loss lives."""
    return _scoped(out, routed.with_tokens(routed.batch.tokens.new_empty((routed.batch.num_tokens, 0))))


def balanced_backward_end(tokens: Tensor) -> Tensor:
    """The blocks' input ``tokens`` (floating), unchanged, with no balanced step once the gradient
    reaches it: the end of the blocks' backward (:func:`balanced_in_backward`)."""
    return _scoped(tokens, None)


class KnapDistributedAttention(DistributedAttention):
    """DeepSpeed-Ulysses attention inside compute bags, over uneven chunks of whole sequences.

    Unlike its parent, which assumes every rank of one fixed group holds an equal slice of one
    batch, this module takes its groups and split sizes from the step's routing: the
    :class:`~deepspeed_knap.runtime.routing.RoutedBatch` the tokens came from. Heads need not divide the bag
    size (members run ``ceil`` or ``floor`` of ``H / G`` heads), but every bag needs at least one head
    per GPU.

    Two ways to build and call it:

    * **Drop-in for DeepSpeed-Ulysses**: ``KnapDistributedAttention(local_attention,
      sequence_process_group, scatter_idx, gather_idx)`` and ``forward(query, key, value,
      batch_dim_idx, ...)``, DeepSpeed's constructor and call. Outside a balanced step it *is*
      DeepSpeed's ``DistributedAttention`` (its own forward runs). Inside one (the balancer sets it:
      :func:`set_balanced_step`) the step's tokens are the routed ones, ``[1, T, H, Dh]``
      (``batch_dim_idx=0``) or ``[T, 1, H, Dh]`` (``batch_dim_idx=1``), and attention runs over each
      whole sequence with this package's kernel (``backend``): ``local_attention`` does not know
      sequence boundaries inside a packed batch, so it is not used there. Rotary embeddings must then
      be applied to q and k before the call (``rotary_pos_emb`` and other extra arguments are refused,
      not dropped), and k and v must have q's heads (no grouped-query attention).
    * **Packed**: ``KnapDistributedAttention(num_heads, *, backend=..., topology=...)`` and
      ``forward(query, key, value, routed)`` with ``[T, H, Dh]`` tensors, for models written for packed
      batches (``TinyDiT``, ``PackedFluxTransformer``).

    Args:
        local_attention: DeepSpeed's local attention (drop-in); or, packed, the number of heads ``H``.
        sequence_process_group, scatter_idx, gather_idx, sp_stream, num_kv_heads: DeepSpeed's, for the
            unbalanced drop-in path.
        num_heads: packed: ``H``, instead of the first argument.
        backend: the kernel of balanced steps, see :class:`VarlenAttention`.
        softmax_scale: default ``1 / sqrt(Dh)``.
        topology: when given, checked at construction: every bag must have at most ``H`` GPUs.

    Raises:
        ValueError: at construction, for a bad backend, a non-positive head count, a bag with more GPUs
            than heads, or DeepSpeed's arguments given to a packed module.
    """

    def __init__(
        self,
        local_attention: Callable[..., Tensor] | int | None = None,
        sequence_process_group: Any = None,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
        num_kv_heads: int | None = None,
        *,
        num_heads: int | None = None,
        backend: str = "auto",
        softmax_scale: float | None = None,
        topology: Topology | None = None,
    ) -> None:
        varlen = VarlenAttention(backend, softmax_scale)
        if isinstance(local_attention, int) or num_heads is not None:
            heads = num_heads if num_heads is not None else local_attention
            deepspeed_args = (sequence_process_group, sp_stream, num_kv_heads)
            if (num_heads is not None and local_attention is not None) or any(a is not None for a in deepspeed_args):
                raise ValueError(
                    "a packed KnapDistributedAttention takes the heads and then keywords: "
                    "KnapDistributedAttention(num_heads, backend=..., softmax_scale=..., topology=...); got "
                    f"local_attention={local_attention!r}, sequence_process_group={sequence_process_group!r}"
                )
            if not isinstance(heads, int) or heads < 1:
                raise ValueError(f"num_heads must be a positive integer; got {heads!r}")
            # Packed: no fixed group; groups come with each step's routing.
            super().__init__(varlen, sequence_process_group=None)
            self.num_heads: int | None = heads
        else:
            if not callable(local_attention):
                raise ValueError(
                    f"KnapDistributedAttention needs DeepSpeed's local_attention callable (drop-in) or the number of "
                    f"heads (packed); got {local_attention!r}"
                )
            super().__init__(local_attention, sequence_process_group, scatter_idx, gather_idx, sp_stream,
                             num_kv_heads)  # fmt: skip
            self.num_heads = None  # read off the tensors of each call
        self.varlen_attn = varlen  # the kernel of balanced steps (also local_attn when packed)
        if topology is not None:
            self.configure(topology)

    def configure(self, topology: Topology | None, backend: str | None = None) -> None:
        """Check the heads against ``topology``'s bags (``None``: balancing off, nothing to check)
        and, if given, switch the balanced kernel.

        Raises:
            ValueError: a bag with more GPUs than heads, or an unavailable backend.
        """
        if topology is not None and self.num_heads is not None and max(topology.bag_sizes) > self.num_heads:
            raise ValueError(
                f"topology {topology.spec!r} has bags of {max(topology.bag_sizes)} GPUs but attention has only "
                f"{self.num_heads} heads; Ulysses needs at least one head per GPU of a bag. Use bags of at most "
                f"{self.num_heads} GPUs"
            )
        if backend is not None and backend != self.varlen_attn.backend:
            replacement = VarlenAttention(backend, self.varlen_attn.softmax_scale)
            if self.local_attn is self.varlen_attn:
                self.local_attn = replacement
            self.varlen_attn = replacement

    def forward(self, query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        """Attention of every token over its whole sequence.

        Packed: ``forward(query, key, value, routed, segments=None)``, ``[T, H, Dh]`` tensors in
        ``routed.batch`` order, ``routed`` what :func:`~deepspeed_knap.runtime.routing.route` (or ``local_batch``)
        returned this step. ``segments``: ``[N, K]`` int lengths of ``K`` consecutive attention
        segments of every sequence of the step, by sequence id (the plan's, or the local batch's
        order: :func:`~deepspeed_knap.runtime.routing.gather_sample_ints` builds it), each row summing
        to its sequence's length, zeros for absent segments, the same table on every rank (every rank
        checks the whole of it, so a bad table raises everywhere); attention then runs within each
        segment only (block-diagonal), still with one all-to-all per group and direction. Drop-in: DeepSpeed's ``forward(query, key, value, batch_dim_idx, rotary_pos_emb=None,
        *args, **kwargs)`` (see the class docstring).

        Returns:
            Attention output, shaped like ``query``.

        Raises:
            ValueError: shapes that do not fit the routed batch or the heads; in a balanced drop-in
                step, arguments it cannot honour (``rotary_pos_emb``, extra ones, grouped-query k/v).
        """
        routed = kwargs.pop("routed", args[0] if args and isinstance(args[0], RoutedBatch) else None)
        if routed is not None:
            rest = list(args[1:] if args and args[0] is routed else args)
            segments = kwargs.pop("segments") if "segments" in kwargs else (rest.pop(0) if rest else None)
            if rest or kwargs:  # a positional segments table counts; anything else would be dropped silently
                raise ValueError(f"packed KnapDistributedAttention takes (query, key, value, routed, segments=None); "
                                 f"got also {len(rest)} more arguments and keywords {sorted(kwargs)}")  # fmt: skip
            return self._packed(query, key, value, routed, self.num_heads or query.shape[1], segments)
        step = _balanced_step
        if step is None or self.num_heads is not None:
            return super().forward(query, key, value, *args, **kwargs)
        batch_dim_idx = kwargs.pop("batch_dim_idx", args[0] if args else None)
        extra = [a for a in args[1:] if a is not None] + [k for k, v in kwargs.items() if v is not None]
        if extra:
            raise ValueError(
                f"in a balanced step KnapDistributedAttention cannot honour {extra!r} (e.g. rotary_pos_emb): it runs "
                "its own kernel over the routed sequences. Apply rotary embeddings to query and key before the call"
            )
        if batch_dim_idx not in (0, 1) or query.dim() != 4 or query.shape[batch_dim_idx] != 1:
            raise ValueError(
                f"in a balanced step query must be [1, T, H, Dh] (batch_dim_idx=0) or [T, 1, H, Dh] "
                f"(batch_dim_idx=1): one packed sequence of the routed tokens; got {tuple(query.shape)} with "
                f"batch_dim_idx={batch_dim_idx}"
            )
        if key.shape != query.shape or value.shape != query.shape:
            raise ValueError(
                f"in a balanced step key and value must have query's shape {tuple(query.shape)} (no grouped-query "
                f"attention); got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        q, k, v = (t.squeeze(batch_dim_idx) for t in (query, key, value))
        return self._packed(q, k, v, step, q.shape[1]).unsqueeze(batch_dim_idx)

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, routed: RoutedBatch, num_heads: int,
                segments: np.ndarray | None = None) -> Tensor:  # fmt: skip
        """``[T, H, Dh]`` attention over the routed batch's whole sequences (or their ``segments``)."""
        expected = (routed.batch.num_tokens, num_heads)
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() != 3 or tuple(t.shape[:2]) != expected or t.shape != query.shape:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}; expected [T, H, Dh] = [{expected[0]}, {expected[1]}, Dh] "
                    "(the routed batch's token count, this module's num_heads) and the same shape for q, k and v"
                )
        # Checked on what every rank shares (the plan, the backend, the model's dtypes), so all ranks
        # raise, not only the members of one bag while the others wait for them in an all-to-all: the
        # kernels refuse mixed dtypes on a single GPU, where a group's exchange would promote them.
        if not query.dtype == key.dtype == value.dtype:
            raise ValueError(
                f"query, key and value have dtypes {query.dtype}, {key.dtype} and {value.dtype}; attention takes "
                "one dtype: cast them alike before the attention (e.g. q and k back to v's after a rotary "
                "embedding in float32)"
            )
        largest_group = int(routed.plan.seq_group_size.max(initial=1)) if routed.plan is not None else 1
        if largest_group > num_heads:
            raise ValueError(
                f"the plan runs sequences on {largest_group} GPUs but attention has only {num_heads} heads; "
                f"Ulysses needs at least one head per GPU. Use bags of at most {num_heads} GPUs"
            )
        if segments is not None:  # the whole table, on every rank, before any group's all-to-all
            _check_segments(segments, routed)
        self.varlen_attn.resolve(query.device, query.dtype)
        groups = routed.layout.attention_groups
        if not groups:  # no tokens here: an empty result that still depends on q, k and v for autograd
            return query + key + value
        # In the layout's global (size, start) order: deadlock-free however groups nest (GpuLayout).
        outputs = [
            self._group_attention(query, key, value, routed, index, num_heads, segments) for index in range(len(groups))
        ]
        if len(groups) == 1 and groups[0].rows is None:
            return outputs[0]
        rows = np.concatenate([group.rows for group in groups])
        return torch.cat(outputs).index_select(0, routed.device_array("attention_rows", np.argsort(rows)))

    def _group_attention(self, q: Tensor, k: Tensor, v: Tensor, routed: RoutedBatch, index: int,
                         num_heads: int, segments: np.ndarray | None = None) -> Tensor:  # fmt: skip
        group = routed.layout.attention_groups[index]
        if group.rows is not None:
            rows = routed.device_array(("rows", index), group.rows)
            q, k, v = q.index_select(0, rows), k.index_select(0, rows), v.index_select(0, rows)
        seqs = self._varlen_seqs(routed, index, group, segments)
        if group.size == 1:
            return self.varlen_attn(q, k, v, seqs)
        return self._ulysses(q, k, v, routed, index, group, seqs, num_heads)

    @staticmethod
    def _varlen_seqs(
        routed: RoutedBatch, index: int, group: AttentionGroup, segments: np.ndarray | None = None
    ) -> VarlenSeqs:
        """The kernel's sequences: the group's whole sequences, or with ``segments`` their non-empty
        segments, sequence by sequence (what the all-to-all assembles is sequence-major, and a
        sequence's segments are consecutive in it)."""
        lens, key = group.seq_lens, ("cu_seqlens", index)
        if segments is not None:
            table = np.asarray(segments, dtype=np.int64)[group.seq_ids]  # [m, K], checked in _packed
            lens = table[table > 0]  # row-major: each sequence's segments in order, empty ones dropped
            key = ("cu_seqlens", index, lens.tobytes())  # one table per segmentation and step
        cu_seqlens = np.concatenate([[0], np.cumsum(lens)])
        return VarlenSeqs(
            tuple(lens.tolist()),
            routed.device_array(key, cu_seqlens, torch.int32),
            int(lens.max(initial=0)),
        )

    def _ulysses(self, q: Tensor, k: Tensor, v: Tensor, routed: RoutedBatch, index: int, group: AttentionGroup,
                 seqs: VarlenSeqs, num_heads: int) -> Tensor:  # fmt: skip
        process_group = routed.groups.attention_group(group.start, group.size)
        head_dim = q.shape[-1]
        heads = head_splits(num_heads, group.size)
        bounds = np.cumsum([0, *heads])
        my_heads = heads[group.member]
        member_tokens = group.chunk_lens.sum(axis=1).tolist()  # [G]
        my_tokens = member_tokens[group.member]
        send_counts, recv_counts, out_counts, back_counts = ulysses_counts(member_tokens, heads, group.member, head_dim)

        # Scatter heads, gather sequence: member d gets heads bounds[d]:bounds[d+1] of q, k and v.
        send = torch.cat([t[:, bounds[d] : bounds[d + 1]].reshape(-1) for d in range(group.size) for t in (q, k, v)])
        arrived = exchange(send, send_counts, recv_counts, process_group, "ulysses")
        qkv = torch.cat(
            [
                piece.view(3, n, my_heads * head_dim)
                for piece, n in zip(arrived.split(recv_counts), member_tokens, strict=True)
            ],
            dim=1,
        )  # [3, L, h * Dh] member by member
        if group.seq_major is not None:
            qkv = qkv.index_select(1, routed.device_array(("seq_major", index), group.seq_major))
        q_seq, k_seq, v_seq = (t.view(int(group.seq_lens.sum()), my_heads, head_dim) for t in qkv.unbind(0))

        out = self.varlen_attn(q_seq, k_seq, v_seq, seqs)  # [L, h, Dh]

        # Scatter sequence, gather heads: back to member by member, each member's tokens to it.
        if group.seq_major is not None:
            out = out.index_select(0, routed.device_array(("member_major", index), np.argsort(group.seq_major)))
        back = exchange(out.reshape(-1), out_counts, back_counts, process_group, "ulysses")
        pieces = back.split(back_counts)
        return torch.cat([p.view(my_tokens, h, head_dim) for p, h in zip(pieces, heads, strict=True)], dim=1)
