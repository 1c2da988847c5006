"""LatentDirectory's start-up checks: every bad file is named, ranks split the work and any rank's
finding becomes one message, too few files are refused unless asked to repeat. Contents: a directory
with a manifest (prepare_flux_latents.py writes one) is checked against it, sizes at start-up and each
file's sha256 when a rank reads it; without one, the ranks compare a sampled digest of every file.
Copies that differ between ranks are refused with one message on every rank (2 gloo ranks)."""

import shutil

import pytest
import torch

from deepspeed_knap.data.mixes import SampleShape
from deepspeed_knap.models.flux.data import check_latent_file, latent_directory, save_latent_sample, synthetic_samples
from deepspeed_knap.models.latents import (
    LatentDirectory,
    LatentFileError,
    latent_directory_error,
    write_latent_manifest,
)
from deepspeed_knap.runtime.manifest import MANIFEST
from tests.support.distributed import run_distributed

CONFIG = {"in_channels": 16, "joint_attention_dim": 32, "pooled_projection_dim": 16, "axes_dims_rope": (4, 6, 6)}


def write_samples(directory, count: int) -> list:
    shapes = [SampleShape(text=3 + i, visual=5 + 2 * i, frames=1) for i in range(count)]
    directory.mkdir(parents=True, exist_ok=True)
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
    data = latent_directory(tmp_path, samples_per_rank=2)
    assert simulate_ranks(data, 2) is None
    names, samples = data.read(3, 2)  # position 3 then 4, which wraps to the first file
    assert names == [str(paths[3]), str(paths[0])]
    assert samples[1]["latents"].shape == (5, 16)


def test_shuffled_files_are_each_read_once_an_epoch_in_an_order_the_seed_repeats(tmp_path):
    """After shuffle, every epoch reads every file once, in an order of its own; a directory
    shuffled with the same seed (a resumed run, another rank) reads the same file at every position,
    whatever position it starts at; another seed reads another order."""
    names = [str(path) for path in write_samples(tmp_path, 5)]

    def read_all(seed: int, positions: range) -> list[str]:
        data = latent_directory(tmp_path).shuffle(seed)
        return [data.read(position, 1)[0][0] for position in positions]

    order = read_all(7, range(15))
    epochs = [order[5 * e : 5 * e + 5] for e in range(3)]
    assert all(sorted(epoch) == names for epoch in epochs)
    assert len({tuple(epoch) for epoch in (*epochs, names)}) == 4  # no two alike, none in name order
    assert read_all(7, range(12, 4, -1)) == order[12:4:-1]  # read backwards, across epochs: the same files
    assert read_all(8, range(15)) != order


@pytest.mark.parametrize(("count", "step_files"), [(13, 4), (14, 3), (22, 5), (41, 8)])
def test_a_shuffled_step_across_epochs_reads_no_file_twice(tmp_path, count, step_files):
    """A step that spans two epochs reads the end of one and the start of the next: with at least
    4 * (step_files - 1) files no step reads a file twice (independent draws did, in about 1 step
    in 12 at 10 files and 4 a step), and every epoch still reads every file once."""
    write_samples(tmp_path, count)
    data = latent_directory(tmp_path).shuffle(5, step_files)
    order = [data.file_at(position).name for position in range(20 * count)]
    assert all(sorted(order[e * count : (e + 1) * count]) == sorted(order[:count]) for e in range(20))
    steps = [order[p : p + step_files] for p in range(0, len(order) - step_files + 1, step_files)]
    assert all(len(set(step)) == step_files for step in steps)
    independent = latent_directory(tmp_path).shuffle(5)  # step_files 1: no trades
    assert [independent.file_at(p).name for p in range(count)] == order[:count]  # the first epoch is drawn alike


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

    data = latent_directory(tmp_path)
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
    message = simulate_ranks(latent_directory(tmp_path, samples_per_rank=1), 4)
    assert "has 3 latent files but one step needs 4" in message and "--repeat-data" in message
    assert simulate_ranks(latent_directory(tmp_path, samples_per_rank=1, repeat=True), 4) is None
    assert "no .safetensors files" in simulate_ranks(latent_directory(tmp_path / "empty"), 2)


