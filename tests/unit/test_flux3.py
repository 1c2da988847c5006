"""Packed FLUX.3 against diffusers' ``Flux3Transformer2DModel``, one sample at a time, and attention
by segment.

The reference is diffusers' model run on each sample alone (a batch of one), which is how diffusers
must run samples of different sizes and reference counts; ours runs them all packed in one batch,
with and without references. Balanced runs on 4 gloo ranks are in tests/multirank/test_flux3.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.flux3_cases import CONFIGS, SHAPES, diffusers_output, random_samples, reference_model, relative_error

diffusers = pytest.importorskip("diffusers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # diffusers' fp32 q/k norm on an fp64 model

CASES = list(CONFIGS)
INPUTS = ("hidden_states", "encoder_hidden_states", "image_cond_hidden_states")


def packed(ref, **kwargs):
    from deepspeed_knap.models.flux3 import PackedFlux3Transformer

    return PackedFlux3Transformer.from_diffusers(ref, attention_backend="sdpa", **kwargs)


def _run_both(case: str, shapes, **kwargs):
    """Outputs, parameter and input gradients of a weighted sum of the outputs: packed, diffusers."""
    ref = reference_model(case, torch.float64)
    model = packed(ref, **kwargs)
    ours_in = random_samples(case, shapes, 1, torch.float64, requires_grad=True)
    theirs_in = random_samples(case, shapes, 1, torch.float64, requires_grad=True)
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(s["hidden_states"].shape, generator=g, dtype=torch.float64) for s in ours_in]
    ours = model.forward_samples(ours_in)
    sum((o * w).sum() for o, w in zip(ours, weights, strict=True)).backward()
    theirs = [diffusers_output(ref, s) for s in theirs_in]
    sum((o * w).sum() for o, w in zip(theirs, weights, strict=True)).backward()
    ours_grads = {name: p.grad for name, p in model.named_parameters()}
    theirs_grads = {name: p.grad for name, p in ref.named_parameters()}
    input_pairs = [(a[k].grad, b[k].grad) for a, b in zip(ours_in, theirs_in, strict=True) for k in INPUTS if k in a]
    return (ours, theirs), (ours_grads, theirs_grads), input_pairs


@pytest.mark.parametrize("case", CASES)
def test_state_dict_names_and_shapes_equal_diffusers_both_ways(case):
    from deepspeed_knap.models.flux3 import PackedFlux3Transformer

    ref = reference_model(case, torch.float32)
    ours = PackedFlux3Transformer(**CONFIGS[case])
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == {
        k: tuple(v.shape) for k, v in ref.state_dict().items()
    }
    ref.load_state_dict(packed(ref).state_dict(), strict=True)


@pytest.mark.parametrize("case", CASES)
def test_packed_outputs_and_gradients_equal_diffusers_per_sample_fp64(case):
    """SHAPES in one packed batch (samples with no, one and two references of different sizes):
    outputs, every parameter's gradient and the latents', references' and text's input gradients."""
    (ours, theirs), (ours_grads, theirs_grads), input_pairs = _run_both(case, SHAPES)
    for out, want in zip(ours, theirs, strict=True):
        assert out.shape == want.shape and relative_error(out, want) <= 1e-10
    assert ours_grads.keys() == theirs_grads.keys()
    for name, grad in theirs_grads.items():
        assert grad is not None and relative_error(ours_grads[name], grad) <= 1e-10, name
    assert len(input_pairs) == 13
    for got, want in input_pairs:
        assert relative_error(got, want) <= 1e-10


def test_without_references_and_with_gradient_checkpointing():
    """A batch where no sample has references (the reference blocks run on no rows and get zero
    gradients) and recomputed layers: still diffusers' outputs and gradients."""
    shapes = [s for s in SHAPES if not s[3]]
    (ours, theirs), (ours_grads, theirs_grads), _ = _run_both("flux3", shapes, gradient_checkpointing=True)
    for out, want in zip(ours, theirs, strict=True):
        assert relative_error(out, want) <= 1e-10
    for name, grad in ours_grads.items():
        if name.startswith(("mode_blocks.image_cond.", "x_embedders.image_cond", "early_stream_modulations.image_cond",
                            "single_stream_modulations.image_cond")):  # fmt: skip
            assert theirs_grads[name] is None and not grad.any(), name
        else:
            assert relative_error(grad, theirs_grads[name]) <= 1e-10, name


