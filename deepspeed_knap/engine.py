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
import os
from typing import Any

import deepspeed
import deepspeed.comm as dist
from torch import Tensor, nn

from deepspeed_knap.attention import KnapDistributedAttention
from deepspeed_knap.balancer import KnapBalancer
from deepspeed_knap.config import KNAPFORMER, KnapFormerConfig, get_knapformer_config, load_ds_config
from deepspeed_knap.topology import Topology, build_topology, create_process_groups


def initialize(args: Any = None, model: nn.Module | None = None, config: Any = None, **kwargs: Any):
    """``deepspeed.initialize`` plus the balancer its config's ``"knapformer"`` block asks for.

    Takes the same arguments as ``deepspeed.initialize`` (the config as ``config=`` or as
    ``args.deepspeed_config``). The block is validated, and the topology checked against the world
    size, node size and the model's attention heads, before DeepSpeed builds the engine; a bad block
    raises the same ``ValueError`` on every rank. Every ``KnapDistributedAttention`` in ``model``
    gets the block's ``attention_backend``.

    Returns:
        ``(engine, optimizer, dataloader, lr_scheduler, balancer)``: DeepSpeed's four results, and a
        :class:`~deepspeed_knap.balancer.KnapBalancer`, or ``None`` when the block is absent or
        ``"enabled": false`` (then nothing extra is created and nothing extra communicates).
    """
    if config is None:
        if args is None or getattr(args, "deepspeed_config", None) is None:
            raise ValueError("no DeepSpeed config: pass config= or args with --deepspeed_config")
        config, args = args.deepspeed_config, copy.copy(args)
        args.deepspeed_config = None  # DeepSpeed refuses a config given both ways
    ds_config = load_ds_config(config)
    knap = get_knapformer_config(ds_config)
    plain_config = {key: value for key, value in ds_config.items() if key != KNAPFORMER}

    # Under mpirun, DeepSpeed discovers ranks through mpi4py and would take port 29500 unless told.
    deepspeed.init_distributed(distributed_port=int(os.environ.get("MASTER_PORT", "29500")))
    topology = None
    if knap.enabled:
        topology = _build_topology(knap, dist.get_world_size())
        for module in model.modules() if model is not None else ():
            if isinstance(module, KnapDistributedAttention):
                module.configure(topology, knap.attention_backend)
    engine, optimizer, dataloader, lr_scheduler = deepspeed.initialize(
        args=args, model=model, config=plain_config, **kwargs
    )
    if topology is None:
        return engine, optimizer, dataloader, lr_scheduler, None
    balancer = KnapBalancer(
        create_process_groups(topology),
        knap.workload.build(),
        knap.solver,
        knap.max_tokens_per_gpu,
        knap.log_interval,
        engine.monitor,
    )
    return engine, optimizer, dataloader, lr_scheduler, balancer


def _build_topology(knap: KnapFormerConfig, world_size: int) -> Topology:
    gpus_per_node = knap.gpus_per_node
    if gpus_per_node is None and os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        gpus_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    topology = build_topology(knap.topology, world_size, gpus_per_node)
    if not topology.node_aligned:
        raise ValueError(
            f"topology {knap.topology!r} cannot be laid out over nodes of {gpus_per_node} GPUs without a bag "
            f"crossing a node boundary; use bags that divide {gpus_per_node} (or whole nodes), or set "
            '"gpus_per_node" in the "knapformer" block if the launcher reported it wrongly'
        )
    return topology


def token_mean_loss(per_token_loss: Tensor) -> Tensor:
    """This rank's share of the mean of ``per_token_loss`` over every token of every rank.

    DeepSpeed averages gradients over the ranks, so the loss each rank backpropagates must be its
    tokens' sum times ``world_size / total tokens``; then the averaged gradient is exactly the
    gradient of the global token mean, however unevenly tokens are spread. Collective (one
    all-reduce of the token count): every rank calls it every step, even with zero tokens.

    Args:
        per_token_loss: ``[T, ...]`` losses of this rank's tokens (all elements are averaged).

    Returns:
        A scalar to pass to ``engine.backward``. Its value is not the global mean; that is
        :func:`global_mean_loss` of it.
    """
    import torch

    count = torch.tensor([float(per_token_loss.numel())], dtype=torch.float64, device=per_token_loss.device)
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
