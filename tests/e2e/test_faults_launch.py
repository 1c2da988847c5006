"""Faults at start-up and mid-step under the real deepspeed launcher (issue 22), with DeepSpeed's
per-node launcher (``python -m deepspeed.launcher.launch``) started once per node, as ``deepspeed``
does over ssh: a block that is bad on one node fails every rank of both nodes together, a stopped
rank ends the job within ``timeout_s``, and a failed start leaves nothing in /dev/shm.

Every launcher runs in a session of its own, killed (SIGKILL, stopped ranks included) when its test
ends, whatever happened."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from deepspeed_knap.runtime.shm_buffers import job_buffers, remove_job_buffers
from tests.support.launch import CONFIG, ROOT, free_port

SCRIPT = ROOT / "tests" / "support" / "scripts" / "start_zero3.py"


def write_config(path: Path, zero: dict | None = None, **knapformer) -> Path:
    """The CPU demo config (ZeRO-3, balanced) with topology ``auto``, ``knapformer`` keys changed and
    ``zero`` keys added."""
    config = json.loads(CONFIG.read_text())
    config["knapformer"].update({"topology": "auto", **knapformer})
    config["zero_optimization"].update(zero or {})
    path.write_text(json.dumps(config))
    return path


class Job:
    """One launcher per node (``configs[i]`` is node ``i``'s config), ``ranks_per_node`` ranks each,
    every rank's output in its own log."""

    def __init__(self, tmp_path: Path, configs: list[Path], ranks_per_node: int = 2, *script_args: str):
        self.port = free_port()
        self.logs = tmp_path / "logs"
        nodes = {f"node{i}": list(range(ranks_per_node)) for i in range(len(configs))}
        world_info = base64.urlsafe_b64encode(json.dumps(nodes).encode()).decode()
        # One thread per rank: four ranks of two threads each oversubscribe a 2-core machine.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.commands = [
            [sys.executable, "-m", "deepspeed.launcher.launch", f"--world_info={world_info}", f"--node_rank={node}",
             "--master_addr=127.0.0.1", f"--master_port={self.port}", f"--enable_each_rank_log={self.logs / f'node{node}'}",
             str(SCRIPT), "--deepspeed_config", str(config), *script_args]
            for node, config in enumerate(configs)
        ]  # fmt: skip
        self.env = env
        self.launchers: list[subprocess.Popen] = []
        self.ended: list[float | None] = [None] * len(configs)  # seconds from the start
        self.ranks_per_node = ranks_per_node
        self.ranks: dict[int, psutil.Process] = {}  # by global rank
        self.rank_ended_at: dict[int, float] = {}  # time.time() when a rank's process exited

    def start(self) -> None:
        self.started = time.monotonic()
        self.logs.mkdir(parents=True)
        for node, command in enumerate(self.commands):
            with open(self.logs / f"launcher{node}.log", "w") as log:
                self.launchers.append(subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=log, stderr=log,
                                                       start_new_session=True))  # fmt: skip

    def wait(self, limit_s: float, until_rank_exits: int | None = None) -> list[float | None]:
        """Wait until every launcher exited (or rank ``until_rank_exits`` did), ``limit_s`` from the start
        at most; returns the seconds from the start until each launcher exited, ``None`` if it had not."""
        while time.monotonic() < self.started + limit_s and None in self.ended:
            self._watch_ranks()
            for node, launcher in enumerate(self.launchers):
                if self.ended[node] is None and launcher.poll() is not None:
                    self.ended[node] = time.monotonic() - self.started
            if until_rank_exits in self.rank_ended_at:
                break
            time.sleep(0.1)
        return self.ended

    def _watch_ranks(self) -> None:
        """Note each rank's process (``--local_rank=L`` of node N's launcher) and when it exited."""
        for node, launcher in enumerate(self.launchers):
            try:
                children = psutil.Process(launcher.pid).children()
            except psutil.NoSuchProcess:
                continue
            for child in children:
                with contextlib.suppress(psutil.Error):
                    local = re.search(r"--local_rank=(\d+)", " ".join(child.cmdline()))
                    if local:
                        self.ranks.setdefault(node * self.ranks_per_node + int(local.group(1)), child)
        for rank, process in self.ranks.items():
            if rank not in self.rank_ended_at:
                try:
                    gone = process.status() == psutil.STATUS_ZOMBIE
                except psutil.NoSuchProcess:
                    gone = True
                if gone:
                    self.rank_ended_at[rank] = time.time()

    def rank_logs(self) -> dict[int, str]:
        """Each rank's output, by global rank (the launcher names the files ``<time>_rank<R>.log``)."""
        found = {}
        for log in self.logs.rglob("*_rank*.log"):
            found[int(re.search(r"_rank(\d+)\.log$", log.name).group(1))] = log.read_text(errors="replace")
        return found

    def kill(self) -> None:
        """SIGKILL every launcher's session: the launchers, and their ranks, stopped or not."""
        for launcher in self.launchers:
            with contextlib.suppress(ProcessLookupError):  # every process of the session had exited
                os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()

    def buffers(self) -> set[str]:
        """This job's DeepSpeed all-reduce buffers in /dev/shm."""
        return {path.name for path in job_buffers(self.port)}


