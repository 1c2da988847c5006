"""Fine-tune FLUX with DeepSpeed (ZeRO-3) and KnapFormer balancing on mixed image + video latents.

    deepspeed --num_gpus 4 examples/train_flux.py --deepspeed_config ds_configs/flux_cpu_demo.json --tiny
    deepspeed --hostfile hosts examples/train_flux.py --deepspeed_config ds_configs/flux_zero3_knap.json \\
        --model-path /models/FLUX.1-dev --data-dir /data/flux_latents --export-dir out/flux-finetuned \\
        --lora-rank 16 --save-dir out/ckpt --checkpoint-every 500 --validation-every 500 --validation-prompts p.txt

Each step every rank takes its samples (synthetic latents of a bundled data mix, or ``--data-dir``
files written by ``examples/prepare_flux_latents.py``), draws the rectified-flow noise level per
sample, runs the packed model (balanced when the config's ``"knapformer"`` block is enabled) and
steps on the global token-mean loss. Rank 0 shows a progress bar and prints, per step, the loss,
the step time, tokens per second and the modeled imbalance before and after balancing.

``--lora-rank`` trains LoRA adapters (peft) instead of every weight; ``--resume`` continues a run
from its newest complete checkpoint (or the one given) with the same losses it would have had; ``--validation-every`` renders
images with diffusers' ``FluxPipeline`` from the current weights.

Each checkpoint tag gets a ``manifest.json`` (every file's size and sha256, hashed by the rank that
wrote it) after all its files, and ``latest`` names the tag only then; ``--resume`` has every rank
check the files it sees against the manifest and the ranks agree before DeepSpeed reads anything, so
a missing, truncated or changed file, or a tag whose save did not finish, is one error on every rank
naming the tag and the file (see ``deepspeed_knap/runtime/manifest.py``). ``--data-dir`` files are
checked against the manifest ``prepare_flux_latents.py`` writes, each when a rank reads it.
"""

import argparse
import os
import sys
import time
import warnings
from pathlib import Path
from typing import NoReturn

# transformers (under peft and the validation pipeline) notes optional packages it does not need
# here; it reads this when first imported.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import deepspeed
import deepspeed.comm as dist
import torch
from tqdm import tqdm

import deepspeed_knap
from deepspeed_knap.commands.options import add_mix_argument
from deepspeed_knap.models.flux.base import FluxInputs
from deepspeed_knap.models.flux.data import (
    LatentDirectory,
    LatentFileError,
    SyntheticLatents,
    check_latent_directory,
    rectified_flow,
)
from deepspeed_knap.models.flux.finetune import (
    TINY_FLUX,
    adapter_state_dict,
    add_lora,
    base_state_dict,
    diffusers_transformer,
    lora_config,
    read_prompts,
    save_adapter,
    tiny_pipeline_components,
)
from deepspeed_knap.models.flux.flux2 import TINY_FLUX2
from deepspeed_knap.models.registry import family_class, from_pretrained
from deepspeed_knap.runtime.config import load_ds_config
from deepspeed_knap.runtime.manifest import (
    ManifestError,
    find_checkpoint,
    prepare_checkpoint_save,
    write_checkpoint_manifest,
)
from deepspeed_knap.runtime.shm_buffers import unlink_own_shm_buffer

