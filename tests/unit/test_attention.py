"""Local variable-length attention backends and single-GPU KnapDistributedAttention, against an
explicit softmax(q k^T / sqrt(Dh)) v per sequence. GPU kernels are compared on CUDA when present."""

import logging
import math

import pytest
import torch
from deepspeed.sequence.layer import DistributedAttention

from deepspeed_knap.planner.topology import build_topology
from deepspeed_knap.runtime.attention import (
    BACKENDS,
    KnapDistributedAttention,
    VarlenAttention,
    VarlenSeqs,
    head_splits,
)
from deepspeed_knap.runtime.packing import PackedBatch
from deepspeed_knap.runtime.routing import local_batch


def reference_attention(q, k, v, seq_lens):
    """Explicit per-sequence attention: ``[L, H, Dh]`` in, ``[L, H, Dh]`` out."""
    outs = []
    for qi, ki, vi in zip(*(t.split(seq_lens) for t in (q, k, v)), strict=True):
        scores = torch.einsum("qhd,khd->hqk", qi, ki) / math.sqrt(q.shape[-1])
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), vi))
    return torch.cat(outs)


def varlen_inputs(seq_lens, heads=3, head_dim=8, dtype=torch.float64, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    q, k, v = (torch.randn(total, heads, head_dim, generator=generator, dtype=torch.float64).to(device, dtype)
               for _ in range(3))  # fmt: skip
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, VarlenSeqs(tuple(seq_lens), cu, max(seq_lens))


SEQ_LENS = [1, 7, 32, 2, 19]


def test_sdpa_backend_equals_explicit_attention():
    q, k, v, seqs = varlen_inputs(SEQ_LENS)
    out = VarlenAttention("sdpa")(q, k, v, seqs)
    torch.testing.assert_close(out, reference_attention(q, k, v, SEQ_LENS), rtol=0, atol=1e-12)


def test_softmax_scale_is_used():
    q, k, v, seqs = varlen_inputs(SEQ_LENS)
    out = VarlenAttention("sdpa", softmax_scale=1.0)(q, k, v, seqs)
    expected = reference_attention(q * math.sqrt(q.shape[-1]), k, v, SEQ_LENS)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_auto_runs_sdpa_on_cpu_and_logs_it(caplog):
    attention = VarlenAttention("auto")
    with caplog.at_level(logging.INFO, logger="DeepSpeed"):
        assert attention.resolve(torch.device("cpu"), torch.float32) == "sdpa"
    assert "runs 'sdpa'" in caplog.text


def test_unusable_backends_fail_clearly():
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        VarlenAttention("xformers")
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="flash-attn is not installed"):
            VarlenAttention("flash")
    q, k, v, seqs = varlen_inputs(SEQ_LENS)
    with pytest.raises(ValueError, match="needs CUDA tensors in float16 or bfloat16"):
        VarlenAttention("torch_varlen")(q, k, v, seqs)


def test_the_agreed_kernel_view_tells_nodes_that_would_run_another_kernel_apart(monkeypatch):
    """``auto`` runs the first usable kernel, so the ranks agree on which are usable: a node whose
    flash-attn fails to load (a build for another torch: an ImportError) runs what a node without
    one runs, and says why when asked for flash by name; one with flash-attn would differ."""
    import sys
    import types

    from deepspeed_knap.runtime import attention as attention_module

    def fails_to_load(name):
        raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda")

    broken = types.ModuleType("flash_attn")
    broken.__getattr__ = fails_to_load
    working = types.ModuleType("flash_attn")
    working.flash_attn_varlen_func = lambda *args, **kwargs: None
    views = {}
    for node, module in (("none", None), ("broken", broken), ("flash", working)):
        monkeypatch.setitem(sys.modules, "flash_attn", module)
        attention_module._flash_varlen.cache_clear()
        views[node] = (attention_module.backend_view("auto"), attention_module.backend_view("flash"))
    attention_module._flash_varlen.cache_clear()
    assert views["none"][0] == views["broken"][0] != views["flash"][0]
    assert views["none"][0].startswith("flash unusable; torch_varlen ") and views["flash"][1] == "usable"
    assert views["none"][1] == "flash-attn is not installed (pip install flash-attn)"
    assert views["broken"][1].startswith("flash-attn fails to import (ImportError: flash_attn_2_cuda.so: undefined")


def test_head_splits_are_near_equal_and_cover_all_heads():
    assert head_splits(24, 8) == [3] * 8
    assert head_splits(6, 4) == [2, 2, 1, 1]
    for heads in range(1, 30):
        for size in range(1, heads + 1):
            splits = head_splits(heads, size)
            assert sum(splits) == heads and max(splits) - min(splits) <= 1 and min(splits) >= 1


