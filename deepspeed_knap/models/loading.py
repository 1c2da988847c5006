"""diffusers checkpoints in and out: lazy, checked, and under ZeRO-3 partitioned as they are read.

    model, report = load_checkpoint(PackedFlux2Transformer, "/models/FLUX.2-dev", ds_config=ds_config)

A checkpoint directory holds ``config.json`` and ``diffusion_pytorch_model.safetensors``, or shards of
it with ``diffusion_pytorch_model.safetensors.index.json`` (a pipeline directory has them under
``transformer/``). Before any tensor is read, the config is checked against the family and every
shard's header against the model's parameter names and shapes; errors name the file and the key.
What diffusers' own class ignores is ignored here too, with a warning: config keys its constructor
does not take (Qwen/Qwen-Image's ``pooled_projection_dim``), and stored tensors its
``_keys_to_ignore_on_load_unexpected`` names (the zero ``attn2.norm_added_q`` weights of Wan 2.1
I2V's diffusers release). Without diffusers installed neither is known, and both are refused.

Under ZeRO-3 (``ds_config`` with ``zero_optimization.stage == 3``) the model is built inside
``deepspeed.zero.Init``, so each parameter is partitioned as its module is constructed, and then each
rank fills only its own partition: for each parameter it reads the rows of the stored tensor that
cover its flat slice ``[rank * p, (rank + 1) * p)`` (``p`` the partition size DeepSpeed chose), from
a memory-mapped shard. No rank ever holds the whole model, and each rank reads about ``1 / world`` of
the bytes. Without ZeRO-3 the model is built on the meta device and every tensor is assigned as read.

With a ``ds_config`` loading is collective: every rank checks what it sees (files may differ between
nodes), the ranks agree in one all-gather, and all raise the same error naming the ranks and files.
Peak host memory per rank while loading is measured (Linux ``VmHWM``) and printed by rank 0.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import re
import resource
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from deepspeed.utils import logger
from torch import Tensor, nn

from deepspeed_knap.models.registry import CONFIG_NAME, transformer_dir
from deepspeed_knap.models.spec import ModelSpec
from deepspeed_knap.runtime.groups import all_gather_bytes, check_same_on_every_rank, raise_together

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into the model; the message names the file and the key."""


# ---- finding and checking a checkpoint ----


def read_config(path: Path, diffusers_class: str, config_keys: tuple[str, ...]) -> dict:
    """The constructor arguments in a ``config.json`` of ``diffusers_class``.

    Raises:
        CheckpointError: another ``_class_name``, or config keys the family does not implement.
    """
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from error
    class_name = config.get("_class_name", diffusers_class)
    if class_name != diffusers_class:
        raise CheckpointError(
            f"{path} has _class_name {class_name!r}, not {diffusers_class!r}; load it with the class of its family "
            "(deepspeed_knap.models.auto.from_pretrained picks it from _class_name)"
        )
    unknown = sorted(key for key in config if not key.startswith("_") and key not in config_keys)
    theirs = _diffusers_class(diffusers_class) if unknown else None
    if isinstance(theirs, type):  # keys diffusers' class does not take either, diffusers ignores (with a warning)
        taken = inspect.signature(theirs.__init__).parameters
        ignored = [key for key in unknown if key not in taken]
        unknown = [key for key in unknown if key in taken]
        if ignored and _first_rank():
            logger.warning(f"{path}: config keys {ignored} are not arguments of {diffusers_class}; ignored, as "
                           "diffusers ignores them")  # fmt: skip
    if unknown:
        which = f" ({theirs}, to tell which ones diffusers ignores)" if isinstance(theirs, str) else ""
        raise CheckpointError(
            f"{path} has config keys {unknown} that this {diffusers_class} implementation does not know{which} (it "
            f"knows {sorted(config_keys)}); this checkpoint is a variant it cannot run faithfully"
        )
    return {key: value for key, value in config.items() if key in config_keys}


def _diffusers_class(name: str) -> type | str:
    """diffusers' model class ``name``, or why there is none here (the reason, for a message)."""
    try:
        import diffusers

        return getattr(diffusers, name)
    except ModuleNotFoundError as error:
        if error.name == "diffusers":
            return "diffusers is not installed"
        problem: Exception = error
    except Exception as error:  # an older diffusers without the class; one whose import fails (RuntimeError)
        problem = error
    return f"diffusers has no {name} here ({type(problem).__name__}: {problem})"


