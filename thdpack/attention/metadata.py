"""THD metadata, validated once per batch, and the per-token layout attention kernels need.

A THD batch (``thdpack.to_thd`` / ``thdpack.cp.shard``) describes N sequences packed into T
tokens: ``cu_seqlens`` (real lengths) and ``cu_seqlens_padded`` (storage slots; real tokens first,
then padding). A CP shard keeps, per sequence, chunks ``cp_rank`` and ``2*cp_size-1-cp_rank`` of
its slot (Transformer Engine's layout) while the metadata stays global.

:class:`ThdMeta` reads that metadata to the host once (it is cached per batch, so the layers of a
model share one validation and one device sync) and builds :class:`Side` objects: the rows of one
operand of an attention tile, grouped by sequence, with each row's position inside its sequence
and whether it is a real token.

Legend: ``T`` tokens, ``N`` sequences (where stated) , ``c`` tokens per CP chunk of a sequence.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

_T = TypeVar("_T")


class Side:
    """Rows of one tile operand: sequence by sequence, each sequence's real tokens first.

    Args:
        counts: (N,) host ints, rows of each sequence on this side (0 allowed).
        valid_counts: (N,) host ints, how many of those rows are real tokens; the real rows are
            a prefix of each sequence's rows (padding follows the real tokens in every layout).
        pos_T: (T,) int64 position of each row inside its sequence (the global position, also
            on a CP shard), on the device of the tensors it describes.
    """

    def __init__(self, counts: tuple[int, ...], valid_counts: tuple[int, ...], pos_T: torch.Tensor) -> None:
        assert len(counts) == len(valid_counts) and pos_T.shape == (sum(counts),)
        self.counts = counts
        self.valid_counts = valid_counts
        self.pos_T = pos_T

    @property
    def device(self) -> torch.device:
        return self.pos_T.device

    @property
    def num_rows(self) -> int:
        return self.pos_T.shape[0]

    @functools.cached_property
    def seg_T(self) -> torch.Tensor:
        """(T,) int64 sequence index of each row."""
        return _rows_of(self.counts)[0].to(self.device)

    @functools.cached_property
    def valid_T(self) -> torch.Tensor:
        """(T,) bool, True for real tokens."""
        seg, within = _rows_of(self.counts)
        return (within < torch.tensor(self.valid_counts, dtype=torch.int64)[seg]).to(self.device)

    @functools.cached_property
    def cu(self) -> torch.Tensor:
        """(N+1,) int32 cumulative row counts (FlashAttention's ``cu_seqlens`` for this side)."""
        return _cumsum_int32(self.counts, self.device)

    @functools.cached_property
    def valid_cu(self) -> torch.Tensor:
        """(N+1,) int32 cumulative real-token counts (for kernels fed only the real rows)."""
        return _cumsum_int32(self.valid_counts, self.device)

    @functools.cached_property
    def valid_index(self) -> torch.Tensor:
        """(T_real,) int64 row indices of the real tokens, in order."""
        return torch.nonzero(self.valid_T).flatten()

    @property
    def has_padding(self) -> bool:
        return self.counts != self.valid_counts

    def half_index(self, back: bool) -> torch.Tensor:
        """(T/2,) int64 rows of the first (``back=False``) or second half of every sequence."""
        return self._halves[1 if back else 0][0]

    def half(self, back: bool) -> Side:
        """The :class:`Side` of :meth:`half_index`'s rows (every count must be even)."""
        return self._halves[1 if back else 0][1]

    @functools.cached_property
    def _halves(self) -> tuple[tuple[torch.Tensor, Side], tuple[torch.Tensor, Side]]:
        assert all(n % 2 == 0 for n in self.counts), "halves need even per-sequence row counts"
        half = tuple(n // 2 for n in self.counts)
        counts = torch.tensor(self.counts, dtype=torch.int64)
        starts = torch.cumsum(counts, 0) - counts
        seg, within = _rows_of(half)
        half_t = torch.tensor(half, dtype=torch.int64)
        out = []
        for back in (False, True):
            index = (starts[seg] + within + (half_t[seg] if back else 0)).to(self.device)
            valid = tuple(max(v - h, 0) if back else min(v, h) for v, h in zip(self.valid_counts, half, strict=True))
            out.append((index, Side(half, valid, self.pos_T.index_select(0, index))))
        return out[0], out[1]


def _rows_of(counts: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, index within the sequence) of every row, (T,) int64 each, on the host."""
    counts_t = torch.tensor(counts, dtype=torch.int64)
    seg = torch.repeat_interleave(torch.arange(len(counts)), counts_t)
    return seg, torch.arange(seg.numel()) - (torch.cumsum(counts_t, 0) - counts_t)[seg]


def _cumsum_int32(counts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    cu = torch.zeros(len(counts) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0)
    return cu.to(device)


@dataclass(frozen=True, kw_only=True)
class ThdMeta:
    """Host-side view of one THD batch's metadata; build it with :func:`thd_meta`."""

    lengths: tuple[int, ...]
    """(N,) real tokens per sequence."""
    lengths_padded: tuple[int, ...]
    """(N,) storage slot per sequence (>= the real length; a multiple of 2*cp_size under CP)."""
    cp_size: int
    """Context-parallel ranks the batch is sharded over (1 = not sharded)."""
    cp_rank: int
    """This shard's rank, 0 <= cp_rank < cp_size."""
    max_seqlen: int
    """Upper bound on every slot width (the batch's ``max_seqlen``)."""
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def total_tokens(self) -> int:
        """Global T (all ranks)."""
        return sum(self.lengths_padded)

    @property
    def local_tokens(self) -> int:
        """Tokens on this rank: T / cp_size."""
        return self.total_tokens // self.cp_size

    @property
    def has_padding(self) -> bool:
        return self.lengths != self.lengths_padded

    def local_side(self, device: torch.device, rank: int | None = None) -> Side:
        """Rows held by ``rank`` (default: this shard's rank), in ``cp.shard`` order."""
        rank = self.cp_rank if rank is None else rank
        return self.cached(("local side", rank, torch.device(device)), lambda: self._build_side(rank, device))

    def global_side(self, device: torch.device) -> Side:
        """All T rows in storage order (what an all-gather of every shard reassembles)."""
        return self.cached(("global side", torch.device(device)), lambda: self._build_side(None, device))

    def cached(self, key: Any, build: Callable[[], _T]) -> _T:
        """``build()``'s result, computed once per batch (the layers of a model share it)."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def _build_side(self, rank: int | None, device: torch.device) -> Side:
        slots = torch.tensor(self.lengths_padded, dtype=torch.int64)
        real = torch.tensor(self.lengths, dtype=torch.int64)
        if rank is None or self.cp_size == 1:
            counts, valid = slots, real
            pos = _rows_of(self.lengths_padded)[1]
        else:
            chunk = slots // (2 * self.cp_size)
            counts = 2 * chunk
            seg, within = _rows_of(tuple(counts.tolist()))
            c = chunk[seg]
            tail_chunk = 2 * self.cp_size - 1 - rank
            # head chunk `rank`, then tail chunk 2*cp_size-1-rank: TE's dual-chunk order
            pos = torch.where(within < c, rank * c + within, tail_chunk * c + within - c)
            head_real = (real - rank * chunk).clamp(0, None).minimum(chunk)
            valid = head_real + (real - tail_chunk * chunk).clamp(0, None).minimum(chunk)
        return Side(tuple(counts.tolist()), tuple(valid.tolist()), pos.to(device))


# One validation per batch, keyed on the identity of the batch's cu_seqlens_padded tensor (tensors
# compare elementwise, so no WeakKeyDictionary). ThdMeta holds no reference to the batch's
# tensors, and a weakref callback drops the entry when the batch dies.
_CACHE: dict[int, tuple[weakref.ref, tuple[Any, ...], ThdMeta]] = {}


def _cache_get(tensor: torch.Tensor, key: tuple[Any, ...]) -> ThdMeta | None:
    entry = _CACHE.get(id(tensor))
    if entry is not None and entry[0]() is tensor and entry[1] == key:
        return entry[2]
    return None


def _cache_put(tensor: torch.Tensor, key: tuple[Any, ...], meta: ThdMeta) -> None:
    tid = id(tensor)
    _CACHE[tid] = (weakref.ref(tensor, lambda _ref: _CACHE.pop(tid, None)), key, meta)


def thd_meta(thd: Mapping[str, Any]) -> ThdMeta:
    """Validate a THD batch's metadata and return its :class:`ThdMeta` (cached per batch).

    Reads ``cu_seqlens`` ((N+1,) integer, ``[0] == 0``, non-decreasing), optional
    ``cu_seqlens_padded`` ((N+1,) integer, each slot >= its real length; defaults to
    ``cu_seqlens``), optional ``max_seqlen`` (int >= the widest slot; computed when absent) and
    optional ``cp_size`` / ``cp_rank`` (default 1 / 0; every slot a multiple of ``2*cp_size``).
    Raises ``ValueError`` / ``TypeError`` naming the offending entry and the fix.

    >>> cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    >>> cu_padded = torch.tensor([0, 4, 8], dtype=torch.int32)
    >>> meta = thd_meta({"cu_seqlens": cu, "cu_seqlens_padded": cu_padded, "max_seqlen": 4})
    >>> meta.lengths, meta.lengths_padded, meta.local_tokens
    ((3, 4), (4, 4), 8)
    >>> shard = thd_meta({"cu_seqlens": cu, "cu_seqlens_padded": cu_padded, "cp_size": 2, "cp_rank": 1})
    >>> side = shard.local_side(torch.device("cpu"))    # rank 1 keeps chunks 1 and 2 of each slot
    >>> side.counts, side.valid_counts, side.pos_T.tolist()
    ((2, 2), (2, 2), [1, 2, 1, 2])
    """
    if "cu_seqlens" not in thd:
        raise ValueError("thd has no 'cu_seqlens'; pass the mapping returned by thdpack.to_thd or thdpack.cp.shard")
    cu_seqlens = thd["cu_seqlens"]
    cu_seqlens_padded = thd.get("cu_seqlens_padded")
    if cu_seqlens_padded is None:
        cu_seqlens_padded = cu_seqlens
    cp_size = int(thd.get("cp_size", 1))
    cp_rank = int(thd.get("cp_rank", 0))
    max_seqlen = thd.get("max_seqlen")
    key = (
        id(cu_seqlens),
        _version(cu_seqlens),
        _version(cu_seqlens_padded),
        cp_size,
        cp_rank,
        max_seqlen if isinstance(max_seqlen, int) else None,
    )
    if isinstance(cu_seqlens_padded, torch.Tensor):
        cached = _cache_get(cu_seqlens_padded, key)
        if cached is not None:
            return cached
    meta = _build_meta(cu_seqlens, cu_seqlens_padded, cp_size, cp_rank, max_seqlen)
    _cache_put(cu_seqlens_padded, key, meta)
    return meta


def _version(tensor: Any) -> int | None:
    return tensor._version if isinstance(tensor, torch.Tensor) else None


def _host_lengths(name: str, cu: Any) -> list[int]:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (int32), got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with at least 2 entries, got shape {tuple(cu.shape)}")
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {values[0]}")
    lengths = [b - a for a, b in itertools.pairwise(values)]
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(
                f"{name} must be non-decreasing; it drops at entry {i + 1} ({values[i]} -> {values[i + 1]})"
            )
    return lengths


def _build_meta(cu_seqlens: Any, cu_seqlens_padded: Any, cp_size: int, cp_rank: int, max_seqlen: Any) -> ThdMeta:
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    lengths = _host_lengths("cu_seqlens", cu_seqlens)
    slots = lengths if cu_seqlens_padded is cu_seqlens else _host_lengths("cu_seqlens_padded", cu_seqlens_padded)
    if len(lengths) != len(slots):
        raise ValueError(
            f"cu_seqlens has {len(lengths) + 1} entries and cu_seqlens_padded {len(slots) + 1}; "
            "both must describe the same sequences"
        )
    for i, (n, slot) in enumerate(zip(lengths, slots, strict=True)):
        if n > slot:
            raise ValueError(
                f"sequence {i} has {n} real tokens but a padded slot of {slot}; "
                "cu_seqlens_padded must leave room for every real token"
            )
        if cp_size > 1 and slot % (2 * cp_size) != 0:
            raise ValueError(
                f"sequence {i} has padded length {slot}, not a multiple of 2*cp_size={2 * cp_size}; "
                f"pad every sequence to a multiple of {2 * cp_size} (plan_packs(..., cp_size={cp_size}) does)"
            )
    widest = max(slots)
    if max_seqlen is None:
        max_seqlen = widest
    elif isinstance(max_seqlen, torch.Tensor) or not isinstance(max_seqlen, int):
        raise TypeError(
            f"max_seqlen must be a Python int (computed on the host by the collator), got "
            f"{type(max_seqlen).__name__}; a tensor here forces a device sync in every layer"
        )
    elif max_seqlen < widest:
        raise ValueError(
            f"max_seqlen={max_seqlen} is below the widest padded sequence ({widest} tokens); "
            "kernels would skip keys; use the max_seqlen thdpack.to_thd computes"
        )
    return ThdMeta(
        lengths=tuple(lengths),
        lengths_padded=tuple(slots),
        cp_size=cp_size,
        cp_rank=cp_rank,
        max_seqlen=max_seqlen,
    )


def kernel_cu_seqlens(thd: Mapping[str, Any], key: str, backend: str, device: torch.device) -> torch.Tensor:
    """``thd[key]`` (``cu_seqlens_padded`` falls back to ``cu_seqlens``) checked for a CUDA kernel.

    FlashAttention / cuDNN kernels read cu_seqlens as int32 on the tensors' device; anything else
    is a ``TypeError`` / ``ValueError`` here rather than a kernel error (or silent misreads) later.
    """
    cu = thd.get(key)
    if cu is None:
        cu = thd["cu_seqlens"]
    if cu.dtype != torch.int32:
        raise TypeError(
            f"{key} has dtype {cu.dtype}, but the {backend!r} backend's kernels need int32; "
            "thdpack.to_thd produces int32 (or convert with .to(torch.int32))"
        )
    if cu.device != device:
        raise ValueError(f"{key} is on {cu.device} but q/k/v are on {device}; move the batch to {device}")
    return cu
