"""Fine-tune a diffusion transformer (FLUX.1, FLUX.2, FLUX.3, Wan 2.x) with DeepSpeed (ZeRO-3) and KnapFormer
balancing on mixed image + video latents.

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

The family comes from the checkpoint's ``config.json`` (``--family`` picks the ``--tiny`` one). Each
step every rank takes its samples (synthetic latents of a bundled data mix, or ``--data-dir`` files
written by ``examples/prepare_flux_latents.py`` for FLUX, ``examples/prepare_video_latents.py`` for
Wan: videos and images, each at its own size; for FLUX.3 files of precomputed latents, references and
text embeddings, ``deepspeed_knap.models.flux3.data``'s format), draws the flow-matching noise level per sample, runs
the packed model (balanced when the config's ``"knapformer"`` block is enabled) and steps on the
global token-mean loss. Rank 0 shows a progress bar and prints, per step, the loss, the step time,
tokens per second and the modeled imbalance before and after balancing.

``--lora-rank`` trains LoRA adapters (peft) instead of every weight; ``--resume`` continues a run
from its newest complete checkpoint (or the one given) with the same losses it would have had;
``--validation-every`` renders with diffusers' own pipeline from the current weights: images through
``FluxPipeline`` (FLUX.1), clips through ``WanPipeline`` written as GIFs (Wan). FLUX.3 trains by the
image tokens' velocity (references and text are clean conditioning); diffusers 0.42.1 has no FLUX.3
pipeline class, so it has no validation, and flow-map (step-distilled) checkpoints are refused.

Each checkpoint tag gets a ``manifest.json`` (every file's size and sha256, hashed by the rank that
wrote it) after all its files, and ``latest`` names the tag only then; ``--resume`` has every rank
check the files it sees against the manifest and the ranks agree before DeepSpeed reads anything, so
a missing, truncated or changed file, or a tag whose save did not finish, is one error on every rank
naming the tag and the file (see ``deepspeed_knap/runtime/manifest.py``). DeepSpeed's files are then
read weights-only (``deepspeed_knap/runtime/checkpoint.py``): a file holding anything but tensors,
numbers and the few classes DeepSpeed stores is refused, its pickle never run, and a checkpoint of
another model (another family, LoRA or not, another LoRA rank) is one error on every rank before
DeepSpeed reads it. ``--data-dir`` files are checked against the manifest the preparing script writes,
each when a rank reads it.
"""

import argparse
import json
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

# transformers (under peft and the validation pipeline) notes optional packages it does not need
# here; it reads this when first imported.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import deepspeed
import deepspeed.comm as dist
import numpy as np
import torch
from tqdm import tqdm

import deepspeed_knap
from deepspeed_knap.commands.options import add_mix_argument
from deepspeed_knap.models.flux import data as flux_data
from deepspeed_knap.models.flux import finetune as flux_finetune
from deepspeed_knap.models.flux.finetune import (
    TINY_FLUX,
    adapter_state_dict,
    add_lora,
    base_state_dict,
    lora_config,
    read_prompts,
    save_adapter,
)
from deepspeed_knap.models.flux.flux2 import TINY_FLUX2
from deepspeed_knap.models.flux3 import data as flux3_data
from deepspeed_knap.models.flux3.flux3 import TINY_FLUX3
from deepspeed_knap.models.latents import LatentFileError, check_latent_directory
from deepspeed_knap.models.registry import family_class, from_pretrained
from deepspeed_knap.models.wan import data as wan_data
from deepspeed_knap.models.wan import finetune as wan_finetune
from deepspeed_knap.models.wan.wan import TINY_WAN
from deepspeed_knap.runtime.checkpoint import CheckpointError, load_checkpoint
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
model_source.add_argument("--model-path", help="diffusers checkpoint (FLUX.1, FLUX.2, FLUX.3, Wan 2.x): a pipeline or "
                          "transformer directory")  # fmt: skip
model_source.add_argument("--tiny", action="store_true", help="a small random model of --family for CPU runs")
parser.add_argument("--family", default="flux", choices=["flux", "flux2", "flux3", "wan"],
                    help="with --tiny: FLUX.1, FLUX.2, FLUX.3 or Wan 2.1 (a checkpoint's family comes from its "
                    "config.json)")  # fmt: skip
