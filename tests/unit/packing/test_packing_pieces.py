"""thdpack.packing.pieces: token ranges of sequences in one canonical form, their set operations and record."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from thdpack.packing.pieces import Pieces, arrays_digest


def test_canonical_form_sorts_and_merges_contiguous_pieces():
    pieces = Pieces.of([2, 0, 0, 2], [0, 3, 0, 5], [5, 2, 3, 1])
    assert (pieces.sample.tolist(), pieces.start.tolist(), pieces.length.tolist()) == ([0, 2], [0, 0], [5, 6])
    assert pieces == Pieces.of([0, 2], [0, 0], [5, 6])


def test_overlapping_pieces_are_refused_naming_the_tokens():
    with pytest.raises(ValueError, match=r"sequence 4: tokens \[3, 6\) overlap tokens \[0, 5\): a token would be"):
        Pieces.of([4, 4], [0, 3], [5, 3])
    with pytest.raises(ValueError, match="a piece needs a start >= 0 and a length >= 1"):
        Pieces.of([0], [0], [0])


def test_minus_and_union_are_inverse_on_random_sets():
    rng = np.random.default_rng(0)
    lengths_S = rng.integers(1, 50, 300)
    everything = Pieces.whole(lengths_S)
    cuts = [np.sort(rng.choice(np.arange(1, n), size=min(n - 1, 3), replace=False)) if n > 1 else [] for n in lengths_S]
    sample, start, length = [], [], []
    for s, (n, cut) in enumerate(zip(lengths_S, cuts, strict=True)):
        bounds = [0, *cut, n]
        for a, b in itertools.pairwise(bounds):
            if rng.random() < 0.5:
                sample.append(s), start.append(a), length.append(b - a)
    taken = Pieces.of(sample, start, length)
    rest = everything.minus(taken)
    assert rest.union(taken) == everything
    assert rest.tokens + taken.tokens == int(lengths_S.sum())
    with pytest.raises(ValueError, match="overlap"):
        rest.union(taken.union(rest.select(np.arange(len(rest)) == 0)))


def test_minus_refuses_pieces_outside_the_set():
    with pytest.raises(ValueError, match=r"sequence 1: tokens \[2, 4\) are not within the set"):
        Pieces.whole(np.array([3, 3])).minus(Pieces.of([1], [2], [2]))


def test_the_record_round_trips_and_its_digest_is_the_documented_recipe():
    import hashlib

    lengths_S = np.array([4, 6, 3, 9, 1, 1, 1, 1, 2])
    pieces = Pieces.of([0, 1, 3, 8], [0, 2, 0, 0], [4, 2, 5, 2])
    arrays = pieces.to_arrays(lengths_S)
    assert np.unpackbits(arrays["whole"]).tolist()[:9] == [1, 0, 0, 0, 0, 0, 0, 0, 1]
    assert (arrays["sample"].tolist(), arrays["start"].tolist(), arrays["length"].tolist()) == ([1, 3], [2, 0], [2, 5])
    assert Pieces.from_arrays(arrays, lengths_S) == pieces
    recipe = hashlib.sha256(b"".join(arrays[k].tobytes() for k in ("whole", "sample", "start", "length")))
    assert arrays_digest(arrays) == recipe.hexdigest()
    with pytest.raises(ValueError, match="the record's bitmap holds 16 sequences, not the data's 20"):
        Pieces.from_arrays(arrays, np.ones(20, dtype=np.int64))
    with pytest.raises(ValueError, match="pieces past the end of the data's 9 sequences"):
        Pieces.from_arrays(arrays, np.array([4, 3, 3, 9, 1, 1, 1, 1, 2]))
