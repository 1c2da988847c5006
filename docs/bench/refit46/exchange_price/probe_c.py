"""The Ulysses price ``c`` the start-up calibration times on 2 CPU ranks against the FLOP prior's
scaled by the compute (what it was before it timed the exchanges): the tiny Wan under ``auto``,
timed at 600-4,725 tokens (the ``wan_image_video`` mix's lengths at 1/16).

    OMP_NUM_THREADS=1 .venv/bin/python docs/bench/refit46/exchange_price/probe_c.py

Prints each rank's fitted ``a``, ``b``, timed ``c`` and scaled ``c`` (the same on both ranks).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

SEQ_LENS = [600, 1200, 2400, 4725]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    import deepspeed

    from deepspeed_knap.cost.calibrate import startup_model
    from deepspeed_knap.engine import initialize
    from deepspeed_knap.models.registry import default_cost_model, spec
    from deepspeed_knap.runtime.shm_buffers import unlink_own_shm_buffer

    deepspeed.init_distributed(verbose=False)
    family = spec("wan")
    torch.manual_seed(0)
    model = family.model_class(**family.tiny_config)
    calibration = {"enabled": True, "seq_lens": SEQ_LENS, "repeats": 2}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
              "zero_allow_untested_optimizer": True,
              "knapformer": {"enabled": True, "topology": "auto", "solver": "refine",
                             "cost_model": {"model": "wan-tiny", "startup_calibration": calibration}}}  # fmt: skip
    _, _, _, _, balancer = initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                                      config=config)  # fmt: skip
    unlink_own_shm_buffer(rank)
    fitted = balancer.cost_model
    # The same compute fit without the exchanges' times: the prior's c, scaled as the compute was.
    times = [[fitted.overhead_s + fitted.linear_coef * s + fitted.quadratic_coef * s * s for s in SEQ_LENS]] * world
    scaled = startup_model(default_cost_model("wan-tiny"), SEQ_LENS, times).model.alltoall_coef
    Path(out, f"rank{rank}.json").write_text(json.dumps([fitted.linear_coef, fitted.quadratic_coef,
                                                         fitted.alltoall_coef, scaled]))  # fmt: skip


def main() -> None:
    from deepspeed_knap.runtime.shm_buffers import remove_job_buffers

    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        try:
            mp.start_processes(_worker, args=(2, port, out), nprocs=2, start_method="spawn")
        finally:
            remove_job_buffers(port)
        for rank in range(2):
            a, b, timed, scaled = json.loads(Path(out, f"rank{rank}.json").read_text())
            print(f"rank {rank}: a = {a:.3g} s/token, b = {b:.3g} s/token^2, timed c = {timed:.3g}, "
                  f"scaled c = {scaled:.3g} s per token sent: timed / scaled = {timed / scaled:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
