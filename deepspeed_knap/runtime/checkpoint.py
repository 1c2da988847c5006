"""Resuming from a DeepSpeed checkpoint without running code from it, and only into the model it was
saved from.

DeepSpeed 0.19's ``engine.load_checkpoint`` reads its ``.pt`` files with
``torch.load(weights_only=False)``: a pickle, so a file crafted to run code on unpickling (with the
tag's ``manifest.json`` rewritten to match: a manifest proves files unchanged, not who wrote them)
runs it in every rank that loads it. :func:`load_checkpoint` loads the same files with torch's
weights-only unpickler instead, which builds tensors, containers and numbers and the few classes
listed in :data:`ALLOWED_GLOBALS`, and refuses any other global (a function to call, a class to
build) before calling it.

The classes DeepSpeed 0.19.8 stores besides torch's tensors, found by saving real checkpoints (ZeRO-1,
2 and 3, fp32 and bf16, with and without LoRA adapters, with DeepSpeed's optimizer and scheduler or a
client's, client states of ints) and listing their pickles' globals
(``torch.serialization.get_unsafe_globals_in_checkpoint``): the model-state files hold none; each
ZeRO optimizer shard holds its ``LossScaler`` (a ``DynamicLossScaler`` under fp16: the same module,
data only), the ``ZeroStageEnum`` of its stage, and under ZeRO-1/2 ``fragment_address`` (a dataclass
of two ints per parameter).

Before DeepSpeed reads anything, :func:`check_checkpoint` has every rank open the files it loads
(weights-only, memory-mapped: the pickles are read, the tensors' bytes are not), and compare the
model-state file's parameter names and shapes with the model's; the ranks agree in one collective,
so a refused file, a missing one, or a checkpoint of another model (another family, LoRA or not,
another LoRA rank, another world size under ZeRO) is one error on every rank naming the tag and the
file, instead of one rank raising inside DeepSpeed's load while the others wait in its next
collective.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import pickletools
import re
import threading
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

# "module.Class" of every class other than torch's own that DeepSpeed 0.19.8 writes in a checkpoint
# (the module docstring says how they were found).
ALLOWED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)

# Examples named in a mismatch error, per kind.
_SHOWN = 3
_FIX = "resume with the model, LoRA settings and ranks of the run that saved it, or from another checkpoint"


class CheckpointError(ValueError):
    """A checkpoint this rank would load is missing, refused (it holds a global no DeepSpeed
    checkpoint holds), unreadable, or saved from another model; the message names the tag and the file."""


def allowed_globals() -> list[type]:
    """The classes of :data:`ALLOWED_GLOBALS`, imported (DeepSpeed's)."""
    found = []
    for name in ALLOWED_GLOBALS:
        module, _, attribute = name.rpartition(".")
        found.append(getattr(importlib.import_module(module), attribute))
    return found


def weights_only_load(
    path: str | os.PathLike, map_location: Any = None, mmap: bool | None = None, **kwargs: Any
) -> Any:
    """``torch.load(path, weights_only=True)`` with :data:`ALLOWED_GLOBALS` allowed: nothing in the
    file is called but torch's tensor rebuilds and those classes' construction.

    Raises:
        CheckpointError: the file holds another global (its payload is never called), naming the file
            and the global.
    """
    import torch

    with torch.serialization.safe_globals(allowed_globals()):
        try:
            # torch.serialization.load is torch.load, unpatched (weights_only_torch_load patches torch.load).
            return torch.serialization.load(path, map_location=map_location, weights_only=True, mmap=mmap, **kwargs)
        except pickle.UnpicklingError as error:
            raise CheckpointError(_refused(path, error)) from None


def _refused(path: Any, error: Exception) -> str:
    """One line for a file the weights-only unpickler refused, naming the file and what it holds."""
    text = str(error)
    if found := re.search(r"Unsupported global: GLOBAL (\S+)", text):
        what = f"the global {found.group(1)}"
    elif found := re.search(r"Unsupported operand (\d+)", text):
        code = chr(int(found.group(1))).encode("latin-1")
        name = next((op.name for op in pickletools.opcodes if op.code.encode("latin-1") == code), "?")
        what = f"the pickle operation {name}"
    else:
        what = f"what the weights-only unpickler refuses ({text.strip().splitlines()[0] if text.strip() else error!r})"
    return (
        f"{path} was not loaded: it holds {what}, which no DeepSpeed checkpoint holds (loading it would run code "
        "from the checkpoint folder); restore the file the save wrote, or load another tag"
    )


_patch_lock = threading.Lock()


@contextlib.contextmanager
def weights_only_torch_load() -> Iterator[None]:
    """Within the block, every ``torch.load`` (DeepSpeed's ``weights_only=False`` ones included,
    whichever of its paths loads a file: its checkpoint engines, ZeRO's fp32 consolidation, the
    universal checkpoint) is :func:`weights_only_load`. Process-wide while it lasts: a load from
    another thread meanwhile is weights-only too, only stricter."""
    import torch

    def load(f, map_location=None, pickle_module=None, *, weights_only=None, mmap=None, **kwargs):
        # pickle_module and weights_only are the caller's wish to unpickle freely: not granted.
        return weights_only_load(f, map_location, mmap=mmap, **kwargs)

    with _patch_lock:
        original = torch.load
        torch.load = load
    try:
        yield
    finally:
        with _patch_lock:
            torch.load = original


def load_checkpoint(
    engine: Any, load_dir: str | os.PathLike, tag: str, **kwargs: Any
) -> tuple[str | None, dict | None]:
    """``engine.load_checkpoint(load_dir, tag, **kwargs)`` without running code from the checkpoint:
    :func:`check_checkpoint` first (collective), then DeepSpeed's load with every file read
    weights-only (:func:`weights_only_torch_load`). Returns what DeepSpeed returns: ``(load path,
    client state)``, ``(None, None)`` when it found nothing to load.

    Raises:
        CheckpointError: the same on every rank, from :func:`check_checkpoint`; or on the rank that
            loads a file changed since that check to hold a refused global (no code is run).
    """
    check_checkpoint(engine, load_dir, tag)
    with weights_only_torch_load():
        return engine.load_checkpoint(str(load_dir), tag, **kwargs)


def check_checkpoint(engine: Any, load_dir: str | os.PathLike, tag: str) -> None:
    """Check, before DeepSpeed reads anything, that checkpoint ``load_dir/tag`` loads into ``engine``
    (collective over the world: every rank calls it).

    Every rank opens the files DeepSpeed will have it load (its model-state file and, under ZeRO, its
    optimizer shard) weights-only and memory-mapped, and compares the model-state file with the
    engine's model: the parameter and buffer names (another family's, or LoRA adapters the model has
    not, or the other way), their shapes (another LoRA rank, another size of the family) and, under
    ZeRO, the number of ranks that saved it. The ranks then agree.

    Raises:
        CheckpointError: the same on every rank, naming the tag, each file and the ranks that found it.
    """
    from deepspeed_knap.runtime.groups import raise_together

    try:
        problem = _rank_problem(engine, Path(load_dir), tag)
    except Exception as error:  # anything unforeseen here is reported with the others, not raised alone
        problem = f"{type(error).__name__}: {error}"
    raise_together(problem, f"checking checkpoint {Path(load_dir) / tag} before loading it", CheckpointError)


def _rank_problem(engine: Any, load_dir: Path, tag: str) -> str | None:
    """What is wrong, for this rank, with loading ``load_dir/tag`` into ``engine``; ``None``: nothing."""
    import deepspeed.comm as dist

    # DeepSpeed's own (private) namers of this rank's files: the files checked are those it loads.
    model_file = Path(engine._get_ckpt_name(str(load_dir), tag))
    files = [model_file]
    if engine.zero_optimization():
        files.append(Path(engine._get_zero_ckpt_name(str(load_dir), tag)))
    states = {}
    for path in files:
        if not path.is_file():
            present = sorted(p.name for p in path.parent.glob("*.pt")) if path.parent.is_dir() else []
            return (
                f"{path} is not there, and this rank loads it (ZeRO stage {engine.zero_optimization_stage()}); "
                f"the tag holds {present[:4] + (['...'] if len(present) > 4 else [])}: saved under another ZeRO "
                f"stage or precision, or by other ranks; {_FIX}"
            )
        try:
            states[path] = weights_only_load(path, map_location="cpu", mmap=_is_zip(path))
        except CheckpointError as error:
            return str(error)
        except Exception as error:  # not a torch file, a truncated zip: DeepSpeed would fail on it alone
            return f"{path} cannot be read as a DeepSpeed checkpoint file ({type(error).__name__}: {error}); {_FIX}"
    world = dist.get_world_size()
    saved_world = states[model_file].get("dp_world_size") if isinstance(states[model_file], Mapping) else None
    if engine.zero_optimization() and isinstance(saved_world, int) and saved_world != world:
        return (
            f"checkpoint {load_dir / tag} was saved by {saved_world} ranks and this job has {world}: ZeRO keeps one "
            f"optimizer shard per rank; resume on {saved_world} ranks"
        )
    # Named by its tag, not this rank's file: the ranks that find the same mismatch say it in one line.
    return model_mismatch(states[model_file], engine.module, f"checkpoint {load_dir / tag}")


def _is_zip(path: Path) -> bool:
    """Whether ``path`` is in torch's zip format (what ``mmap=True`` loads; DeepSpeed writes it unless
    its config's ``checkpoint_serialization`` is false)."""
    return zipfile.is_zipfile(path)


def model_mismatch(state: Any, model: Any, where: str) -> str | None:
    """Why the DeepSpeed model-state file loaded as ``state`` (called ``where`` in the message) was not
    saved from ``model``: other parameter or buffer names (another family; LoRA adapters on one side
    only), or other shapes; ``None`` when its names and shapes are the model's.

    DeepSpeed writes every name of the model's ``state_dict`` under ``"module"`` (ZeRO-3: each an empty
    tensor, the shapes under ``"param_shapes"`` and ``"frozen_param_shapes"``; ZeRO-1/2: the tensors).
    """
    if not isinstance(state, Mapping) or not isinstance(state.get("module"), Mapping):
        return f"{where} holds no model state ('module'): it is no DeepSpeed model-state file; {_FIX}"
    saved = {name: _shape(value) for name, value in state["module"].items()}
    for group in state.get("param_shapes") or ():
        saved.update((name, tuple(shape)) for name, shape in group.items())
    saved.update((name, tuple(shape)) for name, shape in (state.get("frozen_param_shapes") or {}).items())
    mine = {name: tuple(getattr(t, "ds_shape", t.shape)) for name, t in model.state_dict(keep_vars=True).items()}
    what = type(model).__name__ + (
        f" (family {model.family!r})" if isinstance(getattr(model, "family", None), str) else ""
    )
    saved_lora, my_lora = _lora(saved), _lora(mine)
    if saved_lora and not my_lora:
        return (
            f"{where} was saved with LoRA adapters (e.g. {saved_lora[0]!r}) and this {what} has none: resume with "
            f"the LoRA settings of the run that saved it (train_dit.py: --lora-rank)"
        )
    if my_lora and not saved_lora:
        return (
            f"{where} was saved without LoRA adapters and this {what} has them (e.g. {my_lora[0]!r}): resume "
            "without LoRA, as the run that saved it (train_dit.py: no --lora-rank)"
        )
    missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing or extra:
        return (
            f"{where} was saved from another model: {len(extra)} of its {len(saved)} names are not this {what}'s "
            f"(e.g. {extra[:_SHOWN]}), {len(missing)} of this model's {len(mine)} are not in it (e.g. "
            f"{missing[:_SHOWN]}); {_FIX}"
        )
    differ = [name for name in mine if saved[name] is not None and saved[name] != mine[name]]
    if differ:
        shown = "; ".join(f"{name!r} is {list(saved[name])} there, {list(mine[name])} here" for name in differ[:_SHOWN])
        return (
            f"{where} was saved from a {what} of other dimensions: {shown}"
            + (f" (and {len(differ) - _SHOWN} more)" if len(differ) > _SHOWN else "")
            + f" (another LoRA rank, or another size of the model); {_FIX}"
        )
    return None


def _shape(value: Any) -> tuple[int, ...] | None:
    """A saved tensor's shape, ``None`` where it says nothing (ZeRO-3's empty placeholders)."""
    shape = getattr(value, "shape", None)
    return None if shape is None or getattr(value, "numel", lambda: 0)() == 0 else tuple(shape)


def _lora(shapes: Mapping[str, Any]) -> list[str]:
    """The names of LoRA adapter weights (peft's ``lora_A``, ``lora_B``) among ``shapes``."""
    return sorted(name for name in shapes if ".lora_A." in name or ".lora_B." in name)
