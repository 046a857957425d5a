"""The data path of a per-sequence CP placement: packs laid out by it, collate / to_thd, the
record's groups and parts, shard / unshard / local_placement, and clear errors for bad placements."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given

from thdpack.attention import simulated_ring_attention
from thdpack.cp import partition_indices, shard, unshard
from thdpack.cp.partition import local_placement, rank_token_indices
from thdpack.layout.entries import CpLayout
from thdpack.layout.placement import PackPlacement
from thdpack.layout.ranks import rank_indices
from thdpack.packing import build_pack
from thdpack.packing.packer import SampleTokens, assemble_pack
from thdpack.plan import plan_packs
from thdpack.thd import collate, split_micro_batches, thd_collate, to_thd
from thdpack.thd.carriage import thd_meta
from thdpack.thd.parts import shard_parts

from support.placement_cases import MIXED_PACKS, batch_placements, placed_batch, placed_metadata


def _global_positions(thd: dict) -> torch.Tensor:
    """(T,) each token's position inside its entry's slot, from the record alone."""
    slots = thd_meta(thd).lengths_padded_S
    starts = np.repeat(np.cumsum(slots) - slots, slots)
    return torch.from_numpy(np.arange(int(slots.sum())) - starts)


@given(batch_placements())
def test_shard_then_unshard_is_the_identity_and_every_token_keeps_its_facts(packs):
    cp = packs[0].cp_size
    thd = placed_batch(packs, seed=len(packs))
    meta = thd_meta(thd)
    assert meta.groups is not None and meta.groups.cp_size == cp
    assert torch.equal(thd["position_ids"], _global_positions(thd))  # positions restart per entry
    shards = [shard(thd, cp, r) for r in range(cp)]
    seen = []
    for rank, part in enumerate(shards):
        index = torch.tensor(rank_token_indices(part["thd_meta"]))
        seen.append(index)
        assert len(index) == packs[0].pack_size * len(packs) // cp  # every rank holds its budget
        for key in ("input_ids", "labels", "position_ids", "padding_mask"):
            assert torch.equal(part[key], thd[key][index]), (rank, key)  # labels travel with their tokens
        rows = local_placement(part["thd_meta"], "cpu")
        assert torch.equal(rows.pos_T, part["position_ids"])  # global positions: RoPE needs nothing
        assert torch.equal(rows.valid_T, ~part["padding_mask"])
        assert part["cu_seqlens"] is thd["cu_seqlens"] and part["max_seqlen"] == thd["max_seqlen"]
    assert sorted(torch.cat(seen).tolist()) == list(range(len(thd["input_ids"])))
    back = unshard(shards, cp)
    for key, value in thd.items():
        assert torch.equal(back[key], value) if isinstance(value, torch.Tensor) else back[key] == value, key


@given(batch_placements(cp_sizes=[2, 3, 4, 8]))
def test_parts_are_te_shards_of_each_group_then_the_whole_entries(packs):
    """Each split group's rows are TE's partition of the group's entries over its ranks (so the CP
    algorithms run them unchanged); the whole part holds the rank's whole entries in order."""
    cp = packs[0].cp_size
    thd = placed_metadata(packs)
    layout = thd_meta(thd).placement
    starts = np.cumsum(layout.slots_S) - layout.slots_S
    for rank in range(cp):
        local = shard(thd, cp, rank)["thd_meta"]
        index = rank_token_indices(local)
        stop = 0
        for part in shard_parts(local):
            assert part.rows.start == stop
            stop = part.rows.stop
            got = index[part.rows]
            slots = layout.slots_S[part.entries_S]
            to_global = np.concatenate([starts[e] + np.arange(n) for e, n in zip(part.entries_S, slots, strict=True)])
            if part.group_size > 1:
                assert (part.meta.cp_size, part.meta.cp_rank) == (part.group_size, rank - part.group_start)
                want = to_global[rank_indices(slots, part.group_size, rank - part.group_start)]
                assert (layout.group_size_S[part.entries_S] == part.group_size).all()
            else:
                want = to_global
                assert part.meta.cp_size == 1 and (layout.group_start_S[part.entries_S] == rank).all()
            assert got.tolist() == want.tolist()
            assert part.meta.lengths == tuple(layout.lengths_S[part.entries_S].tolist())
        assert stop == len(index)
        sizes = [p.group_size for p in shard_parts(local)]
        assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)


