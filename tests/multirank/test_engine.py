"""DeepSpeed integration on 4 CPU ranks: ZeRO-1/2/3 training with balancing on equals balancing off."""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_distributed

DIM, HEADS, COND = 24, 6, 5
STEPS = 3


def ds_config(stage: int, knapformer: dict | None) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    if knapformer is not None:
        config["knapformer"] = knapformer
    return config


KNAP_ON = {"enabled": True, "topology": "g1n2+g2n1", "solver": "knapformer", "attention_backend": "sdpa",
           "cost_model": {"linear_coef": 1.0, "quadratic_coef": 0.05}, "log_interval": 1}  # fmt: skip
# Elastic: a priced all-to-all keeps short sequences whole while long ones are split.
KNAP_AUTO = {**KNAP_ON, "topology": "auto", "solver": "refine",
             "cost_model": {"linear_coef": 1.0, "quadratic_coef": 0.05, "alltoall_coef": 0.5}}  # fmt: skip


def step_lengths(step: int, rank: int) -> list[int]:
    table = [[[40, 3], [], [9, 9, 2], [1]], [[5], [33, 1], [], [17, 4]], [[2, 2, 2], [60], [7], []]]
    return table[step % len(table)][rank]


def make_engine(config: dict, seed: int = 0):
    import deepspeed_knap
    from deepspeed_knap.models.tiny_dit import TinyDiT

    torch.manual_seed(seed)
    model = TinyDiT(DIM, HEADS, COND)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    engine, _, _, _, balancer = deepspeed_knap.initialize(model=model, optimizer=optimizer, config=config)
    return engine, balancer


def run_steps(engine, balancer, rank: int, steps: range) -> list[float]:
    """Train ``steps`` of TinyDiT; returns the global mean loss of each."""
    import deepspeed_knap
    from deepspeed_knap.models.tiny_dit import random_batch

    losses = []
    for step in steps:
        batch = random_batch(step_lengths(step, rank), 100 * step + rank, DIM, COND)
        target = torch.randn(batch.tokens.shape, generator=torch.Generator().manual_seed(7 * step + rank))
        out = engine(batch, balancer)
        loss = deepspeed_knap.token_mean_loss((out - target).square().mean(dim=-1))
        engine.backward(loss)
        engine.step()
        losses.append(deepspeed_knap.global_mean_loss(loss))
    return losses


def parameters(engine) -> torch.Tensor:
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return torch.cat([p.detach().reshape(-1).clone() for p in params])


def train(rank: int, config: dict) -> tuple[list[float], torch.Tensor]:
    engine, balancer = make_engine(config)
    losses = run_steps(engine, balancer, rank, range(STEPS))
    return losses, parameters(engine)


def _zero_worker(rank: int, world: int, stage: int, monitor_dir: str) -> dict:
    off_config = ds_config(stage, {"enabled": False, "topology": "g4n1"})
    engine, balancer = make_engine(off_config)
    assert balancer is None  # disabled: plain DeepSpeed, no balancer, no extra groups or collectives
    assert backends(engine) == {"sdpa"}  # TinyDiT's own kernel: the block names none
    if stage == 1:  # balancing off runs the kernel the block names, where it names one
        named, _ = make_engine(ds_config(stage, {"enabled": False, "attention_backend": "auto"}))
        assert backends(named) == {"auto"}
    off_losses = run_steps(engine, balancer, rank, range(STEPS))
    off_params = parameters(engine)
    off_timeouts = group_timeouts()
    on_config = ds_config(stage, KNAP_ON)
    on_config["csv_monitor"] = {"enabled": True, "output_path": monitor_dir, "job_name": f"zero{stage}"}
    on_losses, on_params = train(rank, on_config)
    result = {"off": off_losses, "on": on_losses, "param_err": float((on_params - off_params).abs().max()),
              "param_change": float((on_params - _initial_params()).abs().max()),
              "off_timeouts": off_timeouts, "on_timeouts": group_timeouts()}  # fmt: skip
    if stage == 3:
        auto_losses, auto_params = train(rank, ds_config(stage, KNAP_AUTO))
        result.update(auto=auto_losses, auto_param_err=float((auto_params - off_params).abs().max()))
    return result