parser.add_argument("--data-dir", help="latent samples (.safetensors); default: synthetic latents of --mix")
parser.add_argument("--samples-per-rank", type=int, default=1, help="with --data-dir: files per rank per step")
parser.add_argument("--repeat-data", action="store_true", help="with --data-dir: allow fewer files than one step needs")
add_mix_argument(parser, None)  # synthetic data; default: kf_image_video (FLUX), flux3_edit, wan_image_video
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
                    "feed-forwards; FLUX.2: those and the single blocks' fused input and output; FLUX.3: every block's "
                    "attention projections and feed-forward; Wan: the self- and cross-attention projections and the "
                    "feed-forward)")  # fmt: skip
parser.add_argument(
    "--save-dir", help="save DeepSpeed checkpoints here (tag stepN), at the end and every --checkpoint-every"
)
parser.add_argument("--checkpoint-every", type=int, default=0, help="with --save-dir: also every this many steps")
parser.add_argument(
    "--resume", metavar="DIR", help="continue from a --save-dir (its newest complete checkpoint) or one stepN in it"
)
parser.add_argument("--export-dir", help="write the trained weights (or the LoRA adapter) here in diffusers format")
parser.add_argument("--validation-every", type=int, default=0, help="render validation images (Wan: clips) every "
                    "this many steps (FLUX.1 and Wan)")  # fmt: skip
parser.add_argument("--validation-prompts", metavar="FILE", help="validation prompts, one per line")
parser.add_argument(
    "--validation-dir", default="validation_images", help="where validation PNGs (Wan: GIFs) are written"
)
parser.add_argument("--validation-resolution", type=int, default=None,
                    help="image (Wan: frame) height in pixels (FLUX: 1024, Wan: 480; --tiny: 32)")  # fmt: skip
parser.add_argument("--validation-width", type=int, default=None,
                    help="width in pixels (FLUX: the height, Wan: 832; --tiny: 32)")  # fmt: skip
parser.add_argument("--validation-frames", type=int, default=None, help="Wan: frames per clip, 4k+1 (81; --tiny: 5)")
parser.add_argument("--validation-inference-steps", type=int, default=None,
                    help="denoising steps (FLUX: 28, Wan: 50; --tiny: 2)")  # fmt: skip
parser.add_argument("--validation-guidance", type=float, default=None, help="guidance scale (FLUX: 3.5, Wan: 5.0)")
parser.add_argument("--validation-timeout", type=float, default=120.0, metavar="MINUTES",
                    help="how long the other ranks wait for rank 0's validation renders")  # fmt: skip
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
    model = family_class(args.family)(
        **{"flux": TINY_FLUX, "flux2": TINY_FLUX2, "flux3": TINY_FLUX3, "wan": TINY_WAN}[args.family], **options
    )
if args.lora_rank:
    add_lora(model, args.lora_rank, args.lora_alpha, args.lora_targets.split(",") if args.lora_targets else None)
trainable = [p for p in model.parameters() if p.requires_grad]
if "optimizer" in load_ds_config(args.deepspeed_config):  # DeepSpeed's own (fused on GPU)
    engine, _, _, _, balancer = deepspeed_knap.initialize(args=args, model=model, model_parameters=trainable)
else:
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    engine, _, _, _, balancer = deepspeed_knap.initialize(args=args, model=model, optimizer=optimizer)
if balancer is not None:  # the plan worker imports the planner during set-up: step 1 plans ahead too
    balancer.plan_worker().start()
rank, world = dist.get_rank(), dist.get_world_size()
dist.barrier()  # every rank has mapped every rank's CPU all-reduce buffer: the files can go
unlink_own_shm_buffer(rank)
dit = engine.module
video = dit.family == "wan"
flux3 = dit.family == "flux3"
dtype = next(dit.parameters()).dtype  # bf16 under a "bf16" config: inputs must match
guidance = args.guidance if dit.config.get("guidance_embeds") else None


def fail(error: Exception | str) -> NoReturn:
    """Exit with ``error``, which every rank raises alike (each prints it, naming itself)."""
    raise SystemExit(f"train_dit: error (rank {rank}): {error}")


def raise_together(problem: str | None) -> None:
    """Raise the same error on every rank when any rank found a problem (files, paths, data): a rank
    raising alone would leave the others waiting in their next collective."""
    try:
        deepspeed_knap.raise_together(problem, "train_dit")
    except ValueError as error:
        fail(error)


