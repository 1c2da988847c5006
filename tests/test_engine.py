"""DeepSpeed integration on 4 CPU ranks: ZeRO-1/2/3 training with balancing on equals balancing off."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed

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
           "workload": {"linear_coef": 1.0, "quadratic_coef": 0.05}, "log_interval": 1}  # fmt: skip


def step_lengths(step: int, rank: int) -> list[int]:
    table = [[[40, 3], [], [9, 9, 2], [1]], [[5], [33, 1], [], [17, 4]], [[2, 2, 2], [60], [7], []]]
    return table[step % len(table)][rank]


def train(rank: int, config: dict) -> tuple[list[float], torch.Tensor]:
    """Three steps of TinyDiT; returns the global mean losses and the final parameters."""
    import deepspeed
    import deepspeed.comm as dist

    import deepspeed_knap
    from deepspeed_knap.models.tiny_dit import TinyDiT, pack_tiny_samples, random_samples

    torch.manual_seed(0)
    model = TinyDiT(DIM, HEADS, COND)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    engine, _, _, _, balancer = deepspeed_knap.initialize(model=model, optimizer=optimizer, config=config)
    losses = []
    for step in range(STEPS):
        samples = random_samples(step_lengths(step, rank), 100 * step + rank, DIM, COND, torch.float32)
        batch = pack_tiny_samples(samples, DIM, COND, torch.float32)
        target = torch.randn(batch.tokens.shape, generator=torch.Generator().manual_seed(7 * step + rank))
        out = engine(batch, balancer)
        loss = deepspeed_knap.token_mean_loss((out - target).square().mean(dim=-1))
        engine.backward(loss)
        engine.step()
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        losses.append(reported.item() / dist.get_world_size())
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=config["zero_optimization"]["stage"] == 3):
        flat = torch.cat([p.detach().reshape(-1).clone() for p in params])
    return losses, flat


def _zero_worker(rank: int, world: int, stage: int) -> dict:
    off_losses, off_params = train(rank, ds_config(stage, None))
    on_losses, on_params = train(rank, ds_config(stage, KNAP_ON))
    return {"off": off_losses, "on": on_losses, "param_err": float((on_params - off_params).abs().max()),
            "param_change": float((on_params - _initial_params()).abs().max())}  # fmt: skip


def _initial_params() -> torch.Tensor:
    from deepspeed_knap.models.tiny_dit import TinyDiT

    torch.manual_seed(0)
    return torch.cat([p.detach().reshape(-1) for p in TinyDiT(DIM, HEADS, COND).parameters()])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_training_with_balancing_equals_without(stage):
    results = run_distributed(_zero_worker, 4, args=(stage,), timeout=300)
    for result in results:
        assert result["on"] == pytest.approx(result["off"], rel=1e-5, abs=1e-6)
        assert result["param_err"] <= 1e-5
        assert result["param_change"] > 1e-3  # training really moved the weights
    assert results[0]["off"] == results[1]["off"]  # a global mean: the same on every rank