def test_the_design_note_example_through_the_packer_and_shard():
    """docs/design/cp_placement.md section 4: cp 4, pack 48, A..F of 10, 7, 5, 3, 2, 1."""
    pack = PackPlacement.from_groups(
        [10, 7, 5, 3, 2, 1], {(0, 4): [0], (2, 2): [1], (0, 1): [2], (1, 1): [3, 5], (2, 1): [4]},
        cp_size=4, pack_size=48,
    )  # fmt: skip
    pieces = [SampleTokens(np.full(n, 100 + s), np.full(n, 7)) for s, n in enumerate(pack.lengths_S.tolist())]
    built = assemble_pack(pieces, 48, cp_size=4, pad_id=0, placement=pack)
    assert built["seq_lens"].tolist() == [10, 7, 5, 3, 2, 1, 0, 0, 0, 0]
    assert built["seq_lens_padded"].tolist() == [16, 8, 5, 3, 2, 1, 3, 4, 2, 4]
    assert built["cp_group_size"].tolist() == [4, 2, 1, 1, 1, 1, 1, 1, 1, 1]
    assert built["cp_group_start"].tolist() == [0, 2, 0, 1, 2, 1, 0, 1, 2, 3]
    thd = to_thd(collate([built]))
    assert thd["cu_seqlens"].tolist() == [0, 10, 17, 22, 25, 27, 28, 28, 28, 28, 28]
    assert thd["cu_seqlens_padded"].tolist() == [0, 16, 24, 29, 32, 34, 35, 38, 42, 44, 48]
    ranks = [rank_token_indices(shard(thd, 4, r)["thd_meta"]).tolist() for r in range(4)]
    assert ranks == [
        [0, 1, 14, 15, 24, 25, 26, 27, 28, 35, 36, 37],
        [2, 3, 12, 13, 29, 30, 31, 34, 38, 39, 40, 41],
        [4, 5, 10, 11, 16, 17, 22, 23, 32, 33, 42, 43],
        [6, 7, 8, 9, 18, 19, 20, 21, 44, 45, 46, 47],
    ]
    rank2 = shard(thd, 4, 2)
    assert [(p.group_start, p.group_size, p.rows) for p in shard_parts(rank2["thd_meta"])] == [
        (0, 4, slice(0, 4)), (2, 2, slice(4, 8)), (2, 1, slice(8, 12))
    ]  # fmt: skip
    assert rank2["input_ids"].tolist() == [100, 100, 0, 0, 101, 101, 101, 0, 104, 104, 0, 0]  # A[10, 11]: CP padding
    assert local_placement(rank2["thd_meta"], "cpu").sequences == (0, 1, 4, 8)


def test_all_split_placement_is_te_layout_of_the_same_slots():
    """g = cp for every sequence, no tail: the placed shard is Transformer Engine's partition."""
    pack = PackPlacement.from_groups([8, 5, 16], {(0, 4): [0, 1, 2]}, cp_size=4, pack_size=32)
    thd = placed_batch([pack])
    assert thd["cu_seqlens_padded"].tolist() == [0, 8, 16, 32, 32, 32, 32, 32]  # empty padding entries
    for rank in range(4):
        te = partition_indices(thd["cu_seqlens_padded"][:4], 32, 4, rank)  # the three slots
        assert rank_token_indices(shard(thd, 4, rank)["thd_meta"]).tolist() == te.tolist()


def test_an_adaptive_plan_builds_packs_by_its_placement():
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(1, 40, 60), rng.integers(100, 300, 6)])
    samples = [{"input_ids": rng.integers(1, 500, n)} for n in lengths]
    plan = plan_packs(lengths, 512, cp_size=4, cp_placement="adaptive")
    assert plan.placement is not None and (plan.placement.group_size == 1).any()
    for i in range(len(plan)):
        pack = build_pack(samples, plan, i)
        layout = plan.placement.pack(i).layout()
        assert pack["seq_lens"].tolist() == layout.lengths_S.tolist()
        assert pack["seq_lens_padded"].tolist() == layout.slots_S.tolist()
        assert pack["cp_group_size"].tolist() == layout.group_size_S.tolist()
        real = np.repeat(np.arange(len(layout.slots_S)), layout.slots_S)
        within = np.arange(512) - np.repeat(np.cumsum(layout.slots_S) - layout.slots_S, layout.slots_S)
        is_real = within < layout.lengths_S[real]
        assert (pack["labels"].numpy()[~is_real] == -100).all() and (pack["input_ids"].numpy()[~is_real] == 0).all()
        tokens = np.concatenate([samples[s]["input_ids"] for s in plan[i]])
        assert pack["input_ids"].numpy()[is_real].tolist() == tokens.tolist()  # conserved, in pack order
    thd = thd_collate([build_pack(samples, plan, i) for i in range(len(plan))])
    shards = [shard(thd, 4, r) for r in range(4)]
    assert all(len(s["input_ids"]) == 128 * len(plan) for s in shards)
    assert torch.equal(unshard(shards, 4)["input_ids"], thd["input_ids"])


