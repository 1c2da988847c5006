"""Plan one training step with the Python API and print where each sequence goes.

    python examples/plan_step.py

Every rank of a balance group would run exactly this on the all-gathered lengths and get the same
plan; here the lengths come from a bundled mix.
"""

from deepspeed_knap import build_topology, default_cost_model, plan_routing, sample_mix

topology = build_topology("g1n4+g2n2+g4n1", gpus_per_node=8)
cost_model = default_cost_model("flux-dev")
seq_lens_per_rank = sample_mix("kf_image_video", topology.group_size, seed=0)

plan = plan_routing(seq_lens_per_rank, topology, cost_model)
unbalanced = plan_routing(seq_lens_per_rank, topology, cost_model, solver="none")

print(f"{topology.spec}: {plan.seq_lens.size} sequences over {topology.group_size} GPUs")
print(f"modeled step {unbalanced.max_load:.2f} s -> {plan.max_load:.2f} s (bound {plan.lower_bound:.2f} s)")
print(f"imbalance {unbalanced.imbalance:.3f} -> {plan.imbalance:.3f}; tokens moved {plan.tokens_moved_fraction:.1%}")
for i in range(plan.seq_lens.size):
    first, size = int(plan.seq_group_start[i]), int(plan.seq_group_size[i])
    chunks = range(plan.chunk_offsets[i], plan.chunk_offsets[i + 1])
    cuts = ", ".join(f"gpu{plan.chunk_gpu[k]}:{plan.chunk_len[k]}" for k in chunks)
    print(
        f"  seq {i:2d} from rank {plan.seq_src_rank[i]:2d}, {plan.seq_lens[i]:6d} tokens -> GPUs {first}..{first + size - 1} [{cuts}]"
    )
