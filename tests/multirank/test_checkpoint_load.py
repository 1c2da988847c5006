"""Resuming from DeepSpeed checkpoints on 2 gloo ranks without running code from them
(deepspeed_knap.runtime.checkpoint): a real ZeRO-3 checkpoint loads weights-only with the weights and
the client state saved; a shard replaced by a pickle whose payload would write a file is refused on
every rank naming the file, and the payload never runs; a checkpoint of another model (other names,
other shapes) is one error on every rank before DeepSpeed reads anything."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tests.support.distributed import run_distributed

DIM, HEADS, COND = 24, 6, 5
CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
          "zero_allow_untested_optimizer": True, "steps_per_print": 1000}  # fmt: skip
BF16_ZERO1 = {**CONFIG, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}
ZERO2 = {**CONFIG, "zero_optimization": {"stage": 2}}
SHARD = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"


class Payload:
    """Unpickling it creates the file ``marker`` (a stand-in for any code a crafted pickle runs)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


class Renamed(torch.nn.Module):
    """Another model: TinyDiT's parameters under other names."""

    def __init__(self) -> None:
        from deepspeed_knap.models.tiny_dit import TinyDiT

        super().__init__()
        self.inner = TinyDiT(DIM, HEADS, COND)


def _engine(model: torch.nn.Module, config: dict = CONFIG):
    import deepspeed_knap

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    engine, *_ = deepspeed_knap.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """``model`` frozen, with peft LoRA adapters of ``rank`` on its blocks' attention projections."""
    from peft import LoraConfig, inject_adapter_in_model

    model.requires_grad_(False)
    return inject_adapter_in_model(LoraConfig(r=rank, target_modules=["qkv"], init_lora_weights=False), model)


def _train_and_save(engine, rank: int, save: Path, tag: str) -> torch.Tensor:
    """One step, then a checkpoint ``tag`` with a client state of ints; returns the weights saved."""
    import deepspeed_knap
    from deepspeed_knap.models.tiny_dit import random_batch

    dtype = next(engine.module.parameters()).dtype
    batch = random_batch([7, 3 + rank], rank, DIM, COND, dtype)
    loss = deepspeed_knap.token_mean_loss(engine(batch, None).float().square().mean(dim=-1))
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(str(save), tag=tag, client_state={"step": 3, "data_position": 12})
    return _parameters(engine)


def _parameters(engine) -> torch.Tensor:
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return torch.cat([p.detach().reshape(-1).float().clone() for p in params])


def _outcome(engine, save: Path, tag: str) -> str:
    from deepspeed_knap.runtime.checkpoint import CheckpointError, load_checkpoint

    try:
        _, client_state = load_checkpoint(engine, save, tag)
    except CheckpointError as error:
        return f"error: {error}"
    return f"loaded step {client_state['step']!r}, data position {client_state['data_position']!r}"


def _worker(rank: int, world: int, root: str) -> dict:
    import deepspeed.comm as dist

    from deepspeed_knap.models.tiny_dit import TinyDiT
    from deepspeed_knap.runtime.shm_buffers import unlink_own_shm_buffer

    save, marker = Path(root) / "save", Path(root) / "payload-ran"
    torch.manual_seed(0)
    saved = _train_and_save(_engine(TinyDiT(DIM, HEADS, COND)), rank, save, "good")
    dist.barrier()
    unlink_own_shm_buffer(rank)
    if rank == 0:  # rank 1's optimizer shard replaced by a pickle that runs code
        shutil.copytree(save / "good", save / "crafted")
        torch.save({"optimizer_state_dict": Payload(str(marker))}, save / "crafted" / SHARD.format(1))
    dist.barrier()

    out = {}
    torch.manual_seed(123)  # other initial weights: the load must bring back the saved ones
    fresh = _engine(TinyDiT(DIM, HEADS, COND))
    out["good"] = _outcome(fresh, save, "good")
    out["weights_equal"] = bool(torch.equal(_parameters(fresh), saved))
    out["crafted"] = _outcome(_engine(TinyDiT(DIM, HEADS, COND)), save, "crafted")
    out["marker"] = marker.exists()
    out["other_names"] = _outcome(_engine(Renamed()), save, "good")
    out["other_shapes"] = _outcome(_engine(TinyDiT(DIM * 2, HEADS, COND)), save, "good")
    return out


def test_a_checkpoint_loads_weights_only_and_a_crafted_or_foreign_one_is_refused_on_every_rank(tmp_path):
    results = run_distributed(_worker, 2, args=(str(tmp_path),), timeout=240)
    for key in ("good", "crafted", "other_names", "other_shapes"):
        assert results[0][key] == results[1][key], key  # word for word on every rank
    first = results[0]
    assert first["good"] == "loaded step 3, data position 12"
    assert all(result["weights_equal"] for result in results)

    shard = tmp_path / "save" / "crafted" / SHARD.format(1)
    assert not any(result["marker"] for result in results)  # the payload never ran
    assert first["crafted"] == (
        f"error: checking checkpoint {tmp_path / 'save' / 'crafted'} before loading it failed:\nrank(s) [1]: "
        f"{shard} was not loaded: it holds the global io.open, which no DeepSpeed checkpoint holds (loading it "
        "would run code from the checkpoint folder); restore the file the save wrote, or load another tag"
    )
    tag = tmp_path / "save" / "good"
    assert first["other_names"] == (
        f"error: checking checkpoint {tag} before loading it failed:\nrank(s) [0, 1]: checkpoint {tag} was saved from "
        "another model: 25 of its 25 names are not this Renamed's (e.g. ['blocks.0.mlp.0.bias', 'blocks.0.mlp.0.weight', "
        "'blocks.0.mlp.2.bias']), 25 of this model's 25 are not in it (e.g. ['inner.blocks.0.mlp.0.bias', "
        "'inner.blocks.0.mlp.0.weight', 'inner.blocks.0.mlp.2.bias']); resume with the model, LoRA settings and ranks "
        "of the run that saved it, or from another checkpoint"
    )
    assert first["other_shapes"].startswith(
        f"error: checking checkpoint {tag} before loading it failed:\nrank(s) [0, 1]: checkpoint {tag} was saved from "
        "a TinyDiT of other dimensions: 'position.weight' is [24, 3] there, [48, 3] here; "
    )


