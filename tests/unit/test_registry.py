"""The model registry: every spec's names import, every command's --family choices are the
registry's, a checkpoint's family comes from its config.json, and each spec's presets agree with its
own configs and FLOP formula."""

import argparse
import importlib
import inspect
import json
import runpy
import sys

import pytest

from deepspeed_knap.models.registry import (
    MIXES,
    PRESETS,
    SPECS,
    checkpoint_spec,
    default_cost_model,
    family_names,
    spec,
)
from tests.support.launch import ROOT

# What a --family option may be restricted to: a spec attribute a command needs set.
CAPABILITIES = (None, "generator", "block_timer", "pipeline", "bench_configs")


@pytest.mark.parametrize("family", list(SPECS))
def test_every_name_a_spec_gives_imports_and_the_model_is_the_spec_s(family):
    """The lazy ``module:attribute`` names resolve (a typo would otherwise fail only when used), and
    the packed model class says it is the spec's family."""
    family_spec = spec(family)
    for attribute in ("model", "training", "generator", "block_timer"):
        if getattr(family_spec, attribute) is not None:
            assert family_spec.load(attribute) is not None
    assert family_spec.model_class.spec is family_spec and family_spec.model_class.family == family
    assert family_spec.hooks().spec is family_spec
    assert family_spec.default_mix in MIXES
    # What diffusers' model keeps in float32 when loaded in another dtype, the packed one keeps too.
    diffusers = pytest.importorskip("diffusers")
    keep = getattr(diffusers, family_spec.diffusers_class)._keep_in_fp32_modules
    assert family_spec.keep_in_fp32 == tuple(keep or ())


def _family_choices(parser: argparse.ArgumentParser) -> list[str] | None:
    for action in parser._actions:
        if "--family" in action.option_strings:
            return list(action.choices)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                if (choices := _family_choices(sub)) is not None:
                    return choices
    return None


def _command_parsers() -> dict[str, argparse.ArgumentParser]:
    from deepspeed_knap import cli

    parsers = {}
    for name, module in {**cli.COMMANDS, **{f"bench {n}": m for n, m in cli.BENCHES.items()}}.items():
        parser = argparse.ArgumentParser(prog=name)
        importlib.import_module(module).add_arguments(parser)
        parsers[name] = parser
    # examples/train_dit.py: its parser, built by running the script's main() up to parse_args.
    script = runpy.run_path(str(ROOT / "examples" / "train_dit.py"), run_name="train_dit")
    captured = {}

    def capture(self, *args, **kwargs):
        captured["parser"] = self
        raise SystemExit(0)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture
    try:
        with pytest.raises(SystemExit):
            script["main"]()
    finally:
        argparse.ArgumentParser.parse_args = original
    parsers["examples/train_dit.py"] = captured["parser"]
    return parsers


def test_every_command_s_family_choices_are_the_registry_s():
    """Each --family lists the registered families (in registration order), or those whose spec has
    what the command needs (a generator, a block timer, ...): never a list of its own."""
    allowed = {capability: family_names(capability) for capability in CAPABILITIES}
    found = {}
    for name, parser in _command_parsers().items():
        choices = _family_choices(parser)
        if choices is not None:
            found[name] = choices
            assert choices in allowed.values(), (name, choices, allowed)
    assert {"generate", "bench train", "bench generate", "examples/train_dit.py"} <= set(found)
    assert found["examples/train_dit.py"] == list(SPECS) == found["bench train"]


def test_a_checkpoint_s_family_comes_from_its_config(tmp_path):
    for family in SPECS.values():
        (tmp_path / family.name / "transformer").mkdir(parents=True)
        config = {"_class_name": family.diffusers_class, **family.tiny_config}
        (tmp_path / family.name / "transformer" / "config.json").write_text(json.dumps(config))
        assert checkpoint_spec(tmp_path / family.name) is family
    (tmp_path / "other" / "config.json").parent.mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))
    with pytest.raises(ValueError, match="'UNet2DConditionModel', which no model family implements"):
        checkpoint_spec(tmp_path / "other")


