"""The "knapformer" config block: defaults, every cost model source, the online refit, the deprecated
"workload" spelling, and errors that name the key."""

import json
import re

import pytest

from deepspeed_knap.cost.model import CostModel
from deepspeed_knap.models.registry import default_cost_model
from deepspeed_knap.runtime.config import KnapFormerConfig, get_knapformer_config


def block(**fields):
    return get_knapformer_config({"train_batch_size": 8, "knapformer": fields})


def test_absent_block_is_disabled_with_documented_defaults():
    config = get_knapformer_config({"train_batch_size": 8})
    assert not config.enabled and config.topology is None and config.solver == "refine"
    assert config.max_degree is None and config.timeout_s == 300.0
    assert config.attention_backend == "auto" and config.log_interval == 10 and config.max_tokens_per_gpu is None
    assert config.cost_model.build() == default_cost_model("flux-dev")


def test_cost_model_sources():
    assert block(cost_model={"model": "flux-tiny"}).cost_model.build() == default_cost_model("flux-tiny")
    assert block(cost_model={"hidden": 64, "tflops": 100}).cost_model.build() == default_cost_model(
        "flux-dev", hidden=64, tflops=100
    )
    assert block(cost_model={"linear_coef": 1e-6, "quadratic_coef": 1e-9}).cost_model.build() == CostModel(1e-6, 1e-9)


def test_topology_defaults_to_auto():
    assert block(enabled=True).topology == "auto"
    assert block(enabled=True, topology=None).topology == "auto"
    assert block(enabled=True, max_degree=4).max_degree == 4  # auto's knob, with auto by default
    with pytest.raises(ValueError, match='"solver": "knapformer" needs a fixed topology'):
        block(enabled=True, solver="knapformer")


def test_disabled_blocks_that_loaded_before_auto_became_the_default_still_load():
    """With balancing off nothing plans, so the topology checks wait for "enabled": true: a block
    naming the published solver, or a null topology, loads as it did when the topology had no default."""
    assert block(enabled=False, solver="knapformer").topology is None
    assert block(topology=None).topology is None and not block(topology=None).enabled
    assert block(enabled=False, max_degree=4).max_degree == 4
    assert block(enabled=False, topology="g8n4", max_degree=8).topology == "g8n4"
    with pytest.raises(ValueError, match=r"knapformer\.topology = 'g8x4': malformed topology term"):
        block(enabled=False, topology="g8x4")  # the grammar is checked either way
    with pytest.raises(ValueError, match='"solver": "knapformer" needs a fixed topology'):
        block(enabled=True, topology=None, solver="knapformer")


def test_route_coefficients_go_with_any_source():
    """The link is not the model: a preset, coefficients or a calibration file each take them."""
    preset = block(cost_model={"model": "flux-tiny", "route_coef": 2e-6}).cost_model.build()
    assert preset.route_coef == 2e-6 and preset.inter_node_route == 2e-6
    assert preset.linear_coef == default_cost_model("flux-tiny").linear_coef
    measured = block(cost_model={"linear_coef": 1e-6, "quadratic_coef": 1e-9, "route_coef": 1e-7,
                                 "inter_node_route_coef": 4e-7, "route_latency_s": 0.004}).cost_model.build()  # fmt: skip
    assert measured == CostModel(1e-6, 1e-9, route_coef=1e-7, inter_node_route_coef=4e-7, route_latency_s=0.004)
    assert preset.route_latency_s == 0  # not given: not priced
    for field in ("route_coef", "route_latency_s"):
        for bad in (-1e-6, True, "fast"):
            with pytest.raises(ValueError, match=rf"knapformer\.cost_model\.{field}"):
                block(cost_model={field: bad})


