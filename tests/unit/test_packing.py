"""The packed batch: packing and unpacking samples, per-token sequence index, consistency checks."""

import pytest
import torch

from deepspeed_knap.runtime.packing import PackedBatch, pack_samples, unpack_tokens


def samples():
    return [
        {"tokens": torch.randn(3, 4), "ids": torch.arange(9).view(3, 3), "t": torch.tensor(0.5)},
        {"tokens": torch.randn(1, 4), "ids": torch.arange(3).view(1, 3), "t": torch.tensor(0.1)},
        {"tokens": torch.randn(5, 4), "ids": torch.arange(15).view(5, 3), "t": torch.tensor(0.9)},
    ]


def test_pack_then_unpack_gives_the_samples_back():
    items = samples()
    batch = pack_samples(items, token_keys=("ids",), sample_keys=("t",))
    assert batch.seq_lens == (3, 1, 5) and batch.offsets == (0, 3, 4, 9) and batch.num_tokens == 9
    assert batch.seq_index.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2]
    assert batch.sample_data["t"].tolist() == pytest.approx([0.5, 0.1, 0.9])
    assert batch.problem() is None
    assert batch.signature() == "tokens float32[4]; token_data {ids: int64[3]}; sample_data {t: float32[]}"
    for item, tokens, ids in zip(items, unpack_tokens(batch.tokens, batch.seq_lens),
                                 unpack_tokens(batch.token_data["ids"], batch.seq_lens), strict=True):  # fmt: skip
        assert torch.equal(item["tokens"], tokens) and torch.equal(item["ids"], ids)


def test_problem_names_what_is_inconsistent():
    batch = pack_samples(samples(), token_keys=("ids",), sample_keys=("t",))
    assert "seq_lens sum to 10 but tokens has 9 rows" in PackedBatch(batch.tokens, (3, 1, 6)).problem()
    bad_column = PackedBatch(batch.tokens, batch.seq_lens, {"ids": batch.token_data["ids"][:-1]})
    assert "token_data['ids'] has shape (8, 3); expected [9, ...]" in bad_column.problem()
    bad_sample = PackedBatch(batch.tokens, batch.seq_lens, {}, {"t": torch.zeros(2)})
    assert "sample_data['t'] has shape (2,); expected [3, ...]" in bad_sample.problem()


def test_pack_errors_name_the_sample_and_key():
    items = samples()
    with pytest.raises(ValueError, match="sample 1 has no 'ids'"):
        pack_samples([items[0], {"tokens": torch.zeros(2, 4)}], token_keys=("ids",))
    items[2]["ids"] = items[2]["ids"][:4]
    with pytest.raises(ValueError, match="sample 2: 'ids' has 4 rows but 'tokens' has 5"):
        pack_samples(items, token_keys=("ids",))
    with pytest.raises(ValueError, match="at least one sample"):
        pack_samples([])
    with pytest.raises(ValueError, match="cannot be split"):
        unpack_tokens(torch.zeros(4, 1), [2, 3])


def test_columns_turn_into_bytes_and_back_even_empty():
    """Routed columns travel as raw bytes, an empty one from NumPy too (``torch.as_tensor`` gives it
    stride 0, which a view to bytes rejects: a rank with no samples failed its route)."""
    import numpy as np

    from deepspeed_knap.runtime.routing import _from_row_bytes, _row_bytes

    for column in (torch.arange(12).view(4, 3), torch.as_tensor(np.zeros((0, 3), dtype=np.int64))):
        raw = _row_bytes(column)
        assert raw.shape == (len(column), 24) and torch.equal(_from_row_bytes(raw, column), column)
