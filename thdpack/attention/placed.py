"""Attention of a CP shard under a per-sequence placement: each part by its own path, one output.

A placed shard's rows come in parts (``thdpack.thd.parts``): one per split group holding
sequences of the rank (largest first), each a TE-layout shard of the group's sequences that the
backend's CP algorithm runs over that group's process group (``CpTopology.group``), then the
whole sequences, which the backend's kernel runs with no communication. The parts' rows are back
to back in shard order, so their outputs concatenate into the shard's buffer and autograd gives
each part its rows' gradient. Every rank of a group meets its collectives in the same order: the
parts follow the shared placement, nested groups largest first. A batch without split sequences
communicates nothing.

Legend: ``T`` tokens on this rank, ``N`` heads, ``H`` head dim.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from thdpack.attention.backends.base import AttendFn, AttentionCall, AttentionOutput
from thdpack.attention.merge import accumulation_dtype
from thdpack.thd.carriage import attach_meta
from thdpack.thd.cu import cu_from_lengths
from thdpack.thd.meta import ThdMeta
from thdpack.thd.parts import shard_parts


def part_batch(meta: ThdMeta, index: int, device: torch.device) -> Mapping[str, Any]:
    """Part ``index``'s metadata as a THD batch on ``device`` (its own ``cu_seqlens`` /
    ``cu_seqlens_padded`` / ``max_seqlen`` and record), built once per shard and device."""

    def build() -> Mapping[str, Any]:
        part = shard_parts(meta)[index].meta
        batch: dict[str, Any] = {
            "cu_seqlens": cu_from_lengths(part.lengths_S, device),
            "cu_seqlens_padded": cu_from_lengths(part.lengths_padded_S, device),
            "max_seqlen": part.max_seqlen,
        }
        attach_meta(batch, part)
        return batch

    return meta.cached(("part batch", index, device), build)


def placed_attention(
    q_TNH: torch.Tensor,
    k_TNH: torch.Tensor,
    v_TNH: torch.Tensor,
    call: AttentionCall,
    *,
    split: AttendFn,
    whole: AttendFn,
) -> AttentionOutput:
    """``(out (T, Nq, Hv), lse (Nq, T) or None)`` of a placed shard: ``split`` (a CP algorithm, or
    the backend's own CP attention) on each split group's rows over the group's process group,
    ``whole`` (the backend's kernel) on the whole part's rows; every rank of ``call.cp_group``
    calls it together."""
    meta = call.meta
    assert meta.groups is not None and call.cp_group is not None, "placed_attention runs a placed CP shard"
    _check_subgroups(call)
    outs, lses = [], []
    for index, part in enumerate(shard_parts(meta)):
        batch = part_batch(meta, index, q_TNH.device)
        if part.group_size == 1:
            attend, group = whole, None
        elif call.topology is None:  # a plain CP group: every split part spans it (_check_subgroups)
            attend, group = split, call.cp_group
        else:
            attend, group = split, call.topology.group(part.group_start, part.group_size)
        part_call = AttentionCall(
            thd=batch,
            meta=batch["thd_meta"],
            config=call.config,
            scale=call.scale,
            cp_group=group,
            return_lse=call.return_lse,
        )
        rows = part.rows
        out_TNH, lse_NT = attend(q_TNH[rows], k_TNH[rows], v_TNH[rows], part_call)
        outs.append(out_TNH)
        lses.append(lse_NT)
    out_TNH = outs[0] if len(outs) == 1 else torch.cat(outs)
    if not call.return_lse:
        return out_TNH, None
    acc = accumulation_dtype(q_TNH.dtype)
    lse_NT = torch.cat([lse.to(acc) for lse in lses], dim=1)
    return out_TNH, lse_NT


def _check_subgroups(call: AttentionCall) -> None:
    """``ValueError`` before any collective when the shard splits sequences over groups smaller than
    its CP group and the caller has no process group for them: a plain process group has no
    sub-groups, a topology may lack its placement groups. The batch's placement is every rank's,
    so every rank of the CP group refuses."""
    meta = call.meta
    assert meta.groups is not None
    smaller = sorted({g for g in meta.groups.size_S.tolist() if 1 < g < meta.cp_size})
    if not smaller:
        return
    if call.topology is None:
        raise ValueError(
            f"the batch's CP placement splits sequences over groups of {smaller} ranks, smaller than its CP group "
            f"of {meta.cp_size}, and a plain process group has no sub-groups; pass the run's CpTopology as "
            "cp_group (thdpack.cp.topology.CpTopology.create(cp_size, device_type=...) on every process makes them)"
        )
    for size in smaller:  # this rank's aligned group of each size (raises the topology's reason)
        call.topology.group(meta.cp_rank // size * size, size)