def test_inter_node_all_to_all_bandwidth_and_coefficient():
    """A preset prices peers on other nodes at 50 GB/s unless told otherwise; ``null`` leaves them
    unpriced; a measured ``c'`` goes with any source and replaces the preset's."""
    assert (
        block().cost_model.build().inter_node_alltoall_coef == default_cost_model("flux-dev").inter_node_alltoall_coef
    )
    slower = block(cost_model={"inter_node_alltoall_gbps": 25}).cost_model.build()
    assert slower == default_cost_model("flux-dev", inter_node_alltoall_gbps=25)
    assert block(cost_model={"inter_node_alltoall_gbps": None}).cost_model.build().inter_node_alltoall_coef is None
    measured = block(cost_model={"linear_coef": 1e-6, "quadratic_coef": 1e-9, "alltoall_coef": 1e-8,
                                 "inter_node_alltoall_coef": 4e-8}).cost_model.build()  # fmt: skip
    assert measured == CostModel(1e-6, 1e-9, 1e-8, inter_node_alltoall_coef=4e-8)
    assert block(cost_model={"inter_node_alltoall_coef": 1e-7}).cost_model.build().inter_node_alltoall_coef == 1e-7
    for key, bad in (("inter_node_alltoall_gbps", 0), ("inter_node_alltoall_coef", -1e-6)):
        with pytest.raises(ValueError, match=rf"knapformer\.cost_model\.{key}"):
            block(cost_model={key: bad})


def test_online_refit_and_frozen_base_settings():
    from deepspeed_knap.cost.online import OnlineSettings

    assert block(cost_model={"model": "flux-dev"}).cost_model.online_settings() is None
    assert block(cost_model={"online": False}).cost_model.online_settings() is None
    assert block(cost_model={"online": True}).cost_model.online_settings() == OnlineSettings()
    online = block(cost_model={"online": {"warmup_steps": 2, "forgetting": 0.8}}).cost_model.online_settings()
    assert online == OnlineSettings(warmup_steps=2, forgetting=0.8, refit_interval=1, max_speed_ratio=4.0)
    assert block(cost_model={"online": {"enabled": False}}).cost_model.online_settings() is None
    assert block(cost_model={"online": {"fit_route": False}}).cost_model.online_settings() == OnlineSettings(
        fit_route=False
    )
    lora = block(cost_model={"model": "flux-dev", "frozen_base": True}).cost_model.build()
    assert lora.linear_coef == pytest.approx(default_cost_model("flux-dev").linear_coef * 2 / 3)
    assert lora.quadratic_coef == default_cost_model("flux-dev").quadratic_coef


