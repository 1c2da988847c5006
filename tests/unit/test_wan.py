"""Packed Wan 2.x against diffusers' ``WanTransformer3DModel``, one sample at a time.

The reference is diffusers' model run on each sample alone (batch of one), which is how diffusers
must run samples of different frame counts and sizes; ours runs them all packed in one batch.
Balanced runs on 4 gloo ranks are in tests/multirank/test_wan.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.wan_cases import (
    CONFIGS,
    FP32_ROUNDED,
    SHAPES,
    TOLERANCE,
    diffusers_output,
    grads,
    norm_relative_error,
    output_weights,
    random_samples,
    reference_model,
    relative_error,
)

diffusers = pytest.importorskip("diffusers")

CASES = list(CONFIGS)


def packed(ref, **kwargs):
    from deepspeed_knap.models.wan import PackedWanTransformer

    return PackedWanTransformer.from_diffusers(ref, attention_backend="sdpa", **kwargs)


@pytest.mark.parametrize("case", CASES)
def test_state_dict_names_and_shapes_equal_diffusers_both_ways(case):
    from deepspeed_knap.models.wan import PackedWanTransformer

    ref = reference_model(case, torch.float32)
    ours = PackedWanTransformer(**CONFIGS[case])
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == {
        k: tuple(v.shape) for k, v in ref.state_dict().items()
    }
    ref.load_state_dict(packed(ref).state_dict(), strict=True)


def test_a_copy_keeps_each_tensor_s_dtype_where_diffusers_keeps_modules_in_fp32():
    """diffusers loads Wan in bf16 with ``_keep_in_fp32_modules`` in fp32: ``from_diffusers`` copies
    each tensor as it is (same values, dtype, device), and the copy trains every parameter."""
    ref = reference_model("wan21", torch.bfloat16)
    kept = diffusers.WanTransformer3DModel._keep_in_fp32_modules
    for name, module in ref.named_modules():
        if any(part in kept for part in name.split(".")):
            module.float()
    theirs = ref.state_dict()
    assert {t.dtype for t in theirs.values()} == {torch.bfloat16, torch.float32}
    copy = packed(ref)
    ours = copy.state_dict()
    assert {k: v.dtype for k, v in ours.items()} == {k: v.dtype for k, v in theirs.items()}
    for key, value in theirs.items():
        assert torch.equal(ours[key], value) and ours[key].data_ptr() != value.data_ptr(), key
    assert all(p.requires_grad and p.device == torch.device("cpu") for p in copy.parameters())


@pytest.mark.parametrize("case", CASES)
def test_packed_outputs_and_gradients_equal_diffusers_per_sample_fp64(case):
    """Every sample of SHAPES (an image, videos of 2-5 frames) in one packed batch; parameter and
    input gradients of a weighted sum of the outputs, against diffusers' summed over samples."""
    ref = reference_model(case, torch.float64)
    model = packed(ref)
    ours_in = random_samples(case, SHAPES, 1, torch.float64, requires_grad=True)
    theirs_in = random_samples(case, SHAPES, 1, torch.float64, requires_grad=True)

    outputs = model.forward_samples(ours_in)
    weights = output_weights(outputs, 2)
    sum((o * w).sum() for o, w in zip(outputs, weights, strict=True)).backward()
    for sample, output, weight in zip(theirs_in, outputs, weights, strict=True):
        expected = diffusers_output(ref, sample)
        assert output.shape == expected.shape
        assert relative_error(output, expected) <= TOLERANCE[torch.float64]
        (expected * weight).sum().backward()

    for ours, theirs in zip(ours_in, theirs_in, strict=True):
        for key, tolerance in (("hidden_states", 1e-10), ("encoder_hidden_states", 1e-10),
                               ("encoder_hidden_states_image", 1e-6)):  # fmt: skip
            if key in ours:  # the image context's gradient diffusers rounds (tests/support/wan_cases.py)
                assert relative_error(ours[key].grad, theirs[key].grad) <= tolerance, key
    ours_grads, theirs_grads = grads(model), grads(ref)
    for name in theirs_grads:
        # diffusers rounds these to fp32 even in fp64 (tests/support/wan_cases.py).
        tolerance = 1e-6 if any(part in name for part in FP32_ROUNDED) else TOLERANCE[torch.float64]
        assert relative_error(ours_grads[name], theirs_grads[name]) <= tolerance, name


