"""Communication volume of balancing: bytes moved by routing and by the Ulysses all-to-alls.

    python -m deepspeed_knap.bench.routing --topology g8n4 --steps 20

Computed exactly from the plans (the same split sizes the all-to-alls use; ``tests/test_routing.py``
checks them against the bytes the real exchanges send), for the bundled workloads. Bytes are what
GPUs send to *other* GPUs in one forward pass, for the token states and q/k/v/output only: the side
columns (position ids, modality: ~25 bytes a token against ``2 * D`` for the states) and the
per-sample rows are left out. In training the backward pass sends the same again (the gradients).
The activation size is one copy of the step's token states, ``tokens * D * bytes``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from deepspeed_knap.attention import head_splits
from deepspeed_knap.planner import DEFAULT_SOLVER, SOLVERS, RoutingPlan, plan_routing
from deepspeed_knap.topology import build_topology
from deepspeed_knap.workload import MODEL_PRESETS, default_workload
from deepspeed_knap.workloads import WORKLOADS, sample_workload


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
    workloads: Sequence[str], topology_spec: str, solver: str, model: str, steps: int, seed: int = 0
) -> list[dict]:
    """Median per-step traffic of ``steps`` sampled steps per workload."""
    dims = MODEL_PRESETS[model]
    num_layers = dims["double_blocks"] + dims["single_blocks"]
    num_heads = max(1, dims["hidden"] // 128)  # FLUX heads are 128 wide
    topology = build_topology(topology_spec)
    workload = default_workload(model)
    rows = []
    for name in workloads:
        traffic = []
        for step in range(steps):
            seq_lens = sample_workload(name, topology.group_size, seed + step)
            plan = plan_routing(seq_lens, topology, workload, solver)
            traffic.append(step_traffic(plan, dims["hidden"], num_heads, num_layers, 2))
        activation = np.median([t.activation_bytes for t in traffic])
        route = np.median([t.route_bytes for t in traffic])
        ulysses = np.median([t.ulysses_bytes for t in traffic])
        rows.append({"workload": name, "activation_MB": activation / 1e6, "route_MB": route / 1e6,
                     "ulysses_MB": ulysses / 1e6, "route_ratio": route / activation,
                     "ulysses_ratio": ulysses / activation})  # fmt: skip
    return rows


def format_traffic(rows: list[dict]) -> str:
    header = f"{'workload':<16}{'activ. MB':>11}{'route MB':>11}{'route/act':>11}{'ulysses MB':>12}{'ulys/act':>10}"
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row['workload']:<16}{row['activation_MB']:>11.1f}{row['route_MB']:>11.1f}{row['route_ratio']:>11.2f}"
            f"{row['ulysses_MB']:>12.1f}{row['ulysses_ratio']:>10.2f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default="g1n8+g2n4+g4n2+g8n1")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--solver", default=DEFAULT_SOLVER, choices=SOLVERS)
    parser.add_argument("--model", default="flux-dev", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    rows = bench_traffic(args.workloads, args.topology, args.solver, args.model, args.steps)
    print(f"{args.topology}, solver {args.solver}, {args.model} (bf16, forward; training's backward moves the same again), "
          f"median of {args.steps} steps")  # fmt: skip
    print(format_traffic(rows))


if __name__ == "__main__":
    main()