def test_calibration_file(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"linear_coef": 2e-6, "quadratic_coef": 3e-10, "alltoall_coef": 1e-7, "r2": 0.99}))
    assert block(cost_model={"calibration_file": str(path)}).cost_model.build() == CostModel(2e-6, 3e-10, 1e-7)
    path.write_text(
        json.dumps({"linear_coef": 2e-6, "quadratic_coef": 3e-10, "degree_efficiency": [[2, 0.9], [4, 0.8]]})
    )
    model = block(cost_model={"calibration_file": str(path)}).cost_model.build()
    assert model.degree_efficiency == ((2, 0.9), (4, 0.8))
    assert model.per_gpu_time(1000, 4) == pytest.approx((2e-6 * 1000 + 3e-10 * 1e6) / (4 * 0.8))
    # A file's route_coef (calibrate --route-gbps) is the default; the block's own replaces it.
    path.write_text(json.dumps({"linear_coef": 2e-6, "quadratic_coef": 3e-10, "route_coef": 5e-8,
                                "route_latency_s": 0.002}))  # fmt: skip
    from_file = block(cost_model={"calibration_file": str(path)}).cost_model.build()
    assert (from_file.route_coef, from_file.route_latency_s) == (5e-8, 0.002)
    given = block(cost_model={"calibration_file": str(path), "route_coef": 0, "route_latency_s": 0}).cost_model.build()
    assert (given.route_coef, given.route_latency_s) == (0, 0)
    # Its alltoall_coef (0 from one process: calibrate times no all-to-all) too.
    given = block(cost_model={"calibration_file": str(path), "alltoall_coef": 2e-5}).cost_model.build()
    assert (given.alltoall_coef, given.linear_coef) == (2e-5, 2e-6)
    path.write_text("{}")
    with pytest.raises(ValueError, match=r"calibration_file .* is unreadable"):
        block(cost_model={"calibration_file": str(path)}).cost_model.build()
    # A bag size that is not a whole number is refused, not truncated (8.7 once became 8).
    path.write_text(json.dumps({"linear_coef": 2e-6, "quadratic_coef": 3e-10, "degree_efficiency": [[8.7, 0.9]]}))
    with pytest.raises(ValueError, match=r"is unreadable \(degree_efficiency = \[\[8\.7, 0\.9\]\]; expected"):
        block(cost_model={"calibration_file": str(path)}).cost_model.build()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"toplogy": "g8n4"}, "unknown key 'knapformer.toplogy'; valid keys: enabled, topology"),
        ({"topology": "g8x4"}, "knapformer.topology = 'g8x4': malformed topology term"),
        ({"solver": "greedy"}, "knapformer.solver = 'greedy': Input should be 'none', 'knapformer' or 'refine'"),
        ({"attention_backend": "xformers"}, "knapformer.attention_backend = 'xformers'"),
        ({"max_tokens_per_gpu": 0}, "knapformer.max_tokens_per_gpu = 0: Input should be greater than 0"),
        ({"log_interval": -1}, "knapformer.log_interval = -1"),
        ({"cost_model": {"foo": 1}}, "unknown key 'knapformer.cost_model.foo'; valid keys: model, hidden"),
        ({"enabled": "yes"}, "knapformer.enabled = 'yes': Input should be a valid boolean"),
        ({"enabled": 1}, "knapformer.enabled = 1: Input should be a valid boolean"),
        ({"cost_model": {"frozen_base": "true"}}, "knapformer.cost_model.frozen_base = 'true'"),
        ({"cost_model": {"online": {"enabled": False, "warmup_steps": 3}}}, 'warmup_steps given with "enabled": false'),
        ({"cost_model": {"online": {"enabled": "no"}}}, "knapformer.cost_model.online.enabled = 'no'"),
        (
            {"cost_model": {"startup_calibration": {"enabled": False, "repeats": 3}}},
            'repeats given with "enabled": false, where nothing reads it',
        ),
        (
            {"cost_model": {"online": {"warmup": 3}}},
            "unknown key 'knapformer.cost_model.online.warmup'; valid keys: enabled,",
        ),
        ({"cost_model": {"warmup_steps": 3}}, "unknown key 'knapformer.cost_model.warmup_steps'"),
        (  # accepted and ignored before: a preset alone reads them
            {"cost_model": {"linear_coef": 1.0, "quadratic_coef": 0.1, "alltoall_gbps": 100}},
            "alltoall_gbps: a preset's FLOPs and links, which measured coefficients or a calibration_file do not read",
        ),
        (  # the keys of the block the typo is in (they were the cost model's)
            {"cost_model": {"startup_calibration": {"seqlens": [1024, 2048, 4096]}}},
            "unknown key 'knapformer.cost_model.startup_calibration.seqlens'; valid keys: enabled, seq_lens, repeats",
        ),
        ({"cost_model": {}, "workload": {}}, 'give "cost_model", not both it and its deprecated spelling "workload"'),
        ({"timeout_s": True}, "knapformer.timeout_s = True: true is a boolean; give a number"),
        ({"cost_model": {"online": {"warmup_steps": False}}}, "online.warmup_steps = False: false is a boolean"),
        # Numbers in quotes: pydantic's lax mode parsed them (a "1e3" is no int).
        ({"log_interval": "10"}, "knapformer.log_interval = '10': '10' is a string; give a number, without quotes"),
        ({"max_tokens_per_gpu": "8192"}, "knapformer.max_tokens_per_gpu = '8192': '8192' is a string"),
        ({"cost_model": {"online": {"forgetting": "0.9"}}}, "online.forgetting = '0.9': '0.9' is a string"),
        ({"cost_model": {"tflops": "auto"}}, "cost_model.tflops = 'auto': 'auto' is a string; give a number"),
        (
            {"cost_model": {"startup_calibration": {"seq_lens": ["1024", 2048, 4096]}}},
            "seq_lens ['1024', 2048, 4096]: a length is a number, not a string",
        ),
        ({"cost_model": {"model": "flux-xl"}}, "unknown model preset 'flux-xl'"),
        ({"cost_model": {"linear_coef": 1.0}}, "coefficients need both linear_coef and quadratic_coef"),
        ({"cost_model": {"model": "flux-dev", "alltoall_coef": 1e-8}}, "a preset takes alltoall_gbps"),
        (
            {"cost_model": {"alltoall_coef": 1e-8}},
            "goes with linear_coef and quadratic_coef, or with a calibration_file",
        ),
        ({"cost_model": {"model": "flux-dev", "linear_coef": 1, "quadratic_coef": 1}}, "give one cost model source"),
        ({"enabled": True, "topology": "g8n4", "max_degree": 8}, '"max_degree": 8 applies to "topology": "auto" only'),
        ({"enabled": True, "topology": "auto", "max_degree": 6}, '"max_degree": 6 must be a power of two'),
        ({"topology": "auto", "max_degree": 0}, "knapformer.max_degree = 0: Input should be greater than 0"),
        ({"timeout_s": 0}, "knapformer.timeout_s = 0: Input should be greater than or equal to 1"),
        ({"solver": "knapformer", "max_tokens_per_gpu": 8192}, '"solver": "knapformer" cannot honour'),
        (
            {"enabled": True, "topology": "auto", "solver": "knapformer"},
            '"solver": "knapformer" needs a fixed topology',
        ),
        ({"cost_model": {"linear_coef": 1, "quadratic_coef": 1, "frozen_base": True}}, "frozen_base adjusts a preset"),
        ({"cost_model": {"online": {"forgetting": 1.5}}}, "knapformer.cost_model.online.forgetting = 1.5"),
        ({"cost_model": {"online": {"max_speed_ratio": 1}}}, "knapformer.cost_model.online.max_speed_ratio = 1"),
        ({"timeout_s": 1e15}, "knapformer.timeout_s = 1000000000000000.0: Input should be less than or equal to 86400"),
    ],
)
def test_bad_blocks_name_the_key_and_value(fields, message):
    with pytest.raises(ValueError, match='invalid "knapformer" block') as error:
        block(**fields)
    assert message in str(error.value)


