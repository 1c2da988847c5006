"""DeepSpeed wiring: ``initialize`` reads the ``"knapformer"`` block and returns the balancer with
DeepSpeed's engine, and ``token_mean_loss`` gives the loss whose averaged gradient is exact.

    engine, optimizer, _, scheduler, balancer = deepspeed_knap.initialize(args=args, model=model, ...)
    out = model(batch, balancer)                   # balancer is None when the block is disabled
    engine.backward(token_mean_loss(per_token_loss))

Nothing is handed to DeepSpeed as an mpu: it sees plain data parallelism over the world, which is
exactly right, because every rank's loss is over its own original samples.
"""

from __future__ import annotations

import copy
import datetime
import json
from collections.abc import Mapping
from typing import Any

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger
from torch import Tensor, nn

from deepspeed_knap.cost.model import CostModel
from deepspeed_knap.models.registry import family_names
from deepspeed_knap.planner.topology import AUTO, Topology, build_topology, default_max_degree
from deepspeed_knap.runtime.attention import KnapDistributedAttention, backend_view
from deepspeed_knap.runtime.balancer import KnapBalancer
from deepspeed_knap.runtime.calibration import calibrate_at_start
from deepspeed_knap.runtime.config import (
    KNAPFORMER,
    KnapFormerConfig,
    collective_timeout,
    get_knapformer_config,
    read_ds_config,
)
from deepspeed_knap.runtime.groups import (
    NODE_SIZE_VARIABLES,
    all_gather_bytes,
    check_same_on_every_rank,
    create_process_groups,
    launcher_gpus_per_node,
    raise_together,
    set_collective_timeout,
    text_digest,
    this_node,
)
from deepspeed_knap.runtime.shm_buffers import unlink_own_shm_buffer


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
):
    """``deepspeed.initialize`` plus the balancer its config's ``"knapformer"`` block asks for.

    Takes the arguments of ``deepspeed.initialize``, in its order (the config as ``config=``, its
    alias ``config_params=``, or ``args.deepspeed_config``, or the deprecated
    ``args.deepscale_config``; ``distributed_port``, default ``MASTER_PORT`` or 29500, and
    ``dist_init_required`` for joining the process group). A model-parallel layout (``mpu``,
    ``mesh_param``, the config's ``sequence_parallel_size`` with ``data_parallel_size`` or its
    ``tensor_parallel.autotp_size``, a ``PipelineModule``) is refused with the block enabled: the
    balancer routes over every rank of the world, and a model-parallel layout would average
    gradients over another group. Every rank first joins the process group, whatever its config says,
    so that a config bad on one node cannot leave the others waiting in the rendezvous; then the
    config is read and the block validated on every rank, and the ranks agree in one collective: a
    config unreadable or a block invalid on any rank raises the same ``ValueError`` on every rank,
    naming the node and ranks and the key. The topology is checked against the world size, node size
    and the model's attention heads before DeepSpeed builds the engine, with the same error
    everywhere. So is a setting that differs between ranks (the block itself, the rest of the
    DeepSpeed config, a ZeRO stage say, the node size the launcher reports, the calibration file,
    whether the attention kernel is installed, the model's parameters): collectives compare them first. Every ``KnapDistributedAttention`` in ``model``
    gets the block's ``attention_backend`` (with balancing off, where the block gives it).

    Deadlines (``timeout_s``, 300 s unless the block gives it): when the block is enabled or gives
    ``timeout_s``, every collective of the job waits that long at most for a stuck, stopped or dead
    rank, then raises on the ranks waiting: the start-up agreement, the balancer's (lengths, routes,
    Ulysses all-to-alls) and DeepSpeed's (ZeRO's gathers and reductions, in the groups that exist when
    ``deepspeed.initialize`` returns). The rendezvous waits ``timeout_s`` or DeepSpeed's default
    (``DEEPSPEED_TIMEOUT`` minutes, 10 unless set), whichever is longer: nodes may start minutes apart.
    Otherwise (no block, or disabled without ``timeout_s``) DeepSpeed's and torch's defaults stand.

    A start-up that fails after the process group exists removes this rank's DeepSpeed CPU all-reduce
    buffer (``/dev/shm``, ~69 MB) before raising.

    Returns:
        ``(engine, optimizer, dataloader, lr_scheduler, balancer)``: DeepSpeed's four results, and a
        :class:`~deepspeed_knap.runtime.balancer.KnapBalancer`, or ``None`` when the block is absent or
        ``"enabled": false`` (then nothing extra is created, and nothing extra communicates after the
        start-up agreement).
    """
    config = config_params if config is None else config
    # DeepSpeed's rules, before anything starts (they are the same code on every rank).
    given = [name for name in ("deepspeed_config", "deepscale_config") if getattr(args, name, None) is not None]
    if len(given) == 2:
        raise ValueError("args holds both deepspeed_config and its deprecated spelling deepscale_config; give one")
    if given and config is not None:
        raise ValueError(f"the DeepSpeed config is given twice, as args.{given[0]} and as config=; give it once")
    if config is None:
        if not given:
            raise ValueError("no DeepSpeed config: pass config= or args with --deepspeed_config")
        config, args = getattr(args, given[0]), copy.copy(args)
        setattr(args, given[0], None)  # DeepSpeed refuses a config given both ways
    ds_config = read_ds_config(config, distributed_port, dist_init_required)
    rank = dist.get_rank()
    kwargs = dict(optimizer=optimizer, model_parameters=model_parameters, training_data=training_data,
                  lr_scheduler=lr_scheduler, mpu=mpu, dist_init_required=dist_init_required, collate_fn=collate_fn,
                  mesh_param=mesh_param)  # fmt: skip
    if distributed_port is not None:
        kwargs["distributed_port"] = distributed_port
    try:
        return _initialize(args, model, ds_config, collective_timeout(ds_config.get(KNAPFORMER)), kwargs)
    except BaseException:
        # Every rank joined the group, so mapped every rank's buffer, before the first collective
        # returned anywhere.
        unlink_own_shm_buffer(rank)
        raise