def test_ranks_that_see_different_files_are_named(tmp_path):
    write_samples(tmp_path, 4)
    reports = [latent_directory(tmp_path).check(rank, 4, CONFIG) for rank in range(4)]
    (tmp_path / "003.safetensors").unlink()  # a node whose copy lacks a file
    reports[3] = latent_directory(tmp_path).check(3, 4, CONFIG)
    message = latent_directory_error(reports)
    assert "ranks [0, 1, 2] see 4 files; ranks [3] see 3 files" in message


def scaled_copy(source, destination, index: int):
    """A copy of a latent directory whose file ``index`` holds the same tensors times 2 (same names,
    same size): what a node with a diverging copy sees."""
    from safetensors.torch import load_file

    shutil.copytree(source, destination)
    file = sorted(destination.glob("*.safetensors"))[index]
    save_latent_sample(file, {key: 2 * t for key, t in load_file(file).items()})
    return file


def test_a_manifest_lists_the_samples_and_a_file_changed_since_is_refused_when_read(tmp_path):
    paths = write_samples(tmp_path / "data", 4)
    write_latent_manifest(tmp_path / "data")
    (tmp_path / "data" / "notes.txt").write_text("not a sample")
    data = latent_directory(tmp_path / "data")
    assert sorted(data.manifest["files"]) == [p.name for p in paths]
    assert simulate_ranks(data, 2) is None
    changed = scaled_copy(tmp_path / "data", tmp_path / "copy", 1)
    copy = latent_directory(tmp_path / "copy")
    assert simulate_ranks(copy, 2) is None  # same names, same sizes: only the contents differ
    copy.read(0, 1)
    with pytest.raises(LatentFileError, match=f"{changed}: sha256 [0-9a-f]{{16}}..., {MANIFEST} says ") as error:
        copy.read(1, 1)
    assert "copy it again from the original" in str(error.value)


def test_files_that_do_not_match_the_manifest_are_named_at_start_up(tmp_path):
    paths = write_samples(tmp_path, 6)
    write_latent_manifest(tmp_path)
    good = paths[3].read_bytes()
    paths[3].write_bytes(good[:-10])  # truncated, and not a readable file any more
    paths[5].unlink()
    save_latent_sample(tmp_path / "new.safetensors", synthetic_samples([SampleShape(2, 3, 1)], CONFIG, seed=5)[0])
    message = simulate_ranks(latent_directory(tmp_path), 2)
    assert message.startswith(f"{tmp_path} does not match its {MANIFEST}: 1 listed file is missing (005.safetensors)")
    assert "1 file is not in it (new.safetensors)" in message
    paths[5].write_bytes(b"")
    (tmp_path / "new.safetensors").unlink()
    message = simulate_ranks(latent_directory(tmp_path), 2)
    assert f"{paths[3]}: {len(good) - 10:,} bytes, {MANIFEST} says {len(good):,}" in message


