"""Shared pytest set-up: the ``gpu`` marker skips cleanly on machines without CUDA; hypothesis runs
the same examples every time (profile ``ci``) unless ``HYPOTHESIS_PROFILE=explore`` asks for fresh
random ones, so a CI run fails only on a change, never on a draw."""

import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
