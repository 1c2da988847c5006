"""The ``"knapformer"`` block of a DeepSpeed JSON config.

    "knapformer": {
        "enabled": true,
        "topology": "auto",
        "cost_model": {"model": "flux-dev", "online": false},
        "solver": "refine",
        "attention_backend": "auto",
        "log_interval": 10
    }

Validated before any process group exists; an unknown key or bad value raises ``ValueError``
naming it. Every field is documented in docs/config.md with its default.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import os
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from deepspeed.utils import logger
from pydantic import BaseModel, Field, StrictBool, ValidationError, ValidationInfo, field_validator, model_validator

from deepspeed_knap.cost.calibrate import read_calibration
from deepspeed_knap.cost.model import (
    COEFFICIENTS,
    DEFAULT_ALLTOALL_GBPS,
    DEFAULT_INTER_NODE_ALLTOALL_GBPS,
    DEFAULT_TFLOPS,
    CostModel,
)
from deepspeed_knap.cost.online import OnlineSettings
from deepspeed_knap.models.registry import PRESETS, default_cost_model
from deepspeed_knap.planner.solve import DEFAULT_SOLVER
from deepspeed_knap.planner.topology import AUTO, parse_topology_spec

KNAPFORMER = "knapformer"
_WORKLOAD_RENAMED = (
    'The cost model\'s key is "cost_model" (a data mix was also called a workload), with the online knobs nested '
    'in "online": {"enabled": true, ...}; "workload" goes in the next release'
)


_ONLINE_KNOBS = ("warmup_steps", "forgetting", "refit_interval", "max_speed_ratio")


class _KnapConfigModel(DeepSpeedConfigModel):
    """A block of the ``"knapformer"`` config: besides DeepSpeed's rules (unknown keys refused), a
    number field refuses a JSON boolean, which pydantic would take as 1 or 0 (``"timeout_s": true``
    would wait one second), and a string, which it would parse (``"log_interval": "10"``: a config
    that reads a number there here would be refused by a stricter reader, and ``"1e3"`` is no
    ``int``)."""

    def __init__(self, /, **data: Any) -> None:
        # DeepSpeed's __init__(strict=False, **data) drops every value "auto" unless called with
        # strict=True, and takes a "strict" key as that argument: pydantic builds the nested blocks
        # without it, so "model": "auto" in "cost_model" fell back to the default unannounced and
        # "strict" was a key no block refused. Every value counts, every unknown key is refused.
        BaseModel.__init__(self, **data)
        self._deprecated_fields_check()

    @field_validator("*", mode="before")
    @classmethod
    def _a_number_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        annotation = cls.model_fields[info.field_name].annotation
        takes = {annotation, *get_args(annotation)}
        if isinstance(value, bool) and not {bool, StrictBool} & takes:
            raise ValueError(f"{str(value).lower()} is a boolean; give a number")
        alternatives = set(get_args(annotation)) if get_origin(annotation) in (Union, UnionType) else {annotation}
        if isinstance(value, str) and alternatives <= {int, float, type(None)} and alternatives & {int, float}:
            raise ValueError(f"{value!r} is a string; give a number, without quotes")
        return value


class _SwitchedConfig(_KnapConfigModel):
    """A block with an ``enabled`` switch: its other keys are refused with ``"enabled": false``,
    which leaves them unread (a user who set them meant the block on)."""

    @model_validator(mode="before")
    @classmethod
    def _no_knob_when_off(cls, values: Any) -> Any:
        if isinstance(values, Mapping) and values.get("enabled") is False:
            knobs = sorted(key for key in values if key != "enabled")
            if knobs:
                raise ValueError(
                    f'{", ".join(knobs)} given with "enabled": false, where nothing reads {"them" if len(knobs) > 1 else "it"}; '
                    'remove it, or set "enabled": true'
                )
        return values


class KnapOnlineConfig(_SwitchedConfig):
    """The ``"online"`` refit of the cost model: ``a``, ``b``, ``c``, a speed factor per rank,
    ``route_coef`` and ``route_latency_s`` fitted to the measured step times, every step, identically on every rank; the cost
    model's source is the prior. ``"online": true`` is this block with its defaults."""

    enabled: StrictBool = True
    """Turn the refit on (an ``"online"`` object asks for it unless this is false)."""
    warmup_steps: int = Field(OnlineSettings.warmup_steps, ge=1)
    """Steps learned from before the first refit (a run's first measured step is not one)."""
    forgetting: float = Field(OnlineSettings.forgetting, gt=0, le=1, allow_inf_nan=False)
    """Weight of a step relative to the next newer one."""
    refit_interval: int = Field(OnlineSettings.refit_interval, ge=1)
    """Refit every this many steps."""
    max_speed_ratio: float = Field(OnlineSettings.max_speed_ratio, gt=1, allow_inf_nan=False)
    """A rank's speed factor stays within this factor of the median rank's."""
    fit_route: StrictBool = OnlineSettings.fit_route
    """Refit ``route_coef`` and ``route_latency_s`` from the measured route phases (once enough steps
    moved tokens), even from a prior of 0: route pricing then turns on. ``false``: the given route
    coefficients are kept."""

    def settings(self) -> OnlineSettings | None:
        """The refit's settings, or ``None`` when it is off."""
        if not self.enabled:
            return None
        return OnlineSettings(self.warmup_steps, self.forgetting, self.refit_interval, self.max_speed_ratio,
                              self.fit_route)  # fmt: skip


