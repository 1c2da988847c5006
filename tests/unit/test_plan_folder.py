"""The folder the plan workers of a host share their solves in: opened once, checked through the
descriptor opened, and every file reached relative to it. A plan file is a pickle: a folder swapped
for a link to another user's after the check must not have this worker unpickle that user's files."""

import os
import pickle
import signal

from deepspeed_knap.models.registry import default_cost_model
from deepspeed_knap.planner import DEFAULT_SOLVER, plan_routing
from deepspeed_knap.planner.topology import build_topology
from deepspeed_knap.planner.worker import PLAN_FOLDER_VARIABLE, PlanWorker, _SharedPlans

JOB = ([[300, 5], [7]], build_topology("g2n1"), default_cost_model("flux-dev"), DEFAULT_SOLVER, None)


class _Payload:
    """Unpickling it creates ``marker`` (a stand-in for any code another user's pickle would run)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_folder_swapped_for_a_link_after_the_check_is_not_read(tmp_path, monkeypatch):
    folder, elsewhere, marker = tmp_path / "plans", tmp_path / "another-users", tmp_path / "payload-ran"
    folder.mkdir(mode=0o700)
    elsewhere.mkdir()
    monkeypatch.setenv(PLAN_FOLDER_VARIABLE, str(folder))
    shared = _SharedPlans.open()
    assert shared is not None  # the user's own folder, mode 0700: shared
    key = shared.key(JOB)
    planted = pickle.dumps((_Payload(str(marker)), 1.0))
    (elsewhere / f"{key}.plan").write_bytes(planted)  # "another user's" plan file for this very job
    # After the check, the folder is renamed and a link to the other folder takes its name.
    folder.rename(tmp_path / "plans-checked")
    folder.symlink_to(elsewhere)
    try:
        plan, _, error, from_sibling = shared.reply(JOB, None)
    finally:
        shared.close()
    assert not marker.exists()  # the planted pickle was never loaded
    assert error is None and not from_sibling and plan == plan_routing(*JOB)  # solved here instead
    assert (elsewhere / f"{key}.plan").read_bytes() == planted  # nothing written through the link
    assert os.listdir(tmp_path / "plans-checked") == []  # this worker's own files, removed at its close


def test_a_folder_that_is_a_link_or_open_to_others_is_not_shared(tmp_path, monkeypatch):
    own = tmp_path / "own"
    own.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(own)
    monkeypatch.setenv(PLAN_FOLDER_VARIABLE, str(link))
    assert _SharedPlans.open() is None
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o755)
    monkeypatch.setenv(PLAN_FOLDER_VARIABLE, str(open_folder))
    assert _SharedPlans.open() is None
    monkeypatch.setenv(PLAN_FOLDER_VARIABLE, str(tmp_path / "new"))  # made by the worker, mode 0700
    shared = _SharedPlans.open()
    assert shared is not None and (tmp_path / "new").stat().st_mode & 0o777 == 0o700
    shared.close()


def test_a_worker_ended_by_sigterm_removes_its_shared_files(tmp_path, monkeypatch):
    """DeepSpeed's launcher and Slurm end a failed job's processes with SIGTERM: the worker's shared
    plan files go with it."""
    folder = tmp_path / "plans"
    monkeypatch.setenv(PLAN_FOLDER_VARIABLE, str(folder))
    worker = PlanWorker()
    try:
        worker.result(worker.submit(*JOB), timeout_s=60)
        assert os.listdir(folder)  # the job's plan, left for the siblings
        os.kill(worker.pid, signal.SIGTERM)
        assert worker._process.wait(timeout=30) == 0
    finally:
        worker.close()
    assert os.listdir(folder) == []