def _model_parallel(model: nn.Module | None, config: Mapping[str, Any], kwargs: Mapping[str, Any]) -> str | None:
    """What asks ``deepspeed.initialize`` for a model-parallel layout (a mesh or an mpu), or ``None``."""
    from deepspeed.pipe import PipelineModule

    try:  # where deepspeed.tp_model_init records its AutoTP, for initialize to merge (no public reader)
        from deepspeed.runtime.tensor_parallel import init_utils
    except ImportError:  # a DeepSpeed without it has no such record
        init_utils = None
    if kwargs["mpu"] is not None or kwargs["mesh_param"] is not None:
        return "an mpu or mesh_param"
    if "sequence_parallel_size" in config and "data_parallel_size" in config:
        return "a config with sequence_parallel_size and data_parallel_size (DeepSpeed's mesh)"
    if ((config.get("tensor_parallel") or {}).get("autotp_size") or 0) > 0:
        return "a config with tensor_parallel.autotp_size"
    if getattr(init_utils, "_TP_MODEL_INIT_ARGS", None) is not None:
        return "AutoTP recorded by deepspeed.tp_model_init"
    if isinstance(model, PipelineModule):
        return "a PipelineModule"
    return None


def _initialize(args: Any, model: nn.Module | None, ds_config: dict, timeout: datetime.timedelta | None,
                kwargs: dict) -> tuple:  # fmt: skip
    """:func:`initialize` once the process group exists and every rank has read the config."""
    knap, problem = None, None
    try:
        knap = get_knapformer_config(ds_config)
    except ValueError as error:
        problem = str(error)
    except Exception as error:  # a bug of ours or DeepSpeed's parsing: still raised on every rank together
        problem = f'parsing the "knapformer" block: {type(error).__name__}: {error}'
    raise_together(problem and f"{this_node()}: {problem}", "reading the DeepSpeed config on every rank")
    # Valid blocks may still differ between nodes; "enabled" decides which collectives a rank runs
    # next, so the block is agreed on before anything branches on it.
    check_same_on_every_rank({'"knapformer" block': json.dumps(ds_config.get(KNAPFORMER), sort_keys=True)})
    plain_config = {key: value for key, value in ds_config.items() if key != KNAPFORMER}
    check_same_deepspeed_config(plain_config)
    topology = cost_model = None
    calibrating = False
    parallel = _model_parallel(model, plain_config, kwargs) if knap.enabled else None  # the config is agreed
    if parallel:  # (an mpu, a mesh or a pipeline module is the same code on every rank)
        raise ValueError(
            f"deepspeed_knap.initialize got {parallel} with balancing on: the balancer routes tokens over every rank "
            "of the world, and DeepSpeed would average gradients over a model-parallel layout's data-parallel ranks "
            'only; drop it, or set "knapformer": {"enabled": false}'
        )
    if knap.enabled:
        attention = [m for m in model.modules() if isinstance(m, KnapDistributedAttention)] if model is not None else []
        cost_model, views = _rank_views(knap, model, attention)
        check_same_on_every_rank(views)
        if isinstance(cost_model, Exception):  # the same on every rank, as just checked
            raise cost_model
        heads = min((m.num_heads for m in attention if m.num_heads is not None), default=None)
        if None not in (heads, cost_model.num_heads) and heads != cost_model.num_heads and dist.get_rank() == 0:
            logger.warning(f"knapformer: the cost model prices attention of {cost_model.num_heads} heads (its preset's "
                           f"or calibration file's) and the model has {heads}: groups that do not divide the heads "
                           "are mispriced; use the model's own preset or calibration")  # fmt: skip
        topology = _build_topology(knap, dist.get_world_size(), heads)
        for module in attention:
            module.configure(topology, knap.attention_backend)
        # Agreed: the model's parameters and the accelerator are in the views checked above.
        calibrating = knap.cost_model.calibrates_at_start(get_accelerator().device_name() == "cuda", _family(model),
                                                          knap.max_tokens_per_gpu)  # fmt: skip
    elif "attention_backend" in knap.model_fields_set:  # (the block is agreed: every rank or none)
        # Balancing off (an A/B against a run with it on) runs the kernel the block names, where it
        # names one; installed kernels differ between nodes: agreed first.
        check_same_on_every_rank(
            {f"attention backend {knap.attention_backend!r}": backend_view(knap.attention_backend)}
        )
        for module in [] if model is None else model.modules():
            if isinstance(module, KnapDistributedAttention):
                module.configure(None, knap.attention_backend)
    engine, optimizer, dataloader, lr_scheduler = deepspeed.initialize(
        args=args, model=model, config=plain_config, **kwargs
    )
    if timeout is not None:
        set_collective_timeout(timeout)  # DeepSpeed's own groups: ZeRO-1/2 reduce gradients in one
    if topology is None:
        return engine, optimizer, dataloader, lr_scheduler, None
    groups = create_process_groups(topology, datetime.timedelta(seconds=knap.timeout_s))
    if calibrating:
        settings = knap.cost_model.startup_calibration
        # The prices the user gave (0 turns a term off) stay; a given c is not timed over.
        given = [name for name in ("alltoall_coef", "inter_node_alltoall_coef", "sequence_coef")
                 if getattr(knap.cost_model, name) is not None]  # fmt: skip
        calibration = calibrate_at_start(engine.module, cost_model, settings.timed_lengths(knap.max_tokens_per_gpu),
                                         settings.repeats, groups, knap.attention_backend,
                                         required=settings.enabled is True, given=given)  # fmt: skip
        if calibration is not None:  # None: "auto"'s timing failed on some rank, and every rank keeps the prior
            cost_model = calibration.model
    balancer = KnapBalancer(
        groups,
        cost_model,
        knap.solver,
        knap.max_tokens_per_gpu,
        knap.log_interval,
        engine.monitor,
        knap.cost_model.online_settings(),
    )
    return engine, optimizer, dataloader, lr_scheduler, balancer


