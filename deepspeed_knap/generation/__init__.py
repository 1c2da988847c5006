"""Balanced generation: requests of mixed sizes packed and balanced across GPUs, denoising step by step.

* :mod:`~deepspeed_knap.generation.requests`: the JSONL request format and its checks (pure).
* :mod:`~deepspeed_knap.generation.schedule`: step-level batching, joins and leaves under a token
  budget, one plan per request set (pure).
* :mod:`~deepspeed_knap.generation.balancer`: the forward-only balancer that reuses a set's plan and
  route, and the forward-only cost model.
* :mod:`~deepspeed_knap.generation.runner`: the intake agreement and the loop every rank runs.

* :mod:`~deepspeed_knap.generation.denoising` and :mod:`~deepspeed_knap.generation.generator`: a
  request's state between steps, and what every family's generator shares.

A family's request handling (text encoding, noise, scheduler shift, decoding) lives with the family:
FLUX.1 and FLUX.2 in :mod:`deepspeed_knap.models.flux.generate`, Wan in
:mod:`deepspeed_knap.models.wan.generate`, each by name in :mod:`deepspeed_knap.models.generators`.
``deepspeed-knap generate`` is the command.
"""
