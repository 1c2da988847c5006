"""The packed batch: one rank's samples as one token tensor plus per-token and per-sample columns.

Dimension names: ``T`` tokens on the rank, ``D`` model width, ``N`` sequences (samples) on the rank.
Sequence ``i`` owns token rows ``offsets[i]:offsets[i + 1]``; for a DiT sample those are its text
tokens followed by its image or video tokens.

Nothing here communicates: a :class:`PackedBatch` is plain tensors, built by :func:`pack_samples` on
the home rank and rebuilt by :mod:`deepspeed_knap.runtime.routing` on the GPUs the tokens are routed to.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True, eq=False)
class PackedBatch:
    """Tokens of ``N`` variable-length sequences, concatenated, with their side data.

    Attributes:
        tokens: ``[T, D]`` float token states (the tensor the transformer blocks transform).
        seq_lens: ``N`` token counts, ``sum(seq_lens) == T``.
        token_data: per-token side columns, each ``[T, ...]`` (e.g. ``"position_ids"`` ``[T, 3]``
            int64, ``"modality"`` ``[T]`` int8). Integer columns are routed bit-exactly.
        sample_data: per-sequence tensors, each ``[N, ...]`` (e.g. ``"timestep"`` ``[N]``,
            ``"pooled"`` ``[N, Dp]``). After routing, a GPU holds the row of every sequence it holds
            tokens of.
    """

    tokens: Tensor
    seq_lens: tuple[int, ...]
    token_data: Mapping[str, Tensor] = field(default_factory=dict)
    sample_data: Mapping[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "seq_lens", tuple(int(n) for n in self.seq_lens))
        object.__setattr__(self, "token_data", dict(self.token_data))
        object.__setattr__(self, "sample_data", dict(self.sample_data))

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """``N + 1`` row offsets of the sequences in ``tokens``."""
        offsets = [0]
        for n in self.seq_lens:
            offsets.append(offsets[-1] + n)
        return tuple(offsets)

    @functools.cached_property
    def seq_index(self) -> Tensor:
        """``[T]`` int64: which of the ``N`` local sequences each token belongs to (for per-token
        lookups such as ``modulation[batch.seq_index]``)."""
        counts = torch.tensor(self.seq_lens, dtype=torch.int64, device=self.tokens.device)
        return torch.repeat_interleave(torch.arange(self.num_seqs, device=self.tokens.device), counts)

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same batch with every tensor on ``device`` (the accelerator: collectives need it there)."""
        return PackedBatch(
            self.tokens.to(device),
            self.seq_lens,
            {name: column.to(device) for name, column in self.token_data.items()},
            {name: column.to(device) for name, column in self.sample_data.items()},
        )

    def problem(self) -> str | None:
        """Why this batch is inconsistent, or ``None``. Checked by the balancer after the lengths
        gather, so that every rank raises instead of one raising and the others hanging."""
        if self.tokens.dim() < 1:
            return f"tokens must be [T, ...]; got a {self.tokens.dim()}-d tensor"
        if any(n < 0 for n in self.seq_lens):
            return f"seq_lens must be non-negative; got {list(self.seq_lens)}"
        if sum(self.seq_lens) != self.num_tokens:
            return (
                f"seq_lens sum to {sum(self.seq_lens)} but tokens has {self.num_tokens} rows; "
                "every token row must belong to exactly one sequence"
            )
        for name, column in self.token_data.items():
            if column.dim() < 1 or column.shape[0] != self.num_tokens:
                return f"token_data[{name!r}] has shape {tuple(column.shape)}; expected [{self.num_tokens}, ...]"
            if column.device != self.tokens.device:
                return f"token_data[{name!r}] is on {column.device}, tokens on {self.tokens.device}"
        for name, column in self.sample_data.items():
            if column.dim() < 1 or column.shape[0] != self.num_seqs:
                return f"sample_data[{name!r}] has shape {tuple(column.shape)}; expected [{self.num_seqs}, ...]"
            if column.device != self.tokens.device:
                return f"sample_data[{name!r}] is on {column.device}, tokens on {self.tokens.device}"
        return None

    def signature(self) -> str:
        """Dtype, trailing shape and gradient flag of the tokens and every column. Ranks must agree
        on it: each column is exchanged, and one missing on one rank would stall the others."""

        def describe(t: Tensor) -> str:
            return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape[1:])}{'+grad' if t.requires_grad else ''}"

        token_cols = ", ".join(f"{k}: {describe(v)}" for k, v in self.token_data.items())
        sample_cols = ", ".join(f"{k}: {describe(v)}" for k, v in self.sample_data.items())
        return f"tokens {describe(self.tokens)}; token_data {{{token_cols}}}; sample_data {{{sample_cols}}}"


def pack_samples(
    samples: Sequence[Mapping[str, Tensor]],
    token_keys: Sequence[str] = (),
    sample_keys: Sequence[str] = (),
    tokens_key: str = "tokens",
) -> PackedBatch:
    """Concatenate per-sample tensors into a :class:`PackedBatch`.

    Args:
        samples: ``N`` dicts. ``sample[tokens_key]`` is ``[L_i, D]``; ``sample[k]`` for ``k`` in
            ``token_keys`` is ``[L_i, ...]``; ``sample[k]`` for ``k`` in ``sample_keys`` is one row
            (any shape, stacked into ``[N, ...]``).
        token_keys: per-token side columns to carry.
        sample_keys: per-sample tensors to carry.
        tokens_key: the key of the token states.

    Raises:
        ValueError: a missing key, or per-token tensors whose lengths disagree within a sample.
    """
    if not samples:
        raise ValueError("pack_samples needs at least one sample; build an empty PackedBatch directly for none")
    for i, sample in enumerate(samples):
        for key in (tokens_key, *token_keys, *sample_keys):
            if key not in sample:
                raise ValueError(f"sample {i} has no {key!r}; it has {sorted(sample)}")
        length = sample[tokens_key].shape[0]
        for key in token_keys:
            if sample[key].shape[0] != length:
                raise ValueError(
                    f"sample {i}: {key!r} has {sample[key].shape[0]} rows but {tokens_key!r} has {length}; "
                    "per-token columns need one row per token"
                )
    return PackedBatch(
        tokens=torch.cat([s[tokens_key] for s in samples]),
        seq_lens=tuple(s[tokens_key].shape[0] for s in samples),
        token_data={k: torch.cat([s[k] for s in samples]) for k in token_keys},
        sample_data={k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in sample_keys},
    )


def unpack_tokens(tokens: Tensor, seq_lens: Sequence[int]) -> list[Tensor]:
    """Split packed ``[T, ...]`` rows back into one ``[L_i, ...]`` tensor per sequence."""
    if tokens.shape[0] != sum(seq_lens):
        raise ValueError(f"{tokens.shape[0]} rows cannot be split into sequences of lengths summing to {sum(seq_lens)}")
    return list(torch.split(tokens, list(seq_lens)))