def test_a_rank_without_samples_runs_forward_and_backward():
    """Zero tokens: every layer runs on empty tensors, every parameter gets a (zero) gradient."""
    from deepspeed_knap.models.flux3 import PackedFlux3Transformer

    model = PackedFlux3Transformer(**CONFIGS["flux3_flow_map"])
    out = model(model.pack([]))
    assert out.shape == (0, CONFIGS["flux3_flow_map"]["in_channels"])
    out.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_attention_segments_are_block_diagonal_and_exact():
    """``segments`` runs attention within each segment of each sequence: the same as attending each
    segment alone; an absent segment (0) is skipped; a table that does not sum to the lengths is refused."""
    from deepspeed_knap.runtime.attention import KnapDistributedAttention
    from deepspeed_knap.runtime.packing import PackedBatch
    from deepspeed_knap.runtime.routing import local_batch

    g = torch.Generator().manual_seed(0)
    seq_lens, segments = (6, 5), np.array([[2, 4, 0], [1, 3, 1]])
    q, k, v = (torch.randn(11, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    routed = local_batch(PackedBatch(torch.zeros(11, 1), seq_lens))
    attention = KnapDistributedAttention(2, backend="sdpa")
    out = attention(q, k, v, routed, segments=segments)
    lens = [int(n) for n in segments.ravel() if n]
    for qq, kk, vv, oo in zip(*(t.split(lens) for t in (q, k, v, out)), strict=True):
        probs = torch.softmax(torch.einsum("qhd,khd->hqk", qq, kk) / 2, dim=-1)
        assert torch.allclose(oo, torch.einsum("hqk,khd->qhd", probs, vv), rtol=1e-12, atol=1e-14)
    assert not torch.allclose(out, attention(q, k, v, routed))  # whole sequences differ
    with pytest.raises(ValueError, match=r"do not cover the step.s 2 sequences of lengths \[6, 5\]"):
        attention(q, k, v, routed, segments=np.array([[2, 3, 0], [1, 3, 1]]))


def test_export_loads_in_diffusers_and_diffusers_checkpoints_load_here(tmp_path):
    from diffusers import Flux3Transformer2DModel

    from deepspeed_knap.models.auto import from_pretrained
    from deepspeed_knap.models.flux3 import PackedFlux3Transformer

    ref = reference_model("flux3_narrow_refs", torch.float32)
    samples = random_samples("flux3_narrow_refs", SHAPES[:3], 6, torch.float32)
    expected = [diffusers_output(ref, s) for s in samples]
    exported = packed(ref).save_pretrained(tmp_path / "ours")
    reloaded = Flux3Transformer2DModel.from_pretrained(exported)
    assert all(torch.equal(t, ref.state_dict()[k]) for k, t in reloaded.state_dict().items())
    # Not bitwise: a model diffusers loads runs 3-5e-7 off the one it saved, in fp32, ours or not.
    for sample, want in zip(samples, expected, strict=True):
        assert relative_error(diffusers_output(reloaded, sample), want) <= 1e-5
    ref.save_pretrained(tmp_path / "pipeline" / "transformer")
    model = from_pretrained(tmp_path / "pipeline", attention_backend="sdpa")  # the family from _class_name
    assert type(model) is PackedFlux3Transformer
    for output, want in zip(model.forward_samples(samples), expected, strict=True):
        assert relative_error(output, want) <= 1e-5


def test_bad_samples_name_the_sample_and_the_problem():
    from deepspeed_knap.models.flux3 import PackedFlux3Transformer

    plain = PackedFlux3Transformer(**CONFIGS["flux3"])
    flow_map = PackedFlux3Transformer(**CONFIGS["flux3_flow_map"])
    good = random_samples("flux3", SHAPES[:2], 7, torch.float32)  # sample 1 has a 2 x 3 reference
    with_target = random_samples("flux3_flow_map", SHAPES[:2], 7, torch.float32)

    def without(sample, key):
        return {k: v for k, v in sample.items() if k != key}

    cases = [
        (plain, [good[0], without(good[1], "image_cond_ids")],
         r"sample 1 has image_cond_hidden_states without image_cond_ids"),
        (plain, [good[0], without(good[1], "image_cond_hidden_states")],
         r"sample 1 has image_cond_ids without image_cond_hidden_states"),
        (flow_map, [with_target[0], without(with_target[1], "target_timestep")],
         r"sample 1: this flow-map model \(flow_map=True\) needs a target_timestep"),
        (plain, [good[0], {**good[1], "target_timestep": torch.tensor(0.5)}],
         r"sample 1: target_timestep given, but this model is not a flow map"),
        (plain, [{**good[0], "encoder_hidden_states": torch.zeros(0, 12), "txt_ids": torch.zeros(0, 4)}],
         r"sample 0 has a text of zero tokens"),
        (plain, [good[0], {**good[1], "img_ids": good[1]["img_ids"][:, :3]}],
         r"sample 1: 'img_ids' has shape \[4, 3\]; expected \[4, 4\]"),
        (plain, [good[0], {**good[1], "image_cond_ids": good[1]["image_cond_ids"][:, :2]}],
         r"sample 1: 'image_cond_ids' has shape \[6, 2\]; expected \[6, 4\]"),
        (plain, [without(good[0], "txt_ids")], r"sample 0 has no \['txt_ids'\]"),
    ]  # fmt: skip
    for model, samples, message in cases:
        with pytest.raises(ValueError, match=message):
            model.pack(samples)
    # A 0-d reference (an IndexError) and text rows given as a nested list (an AttributeError after
    # the check) were raised, not carried: that rank alone raised in a balanced step.
    carried = plain.pack([good[0], {**good[1], "image_cond_hidden_states": torch.tensor(1.0)}], on_problem="carry")
    assert carried.problem.startswith("sample 1: IndexError") and carried.num_samples == 0, carried.problem
    listed = {**good[0], "encoder_hidden_states": good[0]["encoder_hidden_states"].tolist()}
    assert plain.pack([listed], on_problem="carry").txt_lens == plain.pack([good[0]]).txt_lens


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash", "torch_varlen"])
def test_gpu_varlen_kernels_attend_by_segment(backend):
    """The varlen kernels take the segments as sequences: bf16 on CUDA against fp64 sdpa by segment."""
    from deepspeed_knap.runtime.attention import KnapDistributedAttention
    from deepspeed_knap.runtime.packing import PackedBatch
    from deepspeed_knap.runtime.routing import local_batch

    try:
        attention = KnapDistributedAttention(8, backend=backend)
    except ValueError as unavailable:
        pytest.skip(str(unavailable))
    seq_lens, segments = (4608, 1200), np.array([[512, 4096, 0], [200, 700, 300]])
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(sum(seq_lens), 8, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = attention(q, k, v, local_batch(PackedBatch(torch.zeros(sum(seq_lens), 1, device="cuda"), seq_lens)),
                    segments=segments)  # fmt: skip
    routed = local_batch(PackedBatch(torch.zeros(sum(seq_lens), 1, device="cuda", dtype=torch.float64), seq_lens))
    ref = KnapDistributedAttention(8, backend="sdpa")(q.double(), k.double(), v.double(), routed, segments=segments)
    assert attention.varlen_attn.resolve(q.device, q.dtype) == backend
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-2)
