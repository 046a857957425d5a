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

A mapping made elsewhere (NeMo's, Transformer Engine's: ``cu_seqlens`` and optional
``cu_seqlens_padded``, ``max_seqlen``, ``cp_size``, ``cp_rank``) is validated from its tensors
by the first :func:`thd_meta`, which stores the record in it (when it is a mutable mapping),
so the next call (the next layer) finds it.

Legend: ``S`` sequences, ``T`` tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from thdpack.format_rules import check_cp_multiple, check_cp_size

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


def _same_int(value: Any, expected: int) -> bool:
    """``value`` is the Python int ``expected`` (a tensor is never compared: that would sync)."""
    return isinstance(value, int) and not isinstance(value, bool) and value == expected


class ThdMeta:
    """Host-side layout of one THD batch or CP shard; take it from a batch with :func:`thd_meta`.

    Immutable once built (made on every batch, so it is a slotted class rather than a dataclass);
    equal records describe the same layout, whichever tensors they are attached to.
    """

    __slots__ = ("_cache", "_lengths_S", "_padded_S", "_tensors", "cp_rank", "cp_size", "max_seqlen")

    def __init__(
        self,
        lengths_S: np.ndarray,
        padded_S: np.ndarray,
        cp_size: int,
        cp_rank: int,
        max_seqlen: int,
        *,
        cache: dict[Any, Any] | None = None,
    ):
        """Use :meth:`from_lengths`; this stores already validated, read-only arrays."""
        lengths_S.flags.writeable = padded_S.flags.writeable = False
        self._lengths_S, self._padded_S = lengths_S, padded_S
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

    def _fields(self) -> tuple[Any, ...]:
        return (self.lengths, self.lengths_padded, self.cp_size, self.cp_rank, self.max_seqlen)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ThdMeta) and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        return (
            f"ThdMeta(lengths={self.lengths}, lengths_padded={self.lengths_padded}, cp_size={self.cp_size}, "
            f"cp_rank={self.cp_rank}, max_seqlen={self.max_seqlen})"
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
    ) -> ThdMeta:
        """The validated record. Raises ``ValueError`` / ``TypeError`` naming the offending sequence
        (``where(s)`` says which: ``"sequence 3"``, ``"pack 1: sequence 0"``), its value and the fix.

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
        check_cp_multiple(padded_S, int(cp_size), where)
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
        return cls(real_S, padded_S, int(cp_size), int(cp_rank), max_seqlen)

    def for_rank(self, cp_size: int, cp_rank: int) -> ThdMeta:
        """The record of this (global) batch's shard for ``cp_rank`` of ``cp_size``."""
        if self.cp_size != 1:
            raise ValueError(
                f"this THD batch is already CP rank {self.cp_rank}'s shard of cp_size={self.cp_size}; shard the "
                "global batch (unshard / gather restores it)"
            )
        check_cp(cp_size, cp_rank)
        check_cp_multiple(self._padded_S, int(cp_size))
        return ThdMeta(self._lengths_S, self._padded_S, int(cp_size), int(cp_rank), self.max_seqlen)

    def unsharded(self) -> ThdMeta:
        """The record of the global batch this shard belongs to (``self`` for a global record)."""
        if self.cp_size == 1:
            return self
        return ThdMeta(self._lengths_S, self._padded_S, 1, 0, self.max_seqlen)

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
                self._lengths_S, self._padded_S, self.cp_size, self.cp_rank, self.max_seqlen, cache=self._cache
            )
        attached._tensors = (cu_seqlens, cu_seqlens._version, cu_seqlens_padded, padded_version)
        return attached

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles (into and out of DataLoader workers) without the device-side cache, with the tensors it
        describes: pickled together with its batch, it describes the unpickled batch's tensors."""
        tensors = (None, None) if self._tensors is None else (self._tensors[0], self._tensors[2])
        return (_unpickle, (self._lengths_S, self._padded_S, self.cp_size, self.cp_rank, self.max_seqlen, *tensors))


def _unpickle(
    lengths_S: np.ndarray,
    padded_S: np.ndarray,
    cp_size: int,
    cp_rank: int,
    max_seqlen: int,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_padded: torch.Tensor | None,
) -> ThdMeta:
    meta = ThdMeta(lengths_S, padded_S, cp_size, cp_rank, max_seqlen)
    if cu_seqlens is not None:
        meta._attached_to({"cu_seqlens": cu_seqlens, "cu_seqlens_padded": cu_seqlens_padded})
    return meta


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
    )
    return attach_meta(thd, meta) if isinstance(thd, MutableMapping) else meta._attached_to(thd)
