"""thdpack.packing.packer: samples -> packs from plans and segments (every overflow policy, CP sizes, labels)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from thdpack.packing.packer import SampleTokens, assemble_pack, build_pack, pack_from_segments, read_sample
from thdpack.plan import plan_packs

from support.pack_checks import check_packs, unique_samples

N = -100


@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=25),
    cp_size=st.sampled_from([1, 2, 4]),
    pack_units=st.integers(1, 4),
    algorithm=st.sampled_from(["bfd", "ffd", "sequential", "window"]),
    overflow=st.sampled_from(["drop", "truncate", "split"]),
    labels=st.booleans(),
    loss_mask=st.booleans(),
    pad_id=st.sampled_from([0, 7, 50_000]),
    seed=st.integers(0, 2**16),
)
def test_packs_from_any_plan_conserve_tokens_and_keep_labels_in_their_document(
    lengths, cp_size, pack_units, algorithm, overflow, labels, loss_mask, pad_id, seed
):
    pack_size = 8 * pack_units  # a multiple of 2*cp_size for every cp_size drawn
    samples = unique_samples(lengths, np.random.default_rng(seed), labels=labels, loss_mask=loss_mask)
    assume(not (overflow == "drop" and min(lengths) > pack_size))  # else nothing is left to plan
    plan = plan_packs(lengths, pack_size, algorithm=algorithm, cp_size=cp_size, overflow=overflow, seed=seed)
    packs = [build_pack(samples, plan, i, pad_id=pad_id) for i in range(len(plan))]
    check_packs(packs, samples, pack_size, cp_size, pad_id, overflow)


def test_split_piece_keeps_the_documents_next_token_and_restarts_positions():
    samples = [{"input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}]
    plan = plan_packs([10], 4, overflow="split", algorithm="sequential")
    packs = [build_pack(samples, plan, i) for i in range(len(plan))]
    assert [p["input_ids"].tolist() for p in packs] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 0]]
    assert [p["labels"].tolist() for p in packs] == [[2, 3, 4, 5], [6, 7, 8, 9], [10, N, N, N]]
    assert [p["position_ids"].tolist() for p in packs] == [[0, 1, 2, 3]] * 3


def test_cp_layout_written_out():
    samples = [
        {"input_ids": [1, 2, 3], "labels": [2, 3, N]},
        {"input_ids": [4, 5, 6, 7, 8], "loss_mask": [0, 0, 1, 1, 1]},
    ]
    pack = pack_from_segments(samples, ([0, 1], [0, 0], [3, 5]), 16, cp_size=2, pad_id=9)
    assert pack["input_ids"].tolist() == [1, 2, 3, 9, 4, 5, 6, 7, 8, 9, 9, 9, 9, 9, 9, 9]
    assert pack["labels"].tolist() == [2, 3, N, N, N, N, 7, 8, N, N, N, N, N, N, N, N]
    assert pack["position_ids"].tolist() == [0, 1, 2, 3, *range(12)]
    assert (pack["seq_lens"].tolist(), pack["seq_lens_padded"].tolist()) == ([3, 5], [4, 12])


def test_samples_are_never_modified():
    ids, labels, mask = np.array([1, 2, 3]), np.array([2, 3, 4]), torch.tensor([0, 1, 1])
    sample = {"input_ids": ids, "labels": labels, "loss_mask": mask}
    pack = pack_from_segments([sample], ([0], [0], [3]), 4)
    assert pack["labels"].tolist() == [N, 3, 4, N]
    assert ids.tolist() == [1, 2, 3] and labels.tolist() == [2, 3, 4] and mask.tolist() == [0, 1, 1]
    assert set(sample) == {"input_ids", "labels", "loss_mask"}


def test_tensor_and_numpy_samples():
    s = read_sample({"input_ids": torch.tensor([4, 5], dtype=torch.int32), "labels": np.array([5, -100])}, 0)
    assert s.input_ids.dtype == np.int64 and s.labels.tolist() == [5, N]


@pytest.mark.parametrize(
    ("sample", "error", "message"),
    [
        ([1, 2], TypeError, "sample 3 must be a mapping with 'input_ids', got list"),
        ({"ids": [1]}, ValueError, r"sample 3 has no 'input_ids' \(keys: \['ids'\]\)"),
        ({"input_ids": []}, ValueError, "sample 3 has empty input_ids"),
        (
            {"input_ids": [1.0, 2.5]},
            TypeError,
            r"sample 3: input_ids must hold integers, got dtype float64 \(first values \[1.0, 2.5\]\)",
        ),
        ({"input_ids": [[1, 2]]}, ValueError, r"sample 3: input_ids must be 1-D, got shape \(1, 2\)"),
        (
            {"input_ids": [1, 2], "labels": [1]},
            ValueError,
            "sample 3: labels has 1 tokens but input_ids has 2",
        ),
        ({"input_ids": [1, 2], "labels": ["a", "b"]}, TypeError, "sample 3: labels must hold integers"),
        (
            {"input_ids": [1, 2], "loss_mask": [1]},
            ValueError,
            "sample 3: loss_mask has 1 entries but input_ids has 2",
        ),
        (
            {"input_ids": [1, 2], "loss_mask": [0.5, 1.0]},
            TypeError,
            "sample 3: loss_mask must hold 0/1 or booleans",
        ),
    ],
)
def test_bad_samples(sample, error, message):
    with pytest.raises(error, match=message):
        read_sample(sample, 3)


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        # Hugging Face's labels (the model shifts them): a copy task if packed as they are
        (
            {"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8]},
            r"sample 3: labels equal input_ids at every labelled position \(4 of them, e\.g\. position 0: 5\); "
            r"thdpack's labels are already shifted \(labels\[t\] is the token after input_ids\[t\]\), as packed here "
            r"they would train a copy task\. Hugging Face labels: pass np\.append\(labels\[1:\], -100\)",
        ),
        (
            {"input_ids": [5, 6, 7, 8], "labels": [N, N, 7, 8]},  # a masked prompt
            r"sample 3: labels equal input_ids at every labelled position \(2 of them, e\.g\. position 2: 7\)",
        ),
        # a left-padded (or right-padded) row: the padding would be trained as text
        (
            {"input_ids": [0, 6, 7], "attention_mask": [0, 1, 1]},
            r"sample 3: attention_mask is not 1 at 1 of 3 positions \(0\): padding, which packing would train as "
            r"text \(packs need no padding\); pass input_ids\[attention_mask == 1\]",
        ),
        ({"input_ids": [5, 6, 0, 0], "attention_mask": [1, 1, 0, 0]}, r"is not 1 at 2 of 4 positions \(2, 3\)"),
        (
            {"input_ids": [5, 6], "attention_mask": [1]},
            r"sample 3: attention_mask has shape \(1,\) but input_ids has 2",
        ),
        # token ids and labels that are no token ids
        (
            {"input_ids": [5, -1, 7]},
            r"sample 3: input_ids holds -1 at position 1; token ids are >= 0: check the tokenization",
        ),
        (
            {"input_ids": [5, 6, 7], "labels": [6, -7, N]},
            r"sample 3: labels holds -7 at position 1; token ids are >= 0 or -100 \(no loss\)",
        ),
        # a loss mask is 0 or 1
        (
            {"input_ids": [5, 6, 7], "loss_mask": [1, 2, 1]},
            r"sample 3: loss_mask is 2 at position 1; give 1 \(train on the token's label\) or 0 \(no loss\)",
        ),
        ({"input_ids": [5, 6, 7], "loss_mask": [1, 0, -1]}, r"sample 3: loss_mask is -1 at position 2"),
    ],
)
def test_silently_wrong_samples_are_refused_naming_the_position(sample, message):
    with pytest.raises(ValueError, match=message):
        read_sample(sample, 3)


def test_the_conventions_that_stay_accepted():
    # shifted labels of a repeated token equal input_ids too: nothing tells them apart, both are fine
    assert read_sample({"input_ids": [4, 4, 4], "labels": [4, 4, N]}, 0).labels.tolist() == [4, 4, N]
    # NeMo's "labels" records: the last label points past input_ids
    assert read_sample({"input_ids": [5, 6, 7], "labels": [6, 7, 8]}, 0).labels.tolist() == [6, 7, 8]
    # an all-ones attention_mask (a tokenizer's output without padding), a boolean loss_mask
    ones = read_sample({"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "loss_mask": [False, True, True]}, 0)
    assert ones.labels.tolist() == [N, 7, N]
    # NeMo's pack_dataset drop-in packs labels as they come
    assert read_sample({"input_ids": [5, 6], "labels": [5, 6]}, 0, labels_as_given=True).labels.tolist() == [5, 6]


def test_token_ids_at_or_above_a_known_vocabulary_are_named():
    with pytest.raises(
        ValueError,
        match=r"sample 2: input_ids holds 97 at position 2, not a token id of the vocabulary of 97 \(ids 0\.\.96\); "
        "tokenize with the model's tokenizer",
    ):
        read_sample({"input_ids": [5, 6, 97]}, 2, vocab_size=97)
    with pytest.raises(ValueError, match=r"sample 2: labels holds 100 at position 0, not a token id of the vocabulary"):
        read_sample({"input_ids": [5, 6, 7], "labels": [100, 7, N]}, 2, vocab_size=97)
    assert read_sample({"input_ids": [5, 96]}, 2, vocab_size=97).labels.tolist() == [96, N]


def test_plan_and_samples_disagree():
    samples = [{"input_ids": [1, 2, 3]}]
    with pytest.raises(ValueError, match=r"sample 0 has 3 tokens but the plan takes tokens \[2, 6\)"):
        pack_from_segments(samples, ([0], [2], [4]), 8)
    with pytest.raises(ValueError, match="sample 0 has 3 tokens but the plan was made for length 5"):
        build_pack(samples, plan_packs([5], 8), 0)
    with pytest.raises(ValueError, match="segments must have equal lengths, got 1 indices, 2 starts, 1 lengths"):
        pack_from_segments(samples, ([0], [0, 0], [3]), 8)


def test_pieces_that_do_not_fit():
    piece = SampleTokens(np.arange(5), np.arange(5))
    with pytest.raises(ValueError, match="the pack's sequences take 16 slots"):
        assemble_pack([piece, piece], 12, cp_size=2)
    with pytest.raises(TypeError, match="pad_id must be an integer token id, got None"):
        assemble_pack([piece], 8, pad_id=None)


def test_a_packed_dataset_of_hugging_face_labels_is_refused_not_trained_as_a_copy_task():
    """Issue 26: ``labels == input_ids`` packed without a word; the pack trained token t -> token t."""
    from thdpack.packing.dataset import PackedDataset

    samples = [{"input_ids": [3, 4, 5, 6], "labels": [3, 4, 5, 6]}, {"input_ids": [7, 8], "labels": [7, 8]}]
    with pytest.raises(ValueError, match=r"sample \d: labels equal input_ids at every labelled position"):
        PackedDataset(samples, 8, shuffle=False)[0]
