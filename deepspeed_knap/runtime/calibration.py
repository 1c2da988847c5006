"""The cost model's calibration at start-up (``"cost_model": {"startup_calibration": ...}``): every
rank times its model's blocks (its family's ``step_timer``) and, in its smallest attention group, the
Ulysses exchanges of those blocks; the ranks gather the times, and every rank fits the same model
from them (:func:`~deepspeed_knap.cost.calibrate.startup_model`)."""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import time
from collections.abc import Collection, Sequence

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger
from torch import nn

from deepspeed_knap.cost.calibrate import StartupCalibration, startup_model, time_lengths
from deepspeed_knap.cost.model import CostModel
from deepspeed_knap.models.registry import spec
from deepspeed_knap.runtime.attention import head_splits, ulysses_counts
from deepspeed_knap.runtime.groups import ProcessGroups, all_gather_bytes, gather_problems
from deepspeed_knap.runtime.routing import exchange, time_exchanges
from deepspeed_knap.runtime.timing import StepTimes


def calibrate_at_start(model: nn.Module, prior: CostModel, seq_lens: Sequence[int], repeats: int,
                       groups: ProcessGroups, backend: str | None = None, required: bool = True,
                       given: Collection[str] = ()) -> StartupCalibration | None:  # fmt: skip
    """Time ``model``'s blocks at ``seq_lens`` on this rank's device, in the dtype of its parameters,
    with its attention ``backend`` under ``groups.topology``, and the Ulysses exchanges of those
    blocks at the longest length in this rank's smallest attention group
    (:func:`time_ulysses_exchanges`); then fit one cost model from every rank's times. The prices in
    ``given`` (the user's ``alltoall_coef``, ``inter_node_alltoall_coef`` or ``sequence_coef``) stay
    as ``prior`` has them, and a given ``alltoall_coef`` is not timed over. Otherwise ``c`` is the prior's scaled as
    the compute where the exchanges give no price: the topology has no group of more than one GPU,
    or the ranks' step timers do not all say alike what the blocks exchange (a family's own timer
    may say nothing). Collective over the world: every rank calls it, and every rank gets the same
    outcome. Rank 0 logs the fit, the speeds and the seconds it took. The copy's memory goes back to
    the device before it returns (the training's allocations start from what they had before).

    ``required``: a rank's failed timing (out of memory at the longest length, say), or times the
    fit refuses, make every rank raise. ``False`` (``enabled: "auto"``, which the user did not ask
    for by name): every rank returns ``None`` instead, to plan with ``prior``, and rank 0 logs why.

    Raises:
        ValueError: with ``required``, on every rank, naming the ranks whose timing failed and why,
            or why the times cannot be fitted.
    """
    import deepspeed.comm as dist

    start = time.perf_counter()
    device = torch.device(get_accelerator().current_device_name())
    dtype = model.dtype  # the packed model's: outside the modules it keeps in float32
    times, calls, problem, step = [], None, None, None
    try:
        step = spec(model.family).load("step_timer")(model, device, dtype, groups.topology, backend)
        times = time_lengths(step, seq_lens, repeats, progress=dist.get_rank() == 0).tolist()
        rows = getattr(step, "ulysses_calls", None) if "alltoall_coef" not in given else None
        if rows:  # plain numbers, to gather
            calls = [[int(heads), int(dim), str(kind), float(count)] for heads, dim, kind, count in rows]
    except Exception as error:  # raised here alone, it would leave the other ranks in the gather
        problem = f"{type(error).__name__}: {error}"
    step = None  # the copy of the blocks, held by the step's closure
    gc.collect()  # and by a failed timing's frames, with its activations
    get_accelerator().empty_cache()
    what = "knapformer.cost_model.startup_calibration (timing the model's blocks and their exchanges)"
    details = gather_problems(problem)
    calibration = None
    if details is None:
        gathered = [json.loads(data) for data in all_gather_bytes(json.dumps([times, calls]).encode())]
        times_by_rank = [rank_times for rank_times, _ in gathered]
        prices = None
        if calls and all(rank_calls == calls for _, rank_calls in gathered):  # the same on every rank, or none
            prices, details = time_ulysses_exchanges(calls, max(seq_lens), groups, prior, device, repeats)
        if details is None:
            try:  # the same times on every rank: a refused fit is refused on every rank alike
                calibration = _for_balance_group(startup_model(prior, seq_lens, times_by_rank, prices, given), groups)
            except Exception as error:
                details = f"{type(error).__name__}: {error}"
    if details is not None:
        if required:
            raise ValueError(f"{what} failed:\n{details}")
        if dist.get_rank() == 0:
            logger.warning(f"knapformer: {what} failed; the first steps plan with the cost model's prior. "
                           '"startup_calibration": false skips the timing; shorter seq_lens need less memory. '
                           f"Why:\n{details}")  # fmt: skip
        return None
    if dist.get_rank() == 0:
        model_now = calibration.model
        logger.info(f"knapformer: start-up calibration at {list(seq_lens)} tokens in {time.perf_counter() - start:.1f} s: "
                    f"a = {model_now.linear_coef:.4g} s/token, b = {model_now.quadratic_coef:.4g} s/token^2 "
                    f"({calibration.scale:.3g}x the prior's compute), c = {model_now.alltoall_coef:.4g} s per token "
                    f"sent ({calibration.fit['alltoall']}), rank speeds {list(calibration.speeds)}")  # fmt: skip
    return calibration


