"""The per-GPU load plot: bag boundaries drawn where the topology puts them, the legend over no bar."""

import matplotlib.pyplot as plt

from deepspeed_knap.models.registry import default_cost_model, sample_mix
from deepspeed_knap.planner import plan_routing
from deepspeed_knap.planner.topology import build_topology
from deepspeed_knap.plots import loads_figure


def test_bag_boundaries_are_drawn_and_the_legend_hides_no_bar():
    topology = build_topology("g1n4+g2n2+g4n1")
    lengths = sample_mix("kf_image_video", topology.group_size, 0)
    plans = {solver: plan_routing(lengths, topology, default_cost_model(), solver) for solver in ("none", "refine")}
    fig = loads_figure(plans, "test", topology)
    try:
        fig.canvas.draw()
        boundaries = {first - 0.5 for first in topology.bag_first_rank if first}
        legend = fig.legends[0].get_window_extent()
        for ax in fig.axes:
            drawn = {line.get_xdata()[0] for line in ax.lines if line.get_xdata()[0] == line.get_xdata()[1]}
            assert drawn == boundaries
            for bar in ax.patches[-topology.group_size :]:  # the bars are drawn last
                assert not legend.overlaps(bar.get_window_extent())
    finally:
        plt.close(fig)


def test_auto_shades_its_largest_groups_not_bags_it_does_not_have():
    """``auto`` has no bags: its legend named its largest groups "bags"; one bag is no shading."""
    lengths = sample_mix("kf_image_video", 8, 0)
    for topology, label in ((build_topology("auto", 8, max_degree=4), "auto's largest groups (alternate shading)"),
                            (build_topology("g8n1"), None)):  # fmt: skip
        fig = loads_figure(
            {"refine": plan_routing(lengths, topology, default_cost_model(), "refine")}, "test", topology
        )
        try:
            labels = [text.get_text() for text in fig.legends[0].get_texts()]
            assert labels[-1] == label if label else not any("shading" in text for text in labels), labels
        finally:
            plt.close(fig)
