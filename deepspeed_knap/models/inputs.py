"""What every family's packed inputs share (:class:`PackedInputs`): one rank's samples packed into a
family's dataclass of tensors and per-sample tuples, moved to a device, and the model's packed output
cut back into samples."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor


class PackedInputs(ABC):
    """The base of a family's packed inputs (a frozen dataclass: ``FluxInputs``, ``Flux3Inputs``,
    ``WanInputs``). A subclass gives :attr:`seq_lens` (what the balancer plans) and
    :attr:`output_lens` (the model's output rows per sample), and :attr:`segments` where the planner
    prices a sequence by its attention segments."""

    @property
    @abstractmethod
    def seq_lens(self) -> tuple[int, ...]:
        """``N`` sequence lengths: what the balancer plans, e.g. for
        :meth:`~deepspeed_knap.runtime.balancer.KnapBalancer.prefetch`."""

    @property
    @abstractmethod
    def output_lens(self) -> tuple[int, ...]:
        """``N`` rows of the model's packed output per sample."""

    @property
    def segments(self) -> np.ndarray | None:
        """``[N, K]`` attention segments per sequence, or ``None`` (one segment each)."""
        return None

    @property
    def num_samples(self) -> int:
        return len(self.output_lens)

    def to(self, device: torch.device | str):
        """The same inputs with every tensor on ``device``."""
        moved = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return dataclasses.replace(self, **{name: t.to(device) for name, t in moved.items() if isinstance(t, Tensor)})

    def split(self, rows: Tensor) -> list[Tensor]:
        """The model's ``[sum output_lens, ...]`` output -> one tensor per sample."""
        return list(torch.split(rows, list(self.output_lens)))


# What a model's pack raises for a sample it cannot pack: its own ValueError naming the sample, and
# what a value of the wrong kind raises on the way (a non-tensor, a 0-d tensor, a missing key).
PACK_ERRORS = (ValueError, TypeError, AttributeError, RuntimeError, LookupError)


def pack_carrying(pack: Callable[[Sequence[Mapping]], PackedInputs], samples: Sequence[Mapping],
                  on_problem: str) -> PackedInputs | None:  # fmt: skip
    """A model's ``pack(samples, on_problem)`` prologue: ``None`` for ``"raise"`` (the model packs and
    raises itself), and for ``"carry"`` ``pack(samples)``, or, where that raises, the empty inputs
    whose ``problem`` names why (a balanced forward raises it on every rank of the step together).

    Raises:
        ValueError: ``on_problem`` other than ``"raise"`` and ``"carry"``.
    """
    if on_problem not in ("raise", "carry"):
        raise ValueError(f"on_problem must be 'raise' or 'carry'; got {on_problem!r}")
    if on_problem == "raise":
        return None
    try:
        return pack(samples)
    except PACK_ERRORS as error:
        problem = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
        return dataclasses.replace(pack([]), problem=problem)


def route_text_embedded(text_dim: int, dim: int) -> bool:
    """Whether a family's text travels embedded (``dim`` wide, its gradient coming back in backward)
    rather than as the text encoder's raw ``text_dim``-wide rows: where that is fewer bytes in
    training (raw rows go forward only, an embedding both ways)."""
    return text_dim > 2 * dim
