"""ThdMeta: the one host-side record of a THD batch's layout, built once, carried by the batch.

Sequence ``s`` occupies a slot of ``lengths_padded[s]`` tokens whose first ``lengths[s]`` are
real; a CP shard keeps ``T / cp_size`` tokens while the record stays global. The record holds host
ints (reading it never syncs a device) and checks each fact of a layout by one method with one
message: the lengths, ``max_seqlen`` and the CP slot rule (:meth:`ThdMeta.from_lengths`), a
shard's rank (:meth:`~ThdMeta.for_rank`), a per-token tensor's rows
(:meth:`~ThdMeta.check_token_count`), the process group (:meth:`~ThdMeta.check_cp_group`). Under a
per-sequence placement it also holds every entry's group (:class:`EntryGroups`).

Legend: ``S`` sequences, ``T`` tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from thdpack.layout.entries import CpLayout
from thdpack.layout.rules import check_cp, check_cp_multiple, check_cp_size, sequence_name
from thdpack.thd.cu import CuTensors

_T = TypeVar("_T")


class EntryGroups(NamedTuple):
    """Where each entry of a batch runs under a per-sequence CP placement (``thdpack.layout``)."""

    size_S: np.ndarray
    """(S,) int64 ranks of each entry's group: 1 = whole on one rank, ``g > 1`` = split over ``g``."""
    start_S: np.ndarray
    """(S,) int64 first rank of each entry's group (aligned: a multiple of its size)."""
    cp_size: int
    """The context-parallel size the placement is for (a shard's ``cp_size`` must equal it)."""
    a2a_S: np.ndarray | None = None
    """(S,) bool, the entries of packs attended by all-to-all (``cp_placement="auto"``, one value
    per pack); None: the placement's groups attend every pack."""

    def key(self) -> tuple[Any, ...]:
        a2a = None if self.a2a_S is None else tuple(self.a2a_S.tolist())
        return (tuple(self.size_S.tolist()), tuple(self.start_S.tolist()), self.cp_size, a2a)

    @property
    def all_to_all(self) -> bool:
        """True when every pack of the batch is attended by all-to-all (``cp_placement="auto"``)."""
        return self.a2a_S is not None and bool(self.a2a_S.all())


class ThdMeta:
    """Host-side layout of one THD batch or CP shard; take it from a batch with ``thdpack.thd.carriage.thd_meta``.

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
        self._tensors: CuTensors | None = None  # set when attached to a batch (thdpack.thd.carriage)

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
            size, start, cp, a2a = self._groups.key()
            placed = f", group_size={size}, group_start={start}, placed for cp_size={cp}"
            if a2a is not None:
                placed += f", a2a={tuple(int(x) for x in a2a)}"
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
        where: Callable[[int], str] = sequence_name,
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
            cp_size = check_cp(cp_size, cp_rank)
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
        cp_size = check_cp(cp_size, cp_rank)  # the one check of a shard's cp_size
        if self._groups is None:
            check_cp_multiple(self._padded_S, cp_size)
        elif cp_size != self._groups.cp_size:
            raise ValueError(
                f"this THD batch is laid out for cp_size={self._groups.cp_size} (its CP placement: every sequence "
                f"whole on one of {self._groups.cp_size} ranks or split over a group of them), not cp_size={cp_size}; "
                f"shard it with cp_size={self._groups.cp_size}, or plan the packs for cp_size={cp_size}"
            )
        return ThdMeta(self._lengths_S, self._padded_S, cp_size, int(cp_rank), self.max_seqlen, groups=self._groups)

    def with_groups(self, groups: EntryGroups, where: Callable[[int], str] = sequence_name) -> ThdMeta:
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
        naming the fix. Only a record taken from its batch (``thdpack.thd.carriage.thd_meta``) knows the tensors."""
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

    @property
    def tensors(self) -> CuTensors | None:
        """The ``cu`` tensors this record describes (None for a record made from lengths alone)."""
        return self._tensors

    def attached_to(self, thd: Mapping[str, Any]) -> ThdMeta:
        """This record describing ``thd``'s cu tensors: ``self`` when it is new or already does, else
        a twin sharing its arrays and cache (the same layout, other tensors: a moved batch)."""
        if self._tensors is not None and self._tensors.held_by(thd):
            return self
        attached = self
        if self._tensors is not None:
            attached = ThdMeta(
                self._lengths_S, self._padded_S, self.cp_size, self.cp_rank, self.max_seqlen, cache=self._cache,
                groups=self._groups,
            )  # fmt: skip
        attached._tensors = CuTensors.of(thd)
        return attached

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles (into and out of DataLoader workers) without the device-side cache, with the tensors it
        describes: pickled together with its batch, it describes the unpickled batch's tensors."""
        bound = self._tensors
        tensors = (None, None) if bound is None else (bound.cu_seqlens, bound.cu_seqlens_padded)
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
    a2a_S = None
    if groups.a2a_S is not None:
        a2a_S = make(groups.a2a_S).reshape(-1)
        if a2a_S.shape != real_S.shape or not np.isin(a2a_S, (0, 1)).all():
            raise ValueError(f"cp_a2a must hold 0 or 1 for each of the {real_S.size} entries, got {a2a_S.tolist()}")
        a2a_S = a2a_S.astype(bool)
        if pack_S is not None and len(a2a_S):
            mixed = np.bincount(pack_S, weights=a2a_S) % np.maximum(np.bincount(pack_S), 1)
            if mixed.any():
                raise ValueError(
                    f"pack {int(np.flatnonzero(mixed)[0])}: cp_a2a differs between its entries; all-to-all is "
                    "chosen per pack (the same value on every entry)"
                )
        a2a_S.flags.writeable = False
    return EntryGroups(size_S, start_S, placed_for, a2a_S)


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
        meta.attached_to({"cu_seqlens": cu_seqlens, "cu_seqlens_padded": cu_seqlens_padded})
    return meta
