"""cp.gather on real gloo process groups: every rank gets the global batch back."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from thdpack.cp import gather, shard
from thdpack.testing import run_distributed
from thdpack.thd import thd_collate

pytestmark = pytest.mark.distributed


def _pack(seq_lens: list[int], pack_size: int, cp_size: int, first_token: int) -> dict[str, torch.Tensor]:
    """A pack with distinct token ids, a float per-token extra, CP-rounded slots, tail padding on the last."""
    step = 2 * cp_size
    widths = [-(-n // step) * step for n in seq_lens]
    widths[-1] += pack_size - sum(widths)
    real = torch.cat([torch.arange(w) < n for n, w in zip(seq_lens, widths, strict=True)])
    input_ids = torch.where(real, torch.arange(first_token, first_token + pack_size), 0)
    return {
        "input_ids": input_ids,
        "labels": torch.where(real, input_ids + 1, -100),
        "position_ids": torch.cat([torch.arange(w) for w in widths]),
        "seq_lens": torch.tensor(seq_lens),
        "seq_lens_padded": torch.tensor(widths),
        "loss_weight": real.to(torch.float32) / 3,
    }


def _global_batch(cp_size: int, replica: int) -> dict:
    """Each data-parallel replica gets its own batch."""
    first = 1 + 1000 * replica
    return thd_collate([_pack([5, 17, 1], 48, cp_size, first), _pack([30, 9], 48, cp_size, first + 100)])


def _gather_in(group: dist.ProcessGroup, replica: int) -> dict:
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    full = _global_batch(cp_size, replica)
    local = shard(full, cp_size, cp_rank)
    gathered = gather(local, group)
    try:
        gather(dict(local, cp_rank=(cp_rank + 1) % cp_size), group)
        wrong_rank_error = ""
    except ValueError as err:
        wrong_rank_error = str(err)
    return {"gathered": gathered, "full": full, "cp_rank": cp_rank, "wrong_rank_error": wrong_rank_error}


def _gather_on_rank(rank: int, world_size: int) -> dict:
    # one launch covers both CP sizes: all 4 ranks as one CP group, then a 2 (DP) x 2 (CP) layout
    cp4 = dist.new_group([0, 1, 2, 3])
    cp2_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    return {4: _gather_in(cp4, 0), 2: _gather_in(cp2_groups[rank // 2], rank // 2)}


def test_gather_restores_the_global_batch_on_every_rank():
    results = run_distributed(_gather_on_rank, 4)
    for rank, by_cp_size in enumerate(results):
        for cp_size, result in by_cp_size.items():
            full, gathered = result["full"], result["gathered"]
            assert full["input_ids"][0] == 1 + 1000 * (rank // 2 if cp_size == 2 else 0)
            assert gathered.keys() == full.keys(), (rank, cp_size)
            for key, value in full.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(gathered[key], value), (rank, cp_size, key)
                else:
                    assert gathered[key] == value, (rank, cp_size, key)
            expected = f"but this process is rank {result['cp_rank']} of a cp_group of {cp_size}; pass the"
            assert expected in result["wrong_rank_error"]