def _for_balance_group(calibration: StartupCalibration, groups: ProcessGroups) -> StartupCalibration:
    """``calibration`` (every rank of the world timed, ``speeds`` ``[world]``) with the model's
    ``gpu_speed`` this rank's balance group's (``[S]``, what its planner prices; ``None`` where those
    ranks are all the median's speed): with several replicas (``g8n1`` on 16 GPUs), each plans its
    own ranks."""
    size = groups.topology.group_size
    mine = calibration.speeds[groups.replica * size : (groups.replica + 1) * size]
    speed = mine if any(s != 1.0 for s in mine) else None
    return dataclasses.replace(calibration, model=dataclasses.replace(calibration.model, gpu_speed=speed))


def time_ulysses_exchanges(calls: list[list], seq_len: int, groups: ProcessGroups, prior: CostModel,
                           device: torch.device, repeats: int) -> tuple[list[float | None] | None, str | None]:  # fmt: skip
    """Every rank's ``alltoall_coef`` timed in its smallest attention group (``G`` GPUs): the seconds
    of the Ulysses exchanges of one forward and backward of the model on a sequence of ``seq_len``
    tokens split over the group, over ``seq_len * (G - 1) / G**2`` (the cost model's all-to-all
    term; in a group across nodes, over that term with ``prior``'s ``c' : c``).

    Each of ``calls`` (``[heads, head_dim, dtype, count]``: the step timer's ``ulysses_calls``) is
    one attention's exchanges as a step runs them: q, k and v to their heads' members, the output
    back, and the reverse of both in the backward, timed as the balancer times a step's (the
    all-to-alls alone: :class:`~deepspeed_knap.runtime.timing.StepTimes`) and counted ``count``
    times; a run's seconds are the sum over ``calls``, and the median of ``repeats`` runs (after one
    untimed) counts. Every group exchanges at once, as in a step (a barrier over the world before
    each run).

    Collective over the world, every rank making the same world collectives whatever fails. A
    rank's failure to make the buffers is agreed on before any exchange, and one in a run after the
    runs (a failure some members of a group meet and others do not leaves those waiting in the
    group's exchange until its timeout). Returns ``(prices, None)``, ``prices[r]`` rank ``r``'s
    (``None`` where it is in no group of more than one GPU), the same on every rank; or
    ``(None, why)``."""
    import deepspeed.comm as dist

    own = min(groups.attention_groups, key=lambda group: (group[1], group[0]), default=None)
    runs, problem, price = [], None, None
    try:
        if own is not None:
            start, size = own
            member, chunk = groups.group_rank - start, max(seq_len // size, 1)
            for heads, head_dim, dtype, count in calls:
                counts = ulysses_counts([chunk] * size, head_splits(heads, size), member, head_dim)
                send = torch.ones(3 * chunk * heads * head_dim, dtype=getattr(torch, dtype), device=device)
                runs.append((*counts, send, count))
    except Exception as error:  # alone, it would leave its partners waiting in the exchange
        problem = f"{type(error).__name__}: {error}"
    if (details := gather_problems(problem)) is not None:
        return None, details
    process_group = None if own is None else groups.attention_group(*own)

    def one_run() -> float:
        seconds = 0.0
        for send_counts, recv_counts, out_counts, back_counts, send, count in runs:
            record = StepTimes(device)
            time_exchanges(record)
            try:
                x = send.detach().requires_grad_()
                arrived = exchange(x, send_counts, recv_counts, process_group, "ulysses")
                back = exchange(arrived[: sum(out_counts)], out_counts, back_counts, process_group, "ulysses")
                back.sum().backward()
            finally:
                time_exchanges(None, record)
            seconds += count * sum(begin.seconds_until(end) for begin, end in record.spans["ulysses"])
        return seconds

    seconds_by_run = []  # the first: the groups' first exchanges (connections), the allocator's growth
    for _ in range(repeats + 1):
        dist.barrier()  # on every rank, failed or not: the world's collectives stay in step
        if problem is None:
            try:
                seconds_by_run.append(one_run())
            except Exception as error:
                problem = f"{type(error).__name__}: {error}"
    try:
        if own is not None and problem is None:
            seconds = statistics.median(seconds_by_run[1:])
            tokens = chunk * size
            first = groups.replica * groups.topology.group_size + start  # the group's first global rank
            across = int(prior.cross_node_peers([first], [size], groups.topology.gpus_per_node)[0])
            dearer = prior.inter_node_alltoall_coef / prior.alltoall_coef if across and prior.alltoall_coef > 0 else 1.0
            peers = size - 1 - across + dearer * across  # in units of an intra-node peer
            price = seconds * size**2 / (tokens * peers) if peers > 0 else None  # no link the model prices
    except Exception as error:
        problem = f"{type(error).__name__}: {error}"
    finally:
        runs.clear()
        get_accelerator().empty_cache()
    if (details := gather_problems(problem)) is not None:
        return None, details
    return [json.loads(data) for data in all_gather_bytes(json.dumps(price).encode())], None