def test_packed_outputs_and_gradients_equal_diffusers_per_sample_fp32():
    ref = reference_model("wan22_ti2v", torch.float32)
    model = packed(ref)
    samples = random_samples("wan22_ti2v", SHAPES, 3, torch.float32)
    outputs = model.forward_samples(samples)
    weights = output_weights(outputs, 4)
    sum((o * w.float()).sum() for o, w in zip(outputs, weights, strict=True)).backward()
    for sample, output, weight in zip(samples, outputs, weights, strict=True):
        expected = diffusers_output(ref, sample)
        assert relative_error(output, expected) <= TOLERANCE[torch.float32]
        (expected * weight.float()).sum().backward()
    ours, theirs = grads(model), grads(ref)
    assert norm_relative_error(*(torch.cat([g[n].flatten() for n in theirs]) for g in (ours, theirs))) <= 1e-5
    for name in theirs:
        assert norm_relative_error(ours[name], theirs[name]) <= 2e-5, name


def test_gradient_checkpointing_changes_nothing():
    ref = reference_model("wan21", torch.float64)
    results = []
    for checkpointing in (False, True):
        model = packed(ref, gradient_checkpointing=checkpointing)
        outputs = model.forward_samples(random_samples("wan21", SHAPES[:3], 5, torch.float64))
        sum(o.square().sum() for o in outputs).backward()
        results.append((torch.cat([o.flatten() for o in outputs]), grads(model)))
    assert torch.equal(results[0][0], results[1][0])
    for name, grad in results[0][1].items():
        assert torch.allclose(grad, results[1][1][name], rtol=1e-12, atol=1e-14), name


@pytest.mark.parametrize("case", ["wan21", "wan21_i2v"])
def test_a_rank_without_samples_runs_forward_and_backward(case):
    """A GPU with zero tokens: every layer runs on empty tensors and every parameter gets a (zero)
    gradient, as ZeRO-3 needs from every rank."""
    from deepspeed_knap.models.wan import PackedWanTransformer

    config = CONFIGS[case]
    model = PackedWanTransformer(**config)
    out = model(model.pack([]))
    assert out.shape == (0, config["out_channels"] * 4)
    out.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert model.forward_samples([]) == []


def test_rope_tables_are_bitwise_diffusers():
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    from deepspeed_knap.models.wan.layers import rotary_cos_sin
    from deepspeed_knap.models.wan.wan import grid_positions

    for head_dim, grid in ((128, (21, 45, 80)), (6, (3, 5, 7))):
        cos, sin = WanRotaryPosEmbed(head_dim, (1, 2, 2), 1024)(torch.zeros(1, 1, grid[0], 2 * grid[1], 2 * grid[2]))
        ours_cos, ours_sin = rotary_cos_sin(grid_positions(*grid), head_dim)
        assert torch.equal(ours_cos, cos[0, :, 0, 0::2]) and torch.equal(ours_sin, sin[0, :, 0, 1::2])


def test_patch_layouts_invert_each_other():
    from deepspeed_knap.models.wan import output_rows, patchify, unpatchify

    latents = torch.randn(3, 4, 6, 8)
    for patch in ((1, 2, 2), (2, 3, 2)):
        grid = (4 // patch[0], 6 // patch[1], 8 // patch[2])
        assert torch.equal(unpatchify(output_rows(latents, patch), grid, patch), latents)
        rows = patchify(latents, patch)  # channel-major within a patch, as the Conv3d weight
        conv = torch.nn.functional.conv3d(latents[None], torch.eye(rows.shape[1]).reshape(-1, 3, *patch), stride=patch)
        assert torch.equal(rows, conv[0].flatten(1).T)


def test_cross_attention_kernel_attends_each_query_chunk_to_its_own_keys():
    from deepspeed_knap.runtime.attention import VarlenAttention, VarlenSeqs

    def seqs(lens):
        return VarlenSeqs(tuple(lens), torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]), max(lens))

    g = torch.Generator().manual_seed(0)
    q_lens, kv_lens = [3, 1, 4], [2, 5, 1]
    q = torch.randn(8, 2, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(8, 2, 4, generator=g, dtype=torch.float64) for _ in range(2))
    out = VarlenAttention("sdpa")(q, k, v, seqs(q_lens), seqs(kv_lens))
    for qq, kk, vv, oo in zip(*(t.split(lens) for t, lens in ((q, q_lens), (k, kv_lens), (v, kv_lens), (out, q_lens))),
                              strict=True):  # fmt: skip
        probs = torch.softmax(torch.einsum("qhd,khd->hqk", qq, kk) / 2, dim=-1)
        assert torch.allclose(oo, torch.einsum("hqk,khd->qhd", probs, vv), rtol=1e-12, atol=1e-14)