def test_micro_batches_keep_the_groups():
    batch = _mixed_batch()
    assert batch["cp_group_size"].shape == batch["seq_lens"].shape
    first, second = split_micro_batches(batch, 2)
    for micro, pack in ((first, MIXED_PACKS[4][0]), (second, MIXED_PACKS[4][1])):
        groups = thd_meta(to_thd(micro)).groups
        assert groups.size_S.tolist() == pack.layout().group_size_S.tolist()
        assert groups.start_S.tolist() == pack.layout().group_start_S.tolist()


def test_the_record_keeps_its_placement_through_pickle_moves_and_rebuilds():
    thd = placed_batch(MIXED_PACKS[3])
    meta = thd_meta(thd)
    again = pickle.loads(pickle.dumps(thd))
    assert thd_meta(again) == meta and thd_meta(again).groups.cp_size == 3
    stale = {**thd, "cu_seqlens": thd["cu_seqlens"].clone()}  # other tensors: the record is rebuilt
    rebuilt = thd_meta(stale)
    assert rebuilt is not meta and rebuilt == meta
    local = shard(thd, 3, 1)
    relabelled = {**local, "cp_rank": 2}  # a key says another shard: the placement stays
    assert thd_meta(relabelled).cp_rank == 2 and thd_meta(relabelled).groups is not None
    fewer = {**thd, "cu_seqlens": thd["cu_seqlens"][:3], "cu_seqlens_padded": torch.tensor([0, 12, 16])}
    assert thd_meta(fewer).groups is None  # other sequences: the placement no longer describes them
    with pytest.raises(ValueError, match="this CP shard's placement describes 13 entries but its cu_seqlens now"):
        thd_meta({**local, "cu_seqlens": thd["cu_seqlens"][:3], "cu_seqlens_padded": torch.tensor([0, 6, 12])})


# ---- errors: each names the pack, the entry and the value -------------------------------


def _mixed_batch() -> dict:
    built = []
    for pack in MIXED_PACKS[4]:
        pieces = [SampleTokens(np.arange(1, n + 1), np.arange(1, n + 1)) for n in pack.lengths_S.tolist()]
        built.append(assemble_pack(pieces, 64, cp_size=4, placement=pack))
    return collate(built)


def _edited(key: str, pack: int, entry: int, value: int) -> dict:
    batch = _mixed_batch()
    batch[key] = batch[key].clone()
    batch[key][pack, entry] = value
    return batch


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            ("cp_group_size", 1, 0, 3),
            r"pack 1: sequence 0 is placed on a group of 3 ranks, which does not divide cp_size=4; valid group "
            r"sizes: 1, 2, 4",
        ),
        (
            ("cp_group_start", 0, 1, 1),
            r"pack 0: sequence 1 is placed on ranks 1..2 \(a group of 2 starting at rank 1\); a group of 2 must "
            r"start at a multiple of 2",
        ),
        (
            ("cp_group_size", 0, 2, 2),
            r"pack 0: sequence 2 is split over 2 ranks but has a slot of 5 tokens, not a multiple of 2\*2=4",
        ),
        (
            ("cp_group_start", 1, 1, 1),  # the 4 tokens whole on rank 0 move to rank 1, which is full
            r"pack 1: rank 1 holds 20 tokens, over its budget of 16 \(the pack's 64 tokens / cp_size=4\)",
        ),
        (
            ("cp_group_start", 1, 7, 0),  # rank 3's padding entry on rank 0: rank 0 over, rank 3 short
            r"pack 1: rank 0 holds 27 tokens, over its budget of 16",
        ),
    ],
)
def test_a_bad_placement_in_a_batch_is_named(edit, message):
    with pytest.raises(ValueError, match=message):
        to_thd(_edited(*edit))