# ZeRO-3 calls two torch.distributed functions that torch deprecated, on every rank, every step.
warnings.filterwarnings("ignore", r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")


parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
model_source = parser.add_mutually_exclusive_group(required=True)
model_source.add_argument("--model-path", help="diffusers FLUX checkpoint: a pipeline or transformer directory")
model_source.add_argument("--tiny", action="store_true", help="a small random FLUX for CPU runs")
parser.add_argument("--family", default="flux", choices=["flux", "flux2"],
                    help="with --tiny: FLUX.1 or FLUX.2 (a checkpoint's family comes from its config.json)")  # fmt: skip
parser.add_argument("--data-dir", help="latent samples (.safetensors); default: synthetic latents of --mix")
parser.add_argument("--samples-per-rank", type=int, default=1, help="with --data-dir: files per rank per step")
parser.add_argument("--repeat-data", action="store_true", help="with --data-dir: allow fewer files than one step needs")
add_mix_argument(parser, "kf_image_video")  # synthetic data
parser.add_argument("--token-scale", type=float, default=1.0, help="synthetic data: shrink sample sizes (CPU: 1/64)")
parser.add_argument("--steps", type=int, default=10, help="train until this many steps are done (resumed ones count)")
parser.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (unless the config has an optimizer)")
parser.add_argument("--guidance", type=float, default=1.0, help="guidance scale fed to guidance-distilled models")
parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute each block in backward")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank instead of every weight")
parser.add_argument("--lora-alpha", type=float, default=None, help="LoRA scale is alpha / rank (default alpha = rank)")
parser.add_argument("--lora-targets", default=None, help="comma-separated layer names as diffusers names them "
                    "(default: the family's lora_targets; FLUX.1: every attention projection and the double blocks' "
                    "feed-forwards; FLUX.2: those and the single blocks' fused input and output)")  # fmt: skip
parser.add_argument(
    "--save-dir", help="save DeepSpeed checkpoints here (tag stepN), at the end and every --checkpoint-every"
)
parser.add_argument("--checkpoint-every", type=int, default=0, help="with --save-dir: also every this many steps")
parser.add_argument(
    "--resume", metavar="DIR", help="continue from a --save-dir (its newest complete checkpoint) or one stepN in it"
)
parser.add_argument("--export-dir", help="write the trained weights (or the LoRA adapter) here in diffusers format")
parser.add_argument("--validation-every", type=int, default=0, help="render validation images every this many steps")
parser.add_argument("--validation-prompts", metavar="FILE", help="validation prompts, one per line")
parser.add_argument("--validation-dir", default="validation_images", help="where validation PNGs are written")
parser.add_argument("--validation-resolution", type=int, default=None, help="image side in pixels (1024; --tiny: 32)")
parser.add_argument("--validation-inference-steps", type=int, default=None, help="denoising steps (28; --tiny: 2)")
parser.add_argument("--validation-guidance", type=float, default=3.5, help="guidance scale of validation images")
parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
if args.validation_every and not args.validation_prompts:
    parser.error("--validation-every needs --validation-prompts FILE")

torch.manual_seed(args.seed)  # the same initial weights (and LoRA A matrices) on every rank
options = dict(gradient_checkpointing=args.gradient_checkpointing)
if args.model_path:  # the family from config.json; under ZeRO-3 each rank reads only the partitions it keeps
    model = from_pretrained(args.model_path, ds_config=args.deepspeed_config, **options)
else:
    model = family_class(args.family)(**{"flux": TINY_FLUX, "flux2": TINY_FLUX2}[args.family], **options)
if args.lora_rank:
    add_lora(model, args.lora_rank, args.lora_alpha, args.lora_targets.split(",") if args.lora_targets else None)
trainable = [p for p in model.parameters() if p.requires_grad]
if "optimizer" in load_ds_config(args.deepspeed_config):  # DeepSpeed's own (fused on GPU)
    engine, _, _, _, balancer = deepspeed_knap.initialize(args=args, model=model, model_parameters=trainable)
else:
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    engine, _, _, _, balancer = deepspeed_knap.initialize(args=args, model=model, optimizer=optimizer)
rank, world = dist.get_rank(), dist.get_world_size()
dist.barrier()  # every rank has mapped every rank's CPU all-reduce buffer: the files can go
unlink_own_shm_buffer(rank)
flux = engine.module
dtype = next(flux.parameters()).dtype  # bf16 under a "bf16" config: inputs must match
guidance = args.guidance if flux.config["guidance_embeds"] else None