def check_same_deepspeed_config(config: Mapping[str, Any]) -> None:
    """Raise the same ``ValueError`` on every rank when the ranks were given different DeepSpeed
    configs (the ``"knapformer"`` block is agreed on before). DeepSpeed builds each rank's engine
    from its own config without comparing: ranks of another ZeRO stage, batch size or precision run
    other collectives, and the job hangs or ends in an opaque store error. Collective: one all-gather
    of a digest of the config; only where digests differ, one more of the configs, so that the
    error names each setting that differs (dotted, e.g. ``zero_optimization.stage``), which ranks
    have which value, up to the first five."""
    import torch

    text = json.dumps(config, sort_keys=True, default=repr)
    mine = torch.tensor([text_digest(text)], dtype=torch.int64, device=get_accelerator().current_device_name())
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    if len({int(t.item()) for t in gathered}) == 1:
        return
    flat = [_flatten(json.loads(raw)) for raw in all_gather_bytes(text.encode())]
    # The ZeRO stage first: it decides which collectives a rank runs.
    keys = sorted(set().union(*flat), key=lambda key: (key != "zero_optimization.stage", key))
    differing = []
    for key in keys:
        by_value: dict[str, list[int]] = {}
        for rank, settings in enumerate(flat):
            by_value.setdefault(settings.get(key, "(not set)"), []).append(rank)
        if len(by_value) > 1:
            seen = ", ".join(
                f"{value} on rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"
                for value, ranks in by_value.items()
            )
            differing.append(f"{key}: {seen}")
    raise ValueError(
        f"the ranks were given different DeepSpeed configs, so their engines would run different collectives and "
        f"the job would hang: {'; '.join(differing[:5])}"
        + (f"; and {len(differing) - 5} more settings" if len(differing) > 5 else "")
        + ". Give every rank the same config (the same file on every node)"
    )


