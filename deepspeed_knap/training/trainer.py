"""Fine-tuning a diffusion transformer of any registered family with DeepSpeed (ZeRO-3) and balancing.

    trainer = Trainer(TrainingArguments(deepspeed_config="ds_configs/flux_cpu_demo.json", family="wan"))
    losses = trainer.train()   # collective: every rank runs it
    trainer.export()

Each step every rank takes its samples (synthetic latents of a bundled mix, or files of prepared
latents), draws the flow-matching noise level per sample (the family's objective), runs the packed
model (balanced when the config's ``"knapformer"`` block is enabled) and steps on the global
token-mean loss. Rank 0 shows a progress bar and prints, per step, the loss, the step time, tokens
per second and the modeled imbalance before and after balancing.

What differs between families (data, objective, packing, validation pipeline) comes from the
family's training hooks (:class:`~deepspeed_knap.models.hooks.TrainingHooks`, named by its spec);
the loop, checkpoints, resume, LoRA, validation's schedule and the per-step agreement are here.

Checkpoints: each tag gets a ``manifest.json`` (every file's size and sha256, hashed by the rank that
wrote it) after all its files, and ``latest`` names the tag only then; resume has every rank check
the files it sees against the manifest and the ranks agree before DeepSpeed reads anything, so a
missing, truncated or changed file, or a tag whose save did not finish, is one error on every rank
naming the tag and the file (:mod:`deepspeed_knap.runtime.manifest`). DeepSpeed's files are then read
weights-only (:mod:`deepspeed_knap.runtime.checkpoint`): a file holding anything but tensors, numbers
and the few classes DeepSpeed stores is refused, its pickle never run, and a checkpoint of another
model (another family, LoRA or not, another LoRA rank) is one error on every rank before DeepSpeed
reads it, and so are another LoRA alpha and a checkpoint without the loop's step (one this trainer did
not save). Prepared data files are checked against the manifest the preparing script writes, each when
a rank reads it.

Every error the trainer raises (:class:`TrainingError`) is raised on every rank together, with the
same message.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import deepspeed
import deepspeed.comm as dist
import numpy as np
import torch
from tqdm import tqdm

from deepspeed_knap.engine import global_mean_loss, initialize, token_mean_loss
from deepspeed_knap.models.auto import checkpoint_family
from deepspeed_knap.models.hooks import Objective, ValidationSettings
from deepspeed_knap.models.latents import LatentFileError, check_latent_directory
from deepspeed_knap.models.loading import checked, plain_ds_config
from deepspeed_knap.models.lora import add_lora, lora_config
from deepspeed_knap.models.registry import spec
from deepspeed_knap.runtime.checkpoint import CheckpointError, load_checkpoint
from deepspeed_knap.runtime.config import read_ds_config
from deepspeed_knap.runtime.groups import check_same_on_every_rank, raise_together
from deepspeed_knap.runtime.manifest import (
    ManifestError,
    find_checkpoint,
    prepare_checkpoint_save,
    write_checkpoint_manifest,
)
from deepspeed_knap.runtime.shm_buffers import unlink_own_shm_buffer
from deepspeed_knap.training.arguments import TrainingArguments
from deepspeed_knap.training.validation import Validator, read_prompts

# ZeRO-3 calls two torch.distributed functions that torch deprecated, on every rank, every step.
warnings.filterwarnings("ignore", r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")


class TrainingError(ValueError):
    """A run that cannot go on: raised on every rank together, with the same message."""


def background_writer_problem(ds_config: Mapping[str, Any], save_dir: str | None) -> str | None:
    """Why the DeepSpeed config's checkpoint writer cannot save the trainer's checkpoints, or
    ``None``: one that saves in the background (DeepSpeed's decoupled writer, DataStates) has not
    written the files when the save returns, where the trainer writes each tag's manifest and
    ``latest`` (and it commits them at the next step, which the last save has not). Read from the
    config, before DeepSpeed starts the writer's process."""
    writer = (ds_config.get("checkpoint") or {}).get("writer") or {}
    decoupled = isinstance(writer, Mapping) and bool(writer.get("decoupled"))
    datastates = ds_config.get("datastates_ckpt") not in (None, False)
    if not save_dir or not (decoupled or datastates):
        return None
    key = '"checkpoint": {"writer": {"decoupled": true}}' if decoupled else '"datastates_ckpt"'
    return (f"--save-dir with a checkpoint writer that saves in the background (the DeepSpeed config's {key}): the "
            "trainer writes each tag's manifest and 'latest' when the save returns, before such a writer has written "
            "the files; remove it from the config to use DeepSpeed's default writer")  # fmt: skip


def _order_words(order: Mapping[str, int | None]) -> tuple[str, str]:
    """``(how the files are read, the flags that read them so)`` of a recorded data order."""
    seed = order.get("shuffle_seed")
    if seed is None:
        return "in name order", "--no-shuffle-data"
    return f"shuffled each epoch with seed {seed}", f"--seed {seed}, without --no-shuffle-data"


class Trainer:
    """One training run (collective: every rank builds one and calls the same methods).

    Building it loads the model (a checkpoint, partitioned under ZeRO-3, or a tiny random one), adds
    LoRA, creates the DeepSpeed engine and the balancer, checks the data on every rank, and resumes
    from a checkpoint when asked.

    Args:
        arguments: the run's :class:`~deepspeed_knap.training.arguments.TrainingArguments`.
        name: how progress and errors name the run (the script's name).

    Attributes:
        engine: DeepSpeed's engine; ``model`` its packed model; ``balancer`` the balancer or ``None``.
        start_step: the steps a resumed checkpoint had done (0 for a new run).
    """

    def __init__(self, arguments: TrainingArguments, name: str = "train_dit") -> None:
        self.arguments, self.name = arguments, name
        a = arguments
        if a.deepspeed_config is None:  # the same arguments on every rank: all raise here
            raise ValueError("--deepspeed_config is required: a DeepSpeed JSON with its \"knapformer\" block, e.g. "
                             "ds_configs/flux_cpu_demo.json")  # fmt: skip
        try:  # collective: joins the process group; a file one node cannot read is one error on every rank
            ds_config = read_ds_config(a.deepspeed_config)
        except ValueError as error:
            raise TrainingError(str(error)) from None
        a = self.arguments = dataclasses.replace(a, deepspeed_config=ds_config)  # read once: nothing reads it again
        if problem := background_writer_problem(ds_config, a.save_dir):  # one config, agreed: every rank alike
            raise TrainingError(problem)
        torch.manual_seed(a.seed)  # the same initial weights (and LoRA A matrices) on every rank
        options = dict(gradient_checkpointing=a.gradient_checkpointing)
        plain = plain_ds_config(ds_config)
        if a.model_path:  # the family from config.json, agreed on by every rank
            family = checked(plain, "reading the checkpoint's model family",
                             lambda: checkpoint_family(a.model_path), "the model family of --model-path")  # fmt: skip
        else:
            family = a.family
        self.hooks = spec(family).hooks()
        checked(plain, "checking the training arguments", lambda: self.hooks.check_arguments(a))
        # Under ZeRO-3 each rank reads only the partitions it keeps (collective: errors agreed inside).
        model = self.hooks.load_model(a, options)
        if a.lora_rank:
            add_lora(model, a.lora_rank, a.lora_alpha, a.lora_targets)
        trainable = [p for p in model.parameters() if p.requires_grad]
        if "optimizer" in ds_config:  # DeepSpeed's own (fused on GPU)
            parts = initialize(model=model, config=a.deepspeed_config, model_parameters=trainable)
        else:
            optimizer = torch.optim.AdamW(trainable, lr=a.lr, weight_decay=0.0)
            parts = initialize(model=model, config=a.deepspeed_config, optimizer=optimizer)
        self.engine, self.balancer = parts[0], parts[4]
        if self.balancer is not None:  # the plan worker imports the planner during set-up: step 1 plans ahead too
            self.balancer.plan_worker().start()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        dist.barrier()  # every rank has mapped every rank's CPU all-reduce buffer: the files can go
        unlink_own_shm_buffer(self.rank)
        self.model = self.engine.module
        # bf16 under a "bf16" config: inputs must match (the packed model's dtype, outside its fp32 modules)
        self.dtype = self.model.dtype
        embeds = bool(self.model.config.get("guidance_embeds"))
        self.guidance = (1.0 if a.guidance is None else a.guidance) if embeds else None
        # A scale the model has no embedding for would be ignored (FLUX.1 [schnell], FLUX.2 [klein],
        # FLUX.3, Wan, Qwen-Image): refused, as --expert is where it means nothing.
        self.raise_together(None if a.guidance is None or embeds else
                            f"--guidance {a.guidance}: this model has no guidance embedding (it is not guidance-"
                            "distilled), so nothing would read the scale; drop --guidance")  # fmt: skip
        self.raise_together(self.hooks.refuse(self.model, a.model_path))
        if (accumulated := self.engine.gradient_accumulation_steps()) != 1:  # one DeepSpeed config: every rank's
            # The loop steps the optimizer every step: steps, checkpoints and --resume count optimizer steps.
            raise TrainingError(
                f"gradient accumulation of {accumulated} steps (the DeepSpeed config's gradient_accumulation_steps, "
                "or its train_batch_size over train_micro_batch_size_per_gpu x ranks): the trainer steps the "
                "optimizer every step, and a checkpoint between accumulation boundaries would drop the gradients "
                "so far; set it to 1 (with --data-dir, train more samples a step with --samples-per-rank)"
            )
        self.progress: tqdm | None = None  # (before the set-up's notes, which _say writes)
        self.data = self._data()
        self.start_step, self.position = 0, 0  # steps done; files consumed by all ranks together
        if a.resume:
            self._resume()
        self.validator = self._validator() if a.validation_every else None

    # ---- errors every rank raises together ----

    def raise_together(self, problem: str | None) -> None:
        """Raise :class:`TrainingError` on every rank when any rank found a ``problem`` (files, paths,
        data): a rank raising alone would leave the others waiting in their next collective.
        Collective."""
        try:
            raise_together(problem, self.name)
        except ValueError as error:
            raise TrainingError(str(error)) from None

    # ---- set-up ----

    def _data(self) -> Any:
        """Every rank checks its share of the files' headers and sizes; all ranks agree first."""
        a = self.arguments
        if not a.data_dir:
            return self.hooks.synthetic_data(a.mix or self.model.spec.default_mix, self.model.config, a.token_scale,
                                             a.seed)  # fmt: skip
        data, problem = None, None
        try:  # listing it may fail on one node alone (a stale NFS handle, a mount's permissions)
            data = self.hooks.latent_directory(a.data_dir, a.samples_per_rank, a.repeat_data)
        except OSError as error:
            problem = f"--data-dir {a.data_dir}: {error}"
        self.raise_together(problem)
        if a.shuffle_data:
            data.shuffle(a.seed, self.world * a.samples_per_rank)
        try:
            check_latent_directory(data, self.model.config)
        except ValueError as error:
            raise TrainingError(str(error)) from None
        if self.rank == 0 and data.manifest is None:
            self._say(f"note: {a.data_dir} has no manifest.json: the ranks compared a sampled digest of each file; "
                      f"{data.writer} writes one (or python -m deepspeed_knap.runtime.manifest DIR) to have "
                      "each file's sha256 checked when it is read")  # fmt: skip
        return data

    def _resume(self) -> None:
        """DeepSpeed's checkpoint plus where the loop and the data were."""
        a = self.arguments
        try:  # every rank checks the files it sees against the tag's manifest; the ranks agree before any load
            choice = find_checkpoint(a.resume)
        except ManifestError as error:
            raise TrainingError(f"--resume {a.resume}: {error}") from None
        if self.rank == 0:  # say which tag, and why newer ones were not taken
            for tag, why in choice.skipped:
                self._say(f"--resume: skipped checkpoint {tag}: {why}")
            self._say(f"--resume: loading checkpoint {choice.tag} from {choice.load_dir}"
                      + ("" if choice.given else ", the newest complete one"))  # fmt: skip
        # Before DeepSpeed loads anything (minutes at A14B size): the expert and data order the manifest recorded.
        self.raise_together(self._saved_run_problem(choice.manifest.get("metadata") or {}, choice.tag))
        try:  # weights-only: no pickle of the checkpoint runs; another model's checkpoint is one error
            _, client_state = load_checkpoint(self.engine, choice.load_dir, choice.tag)
        except CheckpointError as error:
            raise TrainingError(f"--resume {a.resume}: {error}") from None
        self.raise_together(None if client_state else f"DeepSpeed found no checkpoint to load in {a.resume}")
        # ZeRO-3 ranks each read their own file's client state: what it says is agreed before it is used.
        step, position = client_state.get("step"), client_state.get("data_position")
        saved_alpha, alpha = client_state.get("lora_alpha"), self._lora_alpha()
        problem = None
        if not all(isinstance(value, int) and not isinstance(value, bool) and value >= 0 for value in (step, position)):
            problem = (f"--resume {a.resume}: checkpoint {choice.tag} holds no training position (step {step!r}, "
                       f"data_position {position!r}): it was not saved by this trainer, which records both; resume "
                       "from a --save-dir of this trainer")  # fmt: skip
        elif "lora_alpha" in client_state and saved_alpha != alpha:  # (saved before alpha was recorded: none)
            problem = (f"--resume {a.resume}: checkpoint {choice.tag} was trained with LoRA alpha {saved_alpha} and "
                       f"this run has {alpha} (the adapters' scale is alpha / rank): resume with --lora-alpha "
                       f"{saved_alpha}")  # fmt: skip
        else:  # (the files' own record: the manifest's was checked before the load)
            problem = self._saved_run_problem(client_state, choice.tag)
        self.raise_together(problem)
        try:
            check_same_on_every_rank({f"checkpoint {choice.tag}'s step and data position": f"{step} {position}"})
        except ValueError as error:
            raise TrainingError(f"--resume {a.resume}: {error}") from None
        self.start_step, self.position = step, position
        listed, now = client_state.get("data_files"), self._data_files()
        if self.rank == 0 and None not in (listed, now) and listed != now:  # (the listing is agreed at start-up)
            self._say(f"note: --resume: checkpoint {choice.tag} was trained on {listed} and {a.data_dir} holds {now}: "
                      "the data position goes on from where it was, over the files as they are now (this epoch may "
                      "read some files again and skip others)")  # fmt: skip

    def _saved_run_problem(self, saved: Mapping[str, Any], tag: str) -> str | None:
        """Why a checkpoint that recorded ``saved`` (its client state) cannot resume this run: another
        Wan 2.2 expert, or its prepared files read in another order (one saved before the order was
        recorded read them in name order); or ``None`` (also for a checkpoint saved before the expert
        was recorded)."""
        # Saved before the order was recorded: prepared files were read in name order then.
        order, then = self._data_order(), saved.get("data_order", {"shuffle_seed": None})
        if order is not None and then is not None and then != order:
            (read_then, flags), (read_now, _) = _order_words(then), _order_words(order)
            before = "" if "data_order" in saved else ", saved before checkpoints recorded it,"
            return (f"--resume {self.arguments.resume}: checkpoint {tag}{before} read its files {read_then} and this "
                    f"run reads them {read_now}: its data position would name other files (some seen twice this "
                    f"epoch, others skipped); resume with {flags}")  # fmt: skip
        if "expert" not in saved or saved["expert"] == self.hooks.expert:
            return None
        # Wan 2.2 A14B's experts have the same names and shapes: DeepSpeed would load one as the other.
        then, now = (
            f"--expert {e}" if e else "both experts (or one transformer)" for e in (saved["expert"], self.hooks.expert)
        )
        return (f"--resume {self.arguments.resume}: checkpoint {tag} was trained with {then} and this run trains "
                f"{now} (the two experts have the same parameter names: one would load as the other); resume with "
                f"{then}")  # fmt: skip

    def _data_order(self) -> dict[str, int | None] | None:
        """The order this run reads its prepared files in, as a checkpoint records it:
        ``{"shuffle_seed": seed}`` (``None``: name order); ``None`` for synthetic data."""
        a = self.arguments
        return {"shuffle_seed": a.seed if a.shuffle_data else None} if a.data_dir else None

    def _data_files(self) -> str | None:
        """This run's prepared files as a checkpoint records them (:attr:`LatentDirectory.listing`);
        ``None`` for synthetic data."""
        return self.data.listing if self.arguments.data_dir else None

    def _lora_alpha(self) -> float | None:
        """The LoRA alpha the model's adapters have (``None``: no LoRA)."""
        config = lora_config(self.model)
        return None if config is None else float(config.lora_alpha)

    def _validator(self) -> Validator:
        a = self.arguments
        try:
            prompts, problem = read_prompts(a.validation_prompts), None
        except (OSError, ValueError) as error:
            prompts, problem = [], f"--validation-prompts: {error}"
        family = self.model.spec
        validation, hooks, calls = self.hooks.validation, None, []
        if validation is None:  # the same config on every rank: every rank stops here with it
            problem = (f"--validation-every renders with the family's diffusers pipeline; {family.title} has no "
                       "validation renders here: train without --validation-every and render the export yourself")  # fmt: skip
        else:
            hooks = validation(family, a.model_path)
            if a.model_path and not problem:
                problem = hooks.model_path_problem(a.model_path)
        if not problem:
            try:
                calls = [hooks.call(line, Path(a.validation_prompts).parent, self.model) for line in prompts]
            except (OSError, ValueError) as error:
                problem = f"--validation-prompts {a.validation_prompts}: {error}"
        self.raise_together(problem)
        settings = ValidationSettings(a.tiny, a.validation_resolution, a.validation_width, a.validation_frames,
                                      a.validation_inference_steps, a.validation_guidance)  # fmt: skip
        return Validator(hooks, calls, settings, a.model_path, a.validation_dir, a.seed, a.validation_timeout,
                         self.hooks.save_adapters)  # fmt: skip

    # ---- one step ----

    def step_samples(self, step: int, position: int) -> tuple[list[str], list[dict]]:
        """This rank's ``(sample names, latent samples)`` of a step; ``position`` is the step's first
        file (global, over all ranks) with prepared data."""
        a = self.arguments
        if a.data_dir:
            return self.data.read(position + self.rank * a.samples_per_rank, a.samples_per_rank, self.dtype)
        samples = self.data.step_samples(step, self.rank, self.world, self.dtype)
        return [f"synthetic sample {i} of rank {self.rank} at step {step}" for i in range(len(samples))], samples

    def step_inputs(self, step: int, position: int) -> tuple[tuple[list[str], Any, Objective] | None, str | None]:
        """This rank's ``(sample names, packed noised inputs, objective)`` of a step, on the
        CPU (the next step's wait there while this one runs), and ``None``; or ``None`` and why a file
        could not be used (unreadable, or not what its manifest says): the ranks agree on it before
        anyone trains on that step (the step before's all-reduce carries the count)."""
        try:
            names, latents = self.step_samples(step, position)
        except LatentFileError as error:
            return None, str(error)
        generator = torch.Generator().manual_seed((self.arguments.seed * 7919 + step) * 4099 + self.rank)
        objective = self.hooks.objective(latents, generator, self.model.config, self.guidance)
        inputs, problem = self.hooks.pack(self.model, objective.samples, self.balancer is not None)
        if problem:
            return None, f"{problem} (files {names})"
        if inputs.problem:  # balanced: the step's first collective raises it on every rank, naming the files
            inputs = dataclasses.replace(inputs, problem=f"{inputs.problem} (files {names})")
        return (names, inputs, objective), None

    def _prefetch(self, next_inputs: tuple | None) -> None:
        """Solve the next step's plan in the plan worker while this step runs. Collective: a rank
        whose next samples are unusable still takes part (with none); this step's all-reduce then
        stops every rank."""
        columns = self.hooks.segment_columns
        if next_inputs is None:
            lens, segments = [], None if columns is None else np.zeros((0, columns), dtype=np.int64)
        else:
            lens, segments = next_inputs[1].seq_lens, next_inputs[1].segments
        self.balancer.prefetch(lens, self.engine.device, next_segments=segments)

    def steps(self) -> range:
        """The steps left to train (after a resumed checkpoint's)."""
        return range(self.start_step, self.arguments.steps)

    def train(self) -> list[float]:
        """Train until ``arguments.steps`` are done, checkpointing and validating when due. Returns
        each step's global mean loss (the same on every rank). Collective."""
        a = self.arguments
        self.progress = tqdm(self.steps(), desc=self.name, disable=self.rank != 0, file=sys.stdout,
                             initial=self.start_step, total=a.steps)  # fmt: skip
        losses = []
        next_inputs, unusable = self.step_inputs(self.start_step, self.position) if self.steps() else (None, None)
        self.raise_together(unusable)
        for step in self.progress:
            start = time.perf_counter()
            names, inputs, objective = next_inputs
            inputs = inputs.to(self.engine.device)
            self.position += self.world * a.samples_per_rank  # the next step's first file
            unusable = None
            if step + 1 < a.steps:
                next_inputs, unusable = self.step_inputs(step + 1, self.position)
                if self.balancer is not None:
                    self._prefetch(next_inputs)
            loss, tokens = self._forward_backward(step, names, inputs, objective, unusable)
            self.engine.step()
            mean_loss = global_mean_loss(loss)  # also a barrier: the step is over everywhere
            losses.append(mean_loss)
            self._log(step, mean_loss, time.perf_counter() - start, tokens)
            self._after_step(step + 1)
        return losses

    def _forward_backward(self, step: int, names: list[str], inputs: Any, objective: Objective,
                          unusable: str | None) -> tuple[torch.Tensor, float]:  # fmt: skip
        """The step's loss after its backward, and the step's tokens over all ranks."""
        try:  # [tokens, C] for this rank's predicted tokens
            prediction = self.engine(inputs, self.balancer)
        except ValueError as error:
            if self.balancer is None:
                raise
            # a sample a rank could not pack, raised on every rank by the step's first collective
            raise TrainingError(str(error)) from None
        targets = objective.targets
        target = torch.cat(targets).to(prediction.device) if targets else torch.zeros_like(prediction)
        per_token = (prediction.float() - target.float()).square().mean(dim=-1)  # [tokens]
        per_sample = per_token.split([len(rows) for rows in targets]) if targets else ()
        nonfinite = [name for name, rows in zip(names, per_sample, strict=True) if not rows.isfinite().all()]
        # Collectives take tensors on the engine's device: NCCL refuses CPU tensors.
        totals = torch.tensor([sum(inputs.seq_lens), len(nonfinite), unusable is not None],
                              dtype=torch.float64, device=self.engine.device)  # fmt: skip
        dist.all_reduce(totals)
        if (
            totals[1].item() + totals[2].item() > 0
        ):  # every rank sees the counts, so every rank raises, naming the files
            found = [f"non-finite loss at step {step} in {nonfinite}"] if nonfinite else []
            found += [f"step {step + 1}'s data: {unusable}"] if unusable else []
            self.raise_together("; ".join(found) or None)
        weights = None
        if objective.weights is not None:  # rows out of the loss (a clean conditioning frame's)
            weights = torch.cat(objective.weights).to(per_token.device, per_token.dtype)
        loss = token_mean_loss(per_token, weights)
        self.engine.backward(loss)
        return loss, totals[0].item()

    def _log(self, step: int, mean_loss: float, seconds: float, tokens: float) -> None:
        if self.rank != 0:
            return
        line = f"step {step} loss {mean_loss:.6f} time {seconds:.2f}s tokens/s {tokens / seconds:,.0f}"
        if self.balancer is not None:
            metrics = self.balancer.metrics()
            line += (f" modeled imbalance {metrics['knapformer/imbalance_before']:.3f} -> "
                     f"{metrics['knapformer/imbalance_after']:.3f}"
                     + (" (planned ahead)" if metrics["knapformer/planned_ahead"] else ""))  # fmt: skip
        self._say(line)

    def _say(self, line: str) -> None:
        """Rank 0's line: above the progress bar in :meth:`train`, printed when a loop of one's own
        calls the parts. A path's byte that is not UTF-8 (a lone surrogate) is written escaped: where
        stdout's encoding is strict, printing it raised on rank 0 alone, between collectives."""
        encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
        line = line.encode(encoding, "backslashreplace").decode(encoding)
        if self.progress is not None:
            self.progress.write(line)
        else:
            print(line, flush=True)

    def _after_step(self, steps_done: int) -> None:
        """Checkpoints and validation renders when due."""
        a = self.arguments
        if a.save_dir and (steps_done == a.steps or (a.checkpoint_every and steps_done % a.checkpoint_every == 0)):
            self.save_checkpoint(steps_done)
        if self.validator is not None and steps_done % a.validation_every == 0:
            self.validate(steps_done)

    # ---- checkpoints, validation, export ----

    def save_checkpoint(self, steps_done: int) -> None:
        """A DeepSpeed checkpoint ``step{steps_done}`` in ``save_dir``, with its manifest. Collective."""
        save_dir, tag = self.arguments.save_dir, f"step{steps_done}"
        client_state = {
            "step": steps_done,
            "data_position": self.position,
            "lora_alpha": self._lora_alpha(),
            "expert": self.hooks.expert,
            "data_order": self._data_order(),
            "data_files": self._data_files(),
        }
        problem = None
        try:  # (DeepSpeed's rank 0 makes the folder before its first barrier: made here on every rank)
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            prepare_checkpoint_save(save_dir, tag)  # a save over an older tag must not look complete half-way
        except OSError as error:
            problem = f"checkpoint {tag}: rank {self.rank} cannot prepare {save_dir}: {error}"
        self.raise_together(problem)
        # A file a rank cannot write (a full disk on its node: torch.save raises a RuntimeError) is
        # noted, not raised: that rank goes on through DeepSpeed's collectives of the save with the
        # others, then every rank raises it. Both writers are leaf calls, no collective in them.
        engine = self.engine

        def noting(write: Any) -> Any:
            def write_or_note(*args: Any, **kwargs: Any) -> None:
                nonlocal problem
                try:
                    write(*args, **kwargs)
                except Exception as error:
                    problem = problem or (f"checkpoint {tag}: rank {self.rank} cannot write its files: "
                                          f"{type(error).__name__}: {error}")  # fmt: skip

            return write_or_note

        patched = [(engine.checkpoint_engine, "save"), (engine, "_copy_recovery_script")]
        for owner, name in patched:
            setattr(owner, name, noting(getattr(owner, name)))
        try:  # 'latest' is written with the manifest, after it: DeepSpeed's own would name the tag before that
            engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)
        finally:
            for owner, name in patched:
                delattr(owner, name)  # the class's own method again
        self.raise_together(problem)
        try:  # each rank hashes the files it wrote; the ranks write the manifest, then 'latest'
            write_checkpoint_manifest(save_dir, tag, client_state)
        except ManifestError as error:
            raise TrainingError(str(error)) from None

    def current_state_dict(self) -> dict | None:
        """The full current weights on rank 0 (ZeRO-3: gathered layer by layer; collective), else ``None``."""
        if self.engine.zero_optimization_stage() == 3:
            return self.engine._zero3_consolidated_16bit_state_dict()
        return {name: t.detach().cpu() for name, t in self.model.state_dict().items()} if self.rank == 0 else None

    def validate(self, steps_done: int) -> None:
        """Rank 0 renders the validation prompts with the current weights; the others wait.
        Collective."""
        state, problem = self.current_state_dict(), None
        if self.rank == 0:
            try:
                renders = self.validator.render(self.model, state, steps_done, self.engine.device, self.dtype)
                kind = "clip" if self.model.spec.video else "image"
                for path, prompt in renders:
                    self._say(f"validation {kind} {path} after step {steps_done - 1}: {prompt!r}")
            except Exception as error:  # the others wait in the barrier: tell them, rather than leave them there
                problem = f"validation after step {steps_done - 1} failed on rank 0: {type(error).__name__}: {error}"
        self.validator.wait()
        self.raise_together(problem)

    def export(self) -> None:
        """Write the trained weights (or the LoRA adapter) in diffusers' format to ``export_dir``
        (nothing without one). Collective."""
        export_dir = self.arguments.export_dir
        if not export_dir:
            return
        problem = None  # rank 0 writes; the others must hear of its failure, not wait for it elsewhere
        if self.arguments.lora_rank:
            lora_parameters = [p for p in self.model.parameters() if p.requires_grad]
            with deepspeed.zero.GatheredParameters(lora_parameters):  # ZeRO-3 partitions them; no-op otherwise
                if self.rank == 0:
                    state = {name: p.detach().cpu().clone() for name, p in self.model.named_parameters()
                             if p.requires_grad}  # fmt: skip
                    try:
                        for path, _ in self.hooks.save_adapters(self.model, state, Path(export_dir)):
                            self._say(f"exported the LoRA adapter to {path}")
                    except Exception as error:  # safetensors' own error for a full disk, too
                        problem = (f"exporting the LoRA adapter to {export_dir} failed on rank 0: "
                                   f"{type(error).__name__}: {error}")  # fmt: skip
        else:
            state = self.current_state_dict() if self.engine.zero_optimization_stage() == 3 else None
            if self.rank == 0:
                try:
                    self.model.save_pretrained(export_dir, state)
                    self._say(f"exported diffusers weights to {export_dir}")
                except Exception as error:  # safetensors' own error for a full disk, too
                    problem = f"exporting the weights to {export_dir} failed on rank 0: {type(error).__name__}: {error}"
        self.raise_together(problem)
