"""Shared pytest set-up: tiers (``unit/``, ``multirank/``, ``e2e/``; helpers in ``support/``), the ``gpu`` marker skips cleanly on machines without CUDA; hypothesis runs
the same examples every time (profile ``ci``) unless ``HYPOTHESIS_PROFILE=explore`` asks for fresh
random ones, so a CI run fails only on a change, never on a draw.

Before the session, DeepSpeed's /dev/shm buffers that killed runs left (over 10 minutes old, and no
process maps or holds them) are removed: a tmpfs full of them makes every DeepSpeed CPU start-up die
with SIGSEGV. Then DeepSpeed's CPU all-reduce op is built once, before any rank needs it
(``_build_deepspeed_cpu_comm``). The plan workers the tests start share their solves in a folder of
the session's (``DEEPSPEED_KNAP_PLAN_FOLDER``), removed at its end with what killed workers left;
the ``plan_folder`` fixture gives a test one of its own."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_sessionstart(session):
    from deepspeed_knap.planner.worker import PLAN_FOLDER_VARIABLE
    from deepspeed_knap.runtime.shm_buffers import remove_orphaned_buffers

    session.config._plan_folder = tempfile.mkdtemp(prefix="knap-test-plans-")
    os.environ[PLAN_FOLDER_VARIABLE] = session.config._plan_folder

    removed = remove_orphaned_buffers()
    if removed:
        print(f"removed {len(removed)} DeepSpeed all-reduce buffers from /dev/shm that no process uses")
    _build_deepspeed_cpu_comm()


def _build_deepspeed_cpu_comm() -> None:
    """Build (or load) DeepSpeed's CPU shared-memory all-reduce op in this process. Every DeepSpeed
    CPU start-up JIT-builds it (~50 s on 2 cores, again for each new virtual environment, as CI's
    fresh clone is); inside a test, the harness may kill the rank building it at the test's timeout,
    and the build's lock file then stays: torch waits on it forever, and so does every later
    DeepSpeed start-up. A lock that no process holds open is such a leftover, and is removed first."""
    from torch.utils.cpp_extension import _get_build_directory

    from deepspeed_knap.runtime.shm_buffers import open_file_ids
    from tests.support.distributed import deepspeed_cpu_comm_builder

    builder = deepspeed_cpu_comm_builder()
    if builder is None:
        return  # not the CPU accelerator: DeepSpeed does not build it either
    lock = Path(_get_build_directory(builder.name, verbose=False)) / "lock"
    if lock.exists() and (lock.stat().st_dev, lock.stat().st_ino) not in open_file_ids():
        print(f"removed {lock}: a DeepSpeed op build that was killed left it")
        lock.unlink(missing_ok=True)
    try:
        builder.load(verbose=False)
    except Exception as error:  # the DeepSpeed tests fail on it, with its message; the others run
        print(f"could not build DeepSpeed's CPU all-reduce op: {type(error).__name__}: {error}")


def pytest_collection_modifyitems(config, items):
    """Tiers by folder: tests/multirank and tests/e2e mark their tests ``multirank`` and ``e2e``
    (a unit file's few multi-rank tests carry the marker themselves), so ``pytest -m "not multirank and
    not e2e"`` (or ``pytest tests/unit -m "not multirank"``) is the inner loop."""
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        tier = Path(item.fspath).parent.name
        if tier in ("multirank", "e2e"):
            item.add_marker(getattr(pytest.mark, tier))
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Start the server multi-rank tests fork their ranks from, if this run has any, before a test can
    change the working directory or environment it would start with (tests/support/distributed.py).
    With pytest's output capture on, as when a test starts it: its ranks' output is then captured
    with the test's, not written to the terminal."""
    if session.config.option.collectonly:
        return
    if any(item.get_closest_marker("multirank") is not None for item in session.items):
        from tests.support.distributed import start_rank_server

        capture = session.config.pluginmanager.getplugin("capturemanager")  # None under -p no:capture
        if capture is not None:
            capture.resume_global_capture()
        try:
            start_rank_server()
        finally:
            if capture is not None:
                capture.suspend_global_capture()


def pytest_sessionfinish(session):
    shutil.rmtree(getattr(session.config, "_plan_folder", ""), ignore_errors=True)


@pytest.fixture
def plan_folder(tmp_path, monkeypatch):
    """A shared-solves folder of this test's own (the workers it starts inherit it): counting which
    worker solved a job must not find plans another test's killed worker left."""
    from deepspeed_knap.planner.worker import PLAN_FOLDER_VARIABLE

    folder = tmp_path / "plans"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv(PLAN_FOLDER_VARIABLE, str(folder))
    return folder
