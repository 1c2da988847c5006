"""LatentDirectory's start-up checks: every bad file is named, ranks split the work and any rank's
finding becomes one message, too few files are refused unless asked to repeat."""

import torch

from deepspeed_knap.data.mixes import SampleShape
from deepspeed_knap.models.flux.data import (
    LatentDirectory,
    check_latent_file,
    latent_directory_error,
    save_latent_sample,
    synthetic_samples,
)

CONFIG = {"in_channels": 16, "joint_attention_dim": 32, "pooled_projection_dim": 16, "axes_dims_rope": (4, 6, 6)}


def write_samples(directory, count: int) -> list:
    shapes = [SampleShape(text=3 + i, visual=5 + 2 * i, frames=1) for i in range(count)]
    paths = []
    for index, sample in enumerate(synthetic_samples(shapes, CONFIG, seed=0)):
        paths.append(directory / f"{index:03d}.safetensors")
        save_latent_sample(paths[-1], sample)
    return paths


def simulate_ranks(data: LatentDirectory, world_size: int) -> str | None:
    """What every rank of ``world_size`` would raise (the training script gathers these reports)."""
    return latent_directory_error([data.check(rank, world_size, CONFIG) for rank in range(world_size)])


def test_good_files_pass_and_read_in_order_across_epochs(tmp_path):
    paths = write_samples(tmp_path, 4)
    data = LatentDirectory(tmp_path, samples_per_rank=2)
    assert simulate_ranks(data, 2) is None
    names, samples = data.read(3, 2)  # position 3 then 4, which wraps to the first file
    assert names == [str(paths[3]), str(paths[0])]
    assert samples[1]["latents"].shape == (5, 16)


def test_every_bad_file_is_named_whichever_rank_checks_it(tmp_path):
    paths = write_samples(tmp_path, 8)
    good = paths[0].read_bytes()
    paths[1].write_bytes(good[: len(good) // 2])  # truncated
    paths[2].write_bytes(b"\x00garbage" * 20)
    wrong_width = synthetic_samples([SampleShape(text=2, visual=3, frames=1)], {**CONFIG, "in_channels": 8}, seed=1)
    save_latent_sample(paths[5], wrong_width[0])
    sample = synthetic_samples([SampleShape(text=2, visual=3, frames=1)], CONFIG, seed=2)[0]
    from safetensors.torch import save_file

    save_file({key: t for key, t in sample.items() if key != "txt_ids"}, str(paths[6]))  # a key missing
    save_file({**sample, "img_ids": torch.zeros(4, 3)}, str(paths[7]))  # ids that do not match the latents

    data = LatentDirectory(tmp_path)
    reports = [data.check(rank, 4, CONFIG) for rank in range(4)]
    # Each rank opened only its share: files rank, rank + 4.
    assert [len(r["problems"]) for r in reports] == [0, 2, 2, 1]
    message = latent_directory_error(reports)
    assert message.startswith("5 bad latent files")
    for index, what in ((1, "not a readable"), (2, "not a readable"), (5, "do not fit the model"),
                        (6, "missing ['txt_ids']"), (7, "'img_ids'")):  # fmt: skip
        line = next(line for line in message.splitlines() if str(paths[index]) in line)
        assert what in line, line
    assert check_latent_file(paths[0], CONFIG) is None


def test_too_few_files_for_one_step_are_refused_unless_repeating(tmp_path):
    write_samples(tmp_path, 3)
    message = simulate_ranks(LatentDirectory(tmp_path, samples_per_rank=1), 4)
    assert "has 3 latent files but one step needs 4" in message and "--repeat-data" in message
    assert simulate_ranks(LatentDirectory(tmp_path, samples_per_rank=1, repeat=True), 4) is None
    assert "no .safetensors files" in simulate_ranks(LatentDirectory(tmp_path / "empty"), 2)


def test_ranks_that_see_different_files_are_named(tmp_path):
    write_samples(tmp_path, 4)
    reports = [LatentDirectory(tmp_path).check(rank, 4, CONFIG) for rank in range(4)]
    (tmp_path / "003.safetensors").unlink()  # a node whose copy lacks a file
    reports[3] = LatentDirectory(tmp_path).check(3, 4, CONFIG)
    message = latent_directory_error(reports)
    assert "ranks [0, 1, 2] see 4 files; ranks [3] see 3 files" in message