def backends(engine) -> set[str]:
    """The kernels of the engine's model's balanced attention modules."""
    from deepspeed_knap.runtime.attention import KnapDistributedAttention

    return {m.varlen_attn.backend for m in engine.module.modules() if isinstance(m, KnapDistributedAttention)}


def group_timeouts() -> dict[str, float]:
    """The collective timeout (seconds) of every process group this rank is in, by group name."""
    from torch.distributed import distributed_c10d

    return {
        str(group.group_name): group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        for group in distributed_c10d._world.pg_map
    }


def _initial_params() -> torch.Tensor:
    from deepspeed_knap.models.tiny_dit import TinyDiT

    torch.manual_seed(0)
    return torch.cat([p.detach().reshape(-1) for p in TinyDiT(DIM, HEADS, COND).parameters()])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_training_with_balancing_equals_without(stage, tmp_path):
    results = run_distributed(_zero_worker, 4, args=(stage, str(tmp_path)), timeout=300)
    for result in results:
        assert result["on"] == pytest.approx(result["off"], rel=1e-5, abs=1e-6)
        assert result["param_err"] <= 1e-5
        assert result["param_change"] > 1e-3  # training really moved the weights
        if stage == 3:  # and with topology auto
            assert result["auto"] == pytest.approx(result["off"], rel=1e-5, abs=1e-6)
            assert result["auto_param_err"] <= 1e-5
    assert results[0]["off"] == results[1]["off"]  # a global mean: the same on every rank
    for result in results:
        # Balancing off, no timeout_s: DeepSpeed's and torch's timeouts stand (the harness's world group,
        # DeepSpeed's clone of it: torch's 30 minutes on gloo). On: every group, DeepSpeed's included
        # (ZeRO-1/2 reduce gradients in its clone), waits the block's timeout_s (default 300 s).
        assert 300.0 not in result["off_timeouts"].values(), result["off_timeouts"]
        assert len(result["on_timeouts"]) > len(result["off_timeouts"]) >= 2
        assert set(result["on_timeouts"].values()) == {300.0}, result["on_timeouts"]
    # log_interval 1: every step's balancing metrics reached DeepSpeed's CSV monitor.
    written = sorted(p.name for p in (tmp_path / f"zero{stage}").rglob("knapformer_*.csv"))
    names = ("imbalance_after", "imbalance_before", "measured_imbalance", "overhead", "plan_shared", "planned_ahead",
             "prediction_error", "solve_ms", "tokens_moved")  # fmt: skip
    assert written == [f"knapformer_{name}.csv" for name in names], written
    rows = (tmp_path / f"zero{stage}" / "knapformer_imbalance_after.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + STEPS  # header and one row per step
    measured = (tmp_path / f"zero{stage}" / "knapformer_measured_imbalance.csv").read_text().strip().splitlines()
    assert len(measured) == STEPS  # from the second step on: each step ships the last one's times
    assert all(float(line.split(",")[-1]) >= 1.0 for line in measured[1:])


def _checkpoint_worker(rank: int, world: int, save_dir: str) -> dict:
    """ZeRO-3 with balancing: stop after 2 steps, save, reload into a differently initialised engine,
    and the third step must match an uninterrupted run (itself equal to balancing off)."""
    config = ds_config(3, KNAP_ON)
    engine, balancer = make_engine(config)
    run_steps(engine, balancer, rank, range(2))
    engine.save_checkpoint(save_dir, tag="step2")
    uninterrupted = run_steps(engine, balancer, rank, range(2, 3)), parameters(engine)
    engine, balancer = make_engine(config, seed=123)
    engine.load_checkpoint(save_dir, tag="step2")
    resumed = run_steps(engine, balancer, rank, range(2, 3)), parameters(engine)
    return {"loss": (uninterrupted[0], resumed[0]), "param_err": float((uninterrupted[1] - resumed[1]).abs().max())}


def test_zero3_checkpoint_round_trip_with_balancing(tmp_path):
    for result in run_distributed(_checkpoint_worker, 4, args=(str(tmp_path),), timeout=300):
        uninterrupted, resumed = result["loss"]
        assert resumed == uninterrupted
        assert result["param_err"] == 0.0


def _config_error_worker(rank: int, world: int, calibration: str) -> dict:
    import os

    import deepspeed_knap
    from deepspeed_knap.models.tiny_dit import TinyDiT

    # The harness's launcher reports every rank on one node (LOCAL_SIZE); "node" launches as if on
    # nodes of 2, "auto_node" on nodes of 3 (groups of whole nodes need power-of-two nodes),
    # "node_mismatch" keeps the report of 4.
    two_per_node = {"LOCAL_SIZE": "2"}
    cases = {
        "world": ({"topology": "g8n1"}, 6, {}),
        "node": ({"topology": "g3n1+g1n1", "gpus_per_node": 2}, 6, two_per_node),
        "node_mismatch": ({"topology": "g2n2", "gpus_per_node": 2}, 6, {}),
        "heads": ({"topology": "g4n1"}, 2, {}),
        "typo": ({"topology": "g4n1", "sovler": "refine"}, 6, {}),
        "auto_heads": ({"topology": "auto", "max_degree": 4}, 2, {}),
        "auto_node": ({"topology": "auto", "max_degree": 4}, 6, {"LOCAL_SIZE": "3"}),
        "auto_not_a_power_of_two": ({"topology": "auto", "max_degree": 3}, 6, {}),
        # A calibration file only ranks 0 and 1 have (the same relative path, each "node" in its own
        # working directory): every rank must raise, naming 2 and 3 and what they see.
        "file_on_some_nodes": ({"topology": "g2n2", "cost_model": {"calibration_file": "calibration.json"}}, 6, {}),
        # Valid blocks that differ: ranks 2 and 3 have balancing off. Before, they went on into
        # DeepSpeed's start-up while ranks 0 and 1 waited in the agreement, and the job hung.
        "enabled_on_some_nodes": ({"topology": "g2n2"}, 6, {}),
        # Ranks 2 and 3 (node 1 of 2) have a typo, or no config file at all; ranks 0 and 1 are fine.
        # Before, ranks 2 and 3 raised alone and ranks 0 and 1 waited for them.
        "typo_on_some_nodes": ({"topology": "g2n2"}, 6, {"CROSS_RANK": str(rank // 2)}),
        "config_missing_on_some_nodes": ({"topology": "g2n2"}, 6, {}),
    }
    errors = {}
    for name, (block, heads, env) in cases.items():
        model = TinyDiT(DIM, heads, COND)
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        cwd = os.getcwd()
        if name == "file_on_some_nodes":
            os.chdir(os.path.dirname(calibration) if rank < 2 else os.path.dirname(os.path.dirname(calibration)))
        enabled = not (name == "enabled_on_some_nodes" and rank >= 2)
        if name == "typo_on_some_nodes" and rank >= 2:
            block = {**block, "topolgy": "g2n2"}
        config = ds_config(1, {"enabled": enabled, **block})
        if name == "config_missing_on_some_nodes" and rank >= 2:
            config = calibration + ".no-config-on-this-node.json"
        try:
            deepspeed_knap.initialize(model=model, config=config)
        except ValueError as error:
            errors[name] = str(error)
        finally:
            os.chdir(cwd)
            for key, value in saved.items():
                os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    return errors


def test_config_errors_before_the_first_step_on_every_rank(tmp_path):
    calibration = tmp_path / "calibration.json"
    calibration.write_text('{"linear_coef": 1.0, "quadratic_coef": 0.01}')
    results = run_distributed(_config_error_worker, 4, args=(str(calibration),))
    assert all(errors == results[0] for errors in results)  # identical on every rank
    errors = results[0]
    assert "needs a world size that is a multiple of its 8 GPUs" in errors["world"]
    assert "cannot be laid out over nodes of 2 GPUs" in errors["node"]
    assert '"gpus_per_node": 2 in the "knapformer" block, but the launcher reports 4' in errors["node_mismatch"]
    assert "bags of 4 GPUs but attention has only 2 heads" in errors["heads"]
    assert "unknown key 'knapformer.sovler'" in errors["typo"]
    assert '"max_degree": 4 but the model\'s attention has only 2 heads' in errors["auto_heads"]
    assert "max_degree=4 is larger than a node of 3 GPUs: groups of whole nodes need" in errors["auto_node"]
    assert '"max_degree": 3 must be a power of two' in errors["auto_not_a_power_of_two"]
    assert "ranks see different settings" in errors["file_on_some_nodes"]
    assert '"knapformer" block' not in errors["file_on_some_nodes"]  # the same block everywhere
    assert '"knapformer" block (ranks [2, 3] differ from rank 0)' in errors["enabled_on_some_nodes"]
    assert "cost model (calibration_file) (ranks [2, 3] differ from rank 0)" in errors["file_on_some_nodes"]
    # ... and says what rank 2 saw: its file is missing
    assert (
        "rank 2 sees" in errors["file_on_some_nodes"]
        and "is unreadable ([Errno 2] No such file" in errors["file_on_some_nodes"]
    )
    typo = errors["typo_on_some_nodes"]
    assert typo.startswith("reading the DeepSpeed config on every rank failed:\nrank(s) [2, 3]: node 1 (host "), typo
    assert "unknown key 'knapformer.topolgy'" in typo and "[0, 1]" not in typo
    missing = errors["config_missing_on_some_nodes"]
    assert "rank(s) [2, 3]: host " in missing and ".no-config-on-this-node.json" in missing, missing


def _differing_config_worker(rank: int, world: int) -> dict:
    import deepspeed_knap
    from deepspeed_knap.models.tiny_dit import TinyDiT

    errors = {}
    # Rank 1 was given ZeRO-2 where rank 0 has ZeRO-3; then a batch size differing alone (balancing on).
    cases = {"stage": ds_config(3 - rank, None),
             "batch": {**ds_config(1, {"enabled": True, "topology": "g2n1"}), "train_micro_batch_size_per_gpu": 1 + rank}}  # fmt: skip
    for name, config in cases.items():
        model = TinyDiT(DIM, HEADS, COND)
        try:
            deepspeed_knap.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
        except ValueError as error:
            errors[name] = str(error)
    return errors


def _arguments_worker(rank: int, world: int, config_path: str) -> dict:
    """deepspeed.initialize's arguments as DeepSpeed takes them: positionally in its order, the config
    as config_params= or args.deepscale_config (each read: its gradient clipping is the engine's); an
    mpu, DeepSpeed's mesh and AutoTP recorded by deepspeed.tp_model_init refused with balancing on."""
    import argparse

    import deepspeed

    import deepspeed_knap
    from deepspeed_knap.models.tiny_dit import TinyDiT

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:  # an engine takes over its model's parameters
        model = TinyDiT(DIM, HEADS, COND)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    config = {**ds_config(0, {"enabled": False}), "gradient_clipping": 0.5}
    outcome = {}
    model, sgd = fresh()
    engine, optimizer, *_ = deepspeed_knap.initialize(None, model, sgd, None, config=config)  # DeepSpeed's positions
    outcome["positional"] = (optimizer is sgd or optimizer.optimizer is sgd, engine.gradient_clipping())
    outcome["config_params"] = deepspeed_knap.initialize(None, *fresh(), config_params=config)[0].gradient_clipping()
    args = argparse.Namespace(deepscale_config=config_path, deepspeed_config=None)
    outcome["deepscale_config"] = deepspeed_knap.initialize(args, *fresh())[0].gradient_clipping()
    balanced = {**config, "knapformer": {"enabled": True}}
    refused = {"mpu": dict(config=balanced, mpu=object()), "twice": dict(config=config),
               "mesh": dict(config={**balanced, "sequence_parallel_size": 1, "data_parallel_size": 1})}  # fmt: skip
    for name, arguments in refused.items():
        try:
            deepspeed_knap.initialize(args if name == "twice" else None, *fresh(), **arguments)
        except ValueError as error:
            outcome[name] = str(error)
    model, sgd = fresh()  # last: DeepSpeed keeps what tp_model_init records for the rest of the process
    deepspeed.tp_model_init(model, tp_size=1, dtype=torch.float32)
    try:
        deepspeed_knap.initialize(model=model, optimizer=sgd, config=balanced)
    except ValueError as error:
        outcome["tp_model_init"] = str(error)
    return outcome


def test_initialize_takes_deepspeeds_arguments_and_refuses_an_mpu_with_balancing_on(tmp_path):
    import json

    (tmp_path / "ds.json").write_text(json.dumps({**ds_config(0, {"enabled": False}), "gradient_clipping": 0.5}))
    (outcome,) = run_distributed(_arguments_worker, 1, args=(str(tmp_path / "ds.json"),), timeout=120)
    assert outcome.pop("mpu").startswith("deepspeed_knap.initialize got an mpu or mesh_param with balancing on")
    assert outcome.pop("mesh").startswith("deepspeed_knap.initialize got a config with sequence_parallel_size and "
                                          "data_parallel_size (DeepSpeed's mesh) with balancing on")  # fmt: skip
    assert outcome.pop("tp_model_init").startswith("deepspeed_knap.initialize got AutoTP recorded by "
                                                   "deepspeed.tp_model_init with balancing on")  # fmt: skip
    assert (
        outcome.pop("twice")
        == "the DeepSpeed config is given twice, as args.deepscale_config and as config=; give it once"
    )
    assert outcome == {"positional": (True, 0.5), "config_params": 0.5, "deepscale_config": 0.5}


def test_a_deepspeed_config_differing_between_ranks_is_one_error_naming_the_setting_and_ranks():
    """Before, ranks given other ZeRO stages went into DeepSpeed's start-up and the job hung, or ended
    in an opaque gloo store error: the harness's timeout reports it."""
    results = run_distributed(_differing_config_worker, 2, timeout=60)
    assert results[0] == results[1]  # word for word on every rank
    head = "the ranks were given different DeepSpeed configs, so their engines would run different collectives and "
    fix = ". Give every rank the same config (the same file on every node)"
    assert results[0] == {
        "stage": f"{head}the job would hang: zero_optimization.stage: 3 on rank 0, 2 on rank 1{fix}",
        "batch": f"{head}the job would hang: train_micro_batch_size_per_gpu: 1 on rank 0, 2 on rank 1{fix}",
    }


def _startup_worker(rank: int, world: int) -> list:
    """Start-ups of a tiny FLUX.1 under ZeRO-3 with the start-up calibration: rank 1's timer 10x
    slower, then rank 0's failing; then with ``"auto"`` (as on a GPU), rank 0's failing and rank 1's
    recording the lengths it times under ``max_tokens_per_gpu`` 100; then, called directly, times
    that do not grow with the length, with ``required`` and without. Each gives this rank's cost
    model, or the error it raised, and the third the lengths rank 1 timed."""
    import dataclasses

    import deepspeed_knap
    import deepspeed_knap.models.timing as timing
    from deepspeed_knap.models.registry import spec
    from deepspeed_knap.runtime.calibration import calibrate_at_start
    from deepspeed_knap.runtime.config import KnapCostModelConfig

    original = timing.model_step_timer
    timed = []

    def slow_timer(*args, **kwargs):
        step = original(*args, **kwargs)
        return lambda seq_len: 10 * step(seq_len)

    def failing_timer(*args, **kwargs):
        raise RuntimeError("out of memory (made up)")

    def recording_timer(*args, **kwargs):
        step = original(*args, **kwargs)
        return lambda seq_len: timed.append(seq_len) or step(seq_len)

    on_gpu = KnapCostModelConfig.calibrates_at_start  # "auto" turns it on on GPUs only
    KnapCostModelConfig.calibrates_at_start = lambda self, gpu, family, cap=None: on_gpu(self, True, family, cap)
    family = spec("flux")
    results = []
    for patched, enabled, cap in (({1: slow_timer}, True, None), ({0: failing_timer}, True, None),
                                  ({0: failing_timer, 1: recording_timer}, "auto", 100)):  # fmt: skip
        timing.model_step_timer = patched.get(rank, original)
        torch.manual_seed(0)
        model = family.model_class(**family.tiny_config)
        calibration = {"enabled": enabled, "repeats": 1}
        if cap is None:
            calibration["seq_lens"] = [16, 32, 64, 128]
        config = ds_config(3, {"enabled": True, "topology": "auto", "solver": "refine", "max_tokens_per_gpu": cap,
                               "cost_model": {"model": "flux-tiny", "startup_calibration": calibration}})  # fmt: skip
        try:
            _, _, _, _, balancer = deepspeed_knap.initialize(
                model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config
            )
            results.append(dataclasses.asdict(balancer.cost_model))
        except ValueError as error:
            results.append(str(error))
    results.append(sorted(set(timed)))
    timing.model_step_timer = lambda *args, **kwargs: lambda seq_len: 1.0  # no growth: the fit refuses
    prior = balancer.cost_model
    for required in (True, False):
        try:
            results.append(calibrate_at_start(model, prior, [16, 32, 64], 1, balancer.groups,
                                              required=required))  # fmt: skip
        except ValueError as error:
            results.append(str(error))
    return results


def test_the_startup_calibration_is_one_model_on_every_rank_and_calls_a_slow_rank():
    import dataclasses

    from deepspeed_knap.models.registry import default_cost_model

    results = run_distributed(_startup_worker, 2, timeout=120)
    calibrated = [result[0] for result in results]
    assert calibrated[0] == calibrated[1]  # fitted from the gathered times alike on every rank
    prior = default_cost_model("flux-tiny")
    assert calibrated[0]["linear_coef"] != prior.linear_coef or calibrated[0]["quadratic_coef"] != prior.quadratic_coef
    speeds = calibrated[0]["gpu_speed"]
    assert speeds[0] == 1.0 and speeds[1] == 0.25  # rank 1 timed 10x slower: at the bound, 1/4
    failed = [result[1] for result in results]
    assert failed[0] == failed[1] and "startup_calibration" in failed[0]
    assert "rank(s) [0]: RuntimeError: out of memory (made up)" in failed[0]
    # "auto" is not asked for by name: a failed timing leaves every rank with the prior, and a memory
    # cap keeps the default lengths to what a GPU holds.
    assert results[0][2] == results[1][2] == dataclasses.asdict(prior)
    assert results[1][3] == [25, 50, 100]
    required, auto = [result[4] for result in results], [result[5] for result in results]  # times that do not grow
    assert required[0] == required[1] and "startup_calibration" in required[0] and "do not grow" in required[0]
    assert auto == [None, None]


def _exchange_price_worker(rank: int, world: int) -> list[tuple]:
    """A tiny FLUX.1 on one bag of 2 (every sequence split over both ranks) on a simulated slow link
    (every all-to-all also sleeps for its bytes at LINK_BYTES_PER_S, so the link, not the noise of 2
    CPU ranks, sets the exchanges' time), started with the start-up calibration, then 6 steps of one
    1,024-token sequence per rank (512 tokens of each per member, what the calibration's longest
    length gives a member); without gradient checkpointing and with it (whose recompute exchanges
    again). Returns, for each, the calibrated ``alltoall_coef`` and the Ulysses seconds of each step;
    then the ``alltoall_coef`` of a start-up with ``0`` given, and the all-to-alls that start-up ran."""
    import time
    from unittest import mock

    import deepspeed.comm as dist

    import deepspeed_knap
    from deepspeed_knap.data.mixes import SampleShape
    from deepspeed_knap.models.flux.data import synthetic_samples
    from deepspeed_knap.models.registry import spec

    real, exchanges = dist.all_to_all_single, [0]

    def slow_link(output, *args, **kwargs):
        exchanges[0] += 1
        result = real(output, *args, **kwargs)
        time.sleep(output.numel() * output.element_size() / LINK_BYTES_PER_S)
        return result

    family, results = spec("flux"), []
    calibration = {"enabled": True, "seq_lens": [128, 512, 1024], "repeats": 3}
    config = ds_config(1, {"enabled": True, "topology": "g2n1", "solver": "knapformer", "attention_backend": "sdpa",
                           "cost_model": {"model": "flux-tiny", "startup_calibration": calibration}})  # fmt: skip
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = family.model_class(**family.tiny_config, gradient_checkpointing=checkpointing)
        with mock.patch.object(dist, "all_to_all_single", slow_link):
            engine, _, _, _, balancer = deepspeed_knap.initialize(
                model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01), config=config
            )
            calibrated = balancer.cost_model
            hooks, ulysses = family.hooks(), []
            for step in range(6):
                latents = synthetic_samples([SampleShape(text=16, visual=1008, frames=1)], model.config,
                                            10 * step + rank, 1.0, torch.float32)  # fmt: skip
                objective = hooks.objective(latents, torch.Generator().manual_seed(step), model.config, 1.0)
                inputs, _ = hooks.pack(engine.module, objective.samples, balanced=True)
                assert inputs.seq_lens == (1024,)
                engine.backward(engine(inputs, balancer).square().mean())
                engine.step()
                ulysses.append(balancer.close_step()["ulysses"])
        results.append((calibrated.alltoall_coef, ulysses))
    # A price the user gave is theirs (0 turns the term off): not timed over, not scaled.
    given = {"linear_coef": 1e-6, "quadratic_coef": 1e-9, "alltoall_coef": 0.0, "startup_calibration": calibration}
    exchanges[0] = 0
    with mock.patch.object(dist, "all_to_all_single", slow_link):
        _, _, _, _, balancer = deepspeed_knap.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
            config={**config, "knapformer": {**config["knapformer"], "cost_model": given}},
        )  # fmt: skip
    results.append((balancer.cost_model.alltoall_coef, exchanges[0]))
    return results


# The simulated link of _exchange_price_worker: a step's Ulysses exchanges (16 all-to-alls, 8.4 MB a
# rank; 24 with checkpointing) then take ~0.27 s, against 5-25 ms (latency-bound, and as noisy) of
# the 2 CPU ranks' own.
LINK_BYTES_PER_S = 32e6


def test_the_startup_calibration_times_the_ulysses_exchanges_a_step_runs():
    import statistics

    results = run_distributed(_exchange_price_worker, 2, timeout=120)
    for checkpointing in (0, 1):
        (price, _), (price_1, _) = (results[0][checkpointing], results[1][checkpointing])
        assert price == price_1 > 0  # timed, the same on every rank
        # The link's part alone: per attention call, each rank receives 3 x 1,024 x 2 x 16 (q, k, v of
        # its 2 heads) and 512 x 4 x 16 (the output) floats, forward and backward, over the
        # calibration's s (G - 1) / G**2 = 256, for 4 calls (6 with checkpointing: 4 and 4 halves).
        link = 2 * (3 * 1024 * 2 * 16 + 512 * 4 * 16) * 4 / LINK_BYTES_PER_S * (4 + 2 * checkpointing) / 256
        assert link < price < 1.5 * link  # timed over the link (gloo's own exchanges on top)
        # Each rank holds 2 x 512 of the 2,048 tokens and sends half of them away: s (G - 1) / G**2 = 512.
        predicted = price * 2048 * (2 - 1) / 2**2
        # Step 0 connects the group.
        measured = min(statistics.median(rank[checkpointing][1][1:]) for rank in results)
        assert 0.8 < predicted / measured < 1.25, (checkpointing, predicted, measured)
    assert results[0][2] == results[1][2] == (0.0, 0)
