"""Fine-tune a diffusion transformer of any registered family (FLUX.1, FLUX.2, FLUX.3, Wan 2.x) with
DeepSpeed (ZeRO-3) and KnapFormer balancing on mixed image + video latents.

    deepspeed --num_gpus 4 examples/train_dit.py --deepspeed_config ds_configs/flux_cpu_demo.json --tiny
    deepspeed --num_gpus 2 examples/train_dit.py --deepspeed_config ds_configs/wan_cpu_demo.json --tiny --family wan \\
        --token-scale 0.015625
    deepspeed --num_gpus 4 examples/train_dit.py --deepspeed_config ds_configs/flux3_cpu_demo.json --tiny --family flux3 \\
        --token-scale 0.015625
    deepspeed --hostfile hosts examples/train_dit.py --deepspeed_config ds_configs/flux_zero3_knap.json \\
        --model-path /models/FLUX.1-dev --data-dir /data/flux_latents --export-dir out/flux-finetuned \\
        --lora-rank 16 --save-dir out/ckpt --checkpoint-every 500 --validation-every 500 --validation-prompts p.txt
    deepspeed --hostfile hosts examples/train_dit.py --deepspeed_config ds_configs/wan14b_zero3_knap.json \\
        --model-path /models/Wan2.1-T2V-14B-Diffusers --data-dir /data/wan_latents --lora-rank 32 \\
        --gradient-checkpointing --save-dir out/ckpt --validation-every 500 --validation-prompts p.txt

The family comes from the checkpoint's ``config.json`` (``--family`` picks the ``--tiny`` one). Data:
synthetic latents of a bundled mix, or ``--data-dir`` files written by
``examples/prepare_flux_latents.py`` (FLUX), ``examples/prepare_video_latents.py`` (Wan), or for
FLUX.3 files in ``deepspeed_knap.models.flux3.data``'s format. ``--lora-rank`` trains LoRA adapters;
``--resume`` continues from the newest complete checkpoint with the same losses; ``--validation-every``
renders through the family's diffusers pipeline. Every flag is in docs/cli.md.

The run is :class:`deepspeed_knap.training.Trainer` (the loop, checkpoints, resume, LoRA, validation);
what differs between families comes from each family's spec and training hooks. To change the loop,
subclass ``Trainer`` (``train``, ``step_inputs``, ``save_checkpoint``, ...) or call its parts from a
loop of your own.
"""

import argparse
import os
import sys

# transformers (under peft and the validation pipeline) notes optional packages it does not need
# here; it reads this when first imported.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import deepspeed
import deepspeed.comm as dist

from deepspeed_knap.training.arguments import TrainingArguments, add_training_arguments
from deepspeed_knap.training.trainer import Trainer, TrainingError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_training_arguments(parser)
    parser.add_argument("--debug", action="store_true", help="show an error's traceback, not only its message")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    try:
        arguments = TrainingArguments.from_args(args)
    except ValueError as error:  # the same flags on every rank: every rank stops here, before any collective
        parser.error(str(error))
    try:
        trainer = Trainer(arguments)
        trainer.train()
        trainer.export()
    except (TrainingError, ValueError) as error:  # raised on every rank together, the same message
        if args.debug:
            raise
        rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")
        print(f"train_dit: error (rank {rank}): {error}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(1)  # not the interpreter's teardown: see below
    # DeepSpeed 0.19's ZeRO-3 on gloo CPU ranks aborts in C++ teardown at exit in about one run in five
    # (examples/train_tiny.py); leave without it once every rank is done.
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
