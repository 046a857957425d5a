"""The one host-side record of a THD batch's layout: built once, carried by the batch.

A THD batch (``thdpack.to_thd`` / ``thd_collate`` / ``cp.shard``) stores ``S`` sequences in
``T`` tokens: sequence ``s`` occupies a slot of ``lengths_padded[s]`` tokens whose first
``lengths[s]`` are real. Under context parallelism a shard keeps ``T / cp_size`` of them while
the metadata stays global. :class:`ThdMeta` holds exactly that (host ints: reading it never
syncs a device), and every fact about a layout is checked by it, each by one method with one
message: :meth:`ThdMeta.from_lengths` (the lengths, ``max_seqlen``, the ``2*cp_size`` rule),
:meth:`~ThdMeta.check_token_count` (a per-token tensor has one row per token),
:meth:`~ThdMeta.cu_tensor` (``cu_seqlens`` int32 on the kernel's device) and
:meth:`~ThdMeta.check_cp_group` (the process group is the one the batch was sharded for).

The record travels with its batch, as flash-attn's ``bert_padding.unpad_input`` returns
``indices``, ``cu_seqlens`` and ``max_seqlen`` together: every batch thdpack makes (``to_thd``,
``thd_collate``, ``cp.shard`` / ``unshard`` / ``gather``, ``thd_to_device``, ``thd_pin_memory``)
holds its record under :data:`META_KEY` (``"thd_meta"``), and :func:`thd_meta` takes it from
there without reading a tensor. It is the one carrier of a shard's ``cp_size`` / ``cp_rank``.
It pickles with the batch (into and out of DataLoader workers) and still describes the batch
on the other side.

A record describes the ``cu_seqlens`` / ``cu_seqlens_padded`` tensors it was attached to.
When the batch holds other ones (replaced, moved by something other than ``thd_to_device``,
copied by DataLoader's ``pin_memory``) or they were changed in place, or the batch's
``max_seqlen`` / ``cp_size`` / ``cp_rank`` keys say otherwise, the record is stale and is never
used: :func:`thd_meta` builds the record afresh from the tensors (as for a batch made
elsewhere: a host copy of the two ``cu`` tensors, a device sync on an accelerator), keeping the
stale record's ``cp_size`` / ``cp_rank`` unless the batch's keys give them (no tensor says which
shard a batch is), and stores it in the batch in place of the stale one.

Under a per-sequence CP placement (``plan_packs(..., cp_placement="adaptive")``,
``thdpack.plan.placement``) the record also holds every entry's group (:class:`EntryGroups`:
whole on one rank, or split over an aligned group of ranks in TE's layout within the group) and
the CP size the placement is for; :attr:`ThdMeta.placement` is then the batch's ``CpLayout``,
and a shard's record lists the parts its rank computes (:attr:`ThdMeta.parts`: one per split
group, largest first, then the whole entries), each with its own record. The slot rule then
holds per entry with its own ``2g`` (a whole entry's slot is free), checked once, where the batch
is made.

A mapping made elsewhere (NeMo's, Transformer Engine's: ``cu_seqlens`` and optional
``cu_seqlens_padded``, ``max_seqlen``, ``cp_size``, ``cp_rank``) is validated from its tensors
by the first :func:`thd_meta`, which stores the record in it (when it is a mutable mapping),
so the next call (the next layer) finds it.

Legend: ``S`` sequences, ``T`` tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from thdpack.format_rules import check_cp_multiple, check_cp_size
from thdpack.plan.placement import CpLayout, rank_groups

_T = TypeVar("_T")

META_KEY = "thd_meta"
"""The key under which a THD batch carries its :class:`ThdMeta`."""
CU_KEYS = ("cu_seqlens", "cu_seqlens_padded")


def _default_where(s: int) -> str:
    return f"sequence {s}"


def check_cp(cp_size: Any, cp_rank: Any) -> None:
    """``cp_size`` an int >= 1 and ``0 <= cp_rank < cp_size``, else ``ValueError``."""
    cp_size = check_cp_size(cp_size)
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, (int, np.integer)) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an int in [0, {cp_size}), got {cp_rank!r}")


def cu_lengths(name: str, cu: Any) -> np.ndarray:
    """(S,) int64 lengths of a ``cu_seqlens``-style tensor, checked: an integer (S+1,) tensor with
    ``[0] == 0`` that never decreases. Copies it to the host (one sync on an accelerator)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (int32), got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with at least 2 entries (S+1), got shape {tuple(cu.shape)}")
    host = cu.detach().cpu().numpy().astype(np.int64)
    if host[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {host[0]}")
    lengths = np.diff(host)
    drops = lengths < 0
    if drops.any():
        i = int(np.argmax(drops)) + 1
        raise ValueError(f"{name} must be non-decreasing; it drops at entry {i} ({host[i - 1]} -> {host[i]})")
    return lengths


def cu_from_lengths(lengths_S: Sequence[int] | np.ndarray, device: torch.device | str = "cpu") -> torch.Tensor:
    """(S+1,) int32 ``[0] + cumsum(lengths)`` on ``device``: the inverse of :func:`cu_lengths`.

    >>> cu_from_lengths([3, 4, 1]).tolist()
    [0, 3, 7, 8]
    """
    lengths = np.asarray(lengths_S, dtype=np.int64)
    cu = np.empty(len(lengths) + 1, dtype=np.int32)
    cu[0] = 0
    cu[1:] = lengths.cumsum()  # int64 sums, cast once (faster than cumsum into an int32 out)
    return torch.from_numpy(cu).to(device)


class EntryGroups(NamedTuple):
    """Where each entry of a batch runs under a per-sequence CP placement (``thdpack.plan.placement``)."""

    size_S: np.ndarray
    """(S,) int64 ranks of each entry's group: 1 = whole on one rank, ``g > 1`` = split over ``g``."""
    start_S: np.ndarray
    """(S,) int64 first rank of each entry's group (aligned: a multiple of its size)."""
    cp_size: int
    """The context-parallel size the placement is for (a shard's ``cp_size`` must equal it)."""

    def key(self) -> tuple[Any, ...]:
        return (tuple(self.size_S.tolist()), tuple(self.start_S.tolist()), self.cp_size)


class ShardPart(NamedTuple):
    """One part of a placed CP shard: the rows one attention call computes
    (:attr:`ThdMeta.parts`)."""

    group_start: int
    """First rank of the part's group (the rank itself for the whole part)."""
    group_size: int
    """Ranks of the group; 1 = the whole part (entries whole on this rank: no communication)."""
    rows: slice
    """The part's rows of the shard (``[start, stop)``, parts back to back in shard order)."""
    entries_S: np.ndarray
    """(S_part,) int64 the batch entries of the part, in its order."""
    meta: ThdMeta
    """The part's own record: for a split group a TE-layout shard of its entries (``cp_size`` =
    ``group_size``, ``cp_rank`` = rank - ``group_start``); for the whole part an unsharded batch of
    its entries (entries with an empty slot left out: they have no rows)."""


def _same_int(value: Any, expected: int) -> bool:
    """``value`` is the Python int ``expected`` (a tensor is never compared: that would sync)."""
    return isinstance(value, int) and not isinstance(value, bool) and value == expected


class ThdMeta:
    """Host-side layout of one THD batch or CP shard; take it from a batch with :func:`thd_meta`.

    Immutable once built (made on every batch, so it is a slotted class rather than a dataclass);
    equal records describe the same layout, whichever tensors they are attached to.
    """

    __slots__ = ("_cache", "_groups", "_lengths_S", "_padded_S", "_tensors", "cp_rank", "cp_size", "max_seqlen")

    def __init__(
        self,
        lengths_S: np.ndarray,
        padded_S: np.ndarray,
        cp_size: int,
        cp_rank: int,
        max_seqlen: int,
        *,
        cache: dict[Any, Any] | None = None,
        groups: EntryGroups | None = None,
    ):
        """Use :meth:`from_lengths`; this stores already validated, read-only arrays."""
        lengths_S.flags.writeable = padded_S.flags.writeable = False
        if groups is not None:
            groups.size_S.flags.writeable = groups.start_S.flags.writeable = False
        self._lengths_S, self._padded_S, self._groups = lengths_S, padded_S, groups
        self.cp_size, self.cp_rank, self.max_seqlen = cp_size, cp_rank, max_seqlen
        self._cache: dict[Any, Any] = {} if cache is None else cache
        # (cu_seqlens, its _version, cu_seqlens_padded or None, its _version): the tensors described
        self._tensors: tuple[torch.Tensor, int, torch.Tensor | None, int] | None = None

    @property
    def lengths(self) -> tuple[int, ...]:
        """(S,) real tokens per sequence."""
        return self.cached("lengths", lambda: tuple(self._lengths_S.tolist()))

    @property
    def lengths_padded(self) -> tuple[int, ...]:
        """(S,) storage slot per sequence (>= the real length; a multiple of 2*cp_size under CP)."""
        return self.cached("lengths_padded", lambda: tuple(self._padded_S.tolist()))

    @property
    def lengths_S(self) -> np.ndarray:
        """(S,) int64 real lengths, a read-only numpy array."""
        return self._lengths_S

    @property
    def lengths_padded_S(self) -> np.ndarray:
        """(S,) int64 slot lengths, a read-only numpy array."""
        return self._padded_S

    @property
    def groups(self) -> EntryGroups | None:
        """Every entry's CP group under a per-sequence placement, or None: TE's layout (every
        sequence split over all ``cp_size`` ranks)."""
        return self._groups

    @property
    def placement(self) -> CpLayout | None:
        """The batch's global layout under a per-sequence placement (``CpLayout``: per entry its
        real length, slot and group, padding entries included; its CP size is
        ``groups.cp_size``), or None for TE's layout."""
        if self._groups is None:
            return None
        return self.cached(
            "placement", lambda: CpLayout(self._lengths_S, self._padded_S, self._groups.size_S, self._groups.start_S)
        )

    def _fields(self) -> tuple[Any, ...]:
        groups = None if self._groups is None else self.cached("groups key", self._groups.key)
        return (self.lengths, self.lengths_padded, self.cp_size, self.cp_rank, self.max_seqlen, groups)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ThdMeta) and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        placed = ""
        if self._groups is not None:
            size, start, cp = self._groups.key()
            placed = f", group_size={size}, group_start={start}, placed for cp_size={cp}"
        return (
            f"ThdMeta(lengths={self.lengths}, lengths_padded={self.lengths_padded}, cp_size={self.cp_size}, "
            f"cp_rank={self.cp_rank}, max_seqlen={self.max_seqlen}{placed})"
        )

    @classmethod
    def from_lengths(
        cls,
        lengths: Sequence[int] | np.ndarray,
        lengths_padded: Sequence[int] | np.ndarray,
        *,
        cp_size: int = 1,
        cp_rank: int = 0,
        max_seqlen: Any = None,
        where: Callable[[int], str] = _default_where,
        copy: bool = True,
        groups: EntryGroups | None = None,
        pack_S: np.ndarray | None = None,
    ) -> ThdMeta:
        """The validated record. Raises ``ValueError`` / ``TypeError`` naming the offending sequence
        (``where(s)`` says which: ``"sequence 3"``, ``"pack 1: sequence 0"``), its value and the fix.

        ``groups``: every entry's CP group under a per-sequence placement (None: TE's layout). The
        slot rule then holds per entry with its own ``2g`` and every rank must hold an equal share
        of the tokens (``CpLayout.check``), of every pack when ``pack_S`` ((S,) the pack of each
        entry) says where packs begin; a shard's ``cp_size`` must be the placement's.

        >>> ThdMeta.from_lengths([3, 4], [4, 4], cp_size=2, cp_rank=1)
        ThdMeta(lengths=(3, 4), lengths_padded=(4, 4), cp_size=2, cp_rank=1, max_seqlen=4)
        >>> ThdMeta.from_lengths([5], [4])
        Traceback (most recent call last):
        ...
        ValueError: sequence 0 has 5 real tokens but a padded slot of 4; ...
        """
        if cp_size != 1 or cp_rank != 0:
            check_cp(cp_size, cp_rank)
        # the record keeps the arrays (read-only): a copy, unless the caller made them for it (copy=False)
        real_S = (np.array if copy else np.asarray)(lengths, dtype=np.int64).reshape(-1)
        padded_S = (np.array if copy else np.asarray)(lengths_padded, dtype=np.int64).reshape(-1)
        if real_S.shape != padded_S.shape:
            raise ValueError(
                f"cu_seqlens has {real_S.size + 1} entries but cu_seqlens_padded has {padded_S.size + 1}; both "
                "need one entry per sequence plus one"
            )
        # one pass for both faults: a negative slot under a real length >= 0 is also real > padded
        bad = (real_S < 0) | (real_S > padded_S)
        if bad.any():
            s = int(np.argmax(bad))
            if real_S[s] < 0 or padded_S[s] < 0:
                raise ValueError(
                    f"{where(s)} has seq_lens={real_S[s]}, seq_lens_padded={padded_S[s]}; lengths must be >= 0"
                )
            raise ValueError(
                f"{where(s)} has {real_S[s]} real tokens but a padded slot of {padded_S[s]}; a slot must hold its "
                "sequence (cu_seqlens counts real tokens, cu_seqlens_padded the slots that hold them)"
            )
        if groups is None:
            check_cp_multiple(padded_S, int(cp_size), where)
        else:
            groups = _checked_groups(groups, real_S, padded_S, int(cp_size), where, copy, pack_S)
        widest = int(padded_S.max()) if padded_S.size else 0
        if max_seqlen is None:
            max_seqlen = widest
        elif isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
            raise TypeError(
                "max_seqlen must be a Python int (computed on the host where the batch is made, so the forward "
                f"pass needs no .item() and no device sync), got {type(max_seqlen).__name__}"
            )
        elif max_seqlen < widest:
            raise ValueError(
                f"max_seqlen={max_seqlen} is below the widest padded slot ({widest}); kernels may then write out of "
                "bounds or skip keys: use max(diff(cu_seqlens_padded)), which thdpack.to_thd computes"
            )
        return cls(real_S, padded_S, int(cp_size), int(cp_rank), max_seqlen, groups=groups)

    def for_rank(self, cp_size: int, cp_rank: int) -> ThdMeta:
        """The record of this (global) batch's shard for ``cp_rank`` of ``cp_size`` (a placed
        batch: the placement's ``cp_size``)."""
        if self.cp_size != 1:
            raise ValueError(
                f"this THD batch is already CP rank {self.cp_rank}'s shard of cp_size={self.cp_size}; shard the "
                "global batch (unshard / gather restores it)"
            )
        check_cp(cp_size, cp_rank)
        if self._groups is None:
            check_cp_multiple(self._padded_S, int(cp_size))
        elif cp_size != self._groups.cp_size:
            raise ValueError(
                f"this THD batch is laid out for cp_size={self._groups.cp_size} (its CP placement: every sequence "
                f"whole on one of {self._groups.cp_size} ranks or split over a group of them), not cp_size={cp_size}; "
                f"shard it with cp_size={self._groups.cp_size}, or plan the packs for cp_size={cp_size}"
            )
        return ThdMeta(
            self._lengths_S, self._padded_S, int(cp_size), int(cp_rank), self.max_seqlen, groups=self._groups
        )

    def with_groups(self, groups: EntryGroups, where: Callable[[int], str] = _default_where) -> ThdMeta:
        """This (global, TE-layout) record with every entry's CP group, validated as
        :meth:`from_lengths` validates ``groups``; ``self`` when it already carries these groups."""
        if self._groups is not None and self.cached("groups key", self._groups.key) == groups.key():
            return self
        if self.cp_size != 1:
            raise ValueError(
                f"this THD batch is CP rank {self.cp_rank}'s shard of cp_size={self.cp_size}; give the placement "
                "with the global batch"
            )
        if self._groups is not None:
            raise ValueError(
                f"this THD batch already carries a CP placement (for cp_size={self._groups.cp_size}) that differs "
                "from the one given"
            )
        groups = _checked_groups(groups, self._lengths_S, self._padded_S, 1, where, True)
        return ThdMeta(self._lengths_S, self._padded_S, 1, 0, self.max_seqlen, groups=groups)

    def unsharded(self) -> ThdMeta:
        """The record of the global batch this shard belongs to (``self`` for a global record)."""
        if self.cp_size == 1:
            return self
        return ThdMeta(self._lengths_S, self._padded_S, 1, 0, self.max_seqlen, groups=self._groups)

    @property
    def parts(self) -> tuple[ShardPart, ...]:
        """The parts this CP shard's rank computes, back to back in shard order: one per split group
        holding entries of the rank (largest group first), then its whole entries (when they take
        rows). A TE-layout shard is one part, over all ``cp_size`` ranks, described by ``self``.

        >>> groups = EntryGroups(np.array([2, 1, 1, 1, 1]), np.array([0, 1, 0, 0, 1]), 2)
        >>> meta = ThdMeta.from_lengths([6, 3, 1, 0, 0], [8, 3, 1, 3, 1], groups=groups).for_rank(2, 1)
        >>> [(p.group_start, p.group_size, p.rows, p.entries_S.tolist()) for p in meta.parts]
        [(0, 2, slice(0, 4, None), [0]), (1, 1, slice(4, 8, None), [1, 4])]
        >>> meta.parts[0].meta.cp_size, meta.parts[0].meta.cp_rank, meta.parts[1].meta.lengths
        (2, 1, (3, 0))
        """
        if self.cp_size == 1:
            raise ValueError("an unsharded THD batch has no CP parts; shard it (thdpack.cp.shard) first")
        return self.cached("parts", self._build_parts)

    def _build_parts(self) -> tuple[ShardPart, ...]:
        if self._groups is None:
            everything = np.arange(self.num_sequences, dtype=np.int64)
            return (ShardPart(0, self.cp_size, slice(0, self.local_tokens), everything, self),)
        parts, start = [], 0
        for g0, g, entries in rank_groups(self._groups.size_S, self._groups.start_S, self.cp_rank):
            if g == 1:
                entries = entries[self._padded_S[entries] > 0]  # an empty slot has no rows
            real, slots = self._lengths_S[entries], self._padded_S[entries]
            rows = int(slots.sum()) // g
            if rows == 0:
                continue
            widest = int(slots.max())
            if g > 1:
                meta = ThdMeta.from_lengths(real, slots, cp_size=g, cp_rank=self.cp_rank - g0, max_seqlen=widest)
            else:
                meta = ThdMeta.from_lengths(real, slots, max_seqlen=widest)
            parts.append(ShardPart(g0, g, slice(start, start + rows), entries, meta))
            start += rows
        assert start == self.local_tokens, f"the parts hold {start} rows, the shard {self.local_tokens}"
        return tuple(parts)

    @property
    def num_sequences(self) -> int:
        return len(self._lengths_S)

    @property
    def total_tokens(self) -> int:
        """Global T (all ranks)."""
        return self.cached("total_tokens", lambda: int(self._padded_S.sum()))

    @property
    def local_tokens(self) -> int:
        """Tokens on this rank: T / cp_size."""
        return self.total_tokens // self.cp_size

    @property
    def has_padding(self) -> bool:
        return self.lengths != self.lengths_padded

    def cached(self, key: Any, build: Callable[[], _T]) -> _T:
        """``build()``'s result, computed once per batch (the layers of a model share it)."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    # ---- the checks of a layout against what comes with it ----

    def check_token_count(self, count: int, what: str) -> None:
        """``ValueError`` unless ``what`` (a per-token tensor, its ``count`` rows) has one row per token
        of this layout: ``T = cu_seqlens_padded[-1]``, or ``T / cp_size`` on a CP shard.

        >>> ThdMeta.from_lengths([3], [4]).check_token_count(5, "labels")
        Traceback (most recent call last):
        ...
        ValueError: labels has 5 tokens but the THD layout holds 4 (cu_seqlens_padded[-1]=4); ...
        """
        if count != self.local_tokens:
            where = f"cu_seqlens_padded[-1]={self.total_tokens}"
            if self.cp_size > 1:
                where = f"{where} / cp_size={self.cp_size}, on CP rank {self.cp_rank}"
            raise ValueError(
                f"{what} has {count} tokens but the THD layout holds {self.local_tokens} ({where}); every "
                "per-token tensor needs one row per token of the slots cu_seqlens_padded describes (Transformer "
                "Engine silently duplicates or drops tokens otherwise)"
            )

    def cu_tensor(self, key: str, device: torch.device | None = None) -> torch.Tensor:
        """The batch's ``key`` tensor (``cu_seqlens_padded`` falls back to ``cu_seqlens``) as kernels
        read it: int32 (what TE and FlashAttention take), on ``device`` when given; else the error
        naming the fix. Only a record taken from its batch (:func:`thd_meta`) knows the tensors."""
        assert self._tensors is not None, "a record made from lengths alone has no tensors; use thd_meta(batch)"
        cu_seqlens, _, cu_seqlens_padded, _ = self._tensors
        cu = cu_seqlens_padded if key == "cu_seqlens_padded" and cu_seqlens_padded is not None else cu_seqlens
        if cu.dtype != torch.int32:
            raise TypeError(
                f"{key} must be int32 (what TE and FlashAttention kernels take), got {cu.dtype}; thdpack.to_thd "
                "makes int32 (or convert with .to(torch.int32))"
            )
        if device is not None and cu.device != device:
            raise ValueError(f"{key} is on {cu.device} but q/k/v are on {device}; move the batch to {device}")
        return cu

    def check_cp_group(self, group: dist.ProcessGroup | None) -> None:
        """``ValueError`` unless ``group`` is the context-parallel group this batch was sharded for:
        of size ``cp_size`` with this process at ``cp_rank`` (None: an unsharded batch)."""
        size = 1 if group is None else dist.get_world_size(group)
        rank = 0 if group is None else dist.get_rank(group)
        if (size, rank) == (self.cp_size, self.cp_rank):
            return
        batch = f"CP rank {self.cp_rank}'s shard of cp_size={self.cp_size}" if self.cp_size > 1 else "not CP-sharded"
        process = "no cp_group was given" if group is None else f"this process is rank {rank} of a cp_group of {size}"
        raise ValueError(
            f"the THD batch is {batch} but {process}; pass the context-parallel group the batch was sharded for "
            "(thdpack.cp.shard(batch, cp_size=<group size>, cp_rank=<rank in the group>)), or no group with the "
            "unsharded batch"
        )

    # ---- the tensors a record describes ----

    def _describes(self, thd: Mapping[str, Any]) -> bool:
        """``thd`` holds the very tensors this record was attached to, unchanged, and none of its keys
        says otherwise about the layout. Reads no tensor (every attention layer asks this)."""
        if self._tensors is None:
            return False
        cu_seqlens, cu_version, cu_seqlens_padded, padded_version = self._tensors
        if thd.get("cu_seqlens") is not cu_seqlens or thd.get("cu_seqlens_padded") is not cu_seqlens_padded:
            return False
        if cu_seqlens._version != cu_version:
            return False
        if cu_seqlens_padded is not None and cu_seqlens_padded._version != padded_version:
            return False
        max_seqlen = thd.get("max_seqlen", self.max_seqlen)
        if max_seqlen is not self.max_seqlen and not _same_int(max_seqlen, self.max_seqlen):
            return False
        if "cp_size" in thd or "cp_rank" in thd:  # a batch made elsewhere (or relabelled) says which shard
            return _same_int(thd.get("cp_size", self.cp_size), self.cp_size) and _same_int(
                thd.get("cp_rank", self.cp_rank), self.cp_rank
            )
        return True

    def _attached_to(self, thd: Mapping[str, Any]) -> ThdMeta:
        """This record describing ``thd``'s cu tensors: ``self`` when it is new or already does, else
        a twin sharing its arrays and cache (the same layout, other tensors: a moved batch)."""
        cu_seqlens, cu_seqlens_padded = thd["cu_seqlens"], thd.get("cu_seqlens_padded")
        if self._tensors is not None and self._tensors[0] is cu_seqlens and self._tensors[2] is cu_seqlens_padded:
            return self
        padded_version = 0 if cu_seqlens_padded is None else cu_seqlens_padded._version
        attached = self
        if self._tensors is not None:
            attached = ThdMeta(
                self._lengths_S, self._padded_S, self.cp_size, self.cp_rank, self.max_seqlen, cache=self._cache,
                groups=self._groups,
            )  # fmt: skip
        attached._tensors = (cu_seqlens, cu_seqlens._version, cu_seqlens_padded, padded_version)
        return attached

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles (into and out of DataLoader workers) without the device-side cache, with the tensors it
        describes: pickled together with its batch, it describes the unpickled batch's tensors."""
        tensors = (None, None) if self._tensors is None else (self._tensors[0], self._tensors[2])
        fields = (self._lengths_S, self._padded_S, self.cp_size, self.cp_rank, self.max_seqlen)
        return (_unpickle, (*fields, *tensors, self._groups))