def _first_rank() -> bool:
    """Whether this process logs for all: rank 0, or a process outside ``torch.distributed``."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _without_ignored(files: Mapping[str, Path], expected: Mapping[str, Any], diffusers_class: str) -> dict[str, Path]:
    """``files`` (:func:`weight_files`) less the stored tensors the model does not have (not in
    ``expected``) that diffusers' ``diffusers_class`` ignores when it loads a checkpoint: its
    ``_keys_to_ignore_on_load_unexpected`` patterns, searched in each such name as diffusers does.
    The rest of them stay, for :func:`checkpoint_problems` to name."""
    unexpected = sorted(set(files) - set(expected))
    theirs = _diffusers_class(diffusers_class) if unexpected else None
    patterns = (getattr(theirs, "_keys_to_ignore_on_load_unexpected", None) or []) if isinstance(theirs, type) else []
    ignored = {name for name in unexpected if any(re.search(pattern, name) for pattern in patterns)}
    if ignored and _first_rank():
        logger.warning(f"{files[min(ignored)].parent}: {len(ignored)} stored tensors that {diffusers_class} ignores "
                       f"(its _keys_to_ignore_on_load_unexpected {patterns}), e.g. {min(ignored)!r}, are not read")  # fmt: skip
    return {name: file for name, file in files.items() if name not in ignored}


def weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the ``.safetensors`` file holding it (the single file, or the index's shards).

    Raises:
        FileNotFoundError: no weights, or a shard the index lists that is not there (named with a
            key it should hold).
    """
    single = directory / WEIGHTS_NAME
    if single.is_file():
        return {name: single for name in _header_shapes(single)}
    index = directory / INDEX_NAME
    if not index.is_file():
        raise FileNotFoundError(f"{directory} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise CheckpointError(f"{index} is not a safetensors index with a 'weight_map': {error!r}") from error
    files = {name: directory / shard for name, shard in weight_map.items()}
    for name, file in files.items():
        if not file.is_file():
            raise FileNotFoundError(f"{index} maps {name!r} to {file.name}, which is missing from {directory}")
    return files


def _header_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), "pt") as handle:
            return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{file} is not a readable .safetensors file: {error}") from error


def checkpoint_problems(files: Mapping[str, Path], expected: Mapping[str, tuple[int, ...]]) -> list[str]:
    """What stops ``files`` (from :func:`weight_files`) loading into parameters of ``expected``
    shapes: tensors missing, unexpected, absent from the shard the index names, or of another shape.
    Reads only the shards' headers."""
    problems = []
    headers: dict[Path, dict[str, tuple[int, ...]]] = {}
    for file in sorted(set(files.values())):
        try:
            headers[file] = _header_shapes(file)
        except CheckpointError as error:
            problems.append(str(error))
    for name in sorted(set(expected) - set(files)):
        problems.append(f"{name!r} (shape {list(expected[name])}) is in no file of the checkpoint")
    for name in sorted(set(files) - set(expected)):
        problems.append(f"{files[name]} holds {name!r}, which the model does not have")
    for name in sorted(set(files) & set(expected)):
        header = headers.get(files[name])
        if header is None:
            continue  # unreadable file, reported above
        if name not in header:
            problems.append(f"{files[name]} lacks {name!r}, which the index says it holds")
        elif header[name] != expected[name]:
            problems.append(
                f"{files[name]}: {name!r} has shape {list(header[name])}, the model's is {list(expected[name])}"
            )
    return problems


# ---- host memory ----


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


@dataclass
class HostMemory:
    """Resident host memory of this process over a block: ``start`` and ``peak`` bytes. Linux's
    ``VmHWM`` (the peak) is reset on entry through ``/proc/self/clear_refs``; where that is not
    allowed, ``peak`` is the peak since the process started (``since_start``)."""

    start: int = 0
    peak: int = 0
    since_start: bool = False

    @property
    def increase(self) -> int:
        """Bytes the peak rose above the resident memory at the start."""
        return self.peak - self.start

    @classmethod
    @contextlib.contextmanager
    def measure(cls) -> Iterator[HostMemory]:
        memory = cls()
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            memory.since_start = True
        memory.start = 1024 * (_status_kib("VmRSS") or 0)
        yield memory
        peak_kib = _status_kib("VmHWM")
        if peak_kib is None:  # not Linux: the process-lifetime peak
            peak_kib, memory.since_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, True
        memory.peak = 1024 * peak_kib


