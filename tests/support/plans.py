"""Shared planner test helpers: hypothesis strategies of per-rank lengths, and the check that a plan
places every token exactly once."""

import numpy as np
from hypothesis import strategies as st

from deepspeed_knap.planner.search import SEARCH_FLOOR_S, SEARCH_FLOOR_SHARE, SEARCH_TOLERANCE


def near_optimal(optimum_s: float) -> float:
    """The most seconds an ``auto`` plan may take where the best plan (brute force's, or a fixed
    topology's) takes ``optimum_s``: its starts and branch and bound stop within SEARCH_TOLERANCE of
    the lower bound, or within SEARCH_FLOOR_S where that is at most SEARCH_FLOOR_SHARE of it (the
    bound is at most the optimum, so its margin is too), and costs are quantised."""
    margin = max(SEARCH_TOLERANCE, min(SEARCH_FLOOR_SHARE, SEARCH_FLOOR_S / optimum_s)) if optimum_s > 0 else 0.0
    return optimum_s * (1 + margin) * (1 + 1e-9)


# Lengths from single tokens (shorter than any bag) to long videos.
lengths_strategy = st.one_of(st.integers(1, 12), st.integers(200, 5_000), st.integers(10_000, 120_000))


def per_rank_lengths(num_gpus: int, max_per_rank: int = 4):
    return st.lists(st.lists(lengths_strategy, max_size=max_per_rank), min_size=num_gpus, max_size=num_gpus)


def check_plan_covers_every_token(plan, seq_lens_per_rank, topology):
    flat = [s for rank in seq_lens_per_rank for s in rank]
    assert plan.seq_lens.tolist() == flat
    assert plan.seq_src_rank.tolist() == [r for r, rank in enumerate(seq_lens_per_rank) for _ in rank]
    assert plan.chunk_offsets[0] == 0 and plan.chunk_offsets[-1] == len(plan.chunk_gpu)
    for i, length in enumerate(flat):
        chunks = slice(plan.chunk_offsets[i], plan.chunk_offsets[i + 1])
        starts, lens, gpus = plan.chunk_start[chunks], plan.chunk_len[chunks], plan.chunk_gpu[chunks]
        group = range(plan.seq_group_start[i], plan.seq_group_start[i] + plan.seq_group_size[i])
        # One chunk per GPU of the group, in rank order, contiguous, covering [0, length) exactly once.
        assert gpus.tolist() == list(group)
        assert group.start >= 0 and group.stop <= topology.group_size
        assert np.all(lens >= 0) and lens.sum() == length
        assert starts[0] == 0 and np.array_equal(starts[1:], (starts + lens)[:-1])
        assert lens.max() - lens.min() <= 1  # near-equal chunks
    assert plan.gpu_tokens.sum() == sum(flat)


def plan_digests() -> dict[str, str]:
    """A digest of every plan of the bundled mixes (seed 0) at 8, 16 and 32 GPUs: topology ``auto``
    and three fixed topologies, each solver, with equal speeds and with the last GPU at half speed.
    ``tests/support/plan_digests.json`` holds them as the planner gave them before the package was
    reorganised (issue 21); a refactor must leave every one unchanged. ``flux3_edit`` (60 keys, added
    with it) is planned with the ``flux3`` cost model and its samples' attention segments;
    ``qwen_edit``'s 60 keys were added with it (issue 44)."""
    import dataclasses
    import hashlib

    from deepspeed_knap import MIXES, build_topology, default_cost_model, plan_routing, sample_mix
    from deepspeed_knap.models.registry import sample_segments

    digests = {}
    for gpus in (8, 16, 32):
        specs = ["auto", f"g{gpus // 4}n4", f"g1n{gpus // 2}+g{gpus // 4}n2", f"g8n{gpus // 8}"]
        for mix in MIXES:
            lengths = sample_mix(mix, gpus, 0)
            segmented = mix == "flux3_edit"
            segments = sample_segments(mix, gpus, 0) if segmented else None
            for speeds in ("even", "slow"):
                model = default_cost_model("flux3" if segmented else "flux-dev")
                if speeds == "slow":
                    model = dataclasses.replace(model, gpu_speed=(1.0,) * (gpus - 1) + (0.5,))
                for spec in specs:
                    topology = build_topology(spec, gpus if spec == "auto" else None)
                    for solver in ("none", "refine") if spec == "auto" else ("none", "knapformer", "refine"):
                        plan = plan_routing(lengths, topology, model, solver, seq_segments_per_rank=segments)
                        digest = hashlib.sha256()
                        for field in dataclasses.fields(plan):
                            value = getattr(plan, field.name)
                            digest.update(field.name.encode())
                            digest.update(value.tobytes() if isinstance(value, np.ndarray) else repr(value).encode())
                        digests[f"{gpus}/{mix}/{speeds}/{spec}/{solver}"] = digest.hexdigest()[:16]
    return digests