def fail(error: Exception | str) -> NoReturn:
    """Exit with ``error``, which every rank raises alike (each prints it, naming itself)."""
    raise SystemExit(f"train_flux: error (rank {rank}): {error}")


def raise_together(problem: str | None) -> None:
    """Raise the same error on every rank when any rank found a problem (files, paths, data): a rank
    raising alone would leave the others waiting in their next collective."""
    try:
        deepspeed_knap.raise_together(problem, "train_flux")
    except ValueError as error:
        fail(error)


# ---- data: every rank checks its share of the files' headers and sizes; all ranks agree before training ----
if args.data_dir:
    data = LatentDirectory(args.data_dir, args.samples_per_rank, repeat=args.repeat_data)
    try:
        check_latent_directory(data, flux.config)
    except ValueError as error:
        fail(error)
    if rank == 0 and data.manifest is None:
        print(f"note: {args.data_dir} has no manifest.json: the ranks compared a sampled digest of each file; "
              "prepare_flux_latents.py writes one (or python -m deepspeed_knap.runtime.manifest DIR) to have "
              "each file's sha256 checked when it is read", flush=True)  # fmt: skip
else:
    data = SyntheticLatents(args.mix, flux.config, args.token_scale, args.seed)


def step_samples(step: int, position: int) -> tuple[list[str], list[dict]]:
    """This rank's ``(sample names, latent samples)`` of a step; ``position`` is the step's first
    file (global, over all ranks) with ``--data-dir``."""
    if args.data_dir:
        return data.read(position + rank * args.samples_per_rank, args.samples_per_rank, dtype)
    samples = data.step_samples(step, rank, world, dtype)
    return [f"synthetic sample {i} of rank {rank} at step {step}" for i in range(len(samples))], samples


# ---- resume: DeepSpeed's checkpoint plus where the loop and the data were ----
start_step, position = 0, 0  # steps done; files consumed by all ranks together
if args.resume:
    try:  # every rank checks the files it sees against the tag's manifest; the ranks agree before any load
        choice = find_checkpoint(args.resume)
    except ManifestError as error:
        fail(f"--resume {args.resume}: {error}")
    if rank == 0:  # say which tag, and why newer ones were not taken
        for tag, why in choice.skipped:
            print(f"--resume: skipped checkpoint {tag}: {why}", flush=True)
        print(f"--resume: loading checkpoint {choice.tag} from {choice.load_dir}"
              + ("" if choice.given else ", the newest complete one"), flush=True)  # fmt: skip
    _, client_state = engine.load_checkpoint(choice.load_dir, choice.tag)
    raise_together(None if client_state else f"DeepSpeed found no checkpoint to load in {args.resume}")
    start_step, position = client_state["step"], client_state["data_position"]


def save_checkpoint(steps_done: int) -> None:
    tag = f"step{steps_done}"
    client_state = {"step": steps_done, "data_position": position}
    prepare_checkpoint_save(args.save_dir, tag)  # a save over an older tag must not look complete half-way
    # 'latest' is written with the manifest, after it: DeepSpeed's own would name the tag before that.
    engine.save_checkpoint(args.save_dir, tag=tag, client_state=client_state, save_latest=False)
    try:  # each rank hashes the files it wrote; the ranks write the manifest, then 'latest'
        write_checkpoint_manifest(args.save_dir, tag, client_state)
    except ManifestError as error:
        fail(error)


# ---- validation images: diffusers' FluxPipeline on rank 0 with the current weights ----
if args.validation_every:
    try:
        prompts, problem = read_prompts(args.validation_prompts), None
    except (OSError, ValueError) as error:
        prompts, problem = [], f"--validation-prompts: {error}"
    if flux.family != "flux":  # FLUX.2's pipeline (Mistral text encoder, another VAE) is not wired up yet
        problem = f"--validation-every renders with diffusers' FluxPipeline, FLUX.1 only; this model is {flux.family!r}"
    if args.model_path and not problem and not (Path(args.model_path) / "model_index.json").is_file():
        problem = f"--validation-every needs --model-path to be a FLUX pipeline directory (with model_index.json); {args.model_path} is not"
    raise_together(problem)
    resolution = args.validation_resolution or (32 if args.tiny else 1024)
    inference_steps = args.validation_inference_steps or (2 if args.tiny else 28)
    pipeline_parts = None  # VAE, text encoders, tokenizers, scheduler: loaded once, on rank 0, kept on the CPU