@pytest.mark.parametrize("family", [name for name, family in SPECS.items() if family.full_config is not None])
def test_a_full_config_is_the_model_s_arguments_and_a_preset_s_dims(family):
    """What ``doctor`` times on a GPU: a family's full config binds to its packed model's signature
    (not built here: 12-20B parameters) and prices as one of the family's presets."""
    family_spec = spec(family)
    inspect.signature(family_spec.model_class).bind(**family_spec.full_config)
    dims = family_spec.cost_dims(family_spec.full_config)
    assert any(all(dims[key] == value for key, value in preset.items() if key != "text_len")
               for preset in family_spec.presets.values()), dims  # fmt: skip


@pytest.mark.parametrize("family", list(SPECS))
def test_presets_are_the_formula_s_dims_of_the_family_s_configs(family):
    """A bench config (a real full-size transformer config) and its preset agree on every dim the
    preset gives; the tiny preset (``<family>-tiny``, where there is one) prices the tiny config;
    and a preset's cost model is the family's formula of its dims."""
    family_spec = spec(family)
    configs = {**family_spec.bench_configs}
    tiny = next((name for name in family_spec.presets if name.endswith("-tiny")), None)
    if tiny is not None:
        configs[tiny] = family_spec.tiny_config
    for preset, config in configs.items():
        dims = family_spec.cost_dims(config)
        # text_len is the data's (the pipeline's padding, a mix scaled down), not the model's
        assert {k: v for k, v in family_spec.presets[preset].items() if k != "text_len"} == {
            k: dims[k] for k in family_spec.presets[preset] if k != "text_len"
        }, preset
    for preset, dims in family_spec.presets.items():
        assert PRESETS[preset][0] is family_spec
        assert default_cost_model(preset) == family_spec.cost_model(dict(dims))


def test_no_two_families_register_a_mix_or_a_preset_under_one_name():
    mixes = [name for family in SPECS.values() for name in family.mixes]
    presets = [name for family in SPECS.values() for name in family.presets]
    assert len(set(mixes)) == len(mixes) and len(set(presets)) == len(presets)
    assert set(mixes) <= set(MIXES) and set(presets) == set(PRESETS)


def test_the_registry_and_specs_load_no_torch():
    import subprocess

    code = "import sys, deepspeed_knap.models.registry; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr


