"""Transformer Engine's THD context-parallel partition, as an exact pure-torch twin.

Every sequence (padded length a multiple of ``2*cp_size``) is cut into ``2*cp_size`` equal
chunks; rank ``r`` keeps chunk ``r`` and chunk ``2*cp_size-1-r`` of each sequence, sequence by
sequence, head chunk first. For causal attention this gives every rank the same work.

Legend: ``T`` packed tokens (global), ``T_local = T / cp_size``, ``N`` sequences.
"""

from __future__ import annotations

import torch


def _check_cu_seqlens_padded(cu_seqlens_padded: torch.Tensor, total_tokens: int, cp_size: int) -> torch.Tensor:
    """Validate on the host once; return the lengths (N,) int64 on the input's device."""
    if not isinstance(cu_seqlens_padded, torch.Tensor):
        raise TypeError(f"cu_seqlens_padded must be a torch.Tensor, got {type(cu_seqlens_padded).__name__}")
    if cu_seqlens_padded.dim() != 1 or cu_seqlens_padded.numel() < 2:
        raise ValueError(
            f"cu_seqlens_padded must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens_padded.shape)}"
        )
    if cu_seqlens_padded.dtype.is_floating_point or cu_seqlens_padded.dtype == torch.bool:
        raise TypeError(f"cu_seqlens_padded must be an integer tensor, got {cu_seqlens_padded.dtype}")
    cu_host = cu_seqlens_padded.detach().to("cpu", torch.int64)
    lengths = cu_host[1:] - cu_host[:-1]
    if int(cu_host[0]) != 0:
        raise ValueError(f"cu_seqlens_padded[0] must be 0, got {int(cu_host[0])}")
    if bool((lengths < 0).any()):
        i = int(torch.nonzero(lengths < 0)[0])
        raise ValueError(f"cu_seqlens_padded must be non-decreasing; it drops at entry {i + 1}")
    step = 2 * cp_size
    bad = lengths % step != 0
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise ValueError(
            f"sequence {i} has padded length {int(lengths[i])}, not a multiple of 2*cp_size={step}; "
            f"pad every sequence to a multiple of {step} (plan_packs(..., cp_size={cp_size}) does)"
        )
    if int(cu_host[-1]) != total_tokens:
        raise ValueError(
            f"total_tokens={total_tokens} but cu_seqlens_padded[-1]={int(cu_host[-1])}; they must be equal "
            "(Transformer Engine silently duplicates or drops tokens otherwise)"
        )
    return lengths.to(cu_seqlens_padded.device)


def partition_indices(
    cu_seqlens_padded: torch.Tensor, total_tokens: int, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """Global token indices kept by ``cp_rank``: TE's ``thd_get_partitioned_indices``.

    Args:
        cu_seqlens_padded: (N+1,) integer, ``[0] == 0``, non-decreasing, every difference a
            multiple of ``2*cp_size``, ``[-1] == total_tokens``.
        total_tokens: ``T``, the global number of tokens.
        cp_size: context-parallel world size (>= 1).
        cp_rank: this rank, ``0 <= cp_rank < cp_size``.

    Returns:
        (T / cp_size,) int32 on ``cu_seqlens_padded``'s device: same values, same order as TE.

    Raises ``ValueError`` where TE's release build would silently return wrong indices.

    >>> cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    >>> partition_indices(cu, 16, 2, 0).tolist()   # chunks 0 and 3 of each sequence
    [0, 1, 6, 7, 8, 9, 14, 15]
    >>> partition_indices(cu, 16, 2, 1).tolist()   # chunks 1 and 2
    [2, 3, 4, 5, 10, 11, 12, 13]
    """
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    lengths = _check_cu_seqlens_padded(cu_seqlens_padded, int(total_tokens), cp_size)
    device = cu_seqlens_padded.device
    chunk = lengths // (2 * cp_size)  # (N,) tokens per chunk of each sequence
    starts = cu_seqlens_padded[:-1].to(torch.int64)
    local_len = 2 * chunk  # each rank keeps two chunks per sequence
    seq_of_token = torch.repeat_interleave(torch.arange(len(lengths), device=device), local_len)
    local_start = torch.cumsum(local_len, 0) - local_len
    j = torch.arange(int(total_tokens) // cp_size, device=device) - local_start[seq_of_token]
    chunk_t = chunk[seq_of_token]
    # head chunk r for j < c, tail chunk 2W-1-r after it (TE's offset 2W-2-r absorbs the j >= c shift)
    chunk_id = torch.where(j < chunk_t, cp_rank, 2 * cp_size - 2 - cp_rank)
    return (starts[seq_of_token] + j + chunk_t * chunk_id).to(torch.int32)
