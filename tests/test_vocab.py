import pytest
import torch

from drafttrain.data.vocab import (
    build_draft_vocab,
    count_assistant_tokens,
    default_draft_vocab_size,
    draft_to_target,
    target_to_draft,
)
from drafttrain.io import DraftTrainError


def _selected(d2t):
    return (torch.arange(d2t.numel()) + d2t).tolist()


def test_top_n_with_ties_by_lower_id():
    counts = torch.tensor([0, 5, 3, 5, 1, 3, 9, 0])
    d2t, t2d = build_draft_vocab(counts, 4)
    # ranking: 6 (9), 1 (5), 3 (5), 2 (3), 5 (3) ... -> top 4 = {6, 1, 3, 2}, tie 2 vs 5 goes to 2
    assert _selected(d2t) == [1, 2, 3, 6]
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool
    assert d2t.tolist() == [1, 1, 1, 3]
    assert t2d.tolist() == [False, True, True, True, False, False, True, False]


def test_always_include_forces_ids_in():
    counts = torch.tensor([0, 5, 3, 5, 1, 3, 9, 0])
    d2t, t2d = build_draft_vocab(counts, 4, always_include=[7])
    assert _selected(d2t) == [1, 3, 6, 7]  # 7 (count 0) evicts the lowest-ranked of the top 4 (id 2)
    assert t2d[7] and not t2d[2]
    assert int(t2d.sum()) == 4


def test_pads_with_lowest_unused_ids_when_few_seen():
    counts = torch.zeros(10, dtype=torch.long)
    counts[7] = 4
    counts[3] = 2
    d2t, t2d = build_draft_vocab(counts, 5)
    assert _selected(d2t) == [0, 1, 2, 3, 7]
    assert int(t2d.sum()) == 5


def test_full_vocab_is_identity():
    d2t, t2d = build_draft_vocab(torch.randint(0, 5, (16,)), 16)
    assert d2t.tolist() == [0] * 16 and bool(t2d.all())


@pytest.mark.parametrize("n", [0, -3, 11])
def test_bad_sizes_raise(n):
    with pytest.raises(DraftTrainError, match="draft_vocab_size"):
        build_draft_vocab(torch.ones(10), n)


def test_bad_always_include_raises():
    with pytest.raises(DraftTrainError, match="outside"):
        build_draft_vocab(torch.ones(10), 3, always_include=[10])
    with pytest.raises(DraftTrainError, match="always_include"):
        build_draft_vocab(torch.ones(10), 2, always_include=[1, 2, 3])


def test_count_assistant_tokens_only_counts_masked_tokens():
    examples = [
        {"input_ids": [1, 2, 3, 3, 4], "loss_mask": [0, 0, 1, 1, 1]},
        {"input_ids": [4, 4, 0], "loss_mask": [1, 0, 1]},
        {"input_ids": [5, 5], "loss_mask": [0, 0]},
    ]
    counts = count_assistant_tokens(examples, 6)
    assert counts.dtype == torch.long
    assert counts.tolist() == [1, 0, 0, 2, 2, 0]


def test_count_assistant_tokens_errors():
    with pytest.raises(DraftTrainError, match="outside the vocabulary"):
        count_assistant_tokens([{"input_ids": [1, 9], "loss_mask": [1, 1]}], 5)
    with pytest.raises(DraftTrainError, match="differ in length"):
        count_assistant_tokens([{"input_ids": [1, 2], "loss_mask": [1]}], 5)
    with pytest.raises(DraftTrainError, match="loss_mask"):
        count_assistant_tokens([{"input_ids": [1, 2]}], 5)


def test_round_trip_and_out_of_vocab():
    g = torch.Generator().manual_seed(0)
    V, Vd = 50, 17
    d2t, t2d = build_draft_vocab(torch.randint(0, 100, (V,), generator=g), Vd, always_include=[49])
    selected = torch.tensor(_selected(d2t))
    assert torch.equal(draft_to_target(torch.arange(Vd), d2t), selected)
    assert torch.equal(target_to_draft(selected, d2t, t2d), torch.arange(Vd))
    draft = torch.randint(0, Vd, (3, 4), generator=g)
    assert torch.equal(target_to_draft(draft_to_target(draft, d2t), d2t, t2d), draft)
    outside = torch.nonzero(~t2d).flatten()
    assert outside.numel() == V - Vd
    assert (target_to_draft(outside, d2t, t2d) == -1).all()
    assert target_to_draft(torch.tensor([49]), d2t, t2d).item() == Vd - 1


def test_default_draft_vocab_size():
    assert default_draft_vocab_size(128256) == 32000
    assert default_draft_vocab_size(1000) == 500
    assert default_draft_vocab_size(1) == 1
