"""One training step of a plan that mixes a sequence split over two ranks with sequences each rank
runs alone, timed by phase on 2 CPU ranks: the tiny Wan's step 8 of ``bench train --family wan
--token-scale 0.0625`` (a 4,725-token clip, two of 2,079 and two of 99 tokens), which ``auto`` plans
so (the clip split, each rank one 2,079 and one 99 alone) and ``knapformer`` on g2n1 splits whole.
The cost model prices the two plans the same.

    OMP_NUM_THREADS=1 .venv/bin/python docs/bench/refit46/mixed_plan_step.py auto
    OMP_NUM_THREADS=1 .venv/bin/python docs/bench/refit46/mixed_plan_step.py knapformer

Prints, per rank and repeat (6, the first warming up), the step's wall milliseconds and the
balancer's phases, then the plan's (length, group start, group size) per sequence.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

STEP, TOKEN_SCALE, REPEATS = 8, 0.0625, 6


def _worker(rank: int, world: int, port: int, mode: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    import deepspeed

    from deepspeed_knap.engine import initialize, token_mean_loss
    from deepspeed_knap.models.registry import spec
    from deepspeed_knap.runtime.shm_buffers import unlink_own_shm_buffer

    deepspeed.init_distributed(verbose=False)
    family = spec("wan")
    hooks = family.hooks()
    torch.manual_seed(0)
    model = family.model_class(**family.tiny_config)
    topology, solver = ("auto", "refine") if mode == "auto" else ("g2n1", "knapformer")
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}, "steps_per_print": 10**6,
              "zero_allow_untested_optimizer": True,
              "knapformer": {"enabled": True, "topology": topology, "solver": solver, "log_interval": 0,
                             "cost_model": {"model": "wan-tiny"}}}  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _, balancer = initialize(model=model, optimizer=optimizer, config=config)
    unlink_own_shm_buffer(rank)
    latents = hooks.synthetic_data(family.default_mix, engine.module.config, TOKEN_SCALE, 0).step_samples(STEP, rank,
                                                                                                          world)  # fmt: skip
    records = []
    for repeat in range(REPEATS):
        objective = hooks.objective(latents, torch.Generator().manual_seed(repeat), engine.module.config, None)
        inputs, _ = hooks.pack(engine.module, objective.samples, balanced=True)
        torch.distributed.barrier()
        start = time.perf_counter()
        prediction = engine(inputs, balancer)
        loss = token_mean_loss((prediction.float() - torch.cat(objective.targets).float()).square().mean(dim=-1), None)
        engine.backward(loss)
        engine.step()
        torch.distributed.barrier()
        wall = time.perf_counter() - start
        phases = balancer.close_step() or {}
        plan = balancer._last[1]
        records.append({"wall_ms": round(wall * 1e3),
                        **{k: round(phases.get(k, 0.0) * 1e3) for k in ("compute", "ulysses", "route", "reverse_route")},
                        "plan": list(zip(plan.seq_lens.tolist(), plan.seq_group_start.tolist(),
                                         plan.seq_group_size.tolist(), strict=True))})  # fmt: skip
    Path(out, f"rank{rank}.json").write_text(json.dumps(records))


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "auto"
    from deepspeed_knap.runtime.shm_buffers import remove_job_buffers

    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        try:
            mp.start_processes(_worker, args=(2, port, mode, out), nprocs=2, start_method="spawn")
        finally:
            remove_job_buffers(port)
        for rank in range(2):
            for record in json.loads(Path(out, f"rank{rank}.json").read_text()):
                plan = record.pop("plan")
                print(mode, "rank", rank, record)
        print(mode, "plan (length, group start, group size):", plan)


if __name__ == "__main__":
    main()
