"""Fail where NCCL would: a collective given a tensor that was never put on the accelerator.

On CPU ranks (gloo) every tensor lives on the host, so a tensor the code forgot to create on (or move
to) the accelerator passes every collective; on GPUs NCCL refuses it ("No backend type associated
with device type cpu"). :class:`HostTensorTracker` marks, inside a ``TorchFunctionMode``, the tensors
that would stay on the host on a GPU machine:

- made by a factory (``torch.tensor``, ``torch.zeros``, ``torch.from_numpy``, ...) without a ``device``;
- returned by ``.cpu()``;
- computed by an op whose tensor inputs are all marked (``torch.cat`` of host tensors, ...);

and unmarks a tensor moved with ``.to(device)`` or ``.cuda()``. While it is active, the collectives of
``deepspeed.comm`` and ``torch.distributed`` raise on a marked tensor, naming the collective.

Run a training script under it with the deepspeed launcher's ``--module``:

    deepspeed --num_gpus 4 --module tests.support.host_tensors examples/train_dit.py --deepspeed_config ...
"""

from __future__ import annotations

import functools
import runpy
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

_MARK = "_host_tensor"
_FACTORIES = {
    torch.tensor, torch.as_tensor, torch.from_numpy, torch.scalar_tensor, torch.zeros, torch.ones, torch.empty,
    torch.full, torch.arange, torch.linspace, torch.eye, torch.rand, torch.randn, torch.randint, torch.randperm,
}  # fmt: skip
_COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv", "inference_all_reduce",
    "all_reduce_coalesced",
)  # fmt: skip


def is_host_tensor(t: object) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _MARK, False)


def _mark(result: object, host: bool) -> None:
    for t in tree_leaves(result):
        if isinstance(t, torch.Tensor):
            if host:
                setattr(t, _MARK, True)
            elif getattr(t, _MARK, False):
                delattr(t, _MARK)


def _names_device(args: tuple, kwargs: dict) -> bool:
    """Whether a ``Tensor.to`` call names a device (``.to(dtype)`` alone does not)."""
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, str, int, torch.Tensor)) and not isinstance(a, bool) for a in args[1:])


class HostTensorTracker(TorchFunctionMode):
    """Marks host tensors as described in the module docstring."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in _FACTORIES:
            inputs = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
            host = kwargs.get("device") is None and all(is_host_tensor(t) for t in inputs)
            _mark(result, host)
        elif func is torch.Tensor.cpu:
            _mark(result, True)
        elif func is torch.Tensor.cuda or (func is torch.Tensor.to and _names_device(args, kwargs)):
            _mark(result, False)
        elif isinstance(result, (torch.Tensor, tuple, list)):
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if inputs and all(is_host_tensor(t) for t in inputs):
                _mark(result, True)
        return result


def _checked(name: str, collective):
    @functools.wraps(collective)
    def check(*args, **kwargs):
        host = [t for t in tree_leaves((args, kwargs)) if is_host_tensor(t)]
        if host:
            shapes = [tuple(t.shape) for t in host]
            raise RuntimeError(
                f"{name} got host tensors of shapes {shapes}: on GPUs NCCL refuses them; create them with "
                "device=<the engine's or the model's device> or move them with .to(device)"
            )
        return collective(*args, **kwargs)

    return check


def check_collectives() -> None:
    """Make the collectives of ``deepspeed.comm`` and ``torch.distributed`` refuse host tensors."""
    import deepspeed.comm
    import deepspeed.comm.comm
    import torch.distributed

    for module in (deepspeed.comm, deepspeed.comm.comm, torch.distributed):
        for name in _COLLECTIVES:
            if hasattr(module, name):
                setattr(module, name, _checked(f"{module.__name__}.{name}", getattr(module, name)))


def main() -> None:
    """``python -m tests.support.host_tensors [--local_rank=N] SCRIPT.py ARGS``: run SCRIPT as ``__main__``."""
    script = next(arg for arg in sys.argv[1:] if arg.endswith(".py"))
    sys.argv = [script, *(arg for arg in sys.argv[1:] if arg != script)]
    check_collectives()
    with HostTensorTracker():
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