def test_the_old_workload_spelling_still_loads_with_a_warning(caplog):
    """A config written before the rename (flat online knobs beside "online": true) gives the same
    settings as its new spelling, and DeepSpeed's deprecation warning names the new key."""
    old = block(workload={"model": "flux-tiny", "online": True, "warmup_steps": 2, "forgetting": 0.8})
    new = block(cost_model={"model": "flux-tiny", "online": {"warmup_steps": 2, "forgetting": 0.8}})
    assert old.cost_model == new.cost_model
    assert old.cost_model.build() == default_cost_model("flux-tiny")
    assert block(workload={"model": "flux-tiny"}).cost_model.online_settings() is None
    # A flat knob with "online" off was inert in the old block; such a config still loads (with a note).
    assert block(workload={"model": "flux-tiny", "warmup_steps": 3}).cost_model.online_settings() is None
    # ... and so does an enabled block (whose checks read the cost model before DeepSpeed moves it).
    enabled = block(enabled=True, workload={"model": "flux-tiny", "online": True})
    spelled_now = block(enabled=True, cost_model={"model": "flux-tiny", "online": {"enabled": True}})
    assert enabled.enabled and enabled.cost_model == spelled_now.cost_model


def test_auto_is_a_value_like_any_other_and_strict_a_key_like_any_other():
    """DeepSpeed's config models drop every value "auto" and take "strict" as an argument unless
    told otherwise; in this block, at every depth, "auto" is checked as given and "strict" is an
    unknown key."""
    for fields, says in (
        ({"cost_model": {"model": "auto"}}, "unknown model preset 'auto'"),
        ({"cost_model": {"tflops": "auto"}}, "knapformer.cost_model.tflops = 'auto'"),
        ({"cost_model": {"online": {"enabled": "auto"}}}, "knapformer.cost_model.online.enabled = 'auto'"),
        ({"cost_model": {"online": {"strict": False}}}, "unknown key 'knapformer.cost_model.online.strict'"),
        ({"strict": False}, "unknown key 'knapformer.strict'"),
    ):
        with pytest.raises(ValueError, match=re.escape(says)):
            block(enabled=True, **fields)
    assert block(enabled=True, topology="auto").topology == "auto"  # where "auto" is a value, it still is
    calibration = block(enabled=True, cost_model={"startup_calibration": "auto"}).cost_model.startup_calibration
    assert calibration == block(enabled=True).cost_model.startup_calibration  # "auto" spells the default
    for depth in ({"self": 1}, {"cost_model": {"self": 1}}):  # a key like any other, not __init__'s argument
        with pytest.raises(ValueError, match=r"unknown key 'knapformer\.(cost_model\.)?self'"):
            block(**depth)