def _checked_groups(
    groups: EntryGroups,
    real_S: np.ndarray,
    padded_S: np.ndarray,
    cp_size: int,
    where: Callable[[int], str],
    copy: bool,
    pack_S: np.ndarray | None = None,
) -> EntryGroups:
    """``groups`` (int64 arrays, copied unless ``copy`` is False) after ``CpLayout.check`` (per pack
    with ``pack_S``); a shard's ``cp_size`` (1 for a global batch) must be the placement's."""
    make = np.array if copy else np.asarray
    size_S = make(groups.size_S, dtype=np.int64).reshape(-1)
    start_S = make(groups.start_S, dtype=np.int64).reshape(-1)
    placed_for = check_cp_size(groups.cp_size)
    if size_S.shape != real_S.shape or start_S.shape != real_S.shape:
        raise ValueError(
            f"the CP placement gives groups for {size_S.size} / {start_S.size} entries but the batch has "
            f"{real_S.size}; one group per entry (padding entries included)"
        )
    if cp_size != 1 and cp_size != placed_for:
        raise ValueError(f"the shard has cp_size={cp_size} but its CP placement is for cp_size={placed_for}")
    CpLayout(real_S, padded_S, size_S, start_S).check(placed_for, where, pack_S)
    return EntryGroups(size_S, start_S, placed_for)