def current_state_dict() -> dict | None:
    """The full current weights on rank 0 (ZeRO-3: gathered layer by layer; collective), else ``None``."""
    if engine.zero_optimization_stage() == 3:
        return engine._zero3_consolidated_16bit_state_dict()
    return {name: t.detach().cpu() for name, t in flux.state_dict().items()} if rank == 0 else None


@torch.no_grad()
def render_validation_images(steps_done: int, state: dict) -> None:
    """Rank 0: one PNG per prompt through diffusers' own pipeline, with the trained LoRA adapter
    loaded the way a user would load the exported one."""
    global pipeline_parts
    # Quiet diffusers' note that the text encoders get no LoRA weights (we train none).
    import diffusers
    from diffusers import FluxPipeline

    diffusers.utils.logging.set_verbosity_error()

    if pipeline_parts is None:
        if args.tiny:
            pipeline_parts = tiny_pipeline_components(flux.config, args.seed)
        else:
            pipeline_parts = FluxPipeline.from_pretrained(
                args.model_path, transformer=None, torch_dtype=dtype
            ).components
            pipeline_parts.pop("transformer")
    out = Path(args.validation_dir)
    lora = lora_config(flux)
    transformer = diffusers_transformer(flux.config, base_state_dict(state) if lora else state)
    pipe = FluxPipeline(**pipeline_parts, transformer=transformer).to(engine.device)
    pipe.set_progress_bar_config(disable=True)  # one line per image instead
    if lora:
        adapter_dir = save_adapter(out / f"step{steps_done:06d}_adapter", adapter_state_dict(flux, state), lora).parent
        pipe.load_lora_weights(adapter_dir)
    for index, prompt in enumerate(prompts):
        image = pipe(prompt, height=resolution, width=resolution, num_inference_steps=inference_steps,
                     guidance_scale=args.validation_guidance, max_sequence_length=32 if args.tiny else 512,
                     generator=torch.Generator().manual_seed(args.seed + index)).images[0]  # fmt: skip
        path = out / f"step{steps_done:06d}_prompt{index:02d}.png"
        image.save(path)
        progress.write(f"validation image {path} after step {steps_done - 1}: {prompt!r}")
    pipe.to("cpu")  # the text encoders and VAE wait on the CPU, off the training GPU


def step_inputs(step: int, position: int) -> tuple[tuple[list[str], FluxInputs, list[torch.Tensor]] | None, str | None]:
    """This rank's ``(sample names, packed noised inputs, flow-matching targets)`` of a step, on the
    CPU (the next step's wait there while this one runs), and ``None``; or ``None`` and why a file
    could not be used (unreadable, or not what its manifest says): the ranks agree on it before
    anyone trains on that step (the step before's all-reduce carries the count)."""
    try:
        names, latents = step_samples(step, position)
    except LatentFileError as error:
        return None, str(error)
    samples, targets = rectified_flow(
        latents, torch.Generator().manual_seed((args.seed * 7919 + step) * 4099 + rank), guidance
    )
    return (names, flux.pack(samples), targets), None


# ---- training ----
progress = tqdm(range(start_step, args.steps), desc="train_flux", disable=rank != 0, file=sys.stdout,
                initial=start_step, total=args.steps)  # fmt: skip

