"""The one host-side record of a THD batch's layout, and the one validator that builds it.

A THD batch (``thdpack.to_thd`` / ``thd_collate`` / ``cp.shard``) stores ``S`` sequences in
``T`` tokens: sequence ``s`` occupies a slot of ``lengths_padded[s]`` tokens whose first
``lengths[s]`` are real. Under context parallelism a shard keeps ``T / cp_size`` of them while
the metadata stays global. :class:`ThdMeta` holds exactly that (host ints: reading it never
syncs a device) and :meth:`ThdMeta.from_lengths` is the only place its invariants are checked:
every entry point (collate, to_thd, shard, partition_indices, attention, masks, the loss) that
finds a fault reports it with the same message.

Where a batch is made, the record is built from the host lengths the builder already has and
registered for the batch's ``cu_seqlens`` tensors; :func:`thd_meta` then returns it without
reading a tensor. A dict whose ``cu_seqlens`` were replaced (or changed in place) is not
described by the old record any more and is validated afresh.

Legend: ``S`` sequences, ``T`` tokens.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

_T = TypeVar("_T")

CU_KEYS = ("cu_seqlens", "cu_seqlens_padded")


def _default_where(s: int) -> str:
    return f"sequence {s}"


def check_cp(cp_size: Any, cp_rank: Any) -> None:
    """``cp_size`` an int >= 1 and ``0 <= cp_rank < cp_size``, else ``ValueError``."""
    if isinstance(cp_size, bool) or not isinstance(cp_size, (int, np.integer)) or cp_size < 1:
        raise ValueError(f"cp_size must be an int >= 1, got {cp_size!r}")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, (int, np.integer)) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an int in [0, {cp_size}), got {cp_rank!r}")


def check_cp_multiple(lengths_padded_S: np.ndarray, cp_size: int, where: Callable[[int], str] = _default_where) -> None:
    """Every slot a multiple of ``2*cp_size`` (Transformer Engine cuts each into 2*cp_size chunks)."""
    if cp_size == 1:
        return
    step = 2 * cp_size
    bad = np.asarray(lengths_padded_S) % step != 0
    if bad.any():
        s = int(np.argmax(bad))
        raise ValueError(
            f"{where(s)} has padded length {int(lengths_padded_S[s])}, not a multiple of 2*cp_size={step}; "
            f"pad every sequence to a multiple of {step} (plan_packs(..., cp_size={cp_size}) does)"
        )


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


class ThdMeta:
    """Host-side layout of one THD batch or CP shard; build it with :meth:`from_lengths` / :func:`thd_meta`.

    Immutable once built (made on every batch, so it is a slotted class rather than a dataclass).
    """

    __slots__ = ("_cache", "_lengths_S", "_padded_S", "cp_rank", "cp_size", "max_seqlen")

    def __init__(self, lengths_S: np.ndarray, padded_S: np.ndarray, cp_size: int, cp_rank: int, max_seqlen: int):
        """Use :meth:`from_lengths`; this stores already validated, read-only arrays."""
        lengths_S.flags.writeable = padded_S.flags.writeable = False
        self._lengths_S, self._padded_S = lengths_S, padded_S
        self.cp_size, self.cp_rank, self.max_seqlen = cp_size, cp_rank, max_seqlen
        self._cache: dict[Any, Any] = {}

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
        if cp_size > 1:
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

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles (into and out of DataLoader workers) without the device-side cache."""
        return (ThdMeta, (self._lengths_S, self._padded_S, self.cp_size, self.cp_rank, self.max_seqlen))


# The records of the batches made here, keyed by the identity of their cu_seqlens_padded tensor (tensors
# compare elementwise, so no WeakKeyDictionary); a weakref callback drops the entry when the tensor dies.
_REGISTRY: dict[int, tuple[weakref.ref, dict[tuple[Any, ...], ThdMeta]]] = {}


def _key(thd: Mapping[str, Any], cu_padded: torch.Tensor) -> tuple[Any, ...]:
    cu = thd["cu_seqlens"]
    max_seqlen = thd.get("max_seqlen")
    return (
        id(cu),
        cu._version,
        cu_padded._version,
        thd.get("cp_size", 1),
        thd.get("cp_rank", 0),
        max_seqlen if isinstance(max_seqlen, int) else type(max_seqlen).__name__,
    )


def _padded_tensor(thd: Mapping[str, Any]) -> Any:
    cu_padded = thd.get("cu_seqlens_padded")
    return thd.get("cu_seqlens") if cu_padded is None else cu_padded


def register(thd: Mapping[str, Any], meta: ThdMeta) -> None:
    """Record that ``meta`` describes ``thd`` (a batch just built from validated lengths)."""
    cu_padded = _padded_tensor(thd)
    tid = id(cu_padded)
    entry = _REGISTRY.get(tid)
    if entry is None or entry[0]() is not cu_padded:
        entry = (weakref.ref(cu_padded, lambda _ref: _REGISTRY.pop(tid, None)), {})
        _REGISTRY[tid] = entry
    entry[1][_key(thd, cu_padded)] = meta


def thd_meta(thd: Mapping[str, Any]) -> ThdMeta:
    """The validated :class:`ThdMeta` of a THD batch or CP shard (looked up, or built once).

    Reads ``cu_seqlens`` ((S+1,) integer), optional ``cu_seqlens_padded`` (default: ``cu_seqlens``),
    optional ``max_seqlen`` (a Python int; computed when absent) and optional ``cp_size`` /
    ``cp_rank`` (default 1 / 0). Batches made by thdpack are found without reading a tensor.

    >>> cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    >>> meta = thd_meta({"cu_seqlens": cu, "cu_seqlens_padded": torch.tensor([0, 4, 8], dtype=torch.int32)})
    >>> meta.lengths, meta.lengths_padded, meta.max_seqlen
    ((3, 4), (4, 4), 4)
    """
    if "cu_seqlens" not in thd:
        raise ValueError("thd has no 'cu_seqlens'; pass the mapping returned by thdpack.to_thd or thdpack.cp.shard")
    cu_padded = _padded_tensor(thd)
    if isinstance(cu_padded, torch.Tensor) and isinstance(thd["cu_seqlens"], torch.Tensor):
        entry = _REGISTRY.get(id(cu_padded))
        if entry is not None and entry[0]() is cu_padded:
            found = entry[1].get(_key(thd, cu_padded))
            if found is not None:
                return found
    real_S = cu_lengths("cu_seqlens", thd["cu_seqlens"])
    padded_S = real_S if thd.get("cu_seqlens_padded") is None else cu_lengths("cu_seqlens_padded", cu_padded)
    meta = ThdMeta.from_lengths(
        real_S,
        padded_S,
        cp_size=thd.get("cp_size", 1),
        cp_rank=thd.get("cp_rank", 0),
        max_seqlen=thd.get("max_seqlen"),
    )
    register(thd, meta)
    return meta
