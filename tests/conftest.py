"""Shared pytest set-up: the ``gpu`` marker skips cleanly on machines without CUDA; hypothesis runs
the same examples every time (profile ``ci``) unless ``HYPOTHESIS_PROFILE=explore`` asks for fresh
random ones, so a CI run fails only on a change, never on a draw. DeepSpeed's /dev/shm buffers that
killed runs left behind (no process maps them) are removed before the session: a tmpfs full of them
makes every DeepSpeed CPU start-up die with SIGSEGV, and every multi-rank test fail or hang."""

import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_sessionstart(session):
    from deepspeed_knap.shm_buffers import remove_orphaned_buffers

    removed = remove_orphaned_buffers()
    if removed:
        print(f"removed {len(removed)} DeepSpeed all-reduce buffers from /dev/shm that no process maps")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
