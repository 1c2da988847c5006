"""Communication volume of balancing: bytes moved by routing and by the Ulysses all-to-alls.

    deepspeed-knap bench routing --model flux2-dev --topology g8n4 --steps 20

Computed exactly from the plans (the same split sizes the all-to-alls use), for the bundled
mixes. Bytes are what GPUs send to *other* GPUs.

* Ulysses: q, k, v out and the attention output back inside the bags, over all layers, forward.
  ``tests/multirank/test_routing.py`` checks :func:`step_traffic` against the bytes real exchanges send.
* Route, for the packed FLUX models, before and after routing less (``tests/unit/test_flux.py`` checks
  :func:`flux_route_bytes` against the bytes the models really send, forward and backward):

  - *before*: the route carried each token's ``D``-wide hidden state (the embedders ran at home), and
    its gradient came back in backward;
  - *after*: the route carries raw inputs with no gradient (the latent rows, ``C`` wide; text as
    the text-encoder rows, ``Dj`` wide, or, where that is more bytes in training, as their ``D``-wide
    embedding, whose gradient then comes back), and the embedders run after routing;
  - both: the position ids and stream flag of every token, the per-sample conditioning rows, and
    the ``C_out``-wide predictions routed back (with their gradient in backward).

The activation size is one copy of the step's token states, ``tokens * D * bytes``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from deepspeed_knap.models.flux.spec import FLUX1, FLUX2
from deepspeed_knap.models.registry import MIXES, PRESETS, default_cost_model, sample_shapes
from deepspeed_knap.options import add_mix_argument, positive_int
from deepspeed_knap.planner import DEFAULT_SOLVER, SOLVERS
from deepspeed_knap.planner.plan import RoutingPlan
from deepspeed_knap.planner.solve import plan_routing
from deepspeed_knap.planner.topology import build_topology
from deepspeed_knap.runtime.attention import head_splits


@dataclass(frozen=True)
class StepTraffic:
    """Forward-pass bytes of one step of one balance group.

    Attributes:
        activation_bytes: ``tokens * D * bytes``.
        route_bytes: token states sent to other GPUs by the route and the reverse route together
            (side columns and per-sample rows not included).
        ulysses_bytes: q, k, v out and attention output back inside the bags, over all layers.
    """

    activation_bytes: int
    route_bytes: int
    ulysses_bytes: int


@dataclass(frozen=True)
class FluxDims:
    """What routing a packed FLUX model moves per token and per sample.

    Attributes:
        dim: model width ``D``; heads: attention heads; layers: attention layers (blocks).
        latent_channels: ``C`` (in and out); text_dim: ``Dj``; id_axes: position id axes.
        conditioning: elements of a sample's conditioning row (timestep, guidance, pooled text).
        planner: model dims of the planner's FLOP model (:func:`~deepspeed_knap.cost.model.default_cost_model`).
    """

    dim: int
    heads: int
    layers: int
    latent_channels: int
    text_dim: int
    id_axes: int
    conditioning: int
    planner: dict

    @property
    def text_embedded(self) -> bool:
        """Text travels embedded (``D`` wide, with a gradient) rather than raw: the models' rule."""
        from deepspeed_knap.models.inputs import route_text_embedded

        return route_text_embedded(self.text_dim, self.dim)


def flux_dims(preset: str) -> FluxDims:
    """The routing dims of a packed FLUX.1 or FLUX.2 preset, from its spec's full-size config
    (``bench_configs``); the planner's dims are the preset's."""
    family, planner = PRESETS[preset]
    config = family.bench_configs[preset]
    heads = config["num_attention_heads"]
    conditioning = 1 + bool(config.get("guidance_embeds")) + config.get("pooled_projection_dim", 0)
    return FluxDims(heads * config["attention_head_dim"], heads, config["num_layers"] + config["num_single_layers"],
                    config["in_channels"], config["joint_attention_dim"], len(config["axes_dims_rope"]), conditioning,
                    dict(planner))  # fmt: skip


