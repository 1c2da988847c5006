"""docs/recipes.md's recipes start at the sizes they claim: each recipe's shipped config validates and
lays out its topology at every world size of the page's table, 8 GPUs a node, with its model's
attention heads (the check ``deepspeed_knap.initialize`` makes before DeepSpeed builds the engine);
one step of the model's data mix plans under the config's token cap there; and every command on the
page names files and flags that exist, on the GPUs its recipe claims."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from deepspeed_knap.models.registry import PRESETS, sample_mix, sample_segments
from deepspeed_knap.planner.solve import plan_routing
from deepspeed_knap.runtime.config import get_knapformer_config, load_ds_config

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "recipes.md"
GPUS_PER_NODE = 8

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
_TABLE_ROW = re.compile(r"^\|.*\|\s*`(ds_configs/[^`]+\.json)`\s*\|$", re.MULTILINE)
_NODES = re.compile(rf"(\d+) x {GPUS_PER_NODE}\b")


def claimed_sizes(page: str) -> dict[str, set[int]]:
    """The recipes table: each config and the world sizes its row claims (``2 x 8`` -> 16)."""
    claims: dict[str, set[int]] = {}
    for row in _TABLE_ROW.finditer(page):
        sizes = {int(nodes) * GPUS_PER_NODE for nodes in _NODES.findall(row.group(0))}
        claims.setdefault(row.group(1), set()).update(sizes)
    return claims


def sections(page: str) -> list[tuple[str, str]]:
    """``(heading, text)`` of each ``## `` section."""
    parts = re.split(r"^## (.+)$", page, flags=re.MULTILINE)
    return list(zip(parts[1::2], parts[2::2], strict=True))


def commands(text: str) -> list[list[str]]:
    """The shell commands of ``text``'s fenced ``bash`` blocks, continuation lines joined, as argv."""
    found = []
    for language, block in _FENCE.findall(text):
        if language == "bash":
            joined = re.sub(r"\\\n\s*", " ", block)
            found += [shlex.split(line) for line in joined.splitlines() if line.strip()]
    return found


def hostfile_slots(text: str) -> int | None:
    """The GPUs of the hostfile a section shows (a ``text`` block of ``host slots=N`` lines), or ``None``."""
    for language, block in _FENCE.findall(text):
        slots = re.findall(r"^\S+ slots=(\d+)$", block, re.MULTILINE)
        if language == "text" and slots:
            return sum(int(count) for count in slots)
    return None


def train_dit_parser() -> argparse.ArgumentParser:
    """examples/train_dit.py's command line, built as its ``main`` builds it."""
    import deepspeed

    from deepspeed_knap.training.arguments import add_training_arguments

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_training_arguments(parser)
    parser.add_argument("--debug", action="store_true")
    parser.add_argument("--local_rank", type=int, default=-1)
    return deepspeed.add_config_arguments(parser)


def model_heads(preset: str) -> int:
    """The attention heads of the full-size model a cost-model preset describes (its family's spec)."""
    family, dims = PRESETS[preset]
    return dims["num_heads"] if "num_heads" in dims else family.bench_configs[preset]["num_attention_heads"]


PAGE_TEXT = PAGE.read_text()
CLAIMS = claimed_sizes(PAGE_TEXT)
CASES = [(config, size) for config, sizes in sorted(CLAIMS.items()) for size in sorted(sizes)]


def test_the_table_lists_the_recipes():
    assert CLAIMS["ds_configs/flux_zero3_knap.json"] == {8, 16, 32}  # FLUX on 1, 2 and 4 nodes
    assert CLAIMS["ds_configs/wan14b_zero3_knap.json"] == {32}  # Wan on 4
    assert all(sizes for sizes in CLAIMS.values()), CLAIMS