# ---- loading ----


@dataclass(frozen=True)
class LoadReport:
    """What loading one checkpoint took on this rank.

    Attributes:
        model_bytes: every parameter at its loaded dtype (the whole model).
        kept_bytes: the parameter bytes this rank keeps (its partitions under ZeRO-3).
        read_bytes: bytes read from the checkpoint files.
        host: this rank's resident host memory while loading (includes the memory-mapped pages read).
        partitioned: ZeRO-3 partitioned loading.
    """

    model_bytes: int
    kept_bytes: int
    read_bytes: int
    host: HostMemory
    partitioned: bool


def checked(ds_config: Mapping | None, what: str, fn: Callable[[], T], agree_on: str | None = None,
            view: Callable[[T], str] = str) -> T:  # fmt: skip
    """``fn()``; with a ``ds_config`` (a collective load), on every rank and agreed: any rank's
    error is raised on every rank (:func:`~deepspeed_knap.runtime.groups.raise_together`), so none is left
    waiting for the others. With ``agree_on`` (its name in the error), so is a result whose ``view``
    differs between ranks (another copy of a folder on another node), which would send the ranks down
    different code or build different parameters. ``what`` and ``agree_on`` must be the same on every
    rank (no per-node path in them): every rank raises the same message."""
    if ds_config is None:
        return fn()
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    deepspeed.init_distributed(distributed_port=int(os.environ.get("MASTER_PORT", "29500")))
    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))  # as zero.Init does; NCCL needs it
    result, problem = None, None
    try:
        result = fn()
    except (CheckpointError, OSError, ValueError) as error:  # a file one node cannot read, too
        problem = f"{type(error).__name__}: {error}"
    raise_together(problem, what, CheckpointError)
    if agree_on is not None:
        try:
            check_same_on_every_rank({agree_on: view(result)})
        except ValueError as error:
            raise CheckpointError(f"{what}: {error}") from None
    return result