def _unpickle(
    lengths_S: np.ndarray,
    padded_S: np.ndarray,
    cp_size: int,
    cp_rank: int,
    max_seqlen: int,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_padded: torch.Tensor | None,
    groups: EntryGroups | None = None,
) -> ThdMeta:
    meta = ThdMeta(lengths_S, padded_S, cp_size, cp_rank, max_seqlen, groups=groups)
    if cu_seqlens is not None:
        meta._attached_to({"cu_seqlens": cu_seqlens, "cu_seqlens_padded": cu_seqlens_padded})
    return meta


def _kept_groups(stale: ThdMeta | None, num_sequences: int) -> EntryGroups | None:
    """The CP placement a stale record passes on to the record rebuilt from the batch's tensors (no
    tensor says it, as none says the shard): kept while the batch has as many entries (checked again
    with the new lengths); a global batch with other entries has no placement any more, a shard
    with other entries is refused."""
    if stale is None or stale.groups is None or stale.num_sequences == num_sequences:
        return None if stale is None else stale.groups
    if stale.cp_size == 1:
        return None
    raise ValueError(
        f"this CP shard's placement describes {stale.num_sequences} entries but its cu_seqlens now describe "
        f"{num_sequences}; shard the global batch again (thdpack.cp.shard) after changing its sequences"
    )