if dit.family not in ("flux", "flux2", "flux3", "wan"):  # the same config.json on every rank: the same answer
    fail(f"{args.model_path} is a {dit.family!r} checkpoint; this script trains flux, flux2, flux3 and wan")
if flux3 and dit.config["flow_map"]:
    fail(f"{args.model_path} is a FLUX.3 flow-map (step-distilled) checkpoint (flow_map=True): it predicts the jump "
         "to a target_timestep, an objective this script does not train (it trains the velocity of the base "
         "model); fine-tune the base FLUX.3 checkpoint (flow_map=False)")  # fmt: skip
if video and dit.config["image_dim"] is not None:
    fail(f"{args.model_path} is a Wan image-to-video model (image_dim={dit.config['image_dim']}); this script trains "
         "text-to-video models (Wan 2.1 T2V, Wan 2.2 TI2V-5B) from prepare_video_latents.py's samples, which hold no "
         "image context")  # fmt: skip


def two_expert_pipeline(path: str | None) -> str | None:
    """Why ``path`` cannot be trained as one model: a Wan 2.2 A14B pipeline (``transformer_2``), whose
    experts each serve one side of the pipeline's ``boundary_ratio`` of noise levels, where this script
    draws them from all of (0, 1). Read per rank: the ranks agree on the answer."""
    index = Path(path or ".") / "model_index.json"
    try:
        two = path is not None and index.is_file() and (json.loads(index.read_text()).get("transformer_2") or [None])[0]
    except (OSError, ValueError) as error:
        return f"--model-path {path}: cannot read {index} ({error})"
    return (f"{path} is a two-expert Wan 2.2 pipeline (transformer_2): each expert trains on its own side of the "
            "pipeline's boundary_ratio of noise levels, which this script does not do; train Wan 2.1 or Wan 2.2 "
            "TI2V-5B") if two else None  # fmt: skip


if video:
    raise_together(two_expert_pipeline(args.model_path))


# ---- data: every rank checks its share of the files' headers and sizes; all ranks agree before training ----
family_data = wan_data if video else flux3_data if flux3 else flux_data
if args.data_dir:
    data = family_data.latent_directory(args.data_dir, args.samples_per_rank, repeat=args.repeat_data)
    try:
        check_latent_directory(data, dit.config)
    except ValueError as error:
        fail(error)
    if rank == 0 and data.manifest is None:
        print(f"note: {args.data_dir} has no manifest.json: the ranks compared a sampled digest of each file; "
              f"{data.writer} writes one (or python -m deepspeed_knap.runtime.manifest DIR) to have "
              "each file's sha256 checked when it is read", flush=True)  # fmt: skip
elif video:
    data = wan_data.SyntheticVideoLatents(args.mix or "wan_image_video", dit.config, args.token_scale, args.seed)
elif flux3:  # text-to-image and edits with 1-3 references
    data = flux3_data.SyntheticFlux3Latents(args.mix or "flux3_edit", dit.config, args.token_scale, args.seed)
else:
    data = flux_data.SyntheticLatents(args.mix or "kf_image_video", dit.config, args.token_scale, args.seed)


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
    try:  # weights-only: no code runs from the folder; a file refused, or another model's, stops every rank
        _, client_state = load_checkpoint(engine, choice.load_dir, choice.tag)
    except CheckpointError as error:
        fail(f"--resume {args.resume}: {error}")
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


