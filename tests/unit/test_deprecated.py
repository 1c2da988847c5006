"""Old import paths, names and CLI spellings keep working for one release, each with a warning that
names its replacement."""

import importlib
import json
import subprocess
import sys

import pytest

import deepspeed_knap
from deepspeed_knap._deprecated import MOVED_MODULES, RENAMED
from deepspeed_knap.cli import main


def test_every_old_module_path_and_name_resolves_with_a_warning():
    """In a fresh interpreter (no old path imported yet): every old module imports with a warning
    naming its new path, its names are the new module's objects, every old or moved name in its
    table is its new object with a warning, an old pickle loads, and the new module keeps its own
    spec (reload works)."""
    code = (
        "import importlib, json, pickle, warnings\n"
        "from deepspeed_knap._deprecated import MOVED_MODULES\n"
        "problems = []\n"
        "for old, (new, names) in MOVED_MODULES.items():\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always')\n"
        "        stand_in = importlib.import_module(old)\n"
        "        target = importlib.import_module(new)\n"
        "        public = [n for n in vars(target) if not n.startswith('_')][:5]\n"
        "        same = all(getattr(stand_in, n) is getattr(target, n) for n in public)\n"
        "        moved = all(getattr(stand_in, n) is getattr(importlib.import_module(m), to)\n"
        "                    for n, (m, to) in names.items())\n"
        "    messages = [str(w.message) for w in caught if w.category is DeprecationWarning]\n"
        "    warned = any(old in m and new in m for m in messages)\n"
        "    warned_names = all(any(f'{old}.{n} is now' in m for m in messages) for n in names)\n"
        "    if not (same and moved and warned and warned_names and target.__spec__.name == new):\n"
        "        problems.append([old, same, moved, warned, warned_names, target.__spec__.name])\n"
        "old_pickle = pickle.loads(b'cdeepspeed_knap.workload\\nWorkloadModel\\n.')\n"
        "from deepspeed_knap.cost.model import CostModel\n"
        "import deepspeed_knap.runtime.routing as routing\n"
        "importlib.reload(routing)\n"
        "print(json.dumps([problems, old_pickle is CostModel]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    problems, pickle_ok = json.loads(result.stdout.strip().splitlines()[-1])
    assert problems == [] and pickle_ok
    assert len(MOVED_MODULES) == 21


def test_old_names_that_the_engine_and_the_docs_used_import():
    with pytest.warns(DeprecationWarning):
        from deepspeed_knap.topology import create_process_groups  # split off to runtime.groups
        from deepspeed_knap.workload import WorkloadModel
    from deepspeed_knap.cost.model import CostModel
    from deepspeed_knap.runtime.groups import create_process_groups as new_create

    assert WorkloadModel is CostModel and create_process_groups is new_create


def test_the_documented_model_paths_import():
    from deepspeed_knap.models.flux import PackedFlux2Transformer, PackedFluxTransformer, latent_ids, rope_axes

    assert PackedFluxTransformer.family == "flux" and PackedFlux2Transformer.family == "flux2"
    assert callable(latent_ids) and callable(rope_axes)


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_an_old_top_level_name_is_the_new_object_with_a_warning(old):
    module, new = RENAMED[old]
    with pytest.warns(DeprecationWarning, match=f"deepspeed_knap.{old} is now {module}.{new}"):
        value = getattr(deepspeed_knap, old)
    assert value is getattr(importlib.import_module(module), new)


def test_an_unknown_top_level_name_still_raises():
    with pytest.raises(AttributeError, match="no attribute 'Workload'"):
        _ = deepspeed_knap.Workload


def test_the_old_data_mix_flag_works_and_says_so(capsys):
    assert main(["plan", "--gpus", "8", "--mix", "kf_lowres", "--repeat", "1", "--json"]) == 0
    new = capsys.readouterr()
    assert main(["plan", "--gpus", "8", "--workload", "kf_lowres", "--repeat", "1", "--json"]) == 0
    old = capsys.readouterr()
    assert "--workload is deprecated" in old.err and "use --mix" in old.err and not new.err
    strip = [line for line in new.out.splitlines() if "solve_ms" not in line]
    assert strip == [line for line in old.out.splitlines() if "solve_ms" not in line]
