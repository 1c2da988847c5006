"""What a training run is told: :class:`TrainingArguments`, and the command-line flags that fill it
(``examples/train_dit.py``'s; docs/cli.md lists them)."""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from deepspeed_knap.models.registry import SPECS, family_names
from deepspeed_knap.options import add_family_argument, add_mix_argument


@dataclass
class TrainingArguments:
    """One training run (every field has its flag; ``None``: the family's or DeepSpeed's default).

    Attributes:
        deepspeed_config: the DeepSpeed config, a JSON path or a dict, with its ``"knapformer"`` block.
        model_path: a diffusers checkpoint (a pipeline or transformer directory); its family comes
            from its ``config.json``. ``None``: a tiny random model of ``family`` (CPU runs).
        family: the tiny model's family (a registered name).
        data_dir: prepared latent samples (``.safetensors``); ``None``: synthetic latents of ``mix``.
        samples_per_rank: with ``data_dir``, files per rank per step.
        repeat_data: with ``data_dir``, allow fewer files than one step needs.
        shuffle_data: with ``data_dir``, read each epoch's files in a new order drawn from ``seed``
            (the same on every rank); ``False``: in name order every epoch.
        mix: the synthetic data's bundled mix; ``None``: the family's ``default_mix``.
        token_scale: synthetic data: shrink sample sizes (CPU: 1/64).
        steps: train until this many steps are done (resumed ones count).
        lr: AdamW's learning rate, unless the DeepSpeed config has an optimizer.
        guidance: the guidance scale fed to guidance-distilled models (``None``: 1.0); refused for a
            model without a guidance embedding.
        expert: a two-expert model (Wan 2.2 A14B): ``"both"`` (the default for a two-expert pipeline:
            each sample's noise level picks its expert), ``"high"`` or ``"low"`` (that expert alone,
            on its side of the pipeline's ``boundary_ratio``). ``None``: the checkpoint's one model.
        high_noise_share: with both experts, the share of samples the high-noise expert trains on:
            each sample draws its expert, then its noise level on that expert's side, as one expert
            alone draws it. ``None``: one noise level drawn over both sides (logit-normal: about 3%
            of samples above Wan 2.2 T2V-A14B's boundary 0.875).
        first_frame_share: Wan 2.2 TI2V's image-to-video training: the share of clips trained with
            their first latent frame clean (timestep 0, no loss), as ``WanImageToVideoPipeline``
            with ``expand_timesteps`` generates them. ``None``: 0.5 for a pipeline with
            ``expand_timesteps``, else 0.
        gradient_checkpointing: recompute each block in backward.
        seed: the same initial weights (and LoRA A matrices) on every rank; the data's draws and order.
        lora_rank: train LoRA adapters of this rank instead of every weight (0: full fine-tuning).
        lora_alpha: LoRA scale is alpha / rank (``None``: alpha = rank).
        lora_targets: layer names as diffusers names them (``None``: the family's ``lora_targets``).
        save_dir: DeepSpeed checkpoints (tag ``stepN``) at the end and every ``checkpoint_every``.
        checkpoint_every: with ``save_dir``, also every this many steps (0: at the end only).
        resume: continue from a ``save_dir`` (its newest complete checkpoint) or one ``stepN`` in it.
        export_dir: the trained weights (or the LoRA adapter) in diffusers' format, at the end.
        validation_every: render validation samples every this many steps (0: never).
        validation_prompts: a text file of prompts, one per line.
        validation_dir: where the renders go.
        validation_resolution, validation_width, validation_frames, validation_inference_steps,
        validation_guidance: the renders' sizes, steps and guidance (``None``: the family's).
        validation_timeout: minutes the other ranks wait for rank 0's renders.
    """

    deepspeed_config: Any
    model_path: str | None = None
    family: str = "flux"
    data_dir: str | None = None
    samples_per_rank: int = 1
    repeat_data: bool = False
    shuffle_data: bool = True
    mix: str | None = None
    token_scale: float = 1.0
    steps: int = 10
    lr: float = 1e-5
    guidance: float | None = None
    expert: str | None = None
    high_noise_share: float | None = None
    first_frame_share: float | None = None
    gradient_checkpointing: bool = False
    seed: int = 0
    lora_rank: int = 0
    lora_alpha: float | None = None
    lora_targets: list[str] | None = None
    save_dir: str | None = None
    checkpoint_every: int = 0
    resume: str | None = None
    export_dir: str | None = None
    validation_every: int = 0
    validation_prompts: str | None = None
    validation_dir: str = "validation_images"
    validation_resolution: int | None = None
    validation_width: int | None = None
    validation_frames: int | None = None
    validation_inference_steps: int | None = None
    validation_guidance: float | None = None
    validation_timeout: float = 120.0

    def __post_init__(self) -> None:
        if self.family not in SPECS:
            raise ValueError(f"family {self.family!r}: choose one of {', '.join(SPECS)}")
        if self.expert not in (None, "high", "low", "both"):
            raise ValueError(f"expert {self.expert!r}: choose high, low or both")
        if self.high_noise_share is not None and not 0 <= self.high_noise_share <= 1:
            raise ValueError(f"high_noise_share {self.high_noise_share} must lie in [0, 1]")
        if self.first_frame_share is not None and not 0 <= self.first_frame_share <= 1:
            raise ValueError(f"first_frame_share {self.first_frame_share} must lie in [0, 1]")
        if self.seed < 0:
            raise ValueError(f"seed {self.seed}: give a seed of 0 or more (it draws the weights, the noise and the data "
                             "order)")  # fmt: skip
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank {self.lora_rank}: give a LoRA rank of at least 1, or 0 to train every weight")
        if not self.lora_rank and (self.lora_alpha is not None or self.lora_targets):
            raise ValueError("lora_alpha and lora_targets set LoRA up, which lora_rank 0 leaves off (every weight "
                             "trains): give lora_rank too, or drop them")  # fmt: skip
        if self.lora_alpha is not None and not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise ValueError(f"lora_alpha {self.lora_alpha}: the LoRA scale is alpha / rank, so alpha must be a positive "
                             "number (0 scales the adapters to nothing); leave it unset for alpha = rank")  # fmt: skip
        if self.validation_every and not self.validation_prompts:
            raise ValueError("validation_every needs validation_prompts (a file of prompts, one per line)")

    @property
    def tiny(self) -> bool:
        """A tiny random model, not a checkpoint."""
        return self.model_path is None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainingArguments:
        """The arguments of a namespace parsed by :func:`add_training_arguments` (and DeepSpeed's
        ``--deepspeed_config``)."""
        names = {field.name for field in dataclasses.fields(cls)}
        values = {name: value for name, value in vars(args).items() if name in names}
        if values.get("lora_targets"):
            values["lora_targets"] = values["lora_targets"].split(",")
        return cls(**values)


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The training flags (one per :class:`TrainingArguments` field but ``deepspeed_config``, which
    ``deepspeed.add_config_arguments`` adds)."""
    model_source = parser.add_mutually_exclusive_group(required=True)
    model_source.add_argument("--model-path", help="diffusers checkpoint: a pipeline or transformer directory of a "
                              f"registered family ({', '.join(spec.title for spec in SPECS.values())})")  # fmt: skip
    model_source.add_argument("--tiny", action="store_true", help="a small random model of --family for CPU runs")
    add_family_argument(parser, "with --tiny, the model's family (a checkpoint's family comes from its config.json)")
    parser.add_argument("--data-dir", help="latent samples (.safetensors); default: synthetic latents of --mix")
    parser.add_argument("--samples-per-rank", type=int, default=1, help="with --data-dir: files per rank per step")
    parser.add_argument("--repeat-data", action="store_true",
                        help="with --data-dir: allow fewer files than one step needs")  # fmt: skip
    parser.add_argument("--no-shuffle-data", dest="shuffle_data", action="store_false",
                        help="with --data-dir: read the files in name order every epoch (default: a new order each "
                        "epoch, drawn from --seed)")  # fmt: skip
    add_mix_argument(parser, None)  # default: the family's default_mix
    parser.add_argument(
        "--token-scale", type=float, default=1.0, help="synthetic data: shrink sample sizes (CPU: 1/64)"
    )
    parser.add_argument(
        "--steps", type=int, default=10, help="train until this many steps are done (resumed ones count)"
    )
    parser.add_argument(
        "--lr", type=float, default=1e-5, help="AdamW learning rate (unless the config has an optimizer)"
    )
    parser.add_argument("--guidance", type=float, default=None,
                        help="guidance scale fed to guidance-distilled models (default 1.0; others refuse it)")  # fmt: skip
    parser.add_argument("--expert", choices=["high", "low", "both"], default=None,
                        help="a two-expert model (Wan 2.2 A14B): both (default: each sample's noise level picks its "
                        "expert), or the high- or low-noise expert alone on its side of boundary_ratio")  # fmt: skip
    parser.add_argument("--high-noise-share", type=float, default=None,
                        help="with both experts: the share of samples the high-noise expert trains on, each drawn on "
                        "its side of boundary_ratio; default: one logit-normal draw over both (about 3%% high at "
                        "0.875)")  # fmt: skip
    parser.add_argument("--first-frame-share", type=float, default=None,
                        help="Wan 2.2 TI2V: the share of clips trained image-conditioned (first latent frame clean, "
                        "timestep 0, no loss); default 0.5 with expand_timesteps, else 0")  # fmt: skip
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute each block in backward")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="train LoRA adapters of this rank instead of every weight"
    )
    parser.add_argument(
        "--lora-alpha", type=float, default=None, help="LoRA scale is alpha / rank (default alpha = rank)"
    )
    parser.add_argument("--lora-targets", default=None, help="comma-separated layer names as diffusers names them "
                        "(default: the family's lora_targets, docs/models.md)")  # fmt: skip
    parser.add_argument("--save-dir", help="save DeepSpeed checkpoints here (tag stepN), at the end and every "
                        "--checkpoint-every")  # fmt: skip
    parser.add_argument("--checkpoint-every", type=int, default=0, help="with --save-dir: also every this many steps")
    parser.add_argument("--resume", metavar="DIR", help="continue from a --save-dir (its newest complete checkpoint) or "
                        "one stepN in it")  # fmt: skip
    parser.add_argument("--export-dir", help="write the trained weights (or the LoRA adapter) here in diffusers format")
    parser.add_argument("--validation-every", type=int, default=0, help="render validation images (video families: "
                        f"clips) every this many steps ({', '.join(family_names('pipeline'))})")  # fmt: skip
    parser.add_argument("--validation-prompts", metavar="FILE", help="validation prompts, one per line")
    parser.add_argument("--validation-dir", default="validation_images",
                        help="where validation PNGs (video families: GIFs) are written")  # fmt: skip
    parser.add_argument("--validation-resolution", type=int, default=None,
                        help="image (video: frame) height in pixels (FLUX: 1024, Wan: 480; --tiny: 32)")  # fmt: skip
    parser.add_argument("--validation-width", type=int, default=None,
                        help="width in pixels (FLUX: the height, Wan: 832; --tiny: 32)")  # fmt: skip
    parser.add_argument("--validation-frames", type=int, default=None,
                        help="video families: frames per clip, 4k+1 (Wan: 81; --tiny: 5)")  # fmt: skip
    parser.add_argument("--validation-inference-steps", type=int, default=None,
                        help="denoising steps (the pipeline's: FLUX.1 28, the others 50; --tiny: 2)")  # fmt: skip
    parser.add_argument("--validation-guidance", type=float, default=None, help="guidance scale (FLUX: 3.5, Wan: 5.0)")
    parser.add_argument("--validation-timeout", type=float, default=120.0, metavar="MINUTES",
                        help="how long the other ranks wait for rank 0's validation renders")  # fmt: skip