# ---- validation: diffusers' own pipeline on rank 0 with the current weights (FLUX.1: images, Wan: clips) ----
if args.validation_every:
    try:
        prompts, problem = read_prompts(args.validation_prompts), None
    except (OSError, ValueError) as error:
        prompts, problem = [], f"--validation-prompts: {error}"
    pipeline_class = "WanPipeline" if video else "FluxPipeline"
    if dit.family == "flux2":  # FLUX.2's pipeline (Mistral text encoder, another VAE) is not wired up yet
        problem = (
            "--validation-every renders with diffusers' FluxPipeline (FLUX.1) or WanPipeline; this model is FLUX.2"
        )
    if flux3:  # the same config on every rank: every rank stops here with it
        problem = ("--validation-every renders with diffusers' FluxPipeline (FLUX.1) or WanPipeline; this model is "
                   "FLUX.3, for which diffusers 0.42.1 has no pipeline class (only the modular Flux3ModularPipeline, "
                   "not wired up here): train without --validation-every and render the export yourself")  # fmt: skip
    index_file = Path(args.model_path or ".") / "model_index.json"
    if args.model_path and not problem and not index_file.is_file():
        problem = (f"--validation-every needs --model-path to be a {pipeline_class} directory (with model_index.json); "
                   f"{args.model_path} is not")  # fmt: skip
    raise_together(problem)
    if video:
        pipeline_options = dict(wan_finetune.TINY_WAN_VALIDATION if args.tiny else wan_finetune.WAN_VALIDATION)
        if args.validation_resolution:
            pipeline_options.update(height=args.validation_resolution)
        if args.validation_width:
            pipeline_options.update(width=args.validation_width)
        if args.validation_frames:
            pipeline_options.update(num_frames=args.validation_frames)
    else:
        side = args.validation_resolution or (32 if args.tiny else 1024)
        pipeline_options = dict(height=side, width=args.validation_width or side, num_inference_steps=28,
                                max_sequence_length=32 if args.tiny else 512)  # fmt: skip
    if args.validation_inference_steps or args.tiny:
        pipeline_options.update(num_inference_steps=args.validation_inference_steps or 2)
    default_guidance = 5.0 if video else 3.5
    guidance_scale = default_guidance if args.validation_guidance is None else args.validation_guidance
    pipeline_options.update(guidance_scale=guidance_scale)
    # Rank 0 renders while the others wait, longer than timeout_s allows a collective (a 14B clip of
    # 81 frames takes minutes): they wait in a barrier of their own, on the host, with its own limit.
    validation_wait = torch.distributed.new_group(backend="gloo", timeout=timedelta(minutes=args.validation_timeout))
    pipeline_parts = None  # VAE, text encoders, tokenizers, scheduler: loaded once, on rank 0, kept on the CPU


def current_state_dict() -> dict | None:
    """The full current weights on rank 0 (ZeRO-3: gathered layer by layer; collective), else ``None``."""
    if engine.zero_optimization_stage() == 3:
        return engine._zero3_consolidated_16bit_state_dict()
    return {name: t.detach().cpu() for name, t in dit.state_dict().items()} if rank == 0 else None


@torch.no_grad()
def render_validation(steps_done: int, state: dict) -> None:
    """Rank 0: one PNG (Wan: one GIF clip) per prompt through diffusers' own pipeline, with the
    trained LoRA adapter loaded the way a user would load the exported one."""
    global pipeline_parts
    # Quiet diffusers' note that the text encoders get no LoRA weights (we train none).
    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    pipeline_type = getattr(diffusers, pipeline_class)
    if pipeline_parts is None:
        if args.tiny and video:
            pipeline_parts = wan_data.tiny_wan_pipeline(
                dit.config["text_dim"], dit.config["in_channels"], args.seed
            ).components
        elif args.tiny:
            pipeline_parts = flux_finetune.tiny_pipeline_components(dit.config, args.seed)
        else:
            pipeline_parts = pipeline_type.from_pretrained(
                args.model_path, transformer=None, torch_dtype=dtype
            ).components
        pipeline_parts.pop("transformer", None)
    out = Path(args.validation_dir)
    out.mkdir(parents=True, exist_ok=True)
    lora = lora_config(dit)
    finetune = wan_finetune if video else flux_finetune
    transformer = finetune.diffusers_transformer(dit.config, base_state_dict(state) if lora else state)
    pipe = pipeline_type(**pipeline_parts, transformer=transformer).to(engine.device)
    pipe.set_progress_bar_config(disable=True)  # one line per image instead
    if lora:
        adapter = adapter_state_dict(dit, state)
        pipe.load_lora_weights(
            save_adapter(out / f"step{steps_done:06d}_adapter", adapter, lora, pipeline_class).parent
        )
    for index, prompt in enumerate(prompts):
        generator = torch.Generator().manual_seed(args.seed + index)
        if video:
            clip = pipe(prompt, generator=generator, output_type="np", **pipeline_options).frames[0]
            path = wan_finetune.write_gif(clip, out / f"step{steps_done:06d}_prompt{index:02d}.gif")
        else:
            path = out / f"step{steps_done:06d}_prompt{index:02d}.png"
            pipe(prompt, generator=generator, **pipeline_options).images[0].save(path)
        progress.write(f"validation {'clip' if video else 'image'} {path} after step {steps_done - 1}: {prompt!r}")
    pipe.to("cpu")  # the text encoders and VAE wait on the CPU, off the training GPU