# FLUX.1 [dev] and FLUX.2 [dev] (the packed models whose routing this prices), by the planner's presets
# (FLUX.2's SwiGLU MLPs as mlp_ratio 4.5).
FLUX_MODELS = {preset: flux_dims(preset) for family in (FLUX1, FLUX2) for preset in family.bench_configs}


@dataclass(frozen=True)
class RouteBytes:
    """Bytes one step's routing of a packed FLUX model sends to other GPUs (see the module docstring)."""

    before_forward: int
    before_backward: int
    after_forward: int
    after_backward: int

    @property
    def before(self) -> int:
        return self.before_forward + self.before_backward

    @property
    def after(self) -> int:
        return self.after_forward + self.after_backward


HELP = "bytes moved by routing and Ulysses, before and after routing less"


def moved_tokens(plan: RoutingPlan, text_lens: np.ndarray) -> tuple[int, int, int]:
    """``(tokens, text tokens, per-sample rows)`` that leave their home GPU under ``plan``; a
    sequence's tokens are its ``text_lens[s]`` text tokens, then its image tokens."""
    chunks_per_seq = np.diff(plan.chunk_offsets)
    seq = np.repeat(np.arange(len(plan.seq_lens)), chunks_per_seq)
    away = (plan.chunk_gpu != plan.seq_src_rank[seq]) & (plan.chunk_len > 0)
    start, end = plan.chunk_start[away], plan.chunk_start[away] + plan.chunk_len[away]
    text = np.clip(np.minimum(end, text_lens[seq[away]]) - start, 0, None)
    return int(plan.chunk_len[away].sum()), int(text.sum()), int(away.sum())


def flux_route_bytes(plan: RoutingPlan, text_lens: np.ndarray, dims: FluxDims, bytes_per_element: int) -> RouteBytes:
    """Route bytes of one training step (forward and backward), before and after routing less."""
    b = bytes_per_element
    moved, moved_text, sample_rows = moved_tokens(plan, text_lens)
    side = moved * (4 * dims.id_axes + 1) + sample_rows * dims.conditioning * b  # fp32 ids, bool flag; samples
    predictions = moved * dims.latent_channels * b
    text_width = dims.dim if dims.text_embedded else dims.text_dim
    return RouteBytes(
        before_forward=moved * dims.dim * b + side + predictions,
        before_backward=moved * dims.dim * b + predictions,
        after_forward=moved * dims.latent_channels * b + moved_text * text_width * b + side + predictions,
        after_backward=predictions + (moved_text * dims.dim * b if dims.text_embedded else 0),
    )


def ulysses_elements_per_layer(plan: RoutingPlan, num_heads: int, head_dim: int) -> int:
    """Elements the attention all-to-alls of one layer send to other GPUs, summed over GPUs.

    In a group of ``G`` GPUs where member ``p`` holds ``T_p`` of the group's ``L`` tokens and runs
    ``h_p`` heads, member ``p`` sends ``3 * T_p * (H - h_p) * Dh`` of q, k, v and
    ``h_p * (L - T_p) * Dh`` of output.
    """
    total = 0
    groups = np.stack([plan.seq_group_start, plan.seq_group_size], axis=1)
    for start, size in np.unique(groups[plan.seq_group_size > 1], axis=0).tolist():
        in_group = np.repeat((plan.seq_group_start == start) & (plan.seq_group_size == size), plan.seq_group_size)
        member_tokens = np.bincount(plan.chunk_gpu[in_group] - start, weights=plan.chunk_len[in_group], minlength=size)
        heads = np.asarray(head_splits(num_heads, size))
        group_tokens = member_tokens.sum()
        total += int((3 * member_tokens * (num_heads - heads) + heads * (group_tokens - member_tokens)).sum())
    return total * head_dim