def _stages_worker(rank: int, world: int, root: str) -> dict:
    """ZeRO-1 in bf16 and ZeRO-2 and 3 with LoRA adapters: each saved, loaded weights-only into a fresh
    engine; a LoRA checkpoint into a model without LoRA, one of another LoRA rank, and the other way."""
    import deepspeed.comm as dist

    from deepspeed_knap.models.tiny_dit import TinyDiT
    from deepspeed_knap.runtime.shm_buffers import unlink_own_shm_buffer

    save, out = Path(root) / "save", {}
    cases = {"zero1_bf16": (BF16_ZERO1, 0), "zero2_lora": (ZERO2, 4), "zero3_lora": (CONFIG, 4)}
    for name, (config, lora) in cases.items():
        torch.manual_seed(0)
        model = TinyDiT(DIM, HEADS, COND)
        saved = _train_and_save(_engine(_lora(model, lora) if lora else model, config), rank, save, name)
        if name == "zero1_bf16":
            dist.barrier()
            unlink_own_shm_buffer(rank)
        torch.manual_seed(123)
        model = TinyDiT(DIM, HEADS, COND)
        fresh = _engine(_lora(model, lora) if lora else model, config)
        out[name] = _outcome(fresh, save, name)
        out[f"{name} weights equal"] = bool(torch.equal(_parameters(fresh), saved))
    out["lora into no lora"] = _outcome(_engine(TinyDiT(DIM, HEADS, COND)), save, "zero3_lora")
    out["lora into lora of rank 8"] = _outcome(_engine(_lora(TinyDiT(DIM, HEADS, COND), 8)), save, "zero3_lora")
    out["no lora into lora"] = _outcome(_engine(_lora(TinyDiT(DIM, HEADS, COND), 4), BF16_ZERO1), save, "zero1_bf16")
    out["zero2 into zero3"] = _outcome(_engine(_lora(TinyDiT(DIM, HEADS, COND), 4)), save, "zero2_lora")
    return out


def test_zero_stages_bf16_and_lora_checkpoints_load_and_a_lora_mismatch_is_one_line(tmp_path):
    results = run_distributed(_stages_worker, 2, args=(str(tmp_path),), timeout=240)
    assert results[0] == results[1]
    result = results[0]
    for name in ("zero1_bf16", "zero2_lora", "zero3_lora"):
        assert result[name] == "loaded step 3, data position 12", name
        assert result[f"{name} weights equal"], name
    tag, zero1 = tmp_path / "save" / "zero3_lora", tmp_path / "save" / "zero1_bf16"
    head = f"error: checking checkpoint {tag} before loading it failed:\nrank(s) [0, 1]: checkpoint {tag} was saved"
    assert result["lora into no lora"] == (
        f"{head} with LoRA adapters (e.g. 'blocks.0.qkv.lora_A.default.weight') and this TinyDiT has none: resume "
        "with the LoRA settings of the run that saved it (train_dit.py: --lora-rank)"
    )
    assert result["lora into lora of rank 8"].startswith(
        f"{head} from a TinyDiT of other dimensions: 'blocks.0.qkv.lora_A.default.weight' is [4, 24] there, [8, 24] "
        "here; "
    )
    zero2 = tmp_path / "save" / "zero2_lora"
    assert result["zero2 into zero3"] == (
        f"error: checking checkpoint {zero2} before loading it failed:\nrank(s) [0]: {zero2}/zero_pp_rank_0_mp_rank_00_"
        "model_states.pt is not there, and this rank loads it (ZeRO stage 3); the tag holds ['mp_rank_00_model_states"
        ".pt', 'zero_pp_rank_0_mp_rank_00_optim_states.pt', 'zero_pp_rank_1_mp_rank_00_optim_states.pt']: saved under "
        "another ZeRO stage or precision, or by other ranks; resume with the model, LoRA settings and ranks of the run "
        "that saved it, or from another checkpoint"
        f"\nrank(s) [1]: {zero2}/zero_pp_rank_1_mp_rank_00_model_states.pt is not there, and this rank loads it (ZeRO "
        "stage 3); the tag holds ['mp_rank_00_model_states.pt', 'zero_pp_rank_0_mp_rank_00_optim_states.pt', "
        "'zero_pp_rank_1_mp_rank_00_optim_states.pt']: saved under another ZeRO stage or precision, or by other ranks; "
        "resume with the model, LoRA settings and ranks of the run that saved it, or from another checkpoint"
    )
    assert result["no lora into lora"] == (
        f"error: checking checkpoint {zero1} before loading it failed:\nrank(s) [0, 1]: checkpoint {zero1} was saved "
        "without LoRA adapters and this TinyDiT has them (e.g. 'blocks.0.qkv.lora_A.default.weight'): resume without "
        "LoRA, as the run that saved it (train_dit.py: no --lora-rank)"
    )