def test_export_loads_in_diffusers_and_diffusers_checkpoints_load_here(tmp_path):
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file, save_file

    from deepspeed_knap.models.auto import from_pretrained
    from deepspeed_knap.models.loading import load_checkpoint
    from deepspeed_knap.models.wan import PackedWanTransformer

    ref = reference_model("wan22_ti2v", torch.float32)
    samples = random_samples("wan22_ti2v", SHAPES[:3], 6, torch.float32)
    expected = [diffusers_output(ref, s) for s in samples]
    exported = packed(ref).save_pretrained(tmp_path / "ours")
    reloaded = WanTransformer3DModel.from_pretrained(exported)
    for sample, want in zip(samples, expected, strict=True):
        assert torch.equal(diffusers_output(reloaded, sample), want)
    ref.save_pretrained(tmp_path / "pipeline" / "transformer")
    model = from_pretrained(tmp_path / "pipeline", attention_backend="sdpa")  # the family from _class_name
    assert type(model) is PackedWanTransformer
    for output, want in zip(model.forward_samples(samples), expected, strict=True):
        assert relative_error(output, want) <= 1e-5
    # A pipeline of two experts (Wan 2.2 A14B): as one model it would silently be transformer/ alone.
    (tmp_path / "pipeline" / "model_index.json").write_text(json.dumps({
        "_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"], "boundary_ratio": 0.875}))  # fmt: skip
    with pytest.raises(ValueError, match=r"is a pipeline of two transformers .* PackedWanExperts.from_pretrained"):
        from_pretrained(tmp_path / "pipeline")
    assert type(from_pretrained(tmp_path / "pipeline" / "transformer")) is PackedWanTransformer
    # Wan 2.1 I2V's diffusers release stores zero attn2.norm_added_q weights, which diffusers' class
    # ignores (_keys_to_ignore_on_load_unexpected): so does the loader, and reads none of them.
    weights = tmp_path / "pipeline" / "transformer" / "diffusion_pytorch_model.safetensors"
    _, read = load_checkpoint(PackedWanTransformer, weights.parent)
    save_file({**load_file(weights), "blocks.0.attn2.norm_added_q.weight": torch.full((3,), float("nan"))}, weights)
    model, report = load_checkpoint(PackedWanTransformer, weights.parent, attention_backend="sdpa")
    assert report.read_bytes == read.read_bytes and not any("norm_added_q" in name for name in model.state_dict())
    for output, want in zip(model.forward_samples(samples), expected, strict=True):
        assert relative_error(output, want) <= 1e-5
    config = json.loads((exported / "config.json").read_text())
    (exported / "config.json").write_text(json.dumps({**config, "pos_embed_seq_len": 514}))
    with pytest.raises(ValueError, match=r"pos_embed_seq_len=514 \(first-last-frame models\) is not supported"):
        from_pretrained(exported)


def test_two_experts_of_different_shapes_are_refused_naming_each_value():
    from deepspeed_knap.models.wan import PackedWanTransformer
    from deepspeed_knap.models.wan.experts import PackedWanExperts
    from deepspeed_knap.models.wan.spec import TINY_WAN

    low_noise = PackedWanTransformer(**{**TINY_WAN, "num_layers": 1})
    with pytest.raises(ValueError, match=r"configs differ \(num_layers: 2 in transformer, 1 in transformer_2\)"):
        PackedWanExperts(PackedWanTransformer(**{**TINY_WAN, "num_layers": 2}), low_noise, boundary_ratio=0.875)