def _flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """``{"a.b": JSON text}`` of every leaf of a JSON object (a list is a leaf)."""
    if isinstance(value, dict) and value:
        flat = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: json.dumps(value, sort_keys=True)}


def _family(model: nn.Module) -> str | None:
    """The registered family of ``model`` (a packed transformer's ``family``), or ``None``."""
    family = getattr(model, "family", None)
    return family if family in family_names() else None


def _rank_views(knap: KnapFormerConfig, model: nn.Module | None,
                attention: list[KnapDistributedAttention]) -> tuple[CostModel | Exception, dict[str, str]]:  # fmt: skip
    """This rank's cost model (or the error building it) and what it sees of every setting that
    can differ between nodes, for :func:`~deepspeed_knap.runtime.groups.check_same_on_every_rank`."""
    try:
        cost_model: CostModel | Exception = knap.cost_model.build()  # may read a calibration file
    except ValueError as error:
        cost_model = error
    parameters = [] if model is None else [
        (name, tuple(getattr(p, "ds_shape", p.shape)), str(p.dtype)) for name, p in model.named_parameters()
    ]  # fmt: skip
    views = {
        "gpus per node from the launcher": str(launcher_gpus_per_node()),
        "cost model (calibration_file)": repr(cost_model),
        f"attention backend {knap.attention_backend!r}": backend_view(knap.attention_backend),
        "model parameters (names, shapes, dtypes)": repr(parameters),
        "attention heads": repr(sorted({m.num_heads or 0 for m in attention})),
        "accelerator (startup_calibration's auto)": get_accelerator().device_name(),
    }
    return cost_model, views


def _build_topology(knap: KnapFormerConfig, world_size: int, heads: int | None) -> Topology:
    reported = launcher_gpus_per_node()
    if knap.gpus_per_node is not None and reported is not None and knap.gpus_per_node != reported:
        raise ValueError(
            f'"gpus_per_node": {knap.gpus_per_node} in the "knapformer" block, but the launcher reports {reported} '
            f"ranks on this node ({', '.join(NODE_SIZE_VARIABLES)}); bags would be laid out for the wrong nodes. "
            "Fix the block or the launch (e.g. --num_gpus)"
        )
    gpus_per_node = knap.gpus_per_node or reported
    if knap.topology.strip() == AUTO:
        max_degree = knap.max_degree or default_max_degree(world_size, gpus_per_node, heads)
        if heads is not None and max_degree > heads:
            raise ValueError(
                f'"max_degree": {max_degree} but the model\'s attention has only {heads} heads; Ulysses needs at '
                f"least one head per GPU of a group. Use max_degree <= {1 << (heads.bit_length() - 1)}"
            )
        return build_topology(AUTO, world_size, gpus_per_node, max_degree)
    topology = build_topology(knap.topology, world_size, gpus_per_node)
    if not topology.node_aligned:
        raise ValueError(
            f"topology {knap.topology!r} cannot be laid out over nodes of {gpus_per_node} GPUs without a bag "
            f"crossing a node boundary; use bags that divide {gpus_per_node} (or whole nodes), or set "
            '"gpus_per_node" in the "knapformer" block if the launcher reported it wrongly'
        )
    return topology


def token_mean_loss(per_token_loss: Tensor, weights: Tensor | None = None) -> Tensor:
    """This rank's share of the mean of ``per_token_loss`` over every token of every rank.

    DeepSpeed averages gradients over the ranks, so the loss each rank backpropagates must be its
    tokens' sum times ``world_size / total tokens``; then the averaged gradient is exactly the
    gradient of the global token mean, however unevenly tokens are spread. Collective (one
    all-reduce of the token count): every rank calls it every step, even with zero tokens.

    Args:
        per_token_loss: ``[T, ...]`` losses of this rank's tokens (all elements are averaged).
        weights: ``[T, ...]`` each element's weight (0: no loss, e.g. a clean conditioning frame's
            tokens), or ``None``: all 1. The mean is then over the weights' global sum.

    Returns:
        A scalar to pass to ``engine.backward``. Its value is not the global mean; that is
        :func:`global_mean_loss` of it.
    """
    import torch

    if weights is not None:
        total = float(weights.double().sum())
        per_token_loss = per_token_loss * weights
    else:
        total = float(per_token_loss.numel())
    count = torch.tensor([total], dtype=torch.float64, device=per_token_loss.device)
    dist.all_reduce(count)
    if count.item() == 0:
        return per_token_loss.sum()
    return per_token_loss.sum() * (dist.get_world_size() / count.item())


def global_mean_loss(loss: Tensor) -> float:
    """The global token mean behind :func:`token_mean_loss`'s per-rank result, for logging.
    Collective (one all-reduce); the same value on every rank."""
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()