def error_message(log: str) -> str:
    """The ``ValueError`` a rank's log ends with: its first line and the indented or per-rank lines after."""
    # torch prefixes an uncaught exception's lines with "[rank<R>]: " on every rank
    lines = [re.sub(r"^\[rank\d+\]: ", "", line) for line in log.splitlines()]
    first = next((i for i, line in enumerate(lines) if line.startswith("ValueError: ")), None)
    if first is None:
        return ""
    message = [lines[first]]
    for line in lines[first + 1 :]:
        if not line.startswith(("rank(s) ", "  ")):
            break
        message.append(line)
    return "\n".join(message)


def test_a_block_bad_on_one_node_fails_every_rank_of_both_nodes_together(tmp_path):
    """Node 1's block has a typo: before, node 1 raised before the rendezvous and node 0 waited in it for
    DeepSpeed's 10 minutes ("3/4 clients joined"). Now every rank raises the same error, naming the key
    and the node and ranks whose block it is."""
    good = write_config(tmp_path / "node0.json")
    bad = write_config(tmp_path / "node1.json", topolgy="auto")
    job = Job(tmp_path, [good, bad])
    try:
        job.start()
        ended = job.wait(limit_s=60)
        logs = job.rank_logs()
    finally:
        job.kill()
        remove_job_buffers(job.port)
    assert None not in ended, f"launchers still running after 60 s (exited at {ended}); logs: {logs}"
    assert all(launcher.returncode != 0 for launcher in job.launchers)
    assert sorted(logs) == [0, 1, 2, 3]
    errors = {rank: error_message(log) for rank, log in logs.items()}
    assert all(error == errors[0] for error in errors.values()), errors  # the same error on every rank
    assert "unknown key 'knapformer.topolgy'" in errors[0], logs[0]
    assert "rank(s) [2, 3]: node 1" in errors[0]
    assert "[0, 1]" not in errors[0]  # node 0's block is fine
    assert max(ended) - min(ended) < 10, ended  # together, not one node after the other's timeout


def test_a_stopped_rank_ends_the_job_within_timeout_s(tmp_path):
    """Rank 1 stops itself before its third forward; rank 0 waits for it in ZeRO-3's parameter
    all-gather (in the world group, which ``init_distributed`` made with DeepSpeed's 10 minutes). Now
    rank 0 raises ``timeout_s`` after the stop, and its launcher ends the job. (The timeout of the
    groups DeepSpeed makes itself, where ZeRO-1/2 reduce gradients, is checked in
    tests/multirank/test_engine.py.)"""
    timeout_s = 8
    # Every parameter partitioned: TinyDiT's are all below ZeRO-3's persistence threshold (kept whole
    # on every rank, never gathered) otherwise.
    config = write_config(tmp_path / "config.json", {"stage3_param_persistence_threshold": 0}, timeout_s=timeout_s)
    job = Job(tmp_path, [config], 2, "--steps", "3", "--stop-rank", "1", "--stop-step", "2")
    try:
        job.start()
        # Once rank 0 failed, the launcher SIGTERMs rank 1, which a stopped process leaves pending, and
        # SIGKILLs it 30 s later: the job is over once rank 0 exited, and killed below.
        job.wait(limit_s=60, until_rank_exits=0)
        logs = job.rank_logs()
    finally:
        job.kill()
        remove_job_buffers(job.port)
    assert 0 in job.rank_ended_at, f"rank 0 still ran 60 s after the start; logs: {logs}"
    stopped_at = float(re.search(r"rank 1 stops at (\S+)", logs[1]).group(1))
    waited = job.rank_ended_at[0] - stopped_at
    assert timeout_s - 1 < waited < timeout_s + 15, waited
    assert "rank 0 done" not in logs[0]
    assert f"Timed out waiting {timeout_s * 1000}ms" in logs[0], logs[0]
    # ZeRO-3's parameter gather (in DeepSpeed's group), not a collective of ours
    assert "partitioned_param_coordinator.py" in logs[0] and "balancer.py" not in logs[0], logs[0]


def test_a_failed_start_leaves_no_buffer_in_dev_shm(tmp_path):
    """A topology for 8 GPUs on 2 ranks fails after DeepSpeed made its CPU all-reduce buffers (one
    ~69 MB file per rank): each rank removes its own before raising."""
    job = Job(tmp_path, [write_config(tmp_path / "config.json", topology="g8n1", solver="refine")])
    before = job.buffers()
    try:
        job.start()
        ended = job.wait(limit_s=60)
        left = job.buffers() - before
        logs = job.rank_logs()
    finally:
        job.kill()
        remove_job_buffers(job.port)
    assert ended[0] is not None and job.launchers[0].returncode != 0, logs
    assert "needs a world size that is a multiple of its 8 GPUs" in logs[0], logs[0]
    assert left == set()