def step_inputs(step: int, position: int) -> tuple[tuple[list[str], Any, list[torch.Tensor]] | None, str | None]:
    """This rank's ``(sample names, packed noised inputs, flow-matching targets)`` of a step, on the
    CPU (the next step's wait there while this one runs), and ``None``; or ``None`` and why a file
    could not be used (unreadable, or not what its manifest says): the ranks agree on it before
    anyone trains on that step (the step before's all-reduce carries the count). FLUX.3 samples the
    model cannot pack (a file changed after the start-up check) are that too, unbalanced; balanced,
    the packed inputs carry the problem and the step's first collective raises it on every rank."""
    try:
        names, latents = step_samples(step, position)
    except LatentFileError as error:
        return None, str(error)
    generator = torch.Generator().manual_seed((args.seed * 7919 + step) * 4099 + rank)
    if video:
        samples, targets = wan_finetune.flow_matching(latents, generator, dit.config["patch_size"])
    elif flux3:  # image tokens only: references and text are clean conditioning
        samples, targets = flux3_data.rectified_flow(latents, generator)
        if balancer is None:
            problem = dit.check_samples(samples)
            return (None, f"{problem} (files {names})") if problem else ((names, dit.pack(samples), targets), None)
        return (names, dit.pack(samples, on_problem="carry"), targets), None
    else:
        samples, targets = flux_data.rectified_flow(latents, generator, guidance)
    return (names, dit.pack(samples), targets), None


# ---- training ----
progress = tqdm(range(start_step, args.steps), desc="train_dit", disable=rank != 0, file=sys.stdout,
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
            if next_inputs is None:
                next_lens, next_segments = [], np.zeros((0, 3), dtype=np.int64) if flux3 else None
            else:
                next_lens, next_segments = next_inputs[1].seq_lens, next_inputs[1].segments if flux3 else None
            balancer.prefetch(next_lens, engine.device, next_segments=next_segments)  # FLUX.3: [N, 3] by mode
    try:  # [tokens, C] for this rank's image/video tokens (Wan: [tokens, P * C]; FLUX.3: image tokens only)
        prediction = engine(inputs, balancer)
    except ValueError as error:
        if not (flux3 and balancer is not None):
            raise
        fail(error)  # a sample a rank could not pack, raised on every rank by the step's first collective
    target = torch.cat(targets).to(prediction.device) if targets else torch.zeros_like(prediction)
    per_token = (prediction.float() - target.float()).square().mean(dim=-1)  # [tokens]
    per_sample = per_token.split([len(rows) for rows in targets]) if targets else ()
    nonfinite = [name for name, rows in zip(names, per_sample, strict=True) if not rows.isfinite().all()]
    # Collectives take tensors on the engine's device: NCCL refuses CPU tensors.
    totals = torch.tensor([sum(inputs.seq_lens), len(nonfinite), unusable is not None],
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
        state, problem = current_state_dict(), None
        if rank == 0:
            try:
                render_validation(steps_done, state)
            except Exception as error:  # the others wait in the barrier: tell them, rather than leave them there
                problem = f"validation after step {step} failed on rank 0: {type(error).__name__}: {error}"
        torch.distributed.barrier(group=validation_wait)
        raise_together(problem)

if args.export_dir:
    if args.lora_rank:
        lora_parameters = [p for p in dit.parameters() if p.requires_grad]
        with deepspeed.zero.GatheredParameters(lora_parameters):  # ZeRO-3 partitions them; no-op otherwise
            if rank == 0:
                state = {name: p.detach().cpu().clone() for name, p in dit.named_parameters() if p.requires_grad}
                path = save_adapter(args.export_dir, adapter_state_dict(dit, state), lora_config(dit),
                                    dit.diffusers_pipeline)  # fmt: skip
                print(f"exported the LoRA adapter to {path}", flush=True)
    else:
        state = engine._zero3_consolidated_16bit_state_dict() if engine.zero_optimization_stage() == 3 else None
        if rank == 0:
            dit.save_pretrained(args.export_dir, state)
            print(f"exported diffusers weights to {args.export_dir}", flush=True)

# DeepSpeed 0.19's ZeRO-3 on gloo CPU ranks aborts in C++ teardown at exit in about one run in five
# (see examples/train_tiny.py); leave without it once every rank is done.
dist.barrier()
sys.stdout.flush()
os._exit(0)