def step_traffic(plan: RoutingPlan, dim: int, num_heads: int, num_layers: int, bytes_per_element: int) -> StepTraffic:
    """Forward bytes of one step under ``plan`` for a model of width ``dim`` with ``num_layers``
    attention layers of ``num_heads`` heads."""
    tokens = int(plan.seq_lens.sum())
    return StepTraffic(
        activation_bytes=tokens * dim * bytes_per_element,
        route_bytes=2 * plan.tokens_moved * dim * bytes_per_element,
        ulysses_bytes=num_layers * ulysses_elements_per_layer(plan, num_heads, dim // num_heads) * bytes_per_element,
    )


def bench_traffic(
    mixes: Sequence[str], topology_spec: str, solver: str, model: str, steps: int, seed: int = 0
) -> list[dict]:
    """Median per-step traffic of ``steps`` sampled steps per mix, for a model of
    :data:`FLUX_MODELS` in bf16."""
    dims = FLUX_MODELS[model]
    spec, _, gpus = topology_spec.partition(":")  # "auto:32": topology auto on 32 GPUs
    topology = build_topology(spec, int(gpus) if gpus else None)
    cost_model = default_cost_model(dims.planner)
    rows = []
    for name in mixes:
        traffic, route = [], []
        for step in range(steps):
            per_rank = sample_shapes(name, topology.group_size, seed + step)
            plan = plan_routing([[s.length for s in rank] for rank in per_rank], topology, cost_model, solver)
            text_lens = np.array([s.text for rank in per_rank for s in rank], dtype=np.int64)
            traffic.append(step_traffic(plan, dims.dim, dims.heads, dims.layers, 2))
            route.append(flux_route_bytes(plan, text_lens, dims, 2))
        activation = np.median([t.activation_bytes for t in traffic])
        ulysses = np.median([t.ulysses_bytes for t in traffic])
        before_forward = np.median([r.before_forward for r in route])
        before, after = np.median([r.before for r in route]), np.median([r.after for r in route])
        rows.append({"mix": name, "activation_MB": activation / 1e6, "ulysses_MB": ulysses / 1e6,
                     "ulysses_ratio": ulysses / activation, "route_MB": before_forward / 1e6,
                     "route_ratio": before_forward / activation, "route_before_MB": before / 1e6,
                     "route_after_MB": after / 1e6, "route_after_forward_MB": np.median([r.after_forward for r in route]) / 1e6,
                     "route_cut": before / after if after else float("nan")})  # fmt: skip
    return rows


def format_traffic(rows: list[dict]) -> str:
    header = (f"{'mix':<16}{'activ. MB':>11}{'ulysses MB':>12}{'ulys/act':>10}{'route fwd MB':>14}"
              f"{'route MB before':>17}{'after':>10}{'after fwd':>11}{'before/after':>14}")  # fmt: skip
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row['mix']:<16}{row['activation_MB']:>11.1f}{row['ulysses_MB']:>12.1f}{row['ulysses_ratio']:>10.2f}"
            f"{row['route_MB']:>14.1f}{row['route_before_MB']:>17.1f}{row['route_after_MB']:>10.1f}"
            f"{row['route_after_forward_MB']:>11.1f}{row['route_cut']:>14.1f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1; got {args.steps}")
    topology = args.topology if args.topology.strip() != "auto" else f"auto:{args.gpus}"
    rows = bench_traffic(args.mixes, topology, args.solver, args.model, args.steps)
    dims = FLUX_MODELS[args.model]
    print(f"{args.topology}, solver {args.solver}, {args.model} in bf16, median of {args.steps} steps. Ulysses: forward "
          "(training's backward moves the same again). Route: 'route fwd' is the old route's forward (hidden states); "
          f"'before' / 'after' are training steps (forward + backward) without and with routing less (text "
          f"{'embedded' if dims.text_embedded else 'raw'})")  # fmt: skip
    print(format_traffic(rows))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--topology", default="g1n8+g2n4+g4n2+g8n1", help="bags, or auto (on --gpus GPUs)")
    parser.add_argument("--gpus", type=positive_int, default=32, help="GPUs of topology auto")
    add_mix_argument(parser, list(MIXES), many=True)
    parser.add_argument("--solver", default=DEFAULT_SOLVER, choices=list(SOLVERS))
    parser.add_argument("--model", default="flux-dev", choices=list(FLUX_MODELS), help="FLUX dims")
    parser.add_argument("--steps", type=positive_int, default=20, help="sampled steps per mix (median)")
