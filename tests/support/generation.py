"""What the multirank generation tests of a family share: a balanced run that records the plans'
group sizes, and the checks of its outputs and records."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def reference_image(sizes: Mapping[str, tuple[int, int]], name: str) -> Any:
    """The ``PIL.Image`` ``name`` of ``sizes`` (file name -> ``(height, width)`` px): random pixels
    seeded by its place in ``sizes``, the same wherever made (the file a rank reads, the image given
    to the pipeline)."""
    from PIL import Image

    height, width = sizes[name]
    rng = np.random.default_rng(list(sizes).index(name))
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def write_reference_images(directory: Any, sizes: Mapping[str, tuple[int, int]]) -> None:
    """Every image of ``sizes`` (:func:`reference_image`) saved in ``directory`` by its name."""
    for name in sizes:
        reference_image(sizes, name).save(directory / name)


def generate_recording_groups(path: str, generator: Any, budget: int) -> dict:
    """``path`` through ``generate`` on a balancer whose cost model splits sequences over groups
    (attention only, free all-to-alls): this rank's images, records and refusals, and the group sizes
    the plans used."""
    from deepspeed_knap.cost.model import CostModel
    from deepspeed_knap.generation.runner import generate, generation_balancer

    balancer = generation_balancer(generator.model, max_tokens_per_gpu=budget,
                                   cost_model=CostModel(linear_coef=0.0, quadratic_coef=1.0))  # fmt: skip
    sizes, begin_step = set(), balancer.begin_step

    def recording_begin_step(request_set, plan, seq_lens_per_rank):
        sizes.update(int(size) for size in plan.seq_group_size)
        begin_step(request_set, plan, seq_lens_per_rank)

    balancer.begin_step = recording_begin_step
    images = {}
    report = generate(path, generator, balancer, progress=False,
                      on_image=lambda r, image: images.__setitem__(r.id, image))  # fmt: skip
    return {"images": images, "records": report.requests, "refused": report.refused, "group_sizes": sorted(sizes)}


def check_images(results: Sequence[dict], references: Mapping[str, np.ndarray], expected_ids: Sequence[str]) -> None:
    """The ranks' images (``result["images"]``, by id) are exactly ``expected_ids``, each equal to its
    reference within 1e-6."""
    images = {name: image for result in results for name, image in result["images"].items()}
    assert sorted(images) == sorted(expected_ids)
    for name in expected_ids:
        assert images[name].shape == references[name].shape, name
        difference = np.abs(images[name] - references[name]).max()
        assert difference < 1e-6, (name, difference)


def check_outputs_and_records(results: Sequence[dict], references: Mapping[str, np.ndarray],
                              requests: Sequence[dict], seq_lens: Mapping[str, Sequence[int]], world: int) -> None:  # fmt: skip
    """Every request's output equals its reference (1e-6), decoded where its record is; each ran on
    its home rank (line ``i`` on rank ``i % world``) its own steps in a row, its tokens counted; some
    joined after the start and they left at several steps; sequences were split over groups."""
    assert all(result["refused"] == [] for result in results)
    check_images(results, references, [r["id"] for r in requests])
    records = {r["id"]: r for result in results for r in result["records"]}
    for rank, result in enumerate(results):
        assert {r["decoded_on"] for r in result["records"]} <= {rank}
    for index, request in enumerate(requests):
        record = records[request["id"]]
        assert record["home"] == index % world
        assert record["last_step"] - record["first_step"] + 1 == request["steps"]
        assert record["tokens"] == sum(seq_lens[request["id"]]), request["id"]
    assert max(r["first_step"] for r in records.values()) > 0
    assert len({r["last_step"] for r in records.values()}) > 2
    assert max(size for result in results for size in result["group_sizes"]) > 1
