"""This rank's process groups for a topology, and the collectives that make checks agree across ranks."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket
from dataclasses import dataclass
from typing import Any

from deepspeed_knap.planner.topology import Topology


@dataclass(frozen=True, eq=False)
class ProcessGroups:
    """This rank's communication groups for one topology.

    Attributes:
        topology: the layout the groups were made for.
        rank: this process's global rank.
        replica: which balance group it belongs to.
        group_rank: its position inside the balance group, the GPU index plans use.
        balance_group: the process group of the balance group (lengths gather, routing).
        attention_groups: ``{(start, size): process group}`` for every group of size > 1 this rank is
            in (a bag, or with ``auto`` one group per size), keyed by positions inside the balance
            group as plans give them.
        timeout: the collective timeout of every group: how long a rank waits in one for the others.
    """

    topology: Topology
    rank: int
    replica: int
    group_rank: int
    balance_group: Any
    attention_groups: dict[tuple[int, int], Any]
    timeout: datetime.timedelta

    def attention_group(self, start: int, size: int) -> Any:
        """The process group of the ``size`` GPUs starting at ``start`` (``None`` for a single GPU)."""
        if size == 1:
            return None
        try:
            return self.attention_groups[(start, size)]
        except KeyError:
            raise ValueError(
                f"no process group for GPUs {start}..{start + size - 1} of the balance group on rank {self.rank}: "
                f"the plan does not use the groups of topology {self.topology.spec!r} (groups here: "
                f"{sorted(self.attention_groups)})"
            ) from None


def create_process_groups(topology: Topology, timeout: datetime.timedelta | None = None) -> ProcessGroups:
    """Create the balance-group and attention-group process groups.

    Every rank creates every group, in the same order (replica by replica, then
    :attr:`Topology.groups` in order): ``new_group`` is collective, and creating them in different
    orders hangs. Groups go through ``torch.distributed.new_group`` (what ``deepspeed.comm`` calls,
    minus its lack of a timeout) so that a rank stuck inside a group raises after ``timeout``
    instead of blocking its partners for the backend's default (30 min on gloo).

    Args:
        topology: the layout.
        timeout: collective timeout of every group; default DeepSpeed's (``DEEPSPEED_TIMEOUT``
            minutes, 10 unless set).

    Raises:
        ValueError: the world size differs from the topology's (identical on every rank).
    """
    import deepspeed.comm as dist
    import torch.distributed
    from deepspeed.constants import default_pg_timeout

    timeout = default_pg_timeout if timeout is None else timeout
    world_size = dist.get_world_size()
    if world_size != topology.world_size:
        raise ValueError(
            f"topology {topology.spec!r} was built for {topology.world_size} ranks but the job has {world_size}; "
            f"build it with build_topology(spec, world_size={world_size})"
        )
    rank = dist.get_rank()
    replica, group_rank = divmod(rank, topology.group_size)
    balance_group = None
    attention_groups = {}
    for r in range(topology.num_replicas):
        first = r * topology.group_size
        # Made even when it is the whole world, so that the lengths gather and the routes time out too.
        group = torch.distributed.new_group(list(range(first, first + topology.group_size)), timeout=timeout)
        if r == replica:
            balance_group = group
        for start, size in topology.groups:
            if size == 1:
                continue
            group = torch.distributed.new_group(list(range(first + start, first + start + size)), timeout=timeout)
            if r == replica and start <= group_rank < start + size:
                attention_groups[(start, size)] = group
    return ProcessGroups(topology, rank, replica, group_rank, balance_group, attention_groups, timeout)


def set_collective_timeout(timeout: datetime.timedelta) -> int:
    """Give every process group this rank is in (the world's, DeepSpeed's, ours) the collective timeout
    ``timeout``; returns how many groups were set. Local: no communication.

    ``deepspeed.init_distributed(timeout=...)`` reaches the world group only (where ZeRO-3 gathers
    parameters): DeepSpeed makes its other groups with ``new_group`` and no timeout, which gives
    torch's default whatever the world's is (30 minutes on gloo, 10 on NCCL), and ZeRO-1/2 reduce
    gradients in one of them (its clone of the world group). Groups made after this call keep the
    timeout they were made with.
    """
    import warnings

    from torch.distributed import distributed_c10d

    # Private in torch (since 2.3), and the only way to change an existing group's timeout.
    set_timeout = getattr(distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        warnings.warn(
            f"this torch cannot change a process group's timeout: DeepSpeed's collectives keep torch's default "
            f"instead of {timeout.total_seconds():g} s (knapformer.timeout_s); a stopped rank holds the job that long",
            stacklevel=2,
        )
        return 0
    count = 0
    for group in list(distributed_c10d._world.pg_map):
        if distributed_c10d._rank_not_in_group(group):
            continue
        set_timeout(timeout, group)
        count += 1
    return count


# Environment variables holding the number of ranks on this node, by launcher.
NODE_SIZE_VARIABLES = ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                       "SLURM_NTASKS_PER_NODE")  # fmt: skip


# The world size MPI launchers export (Open MPI; MPICH's and Intel MPI's PMI; MVAPICH): DeepSpeed's
# init_distributed finds the ranks through mpi4py there, with no RANK set.
MPI_WORLD_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def launched_by_mpi() -> bool:
    """Whether an MPI launcher started this process among others (``mpirun -n 2`` and up), or
    ``srun`` did with an MPI plugin (PMI or PMIx: ``PMI_RANK``, ``PMIX_RANK``)."""
    if any(os.environ.get(name, "").isdigit() and int(os.environ[name]) > 1 for name in MPI_WORLD_SIZE_VARIABLES):
        return True
    return _srun_tasks() > 1 and any(name in os.environ for name in ("PMI_RANK", "PMIX_RANK"))


def _srun_tasks() -> int:
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "")
    return int(tasks) if tasks.isdigit() else 0


def unjoinable_launch() -> str | None:
    """Why this process cannot find the other ranks of its job, or ``None``: ``srun`` started several
    tasks, but nothing set ``RANK``, no MPI runtime knows the tasks and no process group exists yet
    (a script may start its own), so each task would run alone as rank 0 of a world of one (every
    task the whole job, writing the same files). The same on every task of the step: each raises
    before any collective."""
    import torch.distributed

    tasks = _srun_tasks()
    if "RANK" in os.environ or tasks < 2 or launched_by_mpi() or torch.distributed.is_initialized():
        return None
    return (f"srun started {tasks} tasks but none has RANK set (nor an MPI runtime's rank): each would run "
            "alone as rank 0; launch through launch/slurm.sbatch, which sets RANK, LOCAL_RANK, WORLD_SIZE and "
            "MASTER_ADDR from Slurm's variables, or through the deepspeed launcher")  # fmt: skip


def launcher_gpus_per_node() -> int | None:
    """Ranks on this node as the launcher reports them: ``LOCAL_SIZE`` (deepspeed), ``LOCAL_WORLD_SIZE``
    (torchrun), ``OMPI_COMM_WORLD_LOCAL_SIZE`` (Open MPI), ``MPI_LOCALNRANKS`` (MPICH), or
    ``SLURM_NTASKS_PER_NODE`` (``"8"`` or ``"8(x4)"``); ``None`` if none is set."""
    for name in NODE_SIZE_VARIABLES:
        value = os.environ.get(name, "").split("(")[0].strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def check_same_on_every_rank(views: dict[str, str]) -> None:
    """Raise the same ``ValueError`` on every rank when ranks see a setting differently.

    ``views`` maps a setting's name to what this rank sees (a config block, a node size read from
    the launcher, a file's contents, whether a kernel is installed): anything that can differ between
    nodes. One all-gather of a digest per setting, on the accelerator device, over the world; every
    rank then knows which ranks differ and raises the same message, instead of some raising and the
    others waiting in their next collective. Every rank must call it with the same setting names.

    Raises:
        ValueError: naming each setting that differs and the ranks that see it otherwise than rank 0.
    """
    import deepspeed.comm as dist
    import torch
    from deepspeed.accelerator import get_accelerator

    names = sorted(views)
    mine = torch.tensor(
        [text_digest(name + "\0" + views[name]) for name in names], dtype=torch.int64,
        device=get_accelerator().current_device_name(),
    )  # fmt: skip
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    table = torch.stack(gathered).cpu()  # [world, settings]
    odd_ranks = {
        name: torch.nonzero(table[:, column] != table[0, column]).flatten().tolist()
        for column, name in enumerate(names)
    }
    odd_ranks = {name: odd for name, odd in odd_ranks.items() if odd}
    if not odd_ranks:
        return
    # Every rank has the same table, so every rank is here: one more gather says what each saw
    # (a missing calibration file reads as its error, not only as "differs").
    seen = [json.loads(view) for view in all_gather_bytes(json.dumps([views[n] for n in odd_ranks]).encode())]
    differing = []
    for index, (name, odd) in enumerate(odd_ranks.items()):
        first = odd[0]
        differing.append(f"{name} (ranks {odd} differ from rank 0): rank 0 sees {_short(seen[0][index])}, rank "
                         f"{first} sees {_short(seen[first][index])}")  # fmt: skip
    raise ValueError(
        "ranks see different settings, so they would act differently and the job would hang: "
        + "; ".join(differing)
        + ". Make the nodes' files, installed packages, environment and configs identical"
    )


def _short(view: str, limit: int = 400) -> str:
    """A setting's view for an error message, cut to ``limit`` characters."""
    return repr(view if len(view) <= limit else view[: limit - 3] + "...")


