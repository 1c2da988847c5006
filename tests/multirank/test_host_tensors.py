"""tests/support/host_tensors.py fails on gloo where NCCL would: a collective given a tensor never put on
the accelerator. (tests/multirank/test_training_flux.py trains FLUX with LoRA under it.)"""

from tests.support.distributed import run_distributed


def _collectives_under_the_tracker(rank: int, world_size: int) -> list[str]:
    import deepspeed.comm as ds_comm
    import torch
    import torch.distributed as dist

    from tests.support.host_tensors import HostTensorTracker, check_collectives

    check_collectives()
    refused = []
    with HostTensorTracker():
        on_device = torch.ones(2, device="cpu")  # named a device: on a GPU machine, the GPU
        dist.all_reduce(on_device)
        moved = (torch.arange(3.0) * 2).to(on_device.device)
        dist.all_reduce(moved)
        derived = on_device * 3  # computed from a device tensor
        dist.all_reduce(derived)
        assert on_device.tolist() == [world_size] * 2 and moved.tolist() == [0, 2 * world_size, 4 * world_size]
        for name, collective, host in (
            ("factory", dist.all_reduce, torch.tensor([1.0])),
            ("op over host tensors", dist.all_reduce, torch.cat([torch.zeros(1), torch.ones(2)]) + 1),
            (".cpu()", dist.broadcast, derived.cpu()),
            ("deepspeed.comm", ds_comm.all_reduce, torch.zeros(4).to(torch.float64)),  # a dtype is no device
        ):
            try:
                collective(host, 0) if collective is dist.broadcast else collective(host)
            except RuntimeError as error:
                assert "NCCL refuses them" in str(error)
                refused.append(name)
    return refused


def test_host_tensors_are_refused_and_device_tensors_pass():
    for refused in run_distributed(_collectives_under_the_tracker, world_size=2):
        assert refused == ["factory", "op over host tensors", ".cpu()", "deepspeed.comm"]