def test_bad_samples_name_the_sample_and_the_problem():
    from deepspeed_knap.models.wan import PackedWanTransformer

    model = PackedWanTransformer(**CONFIGS["wan22_ti2v"])
    good = random_samples("wan22_ti2v", SHAPES[:2], 7, torch.float32)  # sample 1: 3 x 2 x 2 = 12 tokens
    cases = {
        r"sample 1: latents \[C, F, H, W\] = \[6, 3, 5, 4\]: height 5 not a positive multiple of the patch \[1, 2, 2\]": {
            "hidden_states": torch.zeros(6, 3, 5, 4)
        },
        r"sample 1: 'timestep' has shape \[11\]; expected a scalar or one per latent token after patching: "
        r"\[12\] = F/1 \* H/2 \* W/2 = 3 \* 2 \* 2": {"timestep": torch.zeros(11)},
        r"sample 1: 'hidden_states' has shape \[4, 3, 4, 4\]; expected latents \[C, F, H, W\] with C = in_channels = 6": {
            "hidden_states": torch.zeros(4, 3, 4, 4)
        },
        r"sample 1: 'encoder_hidden_states' has shape \[0, 100\]; expected \[L, 100\]": {
            "encoder_hidden_states": torch.zeros(0, 100)
        },
        r"sample 1 has encoder_hidden_states_image but this model has no image_dim": {
            "encoder_hidden_states_image": torch.zeros(3, 12)
        },
        r"sample 1: post-patch grid \[40, 2, 2\] exceeds rope_max_seq_len=32": {
            "hidden_states": torch.zeros(6, 40, 4, 4), "timestep": torch.tensor(1.0)
        },
    }  # fmt: skip
    for message, change in cases.items():
        with pytest.raises(ValueError, match=message):
            model.pack([good[0], {**good[1], **change}])
    with pytest.raises(ValueError, match=r"sample 0 has no \['timestep'\]"):
        model.pack([{k: v for k, v in good[0].items() if k != "timestep"}])
    i2v = PackedWanTransformer(**CONFIGS["wan21_i2v"])
    with pytest.raises(ValueError, match=r"sample 0 has no \['encoder_hidden_states_image'\]"):
        i2v.pack(random_samples("wan21", SHAPES[:1], 8, torch.float32))
    with pytest.raises(ValueError, match="an I2V model has both"):
        PackedWanTransformer(**{**CONFIGS["wan21_i2v"], "added_kv_proj_dim": None})


def _bf16_error_against_fp32_diffusers(backend: str, device: str) -> tuple[float, float]:
    """Packed Wan 2.2 TI2V in bf16 with ``backend`` (self- and cross-attention through it, one
    packed batch of every SHAPES sample) against diffusers in fp32, per sample on ``device``: the
    norm-relative error of the outputs and of the latents' input gradient."""
    from deepspeed_knap.models.wan import PackedWanTransformer

    ref = reference_model("wan22_ti2v", torch.float32).to(device)
    model = PackedWanTransformer.from_diffusers(ref, attention_backend=backend).to(device, torch.bfloat16)
    samples = [
        {k: v.to(device, torch.float32 if k == "timestep" else torch.bfloat16) for k, v in sample.items()}
        for sample in random_samples("wan22_ti2v", SHAPES, 3, torch.float32)
    ]
    reference = [{k: v.float().requires_grad_(k == "hidden_states") for k, v in s.items()} for s in samples]
    for sample in samples:
        sample["hidden_states"].requires_grad_(True)
    outputs = model.forward_samples(samples)
    weights = [w.to(device) for w in output_weights(outputs, 4)]
    sum((o.float() * w.float()).sum() for o, w in zip(outputs, weights, strict=True)).backward()
    expected = [diffusers_output(ref, sample) for sample in reference]
    sum((e * w.float()).sum() for e, w in zip(expected, weights, strict=True)).backward()
    ours_grad, theirs_grad = (
        torch.cat([s["hidden_states"].grad.flatten() for s in group]) for group in (samples, reference)
    )
    outputs, expected = (torch.cat([o.flatten() for o in group]) for group in (outputs, expected))
    return norm_relative_error(outputs, expected), norm_relative_error(ours_grad, theirs_grad)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash", "torch_varlen"])
def test_gpu_varlen_kernels_run_packed_wan_as_well_as_sdpa(backend):
    """The varlen kernels take Wan's packed self-attention and its cross-attention (query chunks
    against their own samples' text rows): in bf16 on CUDA their error against diffusers in fp32 is
    that of per-sequence SDPA in bf16, within a factor of 2."""
    from deepspeed_knap.runtime.attention import VarlenAttention

    try:
        VarlenAttention(backend)
    except ValueError as unavailable:
        pytest.skip(str(unavailable))
    sdpa = _bf16_error_against_fp32_diffusers("sdpa", "cuda")
    kernel = _bf16_error_against_fp32_diffusers(backend, "cuda")
    assert max(sdpa) < 0.05, sdpa  # bf16 rounding, not a wrong result
    for ours, baseline in zip(kernel, sdpa, strict=True):
        assert ours <= 2 * baseline + 1e-3, (kernel, sdpa)