def text_digest(text: str) -> int:
    """A 63-bit digest of ``text`` (fits an int64 tensor), equal for equal texts on every machine.
    A lone surrogate (a path's byte that is not UTF-8) is digested as itself: it must not raise on
    the one rank whose path holds it."""
    return int.from_bytes(hashlib.blake2b(text.encode(errors="surrogatepass"), digest_size=8).digest(), "little") >> 1


def raise_together(problem: str | None, what: str, error: type[Exception] = ValueError) -> None:
    """Raise the same ``error`` on every rank when any rank found a ``problem``.

    For checks whose outcome can differ between ranks (a file, a path, a sample, a loss): a rank
    raising alone would leave the others waiting in their next collective. Collective over the world
    (:func:`gather_problems`): every rank calls it, with ``None`` when all is well here.

    Raises:
        error: ``"{what} failed:"`` and each distinct problem with the ranks that found it.
    """
    details = gather_problems(problem)
    if details is not None:
        raise error(f"{what} failed:\n{details}")


def gather_problems(problem: str | None) -> str | None:
    """Every rank's ``problem`` (``None``: none here), one line per distinct problem naming the ranks
    that found it (``rank(s) [0, 3]: ...``), the same on every rank; ``None`` when no rank found one.
    Collective over the world (two all-gathers on the accelerator device: lengths, then the
    messages' bytes)."""
    # A lone surrogate (a path's byte that is not UTF-8) must not raise on the rank that found it alone.
    encoded = (problem or "").encode(errors="backslashreplace")
    messages = [m.decode(errors="replace") for m in all_gather_bytes(encoded)]
    by_message: dict[str, list[int]] = {}
    for rank, message in enumerate(messages):
        if message:
            by_message.setdefault(message, []).append(rank)
    if not by_message:
        return None
    return "\n".join(f"rank(s) {ranks}: {message}" for message, ranks in by_message.items())