@pytest.mark.parametrize(("config", "world_size"), CASES, ids=[f"{Path(c).stem}-{n}" for c, n in CASES])
def test_recipe_config_starts_and_plans_at_the_claimed_size(config, world_size, monkeypatch):
    from deepspeed_knap.engine import _build_topology
    from deepspeed_knap.runtime.groups import NODE_SIZE_VARIABLES

    knap = get_knapformer_config(load_ds_config(str(ROOT / config)))  # validates the block
    heads = model_heads(knap.cost_model.model)
    for name in NODE_SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_SIZE", str(GPUS_PER_NODE))  # what the deepspeed launcher sets on 8-GPU nodes
    try:
        topology = _build_topology(knap, world_size, heads)
    except ValueError as error:  # what start-up would refuse the job with
        pytest.fail(f"{config} cannot start on {world_size} GPUs: {error}")
    assert knap.enabled and knap.topology == "auto", f"{config}: a recipe's config uses topology auto"
    assert topology.world_size == world_size
    assert topology.max_degree <= min(GPUS_PER_NODE, heads)
    for start, size in topology.groups:  # every group inside one node
        assert start // GPUS_PER_NODE == (start + size - 1) // GPUS_PER_NODE, (config, start, size)

    family = PRESETS[knap.cost_model.model][0]
    model = knap.cost_model.build()
    segments = sample_segments(family.default_mix, world_size, seed=0) if model.segment_attention_share else None
    lengths = sample_mix(family.default_mix, world_size, seed=0)
    plan = plan_routing(lengths, topology, model, knap.solver, knap.max_tokens_per_gpu, seq_segments_per_rank=segments)
    assert np.max(plan.gpu_tokens) <= knap.max_tokens_per_gpu


def test_a_fixed_topology_of_32_gpus_is_refused_on_16():
    """What the check above catches: a g8n4 config (what the FLUX configs had) cannot start on 2 nodes."""
    from deepspeed_knap.engine import _build_topology

    knap = get_knapformer_config({"knapformer": {"enabled": True, "topology": "g8n4", "gpus_per_node": 8}})
    with pytest.raises(ValueError, match="multiple of its 32 GPUs"):
        _build_topology(knap, 16, 24)


@pytest.mark.parametrize(("heading", "text"), sections(PAGE_TEXT), ids=[h for h, _ in sections(PAGE_TEXT)])
def test_every_command_names_existing_files_and_flags(heading, text):
    from deepspeed.launcher.runner import DLTS_HOSTFILE
    from deepspeed.launcher.runner import parse_args as launcher_args

    from deepspeed_knap.training.arguments import TrainingArguments

    for argv in commands(text):
        if argv[0] == "python":
            script = ROOT / argv[1]
            assert script.is_file(), f"{heading}: no {argv[1]}"
            source = script.read_text()
            unknown = [a for a in argv[2:] if a.startswith("--") and f'"{a}"' not in source]
            assert not unknown, f"{heading}: {argv[1]} takes no {unknown}"
            continue
        assert argv[0] == "deepspeed", f"{heading}: a command neither deepspeed nor python: {argv}"
        launch = launcher_args(argv[1:])
        assert (ROOT / launch.user_script).is_file(), f"{heading}: no {launch.user_script}"
        assert launch.user_script == "examples/train_dit.py"
        try:
            args, unknown = train_dit_parser().parse_known_args(launch.user_args)
        except (argparse.ArgumentError, SystemExit) as error:
            pytest.fail(f"{heading}: train_dit.py refuses {launch.user_args}: {error}")
        assert not unknown, f"{heading}: train_dit.py takes no {unknown}"
        TrainingArguments.from_args(args)  # the checks train_dit.py makes before starting
        config = args.deepspeed_config
        assert (ROOT / config).is_file(), f"{heading}: no {config}"
        world = launch.num_gpus if launch.hostfile == DLTS_HOSTFILE else hostfile_slots(text)
        assert world in CLAIMS.get(config, set()), f"{heading}: {world} GPUs, not a size the table claims for {config}"


def test_every_claimed_size_has_its_command():
    shown: dict[str, set[int]] = {}
    for _, text in sections(PAGE_TEXT):
        for argv in commands(text):
            if argv[0] == "deepspeed":
                config = argv[argv.index("--deepspeed_config") + 1]
                gpus = int(argv[argv.index("--num_gpus") + 1]) if "--num_gpus" in argv else hostfile_slots(text)
                shown.setdefault(config, set()).add(gpus)
    assert shown == CLAIMS