def test_every_training_flag_is_documented_in_the_cli_page():
    """examples/train_dit.py's flags (the trainer's, and its own) each have a row in docs/cli.md's
    section on the script."""
    import re

    page = (ROOT / "docs" / "cli.md").read_text()
    section = page[page.index("## `examples/train_dit.py`") :]
    section = section[: section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    parser = _command_parsers()["examples/train_dit.py"]
    options = {o for action in parser._actions for o in action.option_strings if o.startswith("--")}
    options -= {"--help", "--local_rank", "--deepspeed", "--deepscale", "--deepscale_config"}
    documented = set(re.findall(r"`(--[a-z_-]+)", section))
    assert options <= documented, sorted(options - documented)


def test_the_models_page_has_a_row_per_family_that_matches_its_spec():
    """docs/models.md's table of registered families: one row per spec, in registry order, each
    column the spec's (name, title, diffusers class, pipeline, presets, mixes, LoRA targets)."""
    page = (ROOT / "docs" / "models.md").read_text()
    table = page[page.index("## Registered families") :].split("\n## ")[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()
            if line.startswith("| `")]  # fmt: skip

    def names(cell: str) -> list[str]:
        return re.findall(r"`([^`]+)`", cell)

    import re

    assert [names(row[0])[0] for row in rows] == list(SPECS)
    for row, family in zip(rows, SPECS.values(), strict=True):
        assert row[1] == family.title, row
        assert names(row[2]) == [family.diffusers_class], row
        assert names(row[3]) == ([family.pipeline] if family.pipeline else []), row
        assert names(row[4]) == list(family.presets), row
        assert names(row[5]) == list(family.mixes), row
        assert names(row[6]) == list(family.lora_targets), row


def test_the_trainer_needs_a_deepspeed_config_and_prompts_are_split_at_newlines_only(tmp_path):
    """Without --deepspeed_config the trainer names the flag (it was a TypeError from deep inside);
    a validation prompt holding U+2028 stays one prompt, as request lines do."""
    from deepspeed_knap.training.arguments import TrainingArguments
    from deepspeed_knap.training.trainer import Trainer
    from deepspeed_knap.training.validation import read_prompts

    with pytest.raises(ValueError, match="--deepspeed_config is required"):
        Trainer(TrainingArguments(None, family="flux"))
    path = tmp_path / "prompts.txt"
    path.write_text('a sign that reads "OPEN\u2028CLOSED"\r\n\nrefs/cat.png\tmake it\x85blue\n', encoding="utf-8")
    assert read_prompts(path) == ['a sign that reads "OPEN\u2028CLOSED"', "refs/cat.png\tmake it\x85blue"]
    path.write_bytes(b"\xef\xbb\xbfa cat\n")  # a byte-order mark (editors write one) is no part of a prompt
    assert read_prompts(path) == ["a cat"]


def test_lora_settings_that_would_train_nothing_or_nothing_of_lora_are_refused():
    """--lora-alpha 0 was taken as alpha = rank (``alpha or rank``), nan passed to the first step's
    loss, and --lora-alpha or --lora-targets without --lora-rank trained every weight silently."""
    from deepspeed_knap.models.flux import PackedFluxTransformer
    from deepspeed_knap.models.lora import add_lora
    from deepspeed_knap.training.arguments import TrainingArguments

    for alpha in (0.0, -2.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="alpha must be a positive number"):
            TrainingArguments({}, lora_rank=4, lora_alpha=alpha)
        with pytest.raises(ValueError, match="alpha must be a positive number"):
            add_lora(PackedFluxTransformer(**PackedFluxTransformer.spec.tiny_config), 4, alpha)
    with pytest.raises(ValueError, match="which lora_rank 0 leaves off"):
        TrainingArguments({}, lora_alpha=8.0)
    with pytest.raises(ValueError, match="which lora_rank 0 leaves off"):
        TrainingArguments({}, lora_targets=["attn.to_q"])
    with pytest.raises(ValueError, match="lora_rank -1: give a LoRA rank of at least 1"):
        TrainingArguments({}, lora_rank=-1)
    tiny = PackedFluxTransformer.spec.tiny_config
    assert add_lora(PackedFluxTransformer(**tiny), 4).lora_alpha == 4  # None: alpha = rank
    assert add_lora(PackedFluxTransformer(**tiny), 4, 0.5).lora_alpha == 0.5


def test_a_checkpoint_writer_that_saves_in_the_background_is_refused_with_a_save_dir():
    """DeepSpeed's decoupled writer (and DataStates) queue the files to another process and commit
    them at the next step: the manifest and 'latest' the trainer writes as the save returns would
    describe files not yet written, and the last tag would never be committed."""
    from deepspeed_knap.training.trainer import background_writer_problem

    decoupled = {"checkpoint": {"writer": {"decoupled": True}}}
    assert background_writer_problem(decoupled, "ckpt").startswith(
        """--save-dir with a checkpoint writer that saves in the background (the DeepSpeed config's "checkpoint": """
    )
    assert '"datastates_ckpt"' in background_writer_problem({"datastates_ckpt": {}}, "ckpt")
    assert background_writer_problem(decoupled, None) is None  # no checkpoints: nothing to describe
    for config in ({}, {"checkpoint": {"writer": {"decoupled": False}}}, {"datastates_ckpt": False}):
        assert background_writer_problem(config, "ckpt") is None, config
