"""make_cp_batch_for_te on real gloo ranks with a DeviceMesh: golden vectors S1-S4 (nemo_te_spec.md §1.6)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from thdpack.compat.nemo import make_cp_batch_for_te, pack_dataset, packed_sequence_thd_collater, process_input_for_thd
from thdpack.packing.dataset import PackedDataset
from thdpack.testing import run_distributed

pytestmark = pytest.mark.distributed

N = -100
F, T = False, True


class WorldGroupMesh:
    """Not a DeviceMesh: anything with size() and get_group() will do."""

    def size(self):
        return dist.get_world_size()

    def get_group(self):
        return dist.group.WORLD


def packs(samples, size, cp_size):
    made = pack_dataset(samples, "train", size, cp_size=cp_size)
    return [dict(made[i]) for i in range(len(made))]


def c1():
    a = packs([{"input_ids": x, "labels": x} for x in ([1, 2, 3], [4, 5, 6, 7, 8])], 16, 2)
    b = packs([{"input_ids": x, "labels": x} for x in ([1, 2, 3], [4, 5], [6])], 16, 2)
    return packed_sequence_thd_collater(a + b)


def p6():
    return packed_sequence_thd_collater(packs([{"input_ids": x, "labels": x} for x in ([1, 2, 3], [4, 5], [6])], 20, 2))


def s3():
    samples = [
        {"input_ids": [11, 12, 13, 14, 15], "labels": [12, 13, 14, 15, N]},
        {"input_ids": [21, 22, 23], "labels": [22, 23, N]},
    ]
    return packed_sequence_thd_collater(packs(samples, 16, 4))


def shard_cases(rank, world_size, cases):
    """Each case's shard on this rank, with a DeviceMesh and with a plain mesh; a ValueError's text."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    out = {}
    for name, (batch, kwargs) in cases.items():
        try:
            out[name] = make_cp_batch_for_te(mesh, batch, **kwargs)
            out[name + "/plain-mesh"] = make_cp_batch_for_te(WorldGroupMesh(), batch, **kwargs)
        except ValueError as err:
            out[name] = f"ValueError: {err}"
    return out


def test_two_ranks_s1_s2_s4_and_bad_lengths():
    (unaligned,) = packs([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}], 6, 1)  # packed without CP
    cases = {
        "s1": (c1(), {"return_local_indices": True}),
        "s2": (p6(), {}),
        "s4": (c1(), {"num_chunks": 2}),
        "unaligned": (packed_sequence_thd_collater([unaligned]), {}),
        "packed_dataset": (from_packed_dataset(), {"return_local_indices": True}),
        # an already-converted THD batch without padding_mask (the mask then comes from cu_seqlens)
        "s1_from_thd": ({k: v for k, v in process_input_for_thd(c1()).items() if k != "padding_mask"}, {}),
    }
    r0, r1 = run_distributed(shard_cases, 2, cases)
    # PackedDataset -> collater -> CP shards: the ranks' tokens are a permutation of the batch, aligned
    whole = process_input_for_thd(cases["packed_dataset"][0])
    (p0, i0), (p1, i1) = r0["packed_dataset"], r1["packed_dataset"]
    assert sorted(i0.tolist() + i1.tolist()) == list(range(len(whole["input_ids"])))
    for part, index in ((p0, i0), (p1, i1)):
        for key in ("input_ids", "labels", "position_ids", "padding_mask"):
            assert torch.equal(part[key], whole[key][index]), key
        assert torch.equal(part["cu_seqlens"], whole["cu_seqlens_padded"])
    for r in (r0, r1):
        for key in ("input_ids", "labels", "position_ids", "padding_mask", "cu_seqlens", "max_seqlen"):
            assert torch.equal(r["s1_from_thd"][key], r["s1"][0][key]), key
    for r in (r0, r1):  # TE would silently duplicate and drop tokens
        assert "ValueError: sequence 0 has padded length 6, not a multiple of 2*cp_size=4" in r["unaligned"]
    for r in (r0, r1):
        for name in ("s1", "s2", "s4"):
            a, b = r[name], r[name + "/plain-mesh"]
            a, b = (a[0], b[0]) if name == "s1" else (a, b)
            assert a.keys() == b.keys() and all(
                torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
            )

    (s1_0, idx0), (s1_1, idx1) = r0["s1"], r1["s1"]
    assert idx0.tolist() == [0, 3, 4, 5, 6, 13, 14, 15, 16, 19, 20, 23, 24, 25, 30, 31]
    assert idx1.tolist() == [1, 2, 7, 8, 9, 10, 11, 12, 17, 18, 21, 22, 26, 27, 28, 29]
    for rank, s in enumerate((s1_0, s1_1)):
        assert s["cu_seqlens"].tolist() == [0, 4, 16, 20, 24, 32] and s["cu_seqlens"].dtype == torch.int32
        assert int(s["max_seqlen"]) == 12 and s["max_seqlen"].dtype == torch.int32
        assert (s["qkv_format"], s["cp_size"], s["cp_rank"]) == ("thd", 2, rank)
        assert "cu_seqlens_padded" not in s
        assert all(s[k].dtype == torch.int64 for k in ("input_ids", "labels", "position_ids"))
    assert s1_0["input_ids"].tolist() == [1, 0, 4, 5, 6, 0, 0, 0, 1, 0, 4, 0, 6, 0, 0, 0]
    assert s1_0["labels"].tolist() == [1, N, 4, 5, 6, N, N, N, 1, N, 4, N, 6, N, N, N]
    assert s1_0["position_ids"].tolist() == [0, 3, 0, 1, 2, 9, 10, 11, 0, 3, 0, 3, 0, 1, 6, 7]
    assert s1_0["padding_mask"].tolist() == [F, T, F, F, F, T, T, T, F, T, F, T, F, T, T, T]
    assert s1_1["input_ids"].tolist() == [2, 3, 7, 8, 0, 0, 0, 0, 2, 3, 5, 0, 0, 0, 0, 0]
    assert s1_1["labels"].tolist() == [2, 3, 7, 8, N, N, N, N, 2, 3, 5, N, N, N, N, N]
    assert s1_1["position_ids"].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 1, 2, 2, 3, 4, 5]
    assert s1_1["padding_mask"].tolist() == [F, F, F, F, T, T, T, T, F, F, F, T, T, T, T, T]

    s2_0, s2_1 = r0["s2"], r1["s2"]
    assert s2_0["cu_seqlens"].tolist() == [0, 4, 8, 20] and int(s2_0["max_seqlen"]) == 12
    assert s2_0["input_ids"].tolist() == [1, 0, 4, 0, 6, 0, 0, 0, 0, 0]
    assert s2_0["position_ids"].tolist() == [0, 3, 0, 3, 0, 1, 2, 9, 10, 11]
    assert s2_0["labels"].tolist() == [1, N, 4, N, 6, N, N, N, N, N]
    assert s2_1["input_ids"].tolist() == [2, 3, 5, 0, 0, 0, 0, 0, 0, 0]
    assert s2_1["position_ids"].tolist() == [1, 2, 1, 2, 3, 4, 5, 6, 7, 8]
    assert s2_1["labels"].tolist() == [2, 3, 5, N, N, N, N, N, N, N]

    s4_0, s4_1 = r0["s4"], r1["s4"]
    assert s4_0["cu_seqlens"].tolist() == [[0, 4, 16, -1000], [0, 4, 8, 16]]
    assert s4_0["max_seqlen"].tolist() == [12, 8]
    assert s4_0["input_ids"].tolist() == [[1, 0, 4, 5, 6, 0, 0, 0], [1, 0, 4, 0, 6, 0, 0, 0]]
    assert s4_1["input_ids"].tolist() == [[2, 3, 7, 8, 0, 0, 0, 0], [2, 3, 5, 0, 0, 0, 0, 0]]
    assert (s4_1["cp_size"], s4_1["cp_rank"]) == (2, 1)