def test_knap_attention_on_one_gpu_is_attention_over_whole_sequences():
    attention = KnapDistributedAttention(3, backend="sdpa")
    assert isinstance(attention, DistributedAttention)
    q, k, v, _ = varlen_inputs(SEQ_LENS)
    routed = local_batch(PackedBatch(torch.zeros(sum(SEQ_LENS), 1), SEQ_LENS))
    torch.testing.assert_close(attention(q, k, v, routed), reference_attention(q, k, v, SEQ_LENS), rtol=0, atol=1e-12)
    empty = local_batch(PackedBatch(torch.zeros(0, 1), ()))
    x = torch.zeros(0, 3, 8, requires_grad=True)
    out = attention(x, x, x, empty)
    out.sum().backward()  # still on the autograd graph: ZeRO-3 needs every rank's backward to run
    assert out.shape == (0, 3, 8) and x.grad is not None
    # Segments given positionally were dropped (full attention, silently): the same as by keyword,
    # each segment attending within itself; anything more is refused.
    segments = torch.tensor([[1, 0], [3, 4], [30, 2], [2, 0], [9, 10]])
    by_segment = reference_attention(q, k, v, [n for row in segments.tolist() for n in row if n])
    torch.testing.assert_close(attention(q, k, v, routed, segments), by_segment, rtol=0, atol=1e-12)
    torch.testing.assert_close(attention(q, k, v, routed, segments=segments), by_segment, rtol=0, atol=1e-12)
    for extra in ((segments, "extra"), ("extra",)):  # the second: segments by keyword beside a stray one
        with pytest.raises(ValueError, match=r"takes \(query, key, value, routed, segments=None\); got also 1 more"):
            attention(q, k, v, routed, *extra, **({} if len(extra) == 2 else {"segments": segments}))


def test_knap_attention_checks_heads_against_the_topology_at_construction():
    KnapDistributedAttention(24, topology=build_topology("g8n2"))
    KnapDistributedAttention(6, topology=build_topology("g4n1"))  # uneven heads are fine
    with pytest.raises(ValueError, match="bags of 16 GPUs but attention has only 12 heads"):
        KnapDistributedAttention(12, topology=build_topology("g16n1+g4n1"))


def test_knap_attention_rejects_qkv_that_disagree_with_the_routed_batch():
    attention = KnapDistributedAttention(3, backend="sdpa")
    q, k, v, _ = varlen_inputs(SEQ_LENS)
    routed = local_batch(PackedBatch(torch.zeros(sum(SEQ_LENS) + 1, 1), [*SEQ_LENS[:-1], SEQ_LENS[-1] + 1]))
    with pytest.raises(ValueError, match=r"query has shape \(61, 3, 8\); expected \[T, H, Dh\] = \[62, 3, Dh\]"):
        attention(q, k, v, routed)
    with pytest.raises(ValueError, match="value has shape"):
        attention(q[:, :, :4], k[:, :, :4], v, local_batch(PackedBatch(torch.zeros(61, 1), SEQ_LENS)))
    # Mixed dtypes: a single GPU's kernel refuses them where a group's exchange would promote them, so
    # some ranks raised alone; refused on every rank (the dtypes are the model's) before any exchange.
    with pytest.raises(ValueError, match=r"query, key and value have dtypes torch\.float64, torch\.float32 and"):
        attention(q, k.float(), v.float(), local_batch(PackedBatch(torch.zeros(61, 1), SEQ_LENS)))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash", "torch_varlen"])
def test_gpu_varlen_kernels_match_sdpa_forward_and_backward(backend):
    try:
        attention = VarlenAttention(backend)
    except ValueError as unavailable:
        pytest.skip(str(unavailable))
    seq_lens = [1, 127, 4096, 33, 1000]
    q, k, v, seqs = varlen_inputs(seq_lens, heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda")
    for t in (q, k, v):
        t.requires_grad_(True)
    out = attention(q, k, v, seqs)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref_inputs = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref = reference_attention(*ref_inputs, seq_lens)
    ref_grads = torch.autograd.grad(ref.square().sum(), ref_inputs)
    assert attention.resolve(q.device, q.dtype) == backend
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-2)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        scale = ref_grad.abs().max()
        assert (grad.double() - ref_grad).abs().max() <= 3e-2 * scale


@pytest.mark.gpu
def test_auto_prefers_a_varlen_kernel_on_cuda():
    choice = VarlenAttention("auto").resolve(torch.device("cuda"), torch.bfloat16)
    assert choice in ("flash", "torch_varlen") and choice in BACKENDS


def test_every_module_runs_equally_often_with_or_without_tokens():
    """ZeRO-3 traces module calls and requires the same order on every rank, so a rank with no
    tokens must call every submodule as often as one with many, forward and backward."""
    from deepspeed_knap.models.tiny_dit import TinyDiT, random_batch

    torch.manual_seed(0)
    model = TinyDiT(24, 6, 5)
    calls = {}
    for lengths in ([], [3, 9]):
        fired = calls.setdefault(len(lengths), [])
        hooks = [m.register_forward_pre_hook(lambda m, a, n=n, f=fired: f.append(("fwd", n)))
                 for n, m in model.named_modules()]  # fmt: skip
        hooks += [m.register_full_backward_pre_hook(lambda m, g, n=n, f=fired: f.append(("bwd", n)))
                  for n, m in model.named_modules() if n != "blocks"]  # fmt: skip
        batch = random_batch(lengths, 0)
        model(batch).square().sum().backward()
        for hook in hooks:
            hook.remove()
    assert calls[0] == calls[2] and len(calls[0]) > 20