def test_a_tampered_group_size_is_named_with_the_pack_s_cp_size():
    """A whole entry on rank 2 of a cp 4 pack edited to a group of 4 reaches past the last rank: it
    is named with its value and the valid sizes, at cp_size=4 (the pack's padding entries), not
    read as a pack over 6 ranks."""
    batch = _mixed_batch()
    assert batch["cp_group_size"][0, 4] == 1 and batch["cp_group_start"][0, 4] == 2
    message = (
        r"pack 0: sequence 4 is placed on ranks 2..5 \(a group of 4 starting at rank 2\); a group of 4 must start "
        r"at a multiple of 4 in \[0, 0\] \(groups are aligned; valid group sizes for cp_size=4: 1, 2, 4\)"
    )
    with pytest.raises(ValueError, match=message):
        shard(to_thd(_edited("cp_group_size", 0, 4, 4)), 4, 0)
    with pytest.raises(ValueError, match=r"pack 0: sequence 4 is placed on a group of 3 ranks, which does not divide "
                                         r"cp_size=4; valid group sizes: 1, 2, 4"):  # fmt: skip
        to_thd(_edited("cp_group_size", 0, 4, 3))


def test_packs_of_two_cp_sizes_do_not_share_a_batch():
    batch = _mixed_batch()
    two = PackPlacement.from_groups([7], {(0, 2): [0]}, cp_size=2, pack_size=64)
    other = assemble_pack([SampleTokens(np.arange(1, 8), np.arange(1, 8))], 64, cp_size=2, placement=two)
    packs = [{k: v[0][v[0] != -1000] if k in ("seq_lens", "seq_lens_padded", "cp_group_size", "cp_group_start")
              else v[0] for k, v in batch.items()}, other]  # fmt: skip
    with pytest.raises(ValueError, match="pack 1 is placed over 2 CP ranks but pack 0 over 4"):
        collate(packs)


def test_shard_refuses_another_cp_size_and_names_a_placement_that_does_not_fit():
    thd = to_thd(_mixed_batch())
    with pytest.raises(ValueError, match=r"laid out for cp_size=4 \(its CP placement.*not cp_size=2; shard it"):
        shard(thd, 2, 0)
    plain = {k: v for k, v in thd.items() if k != "thd_meta"}
    plain["cu_seqlens"] = plain["cu_seqlens"].clone()  # made elsewhere: no record, no placement
    plain_meta = thd_meta({"cu_seqlens": plain["cu_seqlens"], "cu_seqlens_padded": plain["cu_seqlens_padded"]})
    assert plain_meta.groups is None
    te_like = {**plain, "thd_meta": plain_meta}
    with pytest.raises(ValueError, match="has padded length 5, not a multiple of 2\\*cp_size=8"):
        shard(te_like, 4, 0)  # without its placement the batch is not a TE layout
    placed = shard(te_like, 4, 2, placement=MIXED_PACKS[4])
    assert torch.equal(placed["input_ids"], shard(thd, 4, 2)["input_ids"])
    with pytest.raises(
        ValueError, match=r"the placement describes 11 entries \(1 packs.*but the batch has 19; a sequence"
    ):
        shard(te_like, 4, 0, placement=MIXED_PACKS[4][0])  # a pack's sequences placed never
    with pytest.raises(ValueError, match=r"pack 1: entry 1 has 4 real tokens in a slot of 4, but the placement has 12"):
        shard(te_like, 4, 0, placement=[MIXED_PACKS[4][0], _swapped(MIXED_PACKS[4][1])])
    with pytest.raises(ValueError, match=r"already carries a CP placement .* that differs from the one given"):
        shard(thd, 4, 0, placement=[MIXED_PACKS[4][0], _swapped(MIXED_PACKS[4][1])])


def _swapped(pack: PackPlacement) -> PackPlacement:
    """The same pack with its second and third sequences swapped (other lengths at those entries)."""
    order = [0, 2, 1, *range(3, len(pack.lengths_S))]
    return PackPlacement(cp_size=pack.cp_size, pack_size=pack.pack_size, lengths_S=pack.lengths_S[order],
                         group_size_S=pack.group_size_S[order], group_start_S=pack.group_start_S[order])  # fmt: skip


def test_layout_check_without_packs_names_the_rank():
    with pytest.raises(ValueError, match=r"^rank 0 holds 3 tokens, over its budget of 2.5 \(the pack's 5 tokens"):
        CpLayout(np.array([3, 2]), np.array([3, 2]), np.array([1, 1]), np.array([0, 1])).check(2)


def test_the_simulated_ring_refuses_a_placed_batch():
    thd = placed_metadata(MIXED_PACKS[2])
    x = torch.zeros(int(thd["cu_seqlens_padded"][-1]), 2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="simulated_ring_attention runs one ring over Transformer Engine's layout"):
        simulated_ring_attention(x, x, x, thd, cp_size=2)