next_inputs, unusable = step_inputs(start_step, position) if start_step < args.steps else (None, None)
raise_together(unusable)
for step in progress:
    start = time.perf_counter()
    names, inputs, targets = next_inputs
    inputs = inputs.to(engine.device)
    position += world * args.samples_per_rank  # the next step's first file
    unusable = None
    if step + 1 < args.steps:
        next_inputs, unusable = step_inputs(step + 1, position)
        if balancer is not None:  # the next step's plan is solved in a worker process while this one runs
            # Collective: a rank whose next samples are unusable still takes part (with none); this
            # step's all-reduce then stops every rank.
            balancer.prefetch([] if next_inputs is None else next_inputs[1].seq_lens, engine.device)
    prediction = engine(inputs, balancer)  # [tokens, C] for this rank's image/video tokens
    target = torch.cat(targets).to(prediction.device) if targets else torch.zeros_like(prediction)
    per_token = (prediction.float() - target.float()).square().mean(dim=-1)  # [tokens]
    nonfinite = [name for name, rows in zip(names, inputs.split(per_token), strict=True) if not rows.isfinite().all()]
    # Collectives take tensors on the engine's device: NCCL refuses CPU tensors.
    totals = torch.tensor([sum(inputs.img_lens) + sum(inputs.txt_lens), len(nonfinite), unusable is not None],
                          dtype=torch.float64, device=engine.device)  # fmt: skip
    dist.all_reduce(totals)
    if totals[1].item() + totals[2].item() > 0:  # every rank sees the counts, so every rank raises, naming the files
        found = [f"non-finite loss at step {step} in {nonfinite}"] if nonfinite else []
        found += [f"step {step + 1}'s data: {unusable}"] if unusable else []
        raise_together("; ".join(found) or None)
    loss = deepspeed_knap.token_mean_loss(per_token)
    engine.backward(loss)
    engine.step()
    mean_loss = deepspeed_knap.global_mean_loss(loss)  # also a barrier: the step is over everywhere
    seconds = time.perf_counter() - start
    if rank == 0:
        line = f"step {step} loss {mean_loss:.6f} time {seconds:.2f}s tokens/s {totals[0].item() / seconds:,.0f}"
        if balancer is not None:
            metrics = balancer.metrics()
            line += (
                f" modeled imbalance {metrics['knapformer/imbalance_before']:.3f} -> "
                f"{metrics['knapformer/imbalance_after']:.3f}"
                + (" (planned ahead)" if metrics["knapformer/planned_ahead"] else "")
            )
        progress.write(line)
    steps_done = step + 1
    if args.save_dir and (
        steps_done == args.steps or (args.checkpoint_every and steps_done % args.checkpoint_every == 0)
    ):
        save_checkpoint(steps_done)
    if args.validation_every and steps_done % args.validation_every == 0:
        state = current_state_dict()
        if rank == 0:
            render_validation_images(steps_done, state)
        dist.barrier()

if args.export_dir:
    if args.lora_rank:
        lora_parameters = [p for p in flux.parameters() if p.requires_grad]
        with deepspeed.zero.GatheredParameters(lora_parameters):  # ZeRO-3 partitions them; no-op otherwise
            if rank == 0:
                state = {name: p.detach().cpu().clone() for name, p in flux.named_parameters() if p.requires_grad}
                path = save_adapter(args.export_dir, adapter_state_dict(flux, state), lora_config(flux),
                                    flux.diffusers_pipeline)  # fmt: skip
                print(f"exported the LoRA adapter to {path}", flush=True)
    else:
        state = engine._zero3_consolidated_16bit_state_dict() if engine.zero_optimization_stage() == 3 else None
        if rank == 0:
            flux.save_pretrained(args.export_dir, state)
            print(f"exported diffusers weights to {args.export_dir}", flush=True)

# DeepSpeed 0.19's ZeRO-3 on gloo CPU ranks aborts in C++ teardown at exit in about one run in five
# (see examples/train_tiny.py); leave without it once every rank is done.
dist.barrier()
sys.stdout.flush()
os._exit(0)