def from_packed_dataset():
    """Three cp_size=2 packs of a PackedDataset (labels derived, prompt tokens masked), collated."""
    samples = [
        {"input_ids": list(range(100 * i, 100 * i + n)), "loss_mask": [0] * 2 + [1] * (n - 2)}
        for i, n in enumerate((5, 9, 3, 12, 7, 2, 14, 6), start=1)
    ]
    ds = PackedDataset(samples, 24, cp_size=2, seed=3)
    return packed_sequence_thd_collater([ds[i] for i in range(3)])


def test_four_ranks_s3_and_every_token_once():
    batch = s3()
    assert batch["input_ids"][0].tolist() == [11, 12, 13, 14, 15, 0, 0, 0, 21, 22, 23, 0, 0, 0, 0, 0]
    assert batch["seq_lens_padded"].tolist() == [[8, 8]]
    shards = [r["s3"] for r in run_distributed(shard_cases, 4, {"s3": (batch, {})})]
    expected = [
        ([11, 0, 21, 0], [0, 7, 0, 7], [12, N, 22, N], [F, T, F, T]),
        ([12, 0, 22, 0], [1, 6, 1, 6], [13, N, 23, N], [F, T, F, T]),
        ([13, 0, 23, 0], [2, 5, 2, 5], [14, N, N, N], [F, T, F, T]),
        ([14, 15, 0, 0], [3, 4, 3, 4], [15, N, N, N], [F, F, T, T]),
    ]
    for s, (ids, pos, labels, pad) in zip(shards, expected, strict=True):
        assert s["cu_seqlens"].tolist() == [0, 8, 16] and int(s["max_seqlen"]) == 8
        assert (s["input_ids"].tolist(), s["position_ids"].tolist()) == (ids, pos)
        assert (s["labels"].tolist(), s["padding_mask"].tolist()) == (labels, pad)
    # the ranks' (input, position) pairs together are the pack's, each exactly once
    pairs = sorted(p for s in shards for p in zip(s["position_ids"].tolist(), s["input_ids"].tolist(), strict=True))
    assert pairs == sorted(zip(batch["position_ids"][0].tolist(), batch["input_ids"][0].tolist(), strict=True))
