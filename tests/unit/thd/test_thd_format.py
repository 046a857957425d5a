"""validate_thd: every check of the THD format, with its message."""

from __future__ import annotations

import pytest
import torch

from thdpack.cp import shard
from thdpack.thd import thd_collate
from thdpack.thd.format import validate_thd

from support.thd_cases import C1_SECOND, P5


def test_accepts_batches_and_shards_and_returns_their_record():
    thd = thd_collate([P5, C1_SECOND])
    meta = validate_thd(thd)
    assert meta is thd["thd_meta"]
    assert (meta.lengths, meta.lengths_padded) == ((3, 5, 3, 2, 1), (4, 12, 4, 4, 8))
    assert (meta.max_seqlen, meta.total_tokens, meta.cp_size) == (12, 32, 1)
    for rank in range(2):
        part = shard(thd, 2, rank)
        local = validate_thd(part)
        assert local is part["thd_meta"] and (local.cp_size, local.cp_rank, local.local_tokens) == (2, rank, 16)
        assert local.lengths == meta.lengths  # the global layout, on every rank


def _thd(**changes):
    return dict(thd_collate([P5, C1_SECOND]), **changes)


@pytest.mark.parametrize(
    ("thd", "error", "message"),
    [
        (
            {"input_ids": torch.zeros(4)},
            ValueError,
            r"THD batch lacks \['labels', 'position_ids', 'padding_mask', 'cu_seqlens'",
        ),
        (_thd(cu_seqlens=[0, 3]), TypeError, "cu_seqlens must be a torch.Tensor, got list"),
        (
            _thd(cu_seqlens=torch.tensor([0, 3, 8, 11, 13, 14])),
            TypeError,
            r"cu_seqlens must be int32 \(what TE and FlashAttention kernels take\), got torch.int64; thdpack.to_thd ",
        ),
        (
            _thd(cu_seqlens_padded=torch.tensor([32], dtype=torch.int32)),
            ValueError,
            r"cu_seqlens_padded must be 1-D with at least 2 entries \(S\+1\), got shape \(1,\)",
        ),
        (
            _thd(cu_seqlens=torch.tensor([1, 3, 8, 11, 13, 14], dtype=torch.int32)),
            ValueError,
            r"cu_seqlens\[0\] must be 0, got 1",
        ),
        (
            _thd(cu_seqlens=torch.tensor([0, 3, 2, 11, 13, 14], dtype=torch.int32)),
            ValueError,
            r"cu_seqlens must be non-decreasing; it drops at entry 2 \(3 -> 2\)",
        ),
        (
            _thd(cu_seqlens=torch.tensor([0, 3, 8, 14], dtype=torch.int32)),
            ValueError,
            "cu_seqlens has 4 entries but cu_seqlens_padded has 6",
        ),
        (
            _thd(cu_seqlens=torch.tensor([0, 5, 8, 11, 13, 14], dtype=torch.int32)),
            ValueError,
            "sequence 0 has 5 real tokens but a padded slot of 4",
        ),
        (_thd(max_seqlen=torch.tensor(12)), TypeError, "max_seqlen must be a Python int .* got Tensor"),
        (_thd(max_seqlen=5), ValueError, r"max_seqlen=5 is below the widest padded slot \(12\)"),
        (
            _thd(labels=torch.zeros(31, dtype=torch.long)),
            ValueError,
            r"labels has 31 tokens but the THD layout holds 32 \(cu_seqlens_padded\[-1\]=32\); every per-token tensor",
        ),
        (
            _thd(position_ids=torch.zeros(32)),
            TypeError,
            "position_ids must be an integer tensor, got torch.float32",
        ),
        (
            _thd(padding_mask=torch.zeros(32, dtype=torch.long)),
            TypeError,
            r"padding_mask must be a bool tensor \(True = padding\), got torch.int64",
        ),
        (_thd(cp_size=0), ValueError, "cp_size must be >= 1, got 0"),
        (_thd(cp_size=2, cp_rank=2), ValueError, r"cp_rank must be an int in \[0, 2\), got 2"),
        (
            _thd(cp_size=4, cp_rank=0),
            ValueError,
            r"sequence 0 has padded length 4, not a multiple of 2\*cp_size=8",
        ),
        (
            _thd(cp_size=2, cp_rank=0),
            ValueError,
            r"input_ids has 32 tokens but the THD layout holds 16 \(cu_seqlens_padded\[-1\]=32 / cp_size=2, on CP rank 0\)",
        ),
    ],
)
def test_validate_thd_rejects(thd, error, message):
    with pytest.raises(error, match=message):
        validate_thd(thd)
