"""Old import paths, names and CLI spellings keep working for one release, each with a warning that
names its replacement."""

import importlib
import subprocess
import sys

import pytest

import deepspeed_knap
from deepspeed_knap._deprecated import MOVED_MODULES, RENAMED
from deepspeed_knap.cli import main


def test_every_old_module_path_is_the_new_module_with_a_warning():
    code = (
        "import importlib, json, sys, warnings\n"
        "from deepspeed_knap._deprecated import MOVED_MODULES\n"
        "problems = []\n"
        "for old, new in MOVED_MODULES.items():\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always')\n"
        "        module = importlib.import_module(old)\n"
        "    messages = [str(w.message) for w in caught if w.category is DeprecationWarning]\n"
        "    if module is not importlib.import_module(new) or not any(old in m and new in m for m in messages):\n"
        "        problems.append((old, messages))\n"
        "print(json.dumps(problems))\n"
    )
    # a fresh interpreter, where no old path has been imported yet (a second import does not warn)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert len(MOVED_MODULES) == 21


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
