"""Transformer Engine's THD context-parallel partition, and sharding THD batches with it.

Rank ``r`` keeps chunks ``r`` and ``2*cp_size-1-r`` of every sequence (each slot a multiple of
``2*cp_size``), which balances causal work; a batch of a per-sequence placement is sharded by its
placement instead. Both come from :func:`rank_token_indices`, the one index map ``shard``,
``unshard``, ``gather`` and ``local_placement`` derive from. ``partition_indices`` returns what
TE's ``thd_get_partitioned_indices`` returns (TE's kernel where it applies, else computed on the
host).

Legend: ``T`` packed tokens (global), ``T_local = T / cp_size``, ``S`` sequences, ``W = cp_size``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from thdpack._optional import has_transformer_engine, require
from thdpack.layout.entries import CpLayout
from thdpack.layout.placement import PackPlacement
from thdpack.layout.ranks import rank_indices, rank_parts
from thdpack.layout.rules import check_cp
from thdpack.thd.carriage import attach_meta, thd_meta
from thdpack.thd.cu import cu_lengths
from thdpack.thd.format import THD_METADATA_KEYS, THDBatch, check_token_rows
from thdpack.thd.meta import EntryGroups, ThdMeta
from thdpack.thd.tokens import TokenPlacement, global_placement

log = logging.getLogger(__name__)

PartitionImpl = Literal["auto", "te", "numpy"]
_IMPLS = ("auto", "te", "numpy")

TE_MAX_SEQUENCES = 48 * 1024 // 4 - 1
"""The most sequences TE's ``thd_partition_indices_kernel`` takes in one call (12,287): it keeps
``cu_seqlens`` ((S+1,) int32) in dynamic shared memory, which a launch gets up to 48 KiB of
without opting in to more (TE does not), so the launch fails beyond (``context_parallel.cu``)."""


def partition_indices(
    cu_seqlens_padded: torch.Tensor,
    total_tokens: int,
    cp_size: int,
    cp_rank: int,
    *,
    impl: PartitionImpl = "auto",
) -> torch.Tensor:
    """Global token indices kept by ``cp_rank``: TE's ``thd_get_partitioned_indices``.

    Args:
        cu_seqlens_padded: (S+1,) integer, ``[0] == 0``, non-decreasing, every difference a
            multiple of ``2*cp_size``, ``[-1] == total_tokens``.
        total_tokens: ``T``, the global number of tokens.
        cp_size: context-parallel world size (>= 1).
        cp_rank: this rank, ``0 <= cp_rank < cp_size``.
        impl: ``"auto"`` runs TE's kernel when Transformer Engine is installed and
            ``cu_seqlens_padded`` is on CUDA, else ``"numpy"``: the indices computed on the host
            (where the checks have the lengths already) and moved to ``cu_seqlens_padded``'s
            device. ``"te"`` forces TE's kernel (it needs TE and a CUDA tensor); with no token
            (``T == 0``, which TE refuses) or more than :data:`TE_MAX_SEQUENCES` sequences
            (which overflow its shared memory) it computes on the host too. Both give identical
            results.

    Returns:
        (T / cp_size,) int32 on ``cu_seqlens_padded``'s device: same values, same order as TE.

    Raises ``ValueError`` where TE's release build would silently return wrong indices (the
    checks, the THD record's, run before any implementation; they copy ``cu_seqlens_padded`` to
    the host once). With ``cp_size`` 1 the partition is the identity, whatever the slot widths.

    >>> cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    >>> partition_indices(cu, 16, 2, 0).tolist()   # chunks 0 and 3 of each sequence
    [0, 1, 6, 7, 8, 9, 14, 15]
    >>> partition_indices(cu, 16, 2, 1).tolist()   # chunks 1 and 2
    [2, 3, 4, 5, 10, 11, 12, 13]
    """
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    total_tokens = int(total_tokens)
    lengths_S = cu_lengths("cu_seqlens_padded", cu_seqlens_padded)
    record = ThdMeta.from_lengths(lengths_S, lengths_S, copy=False)
    record.check_token_count(total_tokens, "the batch (total_tokens)")
    local = record.for_rank(cp_size, cp_rank)  # cp_size, cp_rank and the 2*cp_size rule
    on_cuda = cu_seqlens_padded.is_cuda
    if impl == "auto":
        impl = "te" if on_cuda and has_transformer_engine() else "numpy"
    if impl == "te" and not on_cuda:
        raise ValueError(
            f"impl='te' runs TE's CUDA kernel, but cu_seqlens_padded is on {cu_seqlens_padded.device}; "
            "move it to a GPU or use impl='auto'"
        )
    # TE's formula for one rank is the identity, also where a slot is odd (TE would refuse); TE
    # refuses T == 0 and cannot launch for more than TE_MAX_SEQUENCES sequences
    if impl == "te" and local.cp_size > 1 and total_tokens > 0:
        if len(lengths_S) <= TE_MAX_SEQUENCES:
            tex = require("transformer_engine_torch", "partition_indices(impl='te')")
            # TE allocates its output on the current CUDA device and launches there: make that cu's
            with torch.cuda.device(cu_seqlens_padded.device):
                return tex.thd_get_partitioned_indices(
                    cu_seqlens_padded.to(torch.int32), total_tokens, local.cp_size, local.cp_rank
                )
        _log_too_many_sequences_for_te()
    index_T = rank_indices(lengths_S, local.cp_size, local.cp_rank)
    return torch.from_numpy(index_T).to(cu_seqlens_padded.device)


@functools.cache
def _log_too_many_sequences_for_te() -> None:
    log.warning(
        "partition_indices: more than %d sequences in one call overflow the shared memory of Transformer Engine's "
        "thd_get_partitioned_indices kernel; computing the indices on the host instead (logged once)",
        TE_MAX_SEQUENCES,
    )


def rank_token_indices(meta: ThdMeta, rank: int | None = None) -> np.ndarray:
    """(T / cp_size,) int64 global token indices CP rank ``rank`` (default: the record's) holds, in
    its local (``shard``) order: the one map from a shard's rows to the global batch.

    Every view of a shard that needs to know where its rows come from reads it: the token
    placement (:func:`local_placement`), the all-gather's and the all-to-all's global order
    (:func:`gather_order`). It is ``thdpack.layout.rank_indices`` of the record's slots (and
    groups, under a per-sequence placement). ``meta`` is the record of any rank's shard of the
    batch; ``rank`` must be a rank of its CP group (0 for a global record). Cached on ``meta`` per rank.

    >>> meta = ThdMeta.from_lengths([3, 8], [4, 8], cp_size=2, cp_rank=0)
    >>> rank_token_indices(meta).tolist(), rank_token_indices(meta, 1).tolist()
    ([0, 3, 4, 5, 10, 11], [1, 2, 6, 7, 8, 9])
    >>> groups = EntryGroups(np.array([2, 1, 1, 1]), np.array([0, 1, 0, 1]), 2)
    >>> meta = ThdMeta.from_lengths([6, 3, 0, 0], [8, 3, 4, 1], groups=groups).for_rank(2, 0)
    >>> rank_token_indices(meta).tolist(), rank_token_indices(meta, 1).tolist()
    ([0, 1, 6, 7, 11, 12, 13, 14], [2, 3, 4, 5, 8, 9, 10, 15])
    """
    rank = _rank_of(meta, rank)

    def build() -> np.ndarray:
        groups = meta.groups
        sizes, starts = (None, None) if groups is None else (groups.size_S, groups.start_S)
        index_T = rank_indices(meta.lengths_padded_S, meta.cp_size, rank, sizes, starts).astype(np.int64)
        index_T.flags.writeable = False
        return index_T

    return meta.cached(("rank token indices", rank), build)


def _rank_of(meta: ThdMeta, rank: int | None) -> int:
    """``rank``, checked against the record's CP size, or the record's own rank (checked when the
    record was made)."""
    if rank is None:
        return meta.cp_rank
    check_cp(meta.cp_size, rank)
    return rank


class GatherOrder(NamedTuple):
    """How the rank-major concatenation of every CP rank's rows (what an all-gather or an
    all-to-all delivers: rank 0's rows in its local order, then rank 1's, ...) maps to the global
    batch, both ways. ``T`` = all tokens."""

    global_of_gathered_T: torch.Tensor
    """(T,) int64: row ``p`` of the concatenation is global token ``global_of_gathered_T[p]``."""
    gathered_of_global_T: torch.Tensor
    """(T,) int64: global token ``j`` is row ``gathered_of_global_T[j]`` of the concatenation."""


def gather_order_of(rank_indices: Sequence[np.ndarray], device: torch.device | str = "cpu") -> GatherOrder:
    """The :class:`GatherOrder` of ``rank_indices`` (rank ``r``'s global token indices in its local
    order, as :func:`rank_token_indices` gives them), checked: every rank holds equally many tokens
    (the collectives exchange equal blocks) and together they hold each token of the batch once.

    >>> order = gather_order_of([np.array([0, 1, 6, 7]), np.array([2, 3, 4, 5])])
    >>> order.global_of_gathered_T.tolist(), order.gathered_of_global_T.tolist()
    ([0, 1, 6, 7, 2, 3, 4, 5], [0, 1, 4, 5, 6, 7, 2, 3])
    >>> gather_order_of([np.array([0, 1]), np.array([1, 2])])
    Traceback (most recent call last):
    ...
    ValueError: the ranks' token indices are not a permutation of the batch's 4 tokens: ...
    """
    counts = [len(index) for index in rank_indices]
    if len(set(counts)) > 1:
        raise ValueError(
            f"CP ranks hold {counts} tokens; the all-gather and the all-to-all exchange equal blocks, so every "
            "rank must hold the same number (pack_size / cp_size)"
        )
    global_of_gathered = np.concatenate([np.asarray(index, dtype=np.int64) for index in rank_indices])
    total = len(global_of_gathered)
    if total and not np.array_equal(np.sort(global_of_gathered), np.arange(total)):
        held = np.bincount(global_of_gathered[(global_of_gathered >= 0) & (global_of_gathered < total)],
                           minlength=total)  # fmt: skip
        missing = np.flatnonzero(held == 0)
        raise ValueError(
            f"the ranks' token indices are not a permutation of the batch's {total} tokens: token "
            f"{int(missing[0])} is held by no rank ({len(missing)} missing in all); every token must be on "
            "exactly one rank"
        )
    gathered_of_global = np.argsort(global_of_gathered, kind="stable")
    return GatherOrder(torch.from_numpy(global_of_gathered).to(device), torch.from_numpy(gathered_of_global).to(device))


def gather_order(meta: ThdMeta, device: torch.device | str) -> GatherOrder:
    """The :class:`GatherOrder` of a CP shard's batch (every rank's :func:`rank_token_indices`),
    cached on ``meta`` per device.

    >>> meta = ThdMeta.from_lengths([8], [8], cp_size=2, cp_rank=1)
    >>> gather_order(meta, "cpu").gathered_of_global_T.tolist()   # rank 0 holds 0,1,6,7; rank 1 holds 2..5
    [0, 1, 4, 5, 6, 7, 2, 3]
    """
    device = torch.device(device)
    return meta.cached(
        ("gather order", device),
        lambda: gather_order_of([rank_token_indices(meta, r) for r in range(meta.cp_size)], device),
    )


def local_placement(meta: ThdMeta, device: torch.device | str, rank: int | None = None) -> TokenPlacement:
    """The rows CP rank ``rank`` (default: the record's) holds, in ``shard`` order (``rank_token_indices``):
    the global placement taken at them. ``rank`` must be a rank of the record's CP group (0 for a
    global record). Cached on ``meta`` per (rank, device). Under TE's layout run ``s`` is sequence
    ``s`` (chunk ``r`` then chunk ``2W-1-r`` of it); under a per-sequence placement the runs are
    the rank's entries in its order (``TokenPlacement.sequences``: its split groups' sequences,
    largest group first, then its whole ones).

    >>> meta = ThdMeta.from_lengths([3, 4], [4, 4], cp_size=2, cp_rank=0)
    >>> local_placement(meta, "cpu", rank=1).pos_T.tolist()   # chunk 1 and chunk 2 of each sequence
    [1, 2, 1, 2]
    >>> local_placement(ThdMeta.from_lengths([3], [4]), "cpu", rank=1)
    Traceback (most recent call last):
    ...
    ValueError: cp_rank must be an int in [0, 1), got 1
    """
    rank = _rank_of(meta, rank)
    device = torch.device(device)

    def build() -> TokenPlacement:
        if meta.cp_size == 1:
            return global_placement(meta, device)
        index_T = rank_token_indices(meta, rank)
        whole = global_placement(meta.unsharded(), "cpu")
        valid_T = whole.valid_T.numpy()[index_T]
        seg_T = whole.seg_T.numpy()[index_T]
        valid_S = np.bincount(seg_T, weights=valid_T, minlength=meta.num_sequences).astype(np.int64)
        pos_T = whole.pos_T[torch.tensor(index_T)].to(device)
        placement = meta.placement
        if placement is None:
            counts = tuple(n // meta.cp_size for n in meta.lengths_padded)
            return TokenPlacement(counts, tuple(valid_S.tolist()), pos_T)
        parts = rank_parts(placement.slots_S, meta.cp_size, rank, placement.group_size_S, placement.group_start_S)
        entries_S = np.concatenate([part.entries_S for part in parts]) if parts else np.zeros(0, dtype=np.int64)
        counts_S = placement.slots_S[entries_S] // placement.group_size_S[entries_S]
        keep = counts_S > 0  # an entry with an empty slot has no rows here
        entries_S = entries_S[keep]
        counts, valid = tuple(counts_S[keep].tolist()), tuple(valid_S[entries_S].tolist())
        return TokenPlacement(counts, valid, pos_T, sequences=tuple(entries_S.tolist()))

    return meta.cached(("local placement", rank, device), build)


def shard(
    thd: Mapping[str, Any],
    cp_size: int,
    cp_rank: int,
    *,
    placement: PackPlacement | Sequence[PackPlacement] | None = None,
) -> THDBatch:
    """The THD batch that CP rank ``cp_rank`` of ``cp_size`` computes on (TE's input convention).

    Args:
        thd: a global THD batch (``thdpack.to_thd``): every padded slot a multiple of
            ``2*cp_size`` (pack with ``cp_size``), ``cu_seqlens_padded[-1] == T``; or the batch of
            packs of a per-sequence CP placement, whose record carries the placement (the packs
            of ``plan_packs(..., cp_placement="adaptive")`` do: ``cp_size`` must be its CP size).
        cp_size: context-parallel world size (>= 1).
        cp_rank: this rank, ``0 <= cp_rank < cp_size``.
        placement: the placement of a batch whose record does not carry one (packs made
            elsewhere, laid out by it): the ``PackPlacement`` of each of its packs, in order (one
            for a batch of one pack). It must describe the batch: as many entries (each pack's
            sequences, then one padding entry per rank), the same real lengths and slots.

    Returns:
        A new dict: every per-token tensor (``input_ids``, ``labels``, ``position_ids``,
        ``padding_mask`` and any other (T, ...) tensor) re-indexed with the rank's
        ``rank_token_indices`` to (T / cp_size, ...): TE's ``partition_indices``, or under a
        placement the rank's split groups' chunks (largest group first, TE's order within each)
        then its whole entries; the GLOBAL ``cu_seqlens``, ``cu_seqlens_padded`` and
        ``max_seqlen`` kept, as TE expects (it divides them itself); ``thd_meta`` the shard's
        record (``cp_size``, ``cp_rank``: which shard it is; the placement, and so its
        parts), made from the batch's without validating again. Positions stay the global
        position within each sequence, so RoPE needs no correction; labels travel with their
        tokens. Non-tensor values pass through.

    The P6 pack of nemo_te_spec.md (S2): sequences of 3, 2, 1 tokens in slots of 4, 4, 12.

    >>> from thdpack.thd import to_thd
    >>> pack = {"input_ids": torch.tensor([[1, 2, 3, 0, 4, 5, 0, 0, 6] + [0] * 11]),
    ...         "labels": torch.tensor([[1, 2, 3, -100, 4, 5, -100, -100, 6] + [-100] * 11]),
    ...         "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3] + list(range(12))]),
    ...         "seq_lens": torch.tensor([[3, 2, 1]]), "seq_lens_padded": torch.tensor([[4, 4, 12]])}
    >>> rank0, rank1 = (shard(to_thd(pack), 2, r) for r in (0, 1))
    >>> rank0["input_ids"].tolist(), rank0["position_ids"].tolist()
    ([1, 0, 4, 0, 6, 0, 0, 0, 0, 0], [0, 3, 0, 3, 0, 1, 2, 9, 10, 11])
    >>> rank1["input_ids"].tolist(), rank1["position_ids"].tolist()
    ([2, 3, 5, 0, 0, 0, 0, 0, 0, 0], [1, 2, 1, 2, 3, 4, 5, 6, 7, 8])
    >>> rank1["cu_seqlens"].tolist(), rank1["cu_seqlens_padded"].tolist(), rank1["max_seqlen"]
    ([0, 3, 5, 6], [0, 4, 8, 20], 12)
    >>> rank1["thd_meta"].cp_size, rank1["thd_meta"].cp_rank
    (2, 1)

    Under a per-sequence placement (docs/design/cp_placement.md): 6 tokens split over both
    ranks (slot 8), 3 whole on rank 1, 1 whole on rank 0, then a padding entry per rank.

    >>> from thdpack.packing.packer import assemble_pack, read_sample
    >>> from thdpack.thd import thd_collate
    >>> samples = [{"input_ids": [1, 2, 3, 4, 5, 6]}, {"input_ids": [10, 20, 30]}, {"input_ids": [100]}]
    >>> place = PackPlacement.from_groups([6, 3, 1], {(0, 2): [0], (1, 1): [1], (0, 1): [2]}, cp_size=2, pack_size=16)
    >>> pieces = [read_sample(sample, i) for i, sample in enumerate(samples)]
    >>> thd = thd_collate([assemble_pack(pieces, 16, cp_size=2, placement=place)])
    >>> rank0, rank1 = (shard(thd, 2, r) for r in (0, 1))
    >>> rank0["input_ids"].tolist(), rank0["position_ids"].tolist()
    ([1, 2, 0, 0, 100, 0, 0, 0], [0, 1, 6, 7, 0, 0, 1, 2])
    >>> rank1["input_ids"].tolist(), rank1["position_ids"].tolist()
    ([3, 4, 5, 6, 10, 20, 30, 0], [2, 3, 4, 5, 0, 1, 2, 0])
    >>> from thdpack.thd.parts import shard_parts
    >>> [(p.group_size, p.rows) for p in shard_parts(rank1["thd_meta"])]   # the ring over both ranks, then whole
    [(2, slice(0, 4, None)), (1, slice(4, 8, None))]
    """
    meta = thd_meta(thd)
    if placement is not None:
        meta = _with_placement(meta, placement)
    local = meta.for_rank(cp_size, cp_rank)
    check_token_rows(thd, meta)
    if local.cp_size == 1:  # nothing to split, and packs without CP need no even slot widths (TE's kernel would)
        return dict(thd)
    # computed on the host from the validated record (no device read), then moved with the tokens
    index_T = torch.tensor(rank_token_indices(local))  # a copy: the cached map is read-only
    out: THDBatch = {}
    for key, value in thd.items():
        if key in ("cp_size", "cp_rank"):  # a batch made elsewhere may say it is unsharded; the record says
            continue
        if key in THD_METADATA_KEYS or not isinstance(value, torch.Tensor):
            out[key] = value
        else:
            out[key] = value.index_select(0, index_T.to(value.device))
    attach_meta(out, local)
    return out


def _with_placement(meta: ThdMeta, placement: PackPlacement | Sequence[PackPlacement]) -> ThdMeta:
    """``meta`` (a global record) with the groups of ``placement``, which must describe its entries."""
    packs = [placement] if isinstance(placement, PackPlacement) else list(placement)
    if not packs or not all(isinstance(p, PackPlacement) for p in packs):
        raise TypeError("placement must be a PackPlacement or a sequence of them (one per pack of the batch)")
    cp = packs[0].cp_size
    if any(p.cp_size != cp for p in packs):
        raise ValueError(f"the packs' placements are for cp_size {sorted({p.cp_size for p in packs})}; use one CP size")
    layouts = [p.layout() for p in packs]
    layout = CpLayout.concat(layouts)
    pack_S = np.concatenate([np.full(len(x.lengths_S), i) for i, x in enumerate(layouts)])
    column_S = np.concatenate([np.arange(len(x.lengths_S)) for x in layouts])

    def where(s: int) -> str:
        return f"pack {int(pack_S[s])}: entry {int(column_S[s])}"

    carried = meta.placement
    if carried is not None and not all(np.array_equal(a, b) for a, b in zip(carried, layout, strict=True)):
        raise ValueError(
            f"this THD batch already carries a CP placement (for cp_size={meta.groups.cp_size}) that differs from "
            "the one given; shard it without a placement, or build the batch from the packs of the plan whose "
            "placement you pass"
        )
    if len(layout.lengths_S) != meta.num_sequences:
        raise ValueError(
            f"the placement describes {len(layout.lengths_S)} entries ({len(packs)} packs: their sequences, then "
            f"{cp} padding entries each) but the batch has {meta.num_sequences}; a sequence of the batch would be "
            "placed never or twice: pass the placements of the batch's packs, in order"
        )
    wrong = (layout.lengths_S != meta.lengths_S) | (layout.slots_S != meta.lengths_padded_S)
    if wrong.any():
        s = int(np.argmax(wrong))
        raise ValueError(
            f"{where(s)} has {int(meta.lengths_S[s])} real tokens in a slot of {int(meta.lengths_padded_S[s])}, but "
            f"the placement has {int(layout.lengths_S[s])} in a slot of {int(layout.slots_S[s])}; lay the packs out by "
            "their placement (build_pack / assemble_pack(..., placement=...))"
        )
    return meta.with_groups(EntryGroups(layout.group_size_S, layout.group_start_S, cp), where)


def unshard(shards: Sequence[Mapping[str, Any]], cp_size: int) -> THDBatch:
    """Reassemble the global THD batch from every rank's ``shard``, in rank order.

    Args:
        shards: ``cp_size`` shards of one global batch, shard ``r`` of CP rank ``r``.
        cp_size: context-parallel world size.

    Returns:
        The global batch: per-token tensors (T, ...) back in storage order, the shared metadata,
        the global record. ``unshard([shard(thd, W, r) for r in range(W)], W)`` equals ``thd``.

    >>> cu = torch.tensor([0, 8], dtype=torch.int32)
    >>> thd = {"input_ids": torch.arange(8), "cu_seqlens": cu, "cu_seqlens_padded": cu, "max_seqlen": 8}
    >>> shards = [shard(thd, 2, r) for r in (0, 1)]
    >>> [s["input_ids"].tolist() for s in shards]
    [[0, 1, 6, 7], [2, 3, 4, 5]]
    >>> unshard(shards, 2)["input_ids"].tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    if len(shards) != cp_size:
        raise ValueError(f"unshard got {len(shards)} shards for cp_size={cp_size}; pass one shard per rank")
    first = shards[0]
    for r, part in enumerate(shards):
        meta = thd_meta(part)
        if (meta.cp_size, meta.cp_rank) != (cp_size, r):
            raise ValueError(
                f"shards[{r}] has cp_size={meta.cp_size}, cp_rank={meta.cp_rank}; expected cp_size={cp_size}, "
                f"cp_rank={r}: pass shard(thd, {cp_size}, r) for r = 0..{cp_size - 1}, in order"
            )
        if part.keys() != first.keys():
            raise ValueError(f"shards[{r}] has keys {sorted(part.keys())} but shards[0] has {sorted(first.keys())}")
        for key in ("cu_seqlens", "cu_seqlens_padded"):
            if not torch.equal(part[key], first[key]):
                raise ValueError(f"shards[{r}] has a different {key} than shards[0]; shards must be of one batch")
    whole = thd_meta(first).unsharded()
    # position in the rank-major concatenation -> global token index, then its inverse
    gathered_to_global_T = np.concatenate([rank_token_indices(thd_meta(first), r) for r in range(cp_size)])
    global_to_gathered_T = torch.from_numpy(np.argsort(gathered_to_global_T, kind="stable"))
    out: THDBatch = {}
    for key, value in first.items():
        if key in ("cp_size", "cp_rank"):
            continue
        if key in THD_METADATA_KEYS or not isinstance(value, torch.Tensor):
            out[key] = value
        else:
            gathered = torch.cat([part[key] for part in shards])
            whole.check_token_count(gathered.shape[0] if gathered.dim() else 0, f"{key} of all shards together")
            out[key] = gathered.index_select(0, global_to_gathered_T.to(gathered.device))
    attach_meta(out, whole)
    return out


def gather(local_thd: Mapping[str, Any], group: dist.ProcessGroup) -> THDBatch:
    """All-gather every rank's shard over the CP ``group``; return the global batch on every rank.

    Collective: one ``all_gather`` per per-token tensor, on gloo (CPU) and NCCL.

    Args:
        local_thd: this rank's ``shard(thd, cp_size, rank)`` of the global batch (``cp_size`` =
            the group's size, ``rank`` = this process's rank in it).
        group: the CP process group.

    Returns:
        The global THD batch, in storage order, with its record.
    """
    meta = thd_meta(local_thd)
    meta.check_cp_group(group)
    whole = meta.unsharded()
    shards: list[dict[str, Any]] = [dict(local_thd) for _ in range(meta.cp_size)]
    for key, value in local_thd.items():
        if key in THD_METADATA_KEYS or not isinstance(value, torch.Tensor):
            continue
        parts = [torch.empty_like(value) for _ in range(meta.cp_size)]
        dist.all_gather(parts, value.contiguous(), group=group)
        for r in range(meta.cp_size):
            shards[r][key] = parts[r]
    for r, part in enumerate(shards):
        if "cp_rank" in part:  # a shard made elsewhere says its rank with keys
            part["cp_rank"] = r
        attach_meta(part, meta if r == meta.cp_rank else whole.for_rank(meta.cp_size, r))
    return unshard(shards, meta.cp_size)
