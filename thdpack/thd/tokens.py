"""Where every token of a THD batch sits: its sequence, its position in it, real or padding.

:class:`TokenPlacement` is the one per-token view of a batch (or of one CP rank's shard, built by
``thdpack.cp.partition.local_placement``): rows grouped sequence by sequence, each sequence's real tokens
first (padding follows the real tokens in every layout thdpack makes), with every row's position
inside its sequence. Masks, attention tiles, the THD ``padding_mask``, per-sequence loss weights
and segment ids all read it; :func:`global_placement` builds it for a whole batch.

Legend: ``S`` sequences, ``T`` rows (tokens).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from thdpack.thd.cu import cu_from_lengths
from thdpack.thd.meta import ThdMeta


def real_rows(counts_S: np.ndarray, valid_S: np.ndarray) -> np.ndarray:
    """(T,) bool, True for real rows: runs of (real: True, padding: False), sequence by sequence."""
    runs_2S = np.empty(2 * len(counts_S), dtype=np.int64)
    runs_2S[0::2] = valid_S
    runs_2S[1::2] = counts_S - valid_S
    real_2S = np.zeros(2 * len(counts_S), dtype=bool)
    real_2S[0::2] = True
    return np.repeat(real_2S, runs_2S)


def _rows_of(counts: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, index within the sequence) of every row, (T,) int64 each, on the host."""
    counts_S = torch.tensor(counts, dtype=torch.int64)
    seg_T = torch.repeat_interleave(torch.arange(len(counts)), counts_S)
    return seg_T, torch.arange(seg_T.numel()) - (torch.cumsum(counts_S, 0) - counts_S)[seg_T]


class TokenPlacement:
    """Rows of a batch or shard: sequence by sequence, each sequence's real tokens first.

    "Sequence" ``s`` of a placement is its ``s``-th run of rows: sequence ``s`` of the batch, or on
    a shard of a per-sequence CP placement the batch's sequence ``sequences[s]`` (a rank holds its
    split groups' sequences first, then its whole ones). Masks compare runs of one placement.

    Args:
        counts: (S,) host ints, rows of each sequence here (0 allowed).
        valid_counts: (S,) host ints, how many of them are real tokens (a prefix of the rows).
        pos_T: (T,) int64 position of each row inside its sequence (the global position, also on a
            CP shard), on the device of the tensors it describes; None: rows are whole slots in
            storage order (a global batch), so positions count 0, 1, ... within each slot.
        device: where the per-row tensors live (``pos_T``'s device when given).
        sequences: (S,) host ints, the batch's sequence of each run (None: run ``s`` is sequence ``s``).

    >>> p = TokenPlacement((4, 4), (3, 2))
    >>> p.seg_T.tolist(), p.pos_T.tolist(), p.padding_mask_T.int().tolist()
    ([0, 0, 0, 0, 1, 1, 1, 1], [0, 1, 2, 3, 0, 1, 2, 3], [0, 0, 0, 1, 0, 0, 1, 1])
    """

    def __init__(
        self,
        counts: tuple[int, ...],
        valid_counts: tuple[int, ...],
        pos_T: torch.Tensor | None = None,
        *,
        device: torch.device | str = "cpu",
        sequences: tuple[int, ...] | None = None,
    ) -> None:
        if len(counts) != len(valid_counts) or any(v > c for c, v in zip(counts, valid_counts, strict=True)):
            raise ValueError(f"valid_counts {valid_counts} must be <= counts {counts}, one per sequence")
        if pos_T is not None and pos_T.shape != (sum(counts),):
            raise ValueError(f"pos_T has shape {tuple(pos_T.shape)}, but the counts describe {sum(counts)} rows")
        if sequences is not None and len(sequences) != len(counts):
            raise ValueError(f"sequences {sequences} must name one batch sequence per count of {counts}")
        self.counts = tuple(counts)
        self.valid_counts = tuple(valid_counts)
        self.sequences = tuple(range(len(counts))) if sequences is None else tuple(sequences)
        """(S,) the batch's sequence of each run of rows."""
        self.device = torch.device(device) if pos_T is None else pos_T.device
        if pos_T is not None:
            self.pos_T = pos_T

    @property
    def num_rows(self) -> int:
        return sum(self.counts)

    @property
    def has_padding(self) -> bool:
        return self.counts != self.valid_counts

    @functools.cached_property
    def pos_T(self) -> torch.Tensor:
        """(T,) int64 position of each row inside its sequence."""
        return _rows_of(self.counts)[1].to(self.device)

    @functools.cached_property
    def seg_T(self) -> torch.Tensor:
        """(T,) int64 sequence index of each row."""
        return _rows_of(self.counts)[0].to(self.device)

    @functools.cached_property
    def valid_T(self) -> torch.Tensor:
        """(T,) bool, True for real tokens."""
        runs = real_rows(np.asarray(self.counts, dtype=np.int64), np.asarray(self.valid_counts, dtype=np.int64))
        return torch.from_numpy(runs).to(self.device)

    @property
    def padding_mask_T(self) -> torch.Tensor:
        """(T,) bool, True for padding (the THD batch's ``padding_mask``)."""
        return ~self.valid_T

    @functools.cached_property
    def cu(self) -> torch.Tensor:
        """(S+1,) int32 cumulative row counts (FlashAttention's ``cu_seqlens`` for these rows)."""
        return cu_from_lengths(self.counts, self.device)

    @functools.cached_property
    def valid_cu(self) -> torch.Tensor:
        """(S+1,) int32 cumulative real-token counts (for kernels fed only the real rows)."""
        return cu_from_lengths(self.valid_counts, self.device)

    @functools.cached_property
    def valid_index(self) -> torch.Tensor:
        """(T_real,) int64 row indices of the real tokens, in order."""
        return torch.nonzero(self.valid_T).flatten()

    def half_index(self, back: bool) -> torch.Tensor:
        """(T/2,) int64 rows of the first (``back=False``) or second half of every sequence."""
        return self._halves[1 if back else 0][0]

    def half(self, back: bool) -> TokenPlacement:
        """The placement of :meth:`half_index`'s rows (every count must be even)."""
        return self._halves[1 if back else 0][1]

    @functools.cached_property
    def _halves(self) -> tuple[tuple[torch.Tensor, TokenPlacement], tuple[torch.Tensor, TokenPlacement]]:
        assert all(n % 2 == 0 for n in self.counts), "halves need even per-sequence row counts"
        half = tuple(n // 2 for n in self.counts)
        counts_S = torch.tensor(self.counts, dtype=torch.int64)
        starts_S = torch.cumsum(counts_S, 0) - counts_S
        seg_T, within_T = _rows_of(half)
        half_S = torch.tensor(half, dtype=torch.int64)
        out = []
        for back in (False, True):
            index_T = (starts_S[seg_T] + within_T + (half_S[seg_T] if back else 0)).to(self.device)
            valid = tuple(max(v - h, 0) if back else min(v, h) for v, h in zip(self.valid_counts, half, strict=True))
            placement = TokenPlacement(half, valid, self.pos_T.index_select(0, index_T), sequences=self.sequences)
            out.append((index_T, placement))
        return out[0], out[1]


def global_placement(meta: ThdMeta, device: torch.device | str = "cpu") -> TokenPlacement:
    """Every row of the whole (unsharded) batch in storage order; cached on ``meta`` per device."""
    device = torch.device(device)
    return meta.cached(
        ("global placement", device), lambda: TokenPlacement(meta.lengths_padded, meta.lengths, device=device)
    )