def pipeline_index(pipeline: str | Path) -> dict:
    """The parsed ``model_index.json`` of a diffusers pipeline directory.

    Raises:
        ValueError: the file cannot be read, is no JSON, or holds no JSON object; naming it.
    """
    index = Path(pipeline) / "model_index.json"
    try:
        parsed = json.loads(index.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {index}: {error}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{index} holds a JSON {type(parsed).__name__}, not an object: it is no diffusers pipeline's")
    return parsed


def names_second_transformer(index: Any) -> bool:
    """Whether a pipeline's ``model_index.json`` (parsed: ``index``) names a ``transformer_2``: a
    ``[library, class]`` pair whose library is set (Wan 2.2 TI2V-5B's ``[null, null]`` names none)."""
    second = index.get("transformer_2") if isinstance(index, dict) else None
    return isinstance(second, list) and bool(second) and bool(second[0])


def _pipeline_names_second_transformer(pipeline: Path) -> bool:
    """:func:`names_second_transformer` of ``pipeline``'s ``model_index.json`` (an unreadable one:
    no, the loading goes on to the transformer's own files)."""
    try:
        return names_second_transformer(pipeline_index(pipeline))
    except ValueError:
        return False


def plain_ds_config(ds_config: Any) -> dict:
    """The DeepSpeed config (a dict, a JSON path or its base64 string) without the ``"knapformer"``
    block, which DeepSpeed's own config parsing does not know."""
    from deepspeed_knap.runtime.config import KNAPFORMER, load_ds_config

    return {key: value for key, value in load_ds_config(ds_config).items() if key != KNAPFORMER}


def _bag_problem(ds_config: Any, config_path: Path, heads: int) -> str | None:
    """Why the config's knapformer bags cannot run a model of ``heads`` heads, or ``None``."""
    from deepspeed_knap.planner.topology import parse_topology_spec
    from deepspeed_knap.runtime.config import get_knapformer_config, load_ds_config

    knap = get_knapformer_config(load_ds_config(ds_config))
    bags = [size for size, _ in parse_topology_spec(knap.topology)] if knap.enabled else []
    if bags and max(bags) > heads:
        return (
            f"{config_path}: num_attention_heads={heads}, but knapformer.topology {knap.topology!r} has bags of "
            f"{max(bags)} GPUs and Ulysses needs a head per GPU; use bags of at most {heads} GPUs"
        )
    return None


def _unsupported_zero3(zero: Mapping) -> str | None:
    """Why partitioned loading cannot fill this ZeRO-3 layout, or ``None``."""
    if zero.get("zero_hpz_partition_size", 1) > 1:
        return "zero_optimization.zero_hpz_partition_size > 1 (hpZ keeps a second partition it fills at creation)"
    if (zero.get("offload_param") or {}).get("device") == "nvme":
        return "zero_optimization.offload_param.device 'nvme' (partitions live on NVMe, not in memory)"
    if zero.get("zero_quantized_weights") or zero.get("zero_quantized_nontrainable_weights"):
        return "zero_optimization.zero_quantized_weights (partitions are stored quantized)"
    return None


def load_checkpoint(
    cls: type, path: str | Path, torch_dtype: torch.dtype | None = None, ds_config: Any = None, **kwargs: Any
) -> tuple[nn.Module, LoadReport]:
    """Build ``cls`` (a :class:`~deepspeed_knap.models.flux.base.PackedFluxBase` family) from a
    diffusers checkpoint directory; see the module docstring. Collective when ``ds_config`` is given.

    Returns:
        ``(model, report)``.

    Raises:
        CheckpointError, FileNotFoundError, ValueError: without ``ds_config``, this rank's problem;
            with it, the problems of every rank, raised on every rank as a :class:`CheckpointError`.
    """
    import deepspeed

    from deepspeed_knap.runtime.config import read_ds_config

    # A config file one rank cannot read is one error on every rank (collective, as the load is);
    # read once, what the checks below take too.
    if ds_config is not None:
        ds_config = read_ds_config(ds_config)
    plain = None if ds_config is None else plain_ds_config(ds_config)
    zero = (plain or {}).get("zero_optimization", {})
    partitioned = zero.get("stage", 0) == 3

    def prepare() -> tuple[dict, nn.Module, dict[str, Path]]:
        directory = transformer_dir(path)
        if directory != Path(path) and _pipeline_names_second_transformer(Path(path)):
            raise ValueError(
                f"{path} is a pipeline of two transformers (its model_index.json names transformer_2 too): as one "
                f"{cls.__name__} it would load transformer/ alone; give {Path(path) / 'transformer'} or "
                f"{Path(path) / 'transformer_2'} for one of them, or load the pair (Wan 2.2 A14B's experts: "
                "PackedWanExperts.from_pretrained)"
            )
        config = read_config(directory / CONFIG_NAME, cls.diffusers_class, cls.config_keys())
        with torch.device("meta"):  # checks the config (RoPE axes, heads against a topology) at no cost
            meta = cls(**config, **kwargs)
        expected = {name: tuple(p.shape) for name, p in meta.named_parameters()}
        files = _without_ignored(weight_files(directory), expected, cls.diffusers_class)
        problems = checkpoint_problems(files, expected)
        if ds_config is not None and (
            bags := _bag_problem(ds_config, directory / CONFIG_NAME, meta.attention.num_heads)
        ):
            problems.insert(0, bags)
        if partitioned and (reason := _unsupported_zero3(zero)):
            problems.insert(0, f"partitioned loading cannot fill {reason}; turn it off for loading")
        if problems:
            raise CheckpointError(f"checkpoint {directory} does not fit {cls.__name__}:\n" + "\n".join(problems))
        return config, meta, files

    config, meta, files = checked(plain, f"loading a {cls.__name__} checkpoint", prepare,
                                  "the checkpoint's transformer config",
                                  lambda prepared: json.dumps(prepared[0], sort_keys=True, default=str))  # fmt: skip
    with HostMemory.measure() as host:
        if partitioned:
            with deepspeed.zero.Init(config_dict_or_path=plain, dtype=torch_dtype):
                model = cls(**config, **kwargs)
            read = _fill_partitions(model, files)
        else:
            model = meta
            # Kept as diffusers keeps them where it matters, below float32; a float64 model (the
            # conformance tests) stays float64 throughout, exact whatever rows a batch groups.
            narrower = isinstance(torch_dtype, torch.dtype) and torch_dtype.is_floating_point and \
                torch.finfo(torch_dtype).bits < 32  # fmt: skip
            read = _assign_tensors(model, files, torch_dtype, cls.keep_in_fp32() if narrower else ())
    report = LoadReport(
        model_bytes=sum(_numel(p) * p.element_size() for p in model.parameters()),
        kept_bytes=sum(_kept(p).numel() * p.element_size() for p in model.parameters()),
        read_bytes=read,
        host=host,
        partitioned=partitioned,
    )
    if plain is not None:
        _print_reports(path, report)
    return model, report


def _in_modules(name: str, modules: tuple[str, ...]) -> bool:
    """Whether the parameter ``name`` (diffusers' dotted name) lies in a module named in ``modules``
    (a component of the name, as diffusers matches ``_keep_in_fp32_modules``)."""
    return not set(name.split(".")).isdisjoint(modules)


def compute_dtype(model: nn.Module, keep_in_fp32: tuple[str, ...]) -> torch.dtype:
    """The dtype of ``model``'s first parameter outside the modules named in ``keep_in_fp32``, or of
    its first parameter if all are in them."""
    found = next((p for name, p in model.named_parameters() if not _in_modules(name, keep_in_fp32)), None)
    return (found if found is not None else next(model.parameters())).dtype


def _numel(param: Tensor) -> int:
    return param.ds_numel if hasattr(param, "ds_numel") else param.numel()


def _kept(param: Tensor) -> Tensor:
    return param.ds_tensor if hasattr(param, "ds_tensor") else param


def _assign_tensors(model: nn.Module, files: Mapping[str, Path], dtype: torch.dtype | None,
                    keep_in_fp32: tuple[str, ...] = ()) -> int:  # fmt: skip
    """Read every tensor of ``files``, shard by shard, into the meta-built ``model``, floating ones
    cast to ``dtype`` but those of modules named in ``keep_in_fp32`` (:func:`_in_modules`), which
    are float32, as diffusers' ``from_pretrained`` loads them; returns bytes read."""
    from safetensors import safe_open

    read, by_file = 0, {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in sorted(by_file.items()):
        with safe_open(str(file), "pt") as handle:
            tensors = {}
            for name in names:
                tensor = handle.get_tensor(name)
                read += tensor.numel() * tensor.element_size()
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(torch.float32 if _in_modules(name, keep_in_fp32) else dtype)
                tensors[name] = tensor
        model.load_state_dict(tensors, strict=False, assign=True)
    return read


def _fill_partitions(model: nn.Module, files: Mapping[str, Path]) -> int:
    """Copy into every ZeRO-3 parameter's partition (``ds_tensor``) its slice of the stored tensor;
    returns bytes read."""
    import deepspeed.comm as dist
    from safetensors import safe_open

    by_file: dict[Path, list[tuple[str, Tensor]]] = {}
    for name, param in model.named_parameters():
        by_file.setdefault(files[name], []).append((name, param))
    read = 0
    for file, params in sorted(by_file.items()):
        with safe_open(str(file), "pt") as handle:
            for name, param in params:
                size = param.ds_tensor.ds_numel
                start = dist.get_rank(group=param.ds_process_group) * size
                count = min(size, param.ds_numel - start)  # the last partitions are padded
                if count <= 0:
                    continue
                flat = _read_flat(handle, name, start, count)
                read += flat.numel() * flat.element_size()
                with torch.no_grad():
                    param.ds_tensor[:count].copy_(flat)
    return read


def _read_flat(handle: Any, name: str, start: int, count: int) -> Tensor:
    """Elements ``start .. start + count`` of the flattened tensor ``name``, reading only the rows
    (first-dim slices) that hold them."""
    stored = handle.get_slice(name)
    shape = stored.get_shape()
    row = math.prod(shape[1:])
    first, end = start // row, -(-(start + count) // row)
    rows = stored[first:end].reshape(-1)
    return rows[start - first * row : start - first * row + count]


def _print_reports(path: str | Path, report: LoadReport) -> None:
    """Rank 0 prints every rank's peak host memory while loading (one all-gather)."""
    import deepspeed.comm as dist

    mine = f"{report.host.increase},{report.host.peak},{report.kept_bytes},{report.read_bytes}".encode()
    rows = [[int(x) for x in raw.decode().split(",")] for raw in all_gather_bytes(mine)]
    if dist.get_rank() != 0:
        return
    mb = 2**20
    peaks = ", ".join(f"{increase / mb:.0f}" for increase, *_ in rows)
    how = "ZeRO-3 partitioned" if report.partitioned else "full copy per rank"
    print(
        f"loaded {path} ({how}): model {report.model_bytes / mb:,.0f} MB; per rank, kept "
        f"{max(r[2] for r in rows) / mb:,.0f} MB, read {max(r[3] for r in rows) / mb:,.0f} MB at most; "
        f"peak host memory while loading, MB above the start, by rank: [{peaks}] (peak RSS up to "
        f"{max(r[1] for r in rows) / mb:,.0f} MB{', since process start' if report.host.since_start else ''})",
        flush=True,
    )


# ---- saving ----


def save_checkpoint(directory: Path, config: Mapping, state_dict: Mapping[str, Tensor], max_shard_size: int) -> Path:
    """Write ``config.json`` and ``state_dict`` as diffusers does: one ``.safetensors`` file, or
    shards of at most ``max_shard_size`` bytes (a larger tensor gets a shard of its own) with an
    index. Weight files of an earlier save in ``directory`` are replaced."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    for stale in [*directory.glob("diffusion_pytorch_model*.safetensors"), directory / INDEX_NAME]:
        stale.unlink(missing_ok=True)
    (directory / CONFIG_NAME).write_text(
        json.dumps({**config, "_diffusers_version": _diffusers_version()}, indent=2) + "\n"
    )
    shards: list[dict[str, Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in state_dict.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_size:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor.detach().contiguous().cpu()
        shard_bytes += size
    if len(shards) == 1:
        save_file(shards[0], directory / WEIGHTS_NAME)
        return directory
    weight_map, total = {}, 0
    for number, shard in enumerate(shards, start=1):
        file = f"diffusion_pytorch_model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / file)
        weight_map.update(dict.fromkeys(shard, file))
        total += sum(t.numel() * t.element_size() for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return directory


def _diffusers_version() -> str:
    try:
        from importlib.metadata import version

        return version("diffusers")
    except Exception:  # diffusers is optional; any recent version reads the files
        return "0.36.0"


# Constructor arguments of a packed model that are not diffusers' config: how it runs here.
EXTRA_ARGS = ("attention_backend", "topology", "gradient_checkpointing")


class DiffusersCheckpoint:
    """The diffusers checkpoint contract every packed model family shares (a mixin for an
    ``nn.Module`` whose constructor takes diffusers' config arguments plus :data:`EXTRA_ARGS`, keeps
    them in ``self.config``, and names its modules as diffusers does): copy a diffusers model, load
    and save diffusers checkpoint directories, with ZeRO-3 partitioned loading.

    A family's class sets ``spec``, its :class:`~deepspeed_knap.models.spec.ModelSpec`, which gives the
    class ``family`` (the registry's name) and ``diffusers_class`` (``config.json``'s ``_class_name``)."""

    spec: ClassVar[ModelSpec]
    family: ClassVar[str]
    diffusers_class: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "spec" in cls.__dict__:
            cls.family, cls.diffusers_class = cls.spec.name, cls.spec.diffusers_class

    @classmethod
    def config_keys(cls) -> tuple[str, ...]:
        """diffusers' config arguments of this family (the constructor's, less :data:`EXTRA_ARGS`)."""
        names = inspect.signature(cls.__init__).parameters
        return tuple(name for name in names if name != "self" and name not in EXTRA_ARGS)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in, as diffusers' ``ModelMixin.dtype``: its first parameter's
        outside the modules kept in float32 (:meth:`keep_in_fp32`)."""
        return compute_dtype(self, self.keep_in_fp32())

    @classmethod
    def keep_in_fp32(cls) -> tuple[str, ...]:
        """The modules diffusers' model of this family keeps in float32 when it is loaded in another
        dtype (the spec's ``keep_in_fp32``, diffusers' ``_keep_in_fp32_modules``: Wan's modulation
        tables, time embedder and norms, FLUX.3's q/k norms); :meth:`from_pretrained` with a
        ``torch_dtype`` below float32 keeps them so too."""
        return cls.spec.keep_in_fp32

    @classmethod
    def diffusers_model(cls, config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> nn.Module:
        """diffusers' own model of this family (``diffusers_class``) of ``config`` (the packed model's,
        which are diffusers' arguments) holding ``state_dict`` (the packed model's names, which are
        diffusers'), in the state dict's dtype, for diffusers' pipelines (validation, references).
        Parameters are made empty and take the state dict's tensors; buffers (RoPE tables, not in the
        state dict) are computed as usual."""
        import diffusers
        from accelerate import init_empty_weights  # peft's dependency

        with init_empty_weights(include_buffers=False):
            model = getattr(diffusers, cls.diffusers_class)(**config)
        model.load_state_dict(dict(state_dict), strict=True, assign=True)
        return model.eval()

    @classmethod
    def pipeline_transformers(cls, config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> dict[str, nn.Module]:
        """The diffusers pipeline's transformer components holding these weights: ``{"transformer":
        diffusers_model(...)}`` (a two-expert model gives two)."""
        return {"transformer": cls.diffusers_model(config, state_dict)}

    @classmethod
    def from_diffusers(cls, model: nn.Module, **kwargs: Any):
        """A copy of a diffusers model of this family (same weights, dtypes and device).
        ``kwargs``: :data:`EXTRA_ARGS`."""
        config = {key: model.config[key] for key in cls.config_keys()}
        # Built without storage and given copies of the weights: built on the host first, FLUX.1
        # [dev] took minutes and 48 GB of host memory to initialise weights only to overwrite them.
        with torch.device("meta"):
            packed = cls(**config, **kwargs)
        packed.load_state_dict({name: t.clone() for name, t in model.state_dict().items()}, strict=True, assign=True)
        return packed

    @classmethod
    def from_pretrained(
        cls, path: str | Path, torch_dtype: torch.dtype | None = None, ds_config: Any = None, **kwargs: Any
    ):
        """Load a diffusers checkpoint directory (``config.json`` and ``diffusion_pytorch_model``
        ``.safetensors``, single or sharded with its ``.index.json``; or a pipeline directory with
        them under ``transformer/``). Tensors are read lazily, shard by shard.

        Args:
            torch_dtype: cast to this dtype (default: the stored dtype; under ZeRO-3, DeepSpeed's),
                but, in a dtype below float32, the modules diffusers keeps in float32
                (:meth:`keep_in_fp32`), as its ``from_pretrained`` (under ZeRO-3 partitioned loading
                every parameter takes DeepSpeed's dtype).
            ds_config: the DeepSpeed config (a dict, a JSON path or its base64 string) the model will
                train with. With it, loading is collective (every rank calls it): ranks agree on the
                checkpoint's checks and raise the same error, and under ZeRO-3 the model is built inside
                ``deepspeed.zero.Init`` and each rank reads only the slices of the tensors it keeps,
                so no rank ever holds the whole model. Rank 0 prints every rank's peak host memory.
            kwargs: :data:`EXTRA_ARGS`.
        """
        return load_checkpoint(cls, path, torch_dtype, ds_config, **kwargs)[0]

    def save_pretrained(
        self, path: str | Path, state_dict: Mapping[str, Tensor] | None = None, max_shard_size: int = 10 * 2**30
    ) -> Path:
        """Write ``config.json`` and the weights as diffusers writes them (one
        ``diffusion_pytorch_model.safetensors``, or shards of at most ``max_shard_size`` bytes with an
        index), which diffusers' ``from_pretrained`` loads. Pass ``state_dict`` when the parameters
        are partitioned (ZeRO-3: the engine's consolidated state dict, on the rank that has it)."""
        config = {"_class_name": self.diffusers_class, **self.config}
        return save_checkpoint(Path(path), config, self.state_dict() if state_dict is None else state_dict,
                               max_shard_size)  # fmt: skip