def test_block_must_be_an_object():
    with pytest.raises(ValueError, match="must be a JSON object"):
        get_knapformer_config({"knapformer": "g8n4"})


def test_every_field_is_documented_in_the_config_page():
    from pathlib import Path

    from deepspeed_knap.runtime.config import KnapCostModelConfig, KnapOnlineConfig

    page = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    for prefix, model in (("", KnapFormerConfig), ("cost_model.", KnapCostModelConfig),
                          ("cost_model.online.", KnapOnlineConfig)):  # fmt: skip
        for name, field in model.model_fields.items():
            if (field.json_schema_extra or {}).get("deprecated"):  # named once, under "Deprecated spellings"
                assert f"`{name}` is the deprecated spelling" in page, prefix + name
            else:
                assert f"| `{prefix}{name}` |" in page, prefix + name


def test_a_bad_config_file_is_named(tmp_path):
    from deepspeed_knap.runtime.config import load_ds_config

    (tmp_path / "ds.json").write_text('{"train_batch_size": 8,,}')
    with pytest.raises(ValueError, match=r"ds.json is not valid JSON: .* line 1, column 24"):
        load_ds_config(tmp_path / "ds.json")
    with pytest.raises(ValueError, match=r"cannot read the DeepSpeed config .*missing.json: No such file"):
        load_ds_config(tmp_path / "missing.json")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="must hold a JSON object; it holds a list"):
        load_ds_config(tmp_path / "list.json")


def test_a_config_file_reads_as_deepspeed_reads_it(tmp_path):
    """As DeepSpeedConfig: hjson (comments), a key given twice refused (it silently took the last
    block), and the config as a base64 string."""
    import base64

    from deepspeed.runtime.config import DeepSpeedConfig

    from deepspeed_knap.runtime.config import load_ds_config

    commented = tmp_path / "commented.json"
    commented.write_text('// ZeRO-2 on one GPU\n{"train_batch_size": 8, "zero_optimization": {"stage": 2}}')
    assert load_ds_config(commented) == DeepSpeedConfig(str(commented))._param_dict
    twice = tmp_path / "twice.json"
    twice.write_text('{"train_batch_size": 8, "knapformer": {"enabled": true}, "knapformer": {"enabled": false}}')
    with pytest.raises(
        ValueError, match=r"twice.json: Duplicate keys in DeepSpeed config: \['knapformer'\]; give each"
    ):
        load_ds_config(twice)
    encoded = base64.urlsafe_b64encode(b'{"train_batch_size": 8}').decode()
    assert load_ds_config(encoded) == DeepSpeedConfig(encoded)._param_dict == {"train_batch_size": 8}
    # A config's base64 is longer than a file name may be (255 bytes): not a path that cannot be read.
    config = {"train_batch_size": 8, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "bf16": {"enabled": True}, "knapformer": {"enabled": True, "topology": "auto", "log_interval": 10}}  # fmt: skip
    encoded = base64.urlsafe_b64encode(json.dumps(config).encode()).decode()
    assert len(encoded) > 255 and load_ds_config(encoded) == config
    with pytest.raises(
        ValueError, match=r"the DeepSpeed config given in base64 \(no file has that name\) is not valid"
    ):
        load_ds_config(base64.urlsafe_b64encode(b'{"train_batch_size": 8,,}').decode())
    braceless = base64.urlsafe_b64encode(b"// hjson\ntrain_batch_size: 8").decode()  # hjson, as DeepSpeed reads it
    assert load_ds_config(braceless) == DeepSpeedConfig(braceless)._param_dict == {"train_batch_size": 8}


@pytest.mark.parametrize("key", ["tflops", "alltoall_gbps"])
def test_infinite_dims_are_refused_naming_the_key(key):
    with pytest.raises(ValueError, match=f"knapformer.cost_model.{key} = inf: Input should be a finite number"):
        block(cost_model={key: float("inf")})
    with pytest.raises(ValueError, match=f"{key}=inf"):
        default_cost_model("flux-dev", **{key: float("inf")})
