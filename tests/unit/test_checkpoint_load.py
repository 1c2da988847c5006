"""Checkpoint files read weights-only (deepspeed_knap.runtime.checkpoint), without ranks: DeepSpeed's
own checkpoint engine, which asks torch.load for weights_only=False, refuses a crafted pickle inside
weights_only_torch_load (what load_checkpoint wraps DeepSpeed's load in) and runs no payload; what
DeepSpeed stores loads; torch.load is itself again after the block."""

import torch

from deepspeed_knap.runtime.checkpoint import CheckpointError, weights_only_load, weights_only_torch_load


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_deepspeeds_checkpoint_engine_loads_weights_only_within_the_block(tmp_path):
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    crafted, marker = tmp_path / "zero_pp_rank_1_mp_rank_00_optim_states.pt", tmp_path / "payload-ran"
    torch.save({"optimizer_state_dict": _Payload(str(marker))}, crafted)
    dynamic = {"init_scale": 2.0**16, "scale_window": 1000, "min_scale": 1, "delayed_shift": 2,
               "consecutive_hysteresis": False}  # fmt: skip
    stored = {  # what DeepSpeed 0.19 stores besides tensors (fp16's dynamic loss scaler too)
        "loss_scaler": CreateLossScaler(torch.half, 1.0, True, dynamic),
        "zero_stage": ZeroStageEnum(3),
        "fragment": fragment_address(numel=4, start=8),
        "client": {"step": 3, "data_position": 12},
        "weights": torch.arange(6.0).reshape(2, 3),
    }
    torch.save(stored, tmp_path / "good.pt")
    original = torch.load
    engine = TorchCheckpointEngine()
    with weights_only_torch_load():
        try:
            engine.load(str(crafted), map_location="cpu")
            raise AssertionError("the crafted file loaded")
        except CheckpointError as error:
            assert str(error) == (
                f"{crafted} was not loaded: it holds the global io.open, which no DeepSpeed checkpoint holds "
                "(loading it would run code from the checkpoint folder); restore the file the save wrote, or load "
                "another tag"
            )
        loaded = engine.load(str(tmp_path / "good.pt"), map_location="cpu")
    assert torch.load is original
    assert not marker.exists()
    assert loaded["client"] == stored["client"] and torch.equal(loaded["weights"], stored["weights"])
    assert loaded["zero_stage"] is ZeroStageEnum.weights and loaded["fragment"] == stored["fragment"]
    assert vars(loaded["loss_scaler"]) == vars(stored["loss_scaler"])
    mapped = weights_only_load(tmp_path / "good.pt", map_location="cpu", mmap=True)
    assert torch.equal(mapped["weights"], stored["weights"])
