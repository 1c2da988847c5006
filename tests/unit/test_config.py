"""The "knapformer" config block: defaults, every workload source, and errors that name the key."""

import json

import pytest

from deepspeed_knap.cost.model import CostModel, default_cost_model
from deepspeed_knap.runtime.config import KnapFormerConfig, get_knapformer_config


def block(**fields):
    return get_knapformer_config({"train_batch_size": 8, "knapformer": fields})


def test_absent_block_is_disabled_with_documented_defaults():
    config = get_knapformer_config({"train_batch_size": 8})
    assert not config.enabled and config.topology is None and config.solver == "refine"
    assert config.max_degree is None and config.timeout_s == 300.0
    assert config.attention_backend == "auto" and config.log_interval == 10 and config.max_tokens_per_gpu is None
    assert config.workload.build() == default_cost_model("flux-dev")


def test_workload_sources():
    assert block(workload={"model": "flux-tiny"}).workload.build() == default_cost_model("flux-tiny")
    assert block(workload={"hidden": 64, "tflops": 100}).workload.build() == default_cost_model(
        "flux-dev", hidden=64, tflops=100
    )
    assert block(workload={"linear_coef": 1e-6, "quadratic_coef": 1e-9}).workload.build() == CostModel(1e-6, 1e-9)


def test_online_refit_and_frozen_base_settings():
    from deepspeed_knap.cost.online import OnlineSettings

    assert block(workload={"model": "flux-dev"}).workload.online_settings() is None
    online = block(workload={"online": True, "warmup_steps": 2, "forgetting": 0.8}).workload.online_settings()
    assert online == OnlineSettings(warmup_steps=2, forgetting=0.8, refit_interval=1, max_speed_ratio=4.0)
    lora = block(workload={"model": "flux-dev", "frozen_base": True}).workload.build()
    assert lora.linear_coef == pytest.approx(default_cost_model("flux-dev").linear_coef * 2 / 3)
    assert lora.quadratic_coef == default_cost_model("flux-dev").quadratic_coef


def test_calibration_file(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"linear_coef": 2e-6, "quadratic_coef": 3e-10, "alltoall_coef": 1e-7, "r2": 0.99}))
    assert block(workload={"calibration_file": str(path)}).workload.build() == CostModel(2e-6, 3e-10, 1e-7)
    path.write_text(
        json.dumps({"linear_coef": 2e-6, "quadratic_coef": 3e-10, "degree_efficiency": [[2, 0.9], [4, 0.8]]})
    )
    model = block(workload={"calibration_file": str(path)}).workload.build()
    assert model.degree_efficiency == ((2, 0.9), (4, 0.8))
    assert model.per_gpu_time(1000, 4) == pytest.approx((2e-6 * 1000 + 3e-10 * 1e6) / (4 * 0.8))
    path.write_text("{}")
    with pytest.raises(ValueError, match=r"calibration_file .* is unreadable"):
        block(workload={"calibration_file": str(path)}).workload.build()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"toplogy": "g8n4"}, "unknown key 'knapformer.toplogy'; valid keys: enabled, topology"),
        ({"enabled": True}, '"enabled": true needs a "topology"'),
        ({"topology": "g8x4"}, "knapformer.topology = 'g8x4': malformed topology term"),
        ({"solver": "greedy"}, "knapformer.solver = 'greedy': Input should be 'none', 'knapformer' or 'refine'"),
        ({"attention_backend": "xformers"}, "knapformer.attention_backend = 'xformers'"),
        ({"max_tokens_per_gpu": 0}, "knapformer.max_tokens_per_gpu = 0: Input should be greater than 0"),
        ({"log_interval": -1}, "knapformer.log_interval = -1"),
        ({"workload": {"foo": 1}}, "unknown key 'knapformer.workload.foo'; valid keys: model, hidden"),
        ({"workload": {"model": "flux-xl"}}, "unknown model preset 'flux-xl'"),
        ({"workload": {"linear_coef": 1.0}}, "coefficients need both linear_coef and quadratic_coef"),
        ({"workload": {"model": "flux-dev", "linear_coef": 1, "quadratic_coef": 1}}, "give one workload source"),
        ({"topology": "g8n4", "max_degree": 8}, '"max_degree": 8 applies to "topology": "auto" only'),
        ({"topology": "auto", "max_degree": 6}, '"max_degree": 6 must be a power of two'),
        ({"topology": "auto", "max_degree": 0}, "knapformer.max_degree = 0: Input should be greater than 0"),
        ({"timeout_s": 0}, "knapformer.timeout_s = 0: Input should be greater than 0"),
        ({"solver": "knapformer", "max_tokens_per_gpu": 8192}, '"solver": "knapformer" cannot honour'),
        ({"topology": "auto", "solver": "knapformer"}, '"solver": "knapformer" needs a fixed topology'),
        ({"workload": {"linear_coef": 1, "quadratic_coef": 1, "frozen_base": True}}, "frozen_base adjusts a preset"),
        ({"workload": {"online": True, "forgetting": 1.5}}, "knapformer.workload.forgetting = 1.5"),
        ({"workload": {"online": True, "max_speed_ratio": 1}}, "knapformer.workload.max_speed_ratio = 1"),
    ],
)
def test_bad_blocks_name_the_key_and_value(fields, message):
    with pytest.raises(ValueError, match='invalid "knapformer" block') as error:
        block(**fields)
    assert message in str(error.value)


def test_block_must_be_an_object():
    with pytest.raises(ValueError, match="must be a JSON object"):
        get_knapformer_config({"knapformer": "g8n4"})


def test_every_field_is_documented_in_the_readme():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for name in KnapFormerConfig.model_fields:
        assert f"| `{name}` |" in readme, name
    from deepspeed_knap.runtime.config import KnapWorkloadConfig

    for name in KnapWorkloadConfig.model_fields:
        assert f"| `workload.{name}` |" in readme, name
