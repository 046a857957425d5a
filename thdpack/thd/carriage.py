"""How a THD batch carries its record: ``thd["thd_meta"]``, taken without reading a tensor.

Every batch thdpack makes holds its ``ThdMeta`` under :data:`META_KEY`, as flash-attn's
``unpad_input`` returns ``indices``, ``cu_seqlens`` and ``max_seqlen`` together; it pickles with
the batch and is the one carrier of a shard's ``cp_size`` / ``cp_rank``. A record describes the
exact ``cu_seqlens`` / ``cu_seqlens_padded`` tensors it was attached to: when the batch holds
others, or they changed in place, :func:`thd_meta` rebuilds it from the tensors (keeping the
shard's ``cp_size`` / ``cp_rank`` and placement, which no tensor says), so a stale record is never
used. A mapping made elsewhere (NeMo's, TE's) is validated by the first call, which stores the
record in it for the next layer.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from thdpack.thd.cu import cu_lengths
from thdpack.thd.meta import EntryGroups, ThdMeta

META_KEY = "thd_meta"
"""The key under which a THD batch carries its :class:`~thdpack.thd.meta.ThdMeta`."""


def describes(meta: ThdMeta, thd: Mapping[str, Any]) -> bool:
    """``thd`` holds the very tensors ``meta`` was attached to, unchanged, and none of its keys
    says otherwise about the layout. Reads no tensor (every attention layer asks this)."""
    if meta.tensors is None or not meta.tensors.unchanged_in(thd):
        return False
    max_seqlen = thd.get("max_seqlen", meta.max_seqlen)
    if max_seqlen is not meta.max_seqlen and not _same_int(max_seqlen, meta.max_seqlen):
        return False
    if "cp_size" in thd or "cp_rank" in thd:  # a batch made elsewhere (or relabelled) says which shard
        return _same_int(thd.get("cp_size", meta.cp_size), meta.cp_size) and _same_int(
            thd.get("cp_rank", meta.cp_rank), meta.cp_rank
        )
    return True


def _same_int(value: Any, expected: int) -> bool:
    """``value`` is the Python int ``expected`` (a tensor is never compared: that would sync)."""
    return isinstance(value, int) and not isinstance(value, bool) and value == expected


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
    attached = meta.attached_to(thd)
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

    >>> import torch
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
        if describes(carried, thd):
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
    return attach_meta(thd, meta) if isinstance(thd, MutableMapping) else meta.attached_to(thd)
