"""One request's denoising state between steps, on its home rank, for every family.

A request runs one sequence through the transformer per step, or two with classifier-free
guidance: the conditional branch and the unconditional one (the negative prompt), each a sequence
of its own that the planner places by cost, like any other. Its home rank combines their
predictions as the family's pipeline does, ``uncond + scale * (cond - uncond)``, and takes the
request's own scheduler step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from deepspeed_knap.generation.requests import Request


@dataclass
class Denoising:
    """One request's state. A family's subclass gives :meth:`step_inputs`.

    Attributes:
        request: what is generated.
        latents: the noisy latents in the family's layout (FLUX: packed ``[L, C]``; Wan:
            ``[C, F, H, W]``), unbatched.
        scheduler: the request's own scheduler (a copy of the pipeline's), its timesteps set.
        timesteps: ``[steps]`` the scheduler's timesteps.
        branches: the transformer's constant inputs per branch (text conditioning, position ids,
            guidance): the conditional branch, then with classifier-free guidance the unconditional.
        guidance_scale: the classifier-free guidance scale (with two branches), else ``None``.
        step: steps taken.
    """

    request: Request
    latents: Tensor
    scheduler: Any
    timesteps: Tensor
    branches: list[dict[str, Tensor]]
    guidance_scale: float | None = None
    step: int = 0

    @property
    def done(self) -> bool:
        return self.step == len(self.timesteps)

    def step_inputs(self, timestep: Tensor) -> dict[str, Tensor]:
        """The transformer's inputs at ``timestep`` shared by the branches (latents and timestep),
        as the family's pipeline casts them."""
        raise NotImplementedError(f"{type(self).__name__} gives step_inputs")

    def samples(self) -> list[dict[str, Tensor]]:
        """The packed transformer's inputs for this step, one unbatched sample per branch."""
        shared = self.step_inputs(self.timesteps[self.step])
        return [{**shared, **branch} for branch in self.branches]

    def target_rows(self, prediction: Tensor) -> Tensor:
        """The rows of one branch's prediction that predict :attr:`latents` (a family whose samples
        also carry conditioning tokens, such as FLUX.2's reference images, drops theirs)."""
        return prediction

    def guidance_at(self, timestep: Tensor) -> float | None:
        """The guidance scale of the step at ``timestep``: :attr:`guidance_scale` (a family whose
        pipeline changes it during the run says how)."""
        return self.guidance_scale

    def combine(self, predictions: list[Tensor], timestep: Tensor) -> Tensor:
        """The prediction the scheduler steps with, from the branches' (:meth:`target_rows`) at
        ``timestep``: the conditional one alone, or with guidance ``uncond + scale * (cond - uncond)``
        (a family whose pipeline guides otherwise says how)."""
        if len(predictions) == 1:
            return predictions[0]
        conditional, unconditional = predictions
        return unconditional + self.guidance_at(timestep) * (conditional - unconditional)

    def decode_work(self) -> int:
        """The decode's price where it is placed (:func:`~deepspeed_knap.generation.decodes.place_decodes`):
        the elements of :attr:`latents`, which a VAE decode's time grows with."""
        return self.latents.numel()

    def for_decode(self) -> Denoising:
        """This finished state without what only the steps needed (the scheduler, the branches), to
        send to the rank that decodes it. A family whose decode reads a branch keeps that part."""
        return dataclasses.replace(self, scheduler=None, branches=[])

    def advance(self, predictions: list[Tensor]) -> None:
        """One scheduler step with the transformer's predictions for :meth:`samples`, in their order."""
        if len(predictions) != len(self.branches):
            raise ValueError(f"request {self.request.id!r} runs {len(self.branches)} branch(es); got "
                             f"{len(predictions)} prediction(s)")  # fmt: skip
        t = self.timesteps[self.step]
        prediction = self.combine([self.target_rows(prediction) for prediction in predictions], t)
        self.latents = self.scheduler.step(prediction[None], t, self.latents[None], return_dict=False)[0][0]
        self.step += 1
