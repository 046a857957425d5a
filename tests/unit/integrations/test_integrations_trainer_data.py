"""Hugging Face examples as thdpack samples, and the step loader the Trainer integration feeds from:
micro-batches built step by step, resumable, and cheap to skip with accelerate's ``skip_first_batches``."""

from __future__ import annotations

import pytest
import torch

from thdpack.integrations.trainer_data import (
    MICRO_BATCH_KEY,
    STEP_KEY,
    STEP_LABELS_KEY,
    HFSamples,
    StepSource,
    packed_step_loader,
    thdpack_sample,
)
from thdpack.packing import PackedDataset
from thdpack.thd.carriage import thd_meta


def test_labels_are_shifted_and_the_last_token_predicts_nothing():
    sample = thdpack_sample({"input_ids": [5, 6, 7, 8], "labels": [-100, 6, -100, 8]}, 0)
    assert sample["input_ids"].tolist() == [5, 6, 7, 8]
    assert sample["labels"].tolist() == [6, -100, 8, -100]
    assert set(thdpack_sample({"input_ids": [5, 6]}, 0)) == {"input_ids"}  # thdpack derives next-token labels


@pytest.mark.parametrize(
    ("example", "match"),
    [
        ({"input_ids": [5, 6, 0], "attention_mask": [1, 1, 0]}, "example 3 has 1 padding tokens"),
        ({"input_ids": [5, 6, 7], "labels": [5, 6]}, "example 3: labels has 2 tokens but input_ids has 3"),
    ],
)
def test_examples_thdpack_cannot_pack_are_refused(example, match):
    with pytest.raises(ValueError, match=match):
        thdpack_sample(example, 3)


def test_a_datasets_dataset_is_read_by_its_token_columns():
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_dict(
        {"input_ids": [[1, 2, 3], [4, 5]], "labels": [[-100, 2, 3], [4, 5]], "messages": ["a", "b"]}
    )
    samples = HFSamples(data)
    assert samples.dataset.column_names == ["input_ids", "labels"]
    assert samples.lengths().tolist() == [3, 2]
    shuffled = HFSamples(data.select([1, 0]))  # an indices mapping over the Arrow table
    assert shuffled.lengths().tolist() == [2, 3] == [len(shuffled[i]["input_ids"]) for i in (0, 1)]
    assert samples[0]["labels"].tolist() == [2, 3, -100]
    with pytest.raises(ValueError, match="the training dataset has no 'input_ids' column"):
        HFSamples(datasets.Dataset.from_dict({"text": ["a"]}))


def test_a_list_of_examples_is_read_as_it_is():
    samples = HFSamples([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4]}])
    assert samples.lengths().tolist() == [3, 1]
    assert samples[0]["labels"].tolist() == [2, 3, -100] and set(samples[1]) == {"input_ids"}


def test_a_stream_is_refused():
    with pytest.raises(ValueError, match="the training dataset is a generator; thdpack plans packs over every"):
        HFSamples(example for example in [{"input_ids": [1]}])


def _source(**kwargs) -> StepSource:
    samples = [{"input_ids": list(range(1, n + 1))} for n in (5, 3, 7, 2, 6, 4, 8, 1)]
    dataset = PackedDataset(samples, 12, cp_size=2, seed=0)
    stream = dataset.step_stream(micro_batches=2, packs_per_micro_batch=1)
    return StepSource(stream, cp_size=2, cp_rank=1, device=torch.device("cpu"), num_examples=8, **kwargs)


def test_micro_batches_are_cp_shards_with_the_step_labels():
    source = _source()
    first, second = source[(0, 0)], source[(0, 1)]
    assert (first[STEP_KEY], first[MICRO_BATCH_KEY], second[MICRO_BATCH_KEY]) == (0, 0, 1)
    meta = thd_meta(first)
    assert (meta.cp_size, meta.cp_rank, first["input_ids"].shape) == (2, 1, (6,))  # half of a 12-token pack
    assert first[STEP_LABELS_KEY][0] is first["labels"] and first[STEP_LABELS_KEY][1] is second["labels"]
    assert source.steps_done == 1


def test_steps_are_built_in_order_only():
    source = _source()
    source[(0, 0)]
    with pytest.raises(RuntimeError, match="asked for micro-batch 0 of step 2, but thdpack's pack stream has built 1"):
        source[(2, 0)]


def test_a_resumed_source_continues_where_the_saved_one_stood():
    full = _source()
    batches = [full[(k, m)] for k in range(3) for m in range(2)]
    head = _source()
    head[(0, 0)]
    resumed = _source()
    resumed.load_state_dict(head.state_dict())
    for k in (1, 2):
        for m in (0, 1):
            assert torch.equal(resumed[(k, m)]["input_ids"], batches[2 * k + m]["input_ids"])


def test_skipping_a_resumed_epoch_builds_no_skipped_step():
    """The Trainer resumes mid-epoch with accelerate's skip_first_batches: the references of the
    trained steps are dropped unfetched, and the source (restored after step 1) builds step 1 next."""
    accelerate = pytest.importorskip("accelerate")
    head = _source()
    head[(0, 0)]
    resumed = _source()
    resumed.load_state_dict(head.state_dict())
    loader = packed_step_loader(resumed, steps_per_epoch=3, micro_batches=2)
    assert len(loader) == 6
    skipping = accelerate.skip_first_batches(loader, 2)
    assert [(mb[STEP_KEY], mb[MICRO_BATCH_KEY]) for mb in skipping] == [(1, 0), (1, 1), (2, 0), (2, 1)]


def test_the_loader_covers_the_epoch_the_trainer_sets():
    loader = packed_step_loader(_source(), steps_per_epoch=2, micro_batches=2)
    assert [mb[STEP_KEY] for mb in loader] == [0, 0, 1, 1]
    loader.set_epoch(1)
    assert [mb[STEP_KEY] for mb in loader] == [2, 2, 3, 3]


def test_token_ids_are_checked_against_the_vocabulary_in_arrow_and_one_by_one():
    datasets = pytest.importorskip("datasets")
    good = {"input_ids": [[1, 2, 3], [4, 5]], "labels": [[-100, 2, 3], [4, 5]]}
    HFSamples(datasets.Dataset.from_dict(good), vocab_size=6).check_token_ids()
    listed = [dict(zip(good, values, strict=True)) for values in zip(*good.values(), strict=True)]
    HFSamples(listed, vocab_size=6).check_token_ids()
    bad = {"input_ids": [[1, 2, 3], [4, 5]], "labels": [[-100, 2, 3], [4, -7]]}
    for data in (datasets.Dataset.from_dict(bad), [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [4, -7]}]):
        with pytest.raises(ValueError, match=r"example 1: labels holds -7 at position 1, not a token id of the"):
            HFSamples(data, vocab_size=6).check_token_ids()
    with pytest.raises(ValueError, match=r"example 1: input_ids holds 6 at position 1"):
        HFSamples(datasets.Dataset.from_dict({"input_ids": [[1], [4, 6]]}), vocab_size=6).check_token_ids()