def all_gather_bytes(data: bytes) -> list[bytes]:
    """Every rank's ``data``, by rank (two all-gathers on the accelerator device: lengths, then bytes)."""
    import deepspeed.comm as dist
    import torch
    from deepspeed.accelerator import get_accelerator

    device = torch.device(get_accelerator().current_device_name())
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(dist.get_world_size())]
    dist.all_gather(lengths, length)
    sizes = [int(t.item()) for t in lengths]
    padded = torch.zeros(max(max(sizes), 1), dtype=torch.uint8)
    if data:
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    padded = padded.to(device)
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded)
    return [t[:size].cpu().numpy().tobytes() for t, size in zip(gathered, sizes, strict=True)]


def exchange_bytes(payloads: list[bytes]) -> list[bytes]:
    """Send ``payloads[r]`` to rank ``r`` (``b""``: nothing) and return what each rank sent here, by
    rank. Collective over the world (two all-to-alls on the accelerator device: lengths, then bytes):
    every rank calls it, with one payload per rank."""
    import deepspeed.comm as dist
    import numpy as np
    import torch
    from deepspeed.accelerator import get_accelerator

    world = dist.get_world_size()
    if len(payloads) != world:
        raise ValueError(f"exchange_bytes takes one payload per rank ({world}); got {len(payloads)}")
    device = torch.device(get_accelerator().current_device_name())
    send_sizes = [len(payload) for payload in payloads]
    recv = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_to_all_single(recv, torch.tensor(send_sizes, dtype=torch.int64, device=device))
    recv_sizes = recv.tolist()
    data = np.frombuffer(b"".join(payloads), dtype=np.uint8)
    sent = torch.from_numpy(data.copy()).to(device)
    received = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(received, sent, output_split_sizes=recv_sizes, input_split_sizes=send_sizes)
    parts = received.cpu().numpy().tobytes()
    offsets = np.cumsum([0, *recv_sizes]).tolist()
    return [parts[offsets[r] : offsets[r + 1]] for r in range(world)]


# Environment variables holding this node's index in the job, by launcher.
NODE_RANK_VARIABLES = ("CROSS_RANK", "GROUP_RANK", "SLURM_NODEID")


def this_node() -> str:
    """``node N (host H)``, or ``host H`` where no launcher says which node this is."""
    host = socket.gethostname()
    for name in NODE_RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return f"node {os.environ[name]} (host {host})"
    return f"host {host}"