def attach_meta(thd: MutableMapping[str, Any], meta: ThdMeta) -> ThdMeta:
    """Store ``meta``, the record of ``thd``'s layout, in ``thd`` (under :data:`META_KEY`); return it.

    For the functions that make THD batches: ``thd`` holds its final ``cu_seqlens`` /
    ``cu_seqlens_padded`` tensors, which ``meta`` (built from the lengths they were made from, or
    taken from the batch they were moved from) describes.
    """
    attached = meta._attached_to(thd)
    thd[META_KEY] = attached
    return attached


def thd_meta(thd: Mapping[str, Any]) -> ThdMeta:
    """The validated :class:`ThdMeta` of a THD batch or CP shard: the one it carries, or built once.

    A batch made by thdpack carries its record (:data:`META_KEY`), returned without reading a
    tensor while it describes the batch (module docstring). Otherwise reads ``cu_seqlens``
    ((S+1,) integer), optional ``cu_seqlens_padded`` (default: ``cu_seqlens``), optional
    ``max_seqlen`` (a Python int; computed when absent) and optional ``cp_size`` / ``cp_rank``
    (default 1 / 0, or a stale record's), validates them and stores the record in ``thd`` when
    ``thd`` is a mutable mapping.

    >>> cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    >>> batch = {"cu_seqlens": cu, "cu_seqlens_padded": torch.tensor([0, 4, 8], dtype=torch.int32)}
    >>> meta = thd_meta(batch)
    >>> meta.lengths, meta.lengths_padded, meta.max_seqlen
    ((3, 4), (4, 4), 4)
    >>> batch["thd_meta"] is meta and thd_meta(batch) is meta   # validated once, then carried
    True
    """
    carried = thd.get(META_KEY)
    if carried is not None:
        if not isinstance(carried, ThdMeta):
            raise TypeError(f"thd[{META_KEY!r}] must be a thdpack ThdMeta, got {type(carried).__name__}")
        if carried._describes(thd):
            return carried
    if "cu_seqlens" not in thd:
        raise ValueError("thd has no 'cu_seqlens'; pass the mapping returned by thdpack.to_thd or thdpack.cp.shard")
    real_S = cu_lengths("cu_seqlens", thd["cu_seqlens"])
    cu_padded = thd.get("cu_seqlens_padded")
    padded_S = real_S if cu_padded is None else cu_lengths("cu_seqlens_padded", cu_padded)
    meta = ThdMeta.from_lengths(
        real_S,
        padded_S,
        cp_size=thd.get("cp_size", 1 if carried is None else carried.cp_size),
        cp_rank=thd.get("cp_rank", 0 if carried is None else carried.cp_rank),
        max_seqlen=thd.get("max_seqlen"),
        copy=False,
        groups=_kept_groups(carried, len(real_S)),
    )
    return attach_meta(thd, meta) if isinstance(thd, MutableMapping) else meta._attached_to(thd)