class KnapStartupCalibrationConfig(_SwitchedConfig):
    """The ``"startup_calibration"`` of the cost model: at start-up every rank times forward and
    backward of a copy of the model's own blocks (its dims and attention kernel) at ``seq_lens``, the
    ranks agree on one fit of ``a`` and ``b`` (and on a speed per rank where one is shown), and the
    first step plans with it (:func:`~deepspeed_knap.cost.calibrate.startup_model`).
    ``true``/``false`` is this block with ``enabled`` set."""

    enabled: StrictBool | Literal["auto"] = "auto"
    """``true``, ``false``, or ``"auto"``: on where it costs little, on GPUs with a preset source
    (the FLOP prior); off on CPU ranks and with measured coefficients or a calibration file."""
    seq_lens: list[int] = Field(default_factory=lambda: [1024, 2048, 4096, 8192])
    """Lengths timed (at least 3 different, each > 0): the fit extrapolates from them. The default
    ones are cut to ``max_tokens_per_gpu`` (:meth:`timed_lengths`)."""
    repeats: int = Field(2, ge=1, le=20)
    """Timed runs per length (the median counts), after one warm-up run."""

    @field_validator("seq_lens", mode="before")
    @classmethod
    def _no_bool_lengths(cls, value: Any) -> Any:
        if isinstance(value, list) and any(isinstance(length, bool) for length in value):
            raise ValueError(f"seq_lens {value}: a length is a number, not a boolean")
        if isinstance(value, list) and any(isinstance(length, str) for length in value):
            raise ValueError(f"seq_lens {value}: a length is a number, not a string; give it without quotes")
        return value

    @field_validator("seq_lens")
    @classmethod
    def _lengths(cls, value: list[int]) -> list[int]:
        if len(set(value)) < 3 or min(value) < 1:
            raise ValueError(f"seq_lens {value}: give at least 3 different lengths, each >= 1 (a, b and an "
                             "overhead are fitted)")  # fmt: skip
        return value

    def timed_lengths(self, max_tokens_per_gpu: int | None) -> list[int]:
        """The lengths to time: ``seq_lens`` as given, or the default ones up to ``max_tokens_per_gpu``
        (no GPU holds more: longer ones would spend memory and time on a length no step runs),
        and where fewer than 3 of those remain, the cap, its half and its quarter (rounded up: a cap
        of 3 tokens times 1, 2 and 3; one of 1 or 2 leaves fewer than 3 lengths: :class:`KnapFormerConfig`
        refuses ``"enabled": true`` there, and ``"auto"`` does not time)."""
        if max_tokens_per_gpu is None or "seq_lens" in self.model_fields_set:
            return list(self.seq_lens)
        within = [length for length in self.seq_lens if length <= max_tokens_per_gpu]
        if len(within) >= 3:
            return within
        return sorted({-(-max_tokens_per_gpu // 2**shift) for shift in range(3)})


class KnapCostModelConfig(_KnapConfigModel):
    """Where the planner's cost model comes from: exactly one of a model preset (FLOP-derived),
    measured coefficients, or a calibration file written by ``deepspeed-knap calibrate``; and whether
    it is refit online."""

    model: str | None = None
    """Preset name: each registered family's (``flux-dev``, ``flux-schnell``, ``flux-tiny``, ``flux2-dev``,
    ``flux2-tiny``, ``flux3``, ``flux3-tiny``; Qwen-Image: ``qwen-image``, ``qwen-image-tiny``; Wan:
    ``wan2.1-1.3b``, ``wan2.1-14b``, ``wan2.2-ti2v-5b``, ``wan-tiny``; docs/models.md lists them);
    the default when nothing else is given. The dims overrides below are FLUX's: a Wan preset takes none
    (another Wan size: calibrate, or give coefficients)."""
    hidden: int | None = Field(None, gt=0)
    """Override the preset's model width."""
    double_blocks: int | None = Field(None, ge=0)
    """Override the preset's double-stream block count."""
    single_blocks: int | None = Field(None, ge=0)
    """Override the preset's single-stream block count."""
    mlp_ratio: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Override the preset's MLP ratio."""
    tflops: float = Field(DEFAULT_TFLOPS, gt=0, allow_inf_nan=False)
    """Sustained TFLOP/s per GPU assumed by the preset model."""
    alltoall_gbps: float = Field(DEFAULT_ALLTOALL_GBPS, gt=0, allow_inf_nan=False)
    """All-to-all bandwidth per GPU (GB/s) inside a node assumed by the preset model."""
    inter_node_alltoall_gbps: float | None = Field(DEFAULT_INTER_NODE_ALLTOALL_GBPS, gt=0, allow_inf_nan=False)
    """All-to-all bandwidth per GPU (GB/s) to other nodes assumed by the preset model: the Ulysses
    all-to-all of a group across nodes pays it for its peers there, and ``auto`` takes such a group
    where that pays. ``null``: not priced apart (as ``alltoall_gbps``; ``auto``'s groups of whole nodes
    then only take what the cap keeps out of every node's group)."""
    linear_coef: float | None = Field(None, ge=0, allow_inf_nan=False)
    """Measured ``a`` (seconds per token on one GPU); give with ``quadratic_coef``."""
    quadratic_coef: float | None = Field(None, ge=0, allow_inf_nan=False)
    """Measured ``b`` (seconds per token squared); give with ``linear_coef``."""
    alltoall_coef: float | None = Field(None, ge=0, allow_inf_nan=False)
    """Measured ``c`` (seconds per token of Ulysses traffic); optional with coefficients, and with a
    calibration file it replaces the file's (one process times no all-to-all)."""
    sequence_coef: float | None = Field(None, ge=0, allow_inf_nan=False)
    """``e``: seconds every GPU of a group spends on a sequence whatever the group's size (Wan: each
    member projects the sample's text itself), with any source; default: the source's (a Wan preset's
    FLOP count, else 0)."""
    route_coef: float | None = Field(None, ge=0, allow_inf_nan=False)
    """Seconds of one token's round trip off its home GPU to another GPU of its node (the route and
    the reverse route, forward and backward), with any source: the planner adds the route phase to
    a plan's modeled step and keeps a sequence home when moving it costs more than it saves. Default:
    the calibration file's ``route_coef``, else 0: moving is free (the plans of before)."""
    inter_node_route_coef: float | None = Field(None, ge=0, allow_inf_nan=False)
    """The same to a GPU of another node; default: ``route_coef``."""
    route_latency_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    """Seconds the route phase costs once any token leaves its home GPU, however few (the
    all-to-alls' fixed cost, which a plan keeping every token home skips), with any source: the
    planner keeps every sequence home unless balancing saves more. Default: the calibration file's
    ``route_latency_s``, else 0 (the plans of before); the online refit fits it (``fit_route``)."""
    inter_node_alltoall_coef: float | None = Field(None, ge=0, allow_inf_nan=False)
    """Measured ``c'`` (seconds per token of Ulysses traffic to a group's peers on other nodes), with
    any source; with a preset it replaces what ``inter_node_alltoall_gbps`` gives. Default: the
    preset's; none with coefficients or a calibration file (crossing nodes priced at ``c``, and
    ``auto``'s groups of whole nodes only for the cap)."""
    calibration_file: str | None = None
    """JSON with ``linear_coef``, ``quadratic_coef`` and optionally ``alltoall_coef``,
    ``degree_efficiency``, ``route_coef`` and ``route_latency_s``, as ``deepspeed-knap calibrate``
    writes it (it writes no ``route_latency_s``: the online refit fits it)."""
    frozen_base: StrictBool = False
    """Preset model: the base weights are frozen (LoRA), so linear layers' backward skips the
    weight gradient (2 forwards' worth instead of 3)."""
    online: KnapOnlineConfig | None = None
    """Refit the model online from measured step times: ``true``, or an object with
    ``enabled``, ``warmup_steps``, ``forgetting``, ``refit_interval``, ``max_speed_ratio``, ``fit_route``
    (:class:`KnapOnlineConfig`); off when absent or ``false``."""

    startup_calibration: KnapStartupCalibrationConfig = Field(default_factory=KnapStartupCalibrationConfig)
    """Time the model's blocks at start-up and plan with the fit from the first step: ``true``,
    ``false``, ``"auto"`` or an object (:class:`KnapStartupCalibrationConfig`); default ``"auto"``
    (on GPUs with a preset source)."""

    @field_validator("startup_calibration", mode="before")
    @classmethod
    def _startup_bool(cls, value: Any) -> Any:
        return {"enabled": value} if isinstance(value, bool) or value == "auto" else value

    def calibrates_at_start(self, accelerator_is_gpu: bool, family: str | None,
                            max_tokens_per_gpu: int | None = None) -> bool:  # fmt: skip
        """Whether the ranks time their blocks at start-up: ``enabled``, or with ``"auto"`` on GPUs
        when the source is a preset (measured coefficients and a calibration file are measured
        already), the model is of a registered ``family`` (its packed model's ``family``) and
        ``max_tokens_per_gpu`` leaves at least 3 lengths to fit (:meth:`KnapStartupCalibrationConfig.timed_lengths`:
        not under a cap of 1 or 2 tokens, where :class:`KnapFormerConfig` refuses ``true``).

        Raises:
            ValueError: ``enabled`` for a model of no registered family (nothing names its blocks).
        """
        enabled = self.startup_calibration.enabled
        if enabled == "auto":
            measured = self.linear_coef is not None or self.calibration_file is not None
            fits = len(self.startup_calibration.timed_lengths(max_tokens_per_gpu)) >= 3
            return accelerator_is_gpu and not measured and family is not None and fits
        if enabled and family is None:
            raise ValueError("knapformer.cost_model.startup_calibration times a model of a registered family (a "
                             "deepspeed_knap packed transformer, whose family names its blocks); this model has "
                             "no family: turn it off, or give a calibration_file (deepspeed-knap calibrate "
                             "--callable times any step)")  # fmt: skip
        return enabled

    @field_validator("online", mode="before")
    @classmethod
    def _online_bool(cls, value: Any) -> Any:
        if value is True:
            return {}
        if value is False:
            return None
        return value

    @model_validator(mode="after")
    def _one_source(self) -> KnapCostModelConfig:
        dims = [k for k in ("hidden", "double_blocks", "single_blocks", "mlp_ratio") if getattr(self, k) is not None]
        coefs = [k for k in ("linear_coef", "quadratic_coef") if getattr(self, k) is not None]
        sources = [name for name, used in (("model/dims", self.model is not None or dims),
                                           ("coefficients", coefs), ("calibration_file", self.calibration_file))
                   if used]  # fmt: skip
        if len(sources) > 1:
            raise ValueError(f"give one cost model source, not {' and '.join(sources)}")
        if coefs and (self.linear_coef is None or self.quadratic_coef is None):
            raise ValueError("coefficients need both linear_coef and quadratic_coef")
        if self.alltoall_coef is not None and not coefs and self.calibration_file is None:
            raise ValueError(f"alltoall_coef {self.alltoall_coef} goes with linear_coef and quadratic_coef, or with a "
                             "calibration_file (whose all-to-all price it replaces); a preset takes alltoall_gbps")  # fmt: skip
        if self.model is not None and self.model not in PRESETS:
            raise ValueError(f"unknown model preset {self.model!r}; choose one of {', '.join(PRESETS)}")
        if self.model is not None and dims and not set(dims) <= set(PRESETS[self.model][1]):
            family = PRESETS[self.model][0]
            raise ValueError(
                f"{', '.join(dims)} override a FLUX-style preset's dims; {family.title} preset {self.model!r} takes "
                f"none (its sizes are the presets {', '.join(family.presets)}; for another, calibrate or give "
                "linear_coef and quadratic_coef)"
            )
        if self.frozen_base and (coefs or self.calibration_file):
            raise ValueError("frozen_base adjusts a preset; measured coefficients already say what they measured")
        preset_only = [k for k in ("tflops", "alltoall_gbps", "inter_node_alltoall_gbps")
                       if k in self.model_fields_set and getattr(self, k) is not None]  # fmt: skip
        if preset_only and (coefs or self.calibration_file):  # read by a preset alone: given here, ignored
            raise ValueError(f"{', '.join(preset_only)}: a preset's FLOPs and links, which measured coefficients or a "
                             "calibration_file do not read; give alltoall_coef (and inter_node_alltoall_coef) "
                             "instead, or drop them")  # fmt: skip
        return self

    def online_settings(self) -> OnlineSettings | None:
        """The online refit's settings, or ``None`` when it is off."""
        return None if self.online is None else self.online.settings()

    def build(self) -> CostModel:
        """The :class:`~deepspeed_knap.cost.model.CostModel` this section describes: its source's, with
        every coefficient the section gives in its place."""
        given = {name: getattr(self, name) for name in COEFFICIENTS[2:] if getattr(self, name) is not None}
        return dataclasses.replace(self._compute_model(), **given)

    def _compute_model(self) -> CostModel:
        if self.linear_coef is not None:
            return CostModel(self.linear_coef, self.quadratic_coef)
        if self.calibration_file is not None:  # alltoall_coef, given, replaces the file's (one process times none)
            try:
                return read_calibration(self.calibration_file)
            except ValueError as error:
                raise ValueError(
                    f"knapformer.cost_model.calibration_file {str(error).removeprefix('calibration file ')}"
                ) from None
        dims = {k: getattr(self, k) for k in ("hidden", "double_blocks", "single_blocks", "mlp_ratio")}
        overrides = {k: v for k, v in dims.items() if v is not None}
        return default_cost_model(self.model or "flux-dev", tflops=self.tflops, alltoall_gbps=self.alltoall_gbps,
                                  inter_node_alltoall_gbps=self.inter_node_alltoall_gbps, frozen_base=self.frozen_base,
                                  **overrides)  # fmt: skip


class KnapFormerConfig(_KnapConfigModel):
    """The ``"knapformer"`` block. With ``enabled: false`` (the default) nothing is balanced and nothing
    extra communicates."""

    enabled: StrictBool = False
    """Turn balancing on."""
    topology: str | None = None
    """``"auto"`` (every sequence gets its own Ulysses degree each step), or the bag layout of one
    balance group, e.g. ``"g8n4"`` or ``"g1n8+g2n4"``. Absent or ``null``: ``"auto"`` when enabled
    (the validated block then reads ``"auto"``); left ``None`` when disabled, where nothing reads it."""
    max_degree: int | None = Field(None, gt=0)
    """``auto`` only: the largest Ulysses group, a power of two; above a node, groups of whole nodes,
    taken where the inter-node all-to-all price says they pay (``cost_model.inter_node_alltoall_gbps``).
    Default: the smallest of 8, the node
    and the model's attention heads."""
    gpus_per_node: int | None = Field(None, gt=0)
    """GPUs per node: bags and groups stay inside nodes (but ``auto``'s groups of whole nodes, see
    ``max_degree``); default: what the launcher reports
    (``LOCAL_SIZE`` from deepspeed, ``LOCAL_WORLD_SIZE`` from torchrun, ``OMPI_COMM_WORLD_LOCAL_SIZE``
    or ``MPI_LOCALNRANKS`` from mpirun, ``SLURM_NTASKS_PER_NODE``)."""
    solver: Literal["none", "knapformer", "refine"] = DEFAULT_SOLVER
    """Planner solver."""
    cost_model: KnapCostModelConfig = Field(default_factory=KnapCostModelConfig)
    """Cost model source, and its online refit."""
    workload: KnapCostModelConfig | None = Field(
        None, json_schema_extra={"deprecated": True, "new_param": "cost_model", "deprecated_msg": _WORKLOAD_RENAMED}
    )
    """Deprecated spelling of ``cost_model`` (its online knobs may stand flat beside ``online``)."""
    max_tokens_per_gpu: int | None = Field(None, gt=0)
    """Memory cap: most tokens one GPU may hold after routing."""
    attention_backend: Literal["auto", "flash", "torch_varlen", "sdpa"] = "auto"
    """Local attention kernel of every ``KnapDistributedAttention`` in the model."""
    log_interval: int = Field(10, ge=0)
    """Log balancing metrics every this many steps (0: never)."""
    timeout_s: float = Field(300.0, ge=1, le=86400, allow_inf_nan=False)
    """Seconds any collective of the job waits for a stuck, stopped or dead rank before the job fails:
    ours (the start-up checks, the lengths gather, the routes, the Ulysses all-to-alls) and, when the
    block is enabled or gives this key, DeepSpeed's too (ZeRO's gathers and reductions), set by
    ``deepspeed_knap.initialize``. From 1 s to 86,400 s (a day): gloo rounds less than a millisecond
    to no wait at all, and ``datetime.timedelta`` overflows far above it."""

    @field_validator("workload", mode="before")
    @classmethod
    def _nest_flat_online_knobs(cls, value: Any) -> Any:
        """The old block kept the online knobs flat beside ``"online": true``."""
        if not isinstance(value, Mapping) or not any(knob in value for knob in _ONLINE_KNOBS):
            return value
        flat = {knob: value[knob] for knob in _ONLINE_KNOBS if knob in value}
        online = value.get("online", False)
        if not isinstance(online, bool):
            raise ValueError(f'"online" must be true or false beside the flat knobs {", ".join(flat)}; got {online!r}')
        rest = {key: v for key, v in value.items() if key not in flat and key != "online"}
        if not online:  # the old block read no knob with "online" off: a config that loaded still loads
            logger.warning(f'knapformer.workload: {", ".join(flat)} ignored, as before: "online" is off')
            return rest
        return {**rest, "online": flat}

    @model_validator(mode="before")
    @classmethod
    def _not_both_spellings(cls, values: Any) -> Any:
        if isinstance(values, Mapping) and "workload" in values and "cost_model" in values:
            raise ValueError('give "cost_model", not both it and its deprecated spelling "workload"')
        return values

    @model_validator(mode="before")
    @classmethod
    def _auto_when_enabled(cls, values: Any) -> Any:
        """An enabled block without a topology (absent or ``null``) is planned ``auto``; a disabled one
        keeps ``None``, so a block that loaded with balancing off before ``auto`` became the default
        (``"solver": "knapformer"``, ``"max_degree"`` without a topology) still loads."""
        if isinstance(values, Mapping) and values.get("enabled") is True and values.get("topology") is None:
            return {**values, "topology": AUTO}
        return values

    @field_validator("topology")
    @classmethod
    def _topology_grammar(cls, value: str | None) -> str | None:
        if value is not None:
            parse_topology_spec(value)
        return value

    @model_validator(mode="after")
    def _topology_when_enabled(self) -> KnapFormerConfig:
        if self.solver == "knapformer" and self.max_tokens_per_gpu is not None:
            raise ValueError(
                f'"solver": "knapformer" cannot honour "max_tokens_per_gpu": {self.max_tokens_per_gpu} (the published '
                'greedy knows no memory); use "solver": "refine", or drop the cap'
            )
        if not self.enabled:  # nothing plans: the topology checks wait for a block that balances
            return self
        # The deprecated spelling is moved to cost_model only after this check has run.
        # (DeepSpeed deletes the attribute when it moves the value: getattr.)
        workload = getattr(self, "workload", None)
        calibration = (workload if workload is not None else self.cost_model).startup_calibration
        lengths = calibration.timed_lengths(self.max_tokens_per_gpu)
        if calibration.enabled is True and len(lengths) < 3:
            raise ValueError(
                f'"max_tokens_per_gpu": {self.max_tokens_per_gpu} leaves "startup_calibration" ("enabled": true) '
                f"fewer than 3 lengths to time ({lengths}; it fits a, b and an overhead): give its "
                '"seq_lens", raise the cap to 3 tokens or more, or turn the calibration off'
            )
        if self.topology.strip() == AUTO and self.solver == "knapformer":
            raise ValueError(
                '"solver": "knapformer" needs a fixed topology, e.g. "topology": "g8n4"; "topology": "auto" (the '
                'default) is planned by "refine"'
            )
        if self.max_degree is not None:
            if self.topology.strip() != AUTO:
                raise ValueError(
                    f'"max_degree": {self.max_degree} applies to "topology": "auto" only; a fixed topology '
                    f"({self.topology!r}) sets its bag sizes itself"
                )
            if self.max_degree & (self.max_degree - 1):
                raise ValueError(f'"max_degree": {self.max_degree} must be a power of two (1, 2, 4, 8, ...)')
        return self


def load_ds_config(config: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config given as a dict, a file path or a base64 string of a JSON object, as a dict,
    read as ``DeepSpeedConfig`` reads it: hjson (JSON, comments allowed), and in a file a key given
    twice at any depth is an error.

    Raises:
        ValueError: the file is unreadable or not a JSON object, or repeats a key, naming the file
            and where.
    """
    import hjson
    from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys

    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, str) and not os.path.exists(config):  # DeepSpeed also takes the config in base64
        try:
            decoded = base64.urlsafe_b64decode(config).decode("utf-8")
        except ValueError:  # not base64 (binascii.Error, UnicodeDecodeError): a path, reported below
            decoded = ""
        try:
            loaded = hjson.loads(decoded) if decoded.strip() else None  # (a base64 config's repeated key: its last)
        except hjson.HjsonDecodeError as error:
            if decoded.lstrip().startswith("{"):  # meant as a config: its error, not the missing file's
                raise ValueError(f"the DeepSpeed config given in base64 (no file has that name) is not valid JSON: "
                                 f"{error.msg} at line {error.lineno}, column {error.colno}") from None  # fmt: skip
            loaded = None
        if isinstance(loaded, Mapping):
            return dict(loaded)
    try:
        with open(config) as file:
            loaded = hjson.load(file, object_pairs_hook=dict_raise_error_on_duplicate_keys)
    except OSError as error:
        where = "" if Path(config).is_absolute() else f" ({Path(config).absolute()})"  # relative to this rank's cwd
        raise ValueError(f"cannot read the DeepSpeed config {config}{where}: {error.strerror or error}") from None
    except hjson.HjsonDecodeError as error:
        raise ValueError(
            f"the DeepSpeed config {config} is not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}"
        ) from None
    except ValueError as error:  # a key given twice
        raise ValueError(f"the DeepSpeed config {config}: {error}; give each key once") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"the DeepSpeed config {config} must hold a JSON object; it holds a {type(loaded).__name__}")
    return loaded


def read_ds_config(config: Any, distributed_port: int | None = None,
                   dist_init_required: bool | None = None) -> dict[str, Any]:  # fmt: skip
    """The DeepSpeed config (a dict, a JSON file every rank reads, or its base64 string), once every
    rank has read it.

    Collective: every rank first joins the process group, whatever its file says
    (``deepspeed.init_distributed``; with the ``"knapformer"`` block's ``timeout_s`` where
    :func:`~deepspeed_knap.engine.initialize` takes it), and binds its accelerator; then the ranks
    agree on the read. A file missing, unreadable or not a JSON object on one node only (a path
    relative to a working directory that differs, a copy edited there) is one ``ValueError`` on
    every rank, naming the node, the ranks and the file, rather than an error on some ranks while the
    others wait in the rendezvous or in their next collective. ``initialize``, the trainer and
    ``from_pretrained(..., ds_config=...)`` read the config so; given the dict, nothing reads it again.

    ``distributed_port`` (default ``MASTER_PORT``, else 29500) and ``dist_init_required``: as
    ``deepspeed.init_distributed`` takes them.

    Raises:
        ValueError: on every rank, when any rank could not read the config, or when ``srun`` started
            the ranks without ``RANK`` (:func:`~deepspeed_knap.runtime.groups.unjoinable_launch`).
    """
    import deepspeed
    import deepspeed.comm as dist
    import torch.distributed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.constants import default_pg_timeout

    from deepspeed_knap.runtime.groups import raise_together, set_collective_timeout, this_node, unjoinable_launch
    from deepspeed_knap.runtime.shm_buffers import unlink_own_shm_buffer

    if problem := unjoinable_launch():  # the same on every task: all raise, before any collective
        raise ValueError(problem)

    try:
        ds_config, problem = load_ds_config(config), None
    except ValueError as error:  # names the file
        ds_config, problem = {}, str(error)
    except (OSError, TypeError) as error:
        ds_config, problem = {}, f"cannot read the DeepSpeed config {config!r}: {error}"
    timeout = collective_timeout(ds_config.get(KNAPFORMER))
    joining = not torch.distributed.is_initialized()  # else a group's timeouts are someone else's to set
    # Under mpirun, DeepSpeed discovers ranks through mpi4py and would take port 29500 unless told.
    port = int(os.environ.get("MASTER_PORT", "29500")) if distributed_port is None else distributed_port
    joined = dict(distributed_port=port, dist_init_required=dist_init_required)
    if timeout is None:
        deepspeed.init_distributed(**joined)
    else:
        # The rendezvous (torch's store) takes this timeout too: never shorter than DeepSpeed's.
        deepspeed.init_distributed(**joined, timeout=max(timeout, default_pg_timeout))
    rank = dist.get_rank()
    try:
        # Our set-up collectives run before DeepSpeed's engine binds this rank to its GPU: bind it
        # now, or every rank would hand NCCL a tensor on GPU 0.
        get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if timeout is not None and joining:
            # The world group waits at most this long in the agreements of the start-up, but never
            # less than DeepSpeed's default until deepspeed.initialize returns: ranks may be slowed
            # apart by start-up work of their own (a kernel import, an op build), as the rendezvous may.
            set_collective_timeout(max(timeout, default_pg_timeout))
        raise_together(problem and f"{this_node()}: {problem}", "reading the DeepSpeed config on every rank")
    finally:
        # Returned on every rank (or raised on every rank together), the agreement's collective had
        # every rank map every rank's DeepSpeed CPU all-reduce buffer: this rank's file can go (a
        # start-up error later would leave it in /dev/shm, ~69 MB a rank).
        unlink_own_shm_buffer(rank)
    return ds_config


_DEFAULT_TIMEOUT_S = KnapFormerConfig.model_fields["timeout_s"].default


def collective_timeout(block: Any) -> datetime.timedelta | None:
    """The collective timeout the raw ``"knapformer"`` block asks for, read before the block is
    validated (the process group takes it when it starts): ``timeout_s`` when the block is enabled or
    gives it, ``None`` (DeepSpeed's defaults) otherwise. A value the block's validation refuses gives
    the default; that validation, agreed by every rank, reports it."""
    if not isinstance(block, Mapping) or (block.get("enabled") is not True and "timeout_s" not in block):
        return None
    try:
        seconds = KnapFormerConfig(timeout_s=block.get("timeout_s", _DEFAULT_TIMEOUT_S)).timeout_s
    except ValidationError:
        seconds = _DEFAULT_TIMEOUT_S
    return datetime.timedelta(seconds=seconds)


def get_knapformer_config(param_dict: Mapping[str, Any]) -> KnapFormerConfig:
    """Parse the ``"knapformer"`` block of a DeepSpeed config dict (absent: disabled).

    Raises:
        ValueError: naming every bad key or value, with the valid keys for unknown ones.
    """
    block = param_dict.get(KNAPFORMER, {})
    if not isinstance(block, Mapping):
        raise ValueError(f'the "knapformer" block must be a JSON object; got {block!r}')
    try:
        return KnapFormerConfig(**block)
    except ValidationError as error:
        raise ValueError(_explain(error)) from None


def _model_at(loc: tuple) -> type[DeepSpeedConfigModel]:
    """The config class at a validation error's location (``("cost_model", "online")``, ...)."""
    model: type[DeepSpeedConfigModel] = KnapFormerConfig
    for part in loc:
        if part in ("workload", "cost_model"):
            model = KnapCostModelConfig
        elif part == "online":
            model = KnapOnlineConfig
        elif part == "startup_calibration":
            model = KnapStartupCalibrationConfig
    return model


def _explain(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in (KNAPFORMER, *item["loc"]))
        if item["type"] == "extra_forbidden":
            model = _model_at(item["loc"][:-1])
            lines.append(f"unknown key {where!r}; valid keys: {', '.join(model.model_fields)}")
        else:
            message = item["msg"].removeprefix("Value error, ")
            lines.append(f"{where} = {item.get('input')!r}: {message}" if item["loc"] else f"{KNAPFORMER}: {message}")
    return 'invalid "knapformer" block in the DeepSpeed config:\n  ' + "\n  ".join(lines)