def test_ranks_with_different_manifests_are_named(tmp_path):
    write_samples(tmp_path / "a", 2)
    write_latent_manifest(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    (tmp_path / "b" / MANIFEST).unlink()
    reports = [latent_directory(tmp_path / d).check(rank, 2, CONFIG) for rank, d in enumerate("ab")]
    message = latent_directory_error(reports)
    assert message.startswith(f"the ranks see different manifests in {tmp_path / 'a'}: rank 0 has one with sha256 ")
    assert ", rank 1 has none; every rank must read the same directory, manifest.json included" in message


def test_without_a_manifest_the_ranks_compare_a_sampled_digest_of_every_file(tmp_path):
    write_samples(tmp_path / "data", 3)
    changed = scaled_copy(tmp_path / "data", tmp_path / "copy", 2)
    reports = [latent_directory(tmp_path / d).check(rank, 2, CONFIG) for rank, d in enumerate(("data", "copy"))]
    message = latent_directory_error(reports)
    assert message.startswith(f"the ranks' copies of {tmp_path / 'data'} differ: {changed.name}: rank 0 / rank 1")
    assert "a manifest" in message


def _diverging_copies_worker(rank: int, world: int, root: str, manifest: bool) -> str:
    """Rank 1 reads a copy whose second file is scaled by 2; both do what train_dit.py does: agree on
    the start-up check, then read their step-0 file and agree on what they found."""
    import deepspeed.comm as dist

    from deepspeed_knap.models.latents import check_latent_directory
    from deepspeed_knap.runtime.groups import raise_together

    dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    data = latent_directory(f"{root}/{'copy' if rank == 1 else 'data'}")
    try:
        check_latent_directory(data, CONFIG)
        try:
            data.read(rank, 1)
            problem = None
        except LatentFileError as error:
            problem = str(error)
        raise_together(problem, "reading latent samples")
    except ValueError as error:
        return str(error).replace(f"{root}/copy", f"{root}/data")
    return "trained"


@pytest.mark.multirank
@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no manifest"])
def test_diverging_copies_on_two_ranks_are_refused_on_both(tmp_path, manifest):
    write_samples(tmp_path / "data", 2)
    if manifest:
        write_latent_manifest(tmp_path / "data")
    changed = scaled_copy(tmp_path / "data", tmp_path / "copy", 1)
    messages = run_distributed(_diverging_copies_worker, 2, args=(str(tmp_path), manifest), timeout=120)
    assert messages[0] == messages[1], messages
    name = f"{tmp_path / 'data' / changed.name}"
    if manifest:  # found by rank 1 when it reads the file
        assert messages[0].startswith(f"reading latent samples failed:\nrank(s) [1]: {name}: sha256 "), messages[0]
    else:  # found at start-up
        assert messages[0].startswith(
            f"the ranks' copies of {tmp_path / 'data'} differ: {changed.name}: rank 0 / rank 1"
        )


def test_preparing_into_a_folder_of_samples_is_refused_unless_overwritten(tmp_path, capsys):
    """prepare_flux_latents.py wrote its samples beside the ones a folder held and listed them all in
    the new manifest: 3 synthetic samples, then 1, trained on all 3. Now the second run is refused
    (the folder and its manifest untouched), and with --overwrite it holds the new samples alone; a
    mix that does not exist is a usage error before the old manifest goes."""
    import json
    import runpy

    from tests.support.launch import ROOT
    from tests.support.training import run_example

    common = ["--synthetic", "kf_mixed_res", "--token-scale", "0.01", "--in-channels", "8",
              "--joint-attention-dim", "8", "--pooled-projection-dim", "8", "--out", str(tmp_path)]  # fmt: skip
    run_example("prepare_flux_latents.py", *common, "--count", "3")
    manifest = (tmp_path / MANIFEST).read_text()

    def refused(*argv: str) -> str:
        sys_argv = ["prepare_flux_latents.py", *argv]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("sys.argv", sys_argv)
            with pytest.raises(SystemExit) as stop:
                runpy.run_path(str(ROOT / "examples" / "prepare_flux_latents.py"), run_name="__main__")
        assert stop.value.code == 2
        return capsys.readouterr().err

    assert f"--out {tmp_path} already holds 3 samples; give an empty directory, or --overwrite" in refused(
        *common, "--count", "1"
    )
    assert "invalid choice: 'nosuch'" in refused("--synthetic", "nosuch", "--out", str(tmp_path))
    assert (tmp_path / MANIFEST).read_text() == manifest and len(list(tmp_path.glob("*.safetensors"))) == 3
    images = tmp_path.parent / f"{tmp_path.name}_images"  # a pipeline that does not load removes nothing either
    images.mkdir()
    (images / "cat.png").write_bytes(b"")
    (images / "cat.txt").write_text("a cat")
    with pytest.MonkeyPatch.context() as patch, pytest.raises(ValueError, match="no-pipeline"):
        patch.setattr("sys.argv", ["prepare_flux_latents.py", "--images", str(images), "--pipeline",
                                   str(images / "no-pipeline"), "--out", str(tmp_path), "--overwrite"])  # fmt: skip
        runpy.run_path(str(ROOT / "examples" / "prepare_flux_latents.py"), run_name="__main__")
    assert (tmp_path / MANIFEST).read_text() == manifest and len(list(tmp_path.glob("*.safetensors"))) == 3
    run_example("prepare_flux_latents.py", *common, "--count", "1", "--overwrite")
    assert sorted(json.loads((tmp_path / MANIFEST).read_text())["files"]) == ["00000000.safetensors"]
    assert [path.name for path in tmp_path.glob("*.safetensors")] == ["00000000.safetensors"]


def test_resuming_prepared_data_in_another_order_is_refused():
    """A checkpoint records the order its prepared files were read in; a resume that would read
    them in another (another --seed, or --no-shuffle-data) is refused naming the flags that read them
    as saved, as its data position would name other files. A checkpoint saved before the order was
    recorded read them in name order. Synthetic data has no file order to keep."""
    from types import SimpleNamespace

    from deepspeed_knap.training.trainer import Trainer

    def run(**arguments) -> SimpleNamespace:
        fields = {"data_dir": "data", "seed": 0, "shuffle_data": True, "resume": "ckpt", **arguments}
        made = SimpleNamespace(arguments=SimpleNamespace(**fields), hooks=SimpleNamespace(expert=None))
        made._data_order = lambda: Trainer._data_order(made)
        return made

    def problem(saved: dict, **arguments) -> str | None:
        return Trainer._saved_run_problem(run(**arguments), saved, "step4")

    def saved_by(**arguments) -> dict:
        return {"step": 4, "data_position": 8, "expert": None, "data_order": run(**arguments)._data_order()}

    assert problem(saved_by()) is None
    assert problem(saved_by(shuffle_data=False), shuffle_data=False) is None
    assert problem(saved_by(data_dir=None), seed=3) is None  # synthetic then: no file order to keep
    assert problem(saved_by(), data_dir=None) is None  # synthetic now
    refused = problem(saved_by(seed=1))
    assert refused == (
        "--resume ckpt: checkpoint step4 read its files shuffled each epoch with seed 1 and this run reads them "
        "shuffled each epoch with seed 0: its data position would name other files (some seen twice this epoch, "
        "others skipped); resume with --seed 1, without --no-shuffle-data"
    )
    assert problem(saved_by(seed=7), shuffle_data=False).endswith("resume with --seed 7, without --no-shuffle-data")
    assert problem(saved_by(shuffle_data=False)).endswith("read its files in name order and this run reads them "
                                                          "shuffled each epoch with seed 0: its data position would "
                                                          "name other files (some seen twice this epoch, others "
                                                          "skipped); resume with --no-shuffle-data")  # fmt: skip
    legacy = {"step": 4, "data_position": 8}  # saved before the order was recorded: name order
    assert problem(legacy, shuffle_data=False) is None and problem(legacy, data_dir=None) is None
    assert "checkpoint step4, saved before checkpoints recorded it, read its files in name order" in problem(legacy)


def test_a_resume_over_changed_files_goes_on_with_a_note(monkeypatch, tmp_path, capsys):
    """The checkpoint records which files there were; a resume over a folder whose files changed
    since goes on from its data position (over the files as they are now), and rank 0 says so."""
    from types import SimpleNamespace

    from deepspeed_knap.training import trainer as trainer_module
    from deepspeed_knap.training.trainer import Trainer

    write_samples(tmp_path / "data", 4)
    saved = {"step": 2, "data_position": 4, "expert": None, "data_order": {"shuffle_seed": 0},
             "data_files": latent_directory(tmp_path / "data").listing}  # fmt: skip
    choice = SimpleNamespace(tag="step2", load_dir=str(tmp_path), skipped=[], given=True, manifest={"metadata": saved})
    monkeypatch.setattr(trainer_module, "find_checkpoint", lambda path: choice)
    monkeypatch.setattr(trainer_module, "load_checkpoint", lambda engine, load_dir, tag: (None, dict(saved)))
    monkeypatch.setattr(trainer_module, "check_same_on_every_rank", lambda views: None)

    def resume() -> str:
        arguments = SimpleNamespace(resume="ckpt", data_dir=str(tmp_path / "data"), seed=0, shuffle_data=True)
        run = SimpleNamespace(arguments=arguments, rank=0, engine=None, hooks=SimpleNamespace(expert=None),
                              data=latent_directory(tmp_path / "data"), raise_together=lambda problem: None,
                              _lora_alpha=lambda: None)  # fmt: skip
        run._data_order = lambda: Trainer._data_order(run)
        run._data_files = lambda: Trainer._data_files(run)
        run.progress, run._say = None, lambda line: Trainer._say(run, line)
        run._saved_run_problem = lambda recorded, tag: Trainer._saved_run_problem(run, recorded, tag)
        Trainer._resume(run)
        assert (run.start_step, run.position) == (2, 4)
        return capsys.readouterr().out

    assert "note:" not in resume()
    write_samples(tmp_path / "data", 5)  # one file more
    note = resume()
    assert "note: --resume: checkpoint step2 was trained on 4 files, names sha256 " in note
    assert f"and {tmp_path / 'data'} holds 5 files, names sha256 " in note


def test_flux2_samples_are_written_without_pooled_text_and_pass_their_check(tmp_path):
    """FLUX.2 has no pooled text: save_latent_sample writes its sample without it, the start-up
    check takes the file, and a file with it is refused naming save_latent_sample (the FLUX.1
    script it named cannot encode FLUX.2)."""
    from deepspeed_knap.models.flux.spec import TINY_FLUX2

    sample = synthetic_samples([SampleShape(text=2, visual=3, frames=1)], TINY_FLUX2, seed=0)[0]
    assert "pooled_projections" not in sample
    save_latent_sample(tmp_path / "flux2.safetensors", sample)
    assert check_latent_file(tmp_path / "flux2.safetensors", TINY_FLUX2) is None
    save_latent_sample(tmp_path / "pooled.safetensors", {**sample, "pooled_projections": torch.zeros(4)})
    refused = check_latent_file(tmp_path / "pooled.safetensors", TINY_FLUX2)
    assert "unexpected ['pooled_projections']" in refused and refused.endswith("rewrite it with save_latent_sample or "
                                                                                "remove it")  # fmt: skip
    with pytest.raises(ValueError, match=r"missing \['txt_ids'\]"):
        save_latent_sample(tmp_path / "x.safetensors", {k: v for k, v in sample.items() if k != "txt_ids"})


def test_a_data_directory_one_node_cannot_list_is_every_rank_s_error(monkeypatch, tmp_path):
    """Listing the data directory may fail on one node alone (a stale NFS handle): its error is
    agreed on, not raised on that node's ranks while the others wait in the files' check."""
    import errno
    from types import SimpleNamespace

    from deepspeed_knap.training.trainer import Trainer

    def stale(path, samples_per_rank, repeat):
        raise OSError(errno.ESTALE, "Stale file handle", str(path / "manifest.json"))

    agreed = []

    def raise_together(problem):
        agreed.append(problem)
        raise RuntimeError("raised on every rank")

    arguments = SimpleNamespace(data_dir=tmp_path, samples_per_rank=1, repeat_data=False, shuffle_data=False)
    run = SimpleNamespace(arguments=arguments, hooks=SimpleNamespace(latent_directory=stale),
                          raise_together=raise_together)  # fmt: skip
    with pytest.raises(RuntimeError, match="raised on every rank"):
        Trainer._data(run)
    assert agreed == [
        f"--data-dir {tmp_path}: [Errno {errno.ESTALE}] Stale file handle: '{tmp_path / 'manifest.json'}'"
    ]


def test_rank_0_notes_naming_a_path_that_is_not_utf8_do_not_raise_where_stdout_is_strict(monkeypatch):
    """Where stdout's encoding is strict (a UTF-8 locale), printing a path whose byte is not UTF-8
    (a lone surrogate) raised on rank 0 alone, before the collectives of a resume."""
    import io
    from types import SimpleNamespace

    from deepspeed_knap.training.trainer import Trainer

    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    monkeypatch.setattr("sys.stdout", out)
    Trainer._say(SimpleNamespace(progress=None), "--resume: loading checkpoint step2 from /ckpt/\udcff")
    out.flush()
    assert out.buffer.getvalue() == b"--resume: loading checkpoint step2 from /ckpt/\\udcff\n"
