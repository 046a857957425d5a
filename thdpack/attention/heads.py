"""Head counts under an exchange that splits the heads over the ``W`` ranks of a CP group.

All-to-all gives each rank ``Nq / W`` query heads, so ``W`` must divide ``Nq``. Where it does not
divide ``Nkv`` (8 KV heads at cp 16, MQA), each KV head is repeated ``f = lcm(Nkv, W) / Nkv``
times first: the copies are GQA again with ``Nkv * f`` heads that ``W`` divides, so each rank
receives just the KV heads its query heads use, and autograd adds the copies' gradients.

Legend: ``T`` tokens, ``N`` heads (``Nq`` query, ``Nkv`` key/value), ``H`` head dim, ``W`` ranks.
"""

from __future__ import annotations

import math

import torch


def kv_replication(nq: int, nkv: int, cp_size: int) -> int:
    """How many copies of each KV head the exchange sends: 1 when ``cp_size`` divides ``nkv``, else
    ``lcm(nkv, cp_size) / nkv``. ``ValueError`` when ``cp_size`` does not divide ``nq``.

    >>> kv_replication(32, 8, 4), kv_replication(32, 8, 16), kv_replication(4, 1, 4), kv_replication(12, 6, 4)
    (1, 2, 4, 2)
    >>> kv_replication(12, 4, 8)
    Traceback (most recent call last):
    ...
    ValueError: cp_comm_type='a2a' gives each of the cp_size=8 ranks Nq / cp_size query heads, but q has Nq=12 ...
    """
    if nq % cp_size:
        raise ValueError(
            f"cp_comm_type='a2a' gives each of the cp_size={cp_size} ranks Nq / cp_size query heads, but q has "
            f"Nq={nq} heads (k/v: Nkv={nkv}); use a cp_size that divides {nq}, or cp_comm_type='p2p' or "
            "'all_gather' (any head count)"
        )
    # nkv | nq and cp_size | nq, so lcm(nkv, cp_size) | nq: the copies form GQA groups again
    return math.lcm(nkv, cp_size) // nkv


def repeat_kv_heads(k_TNH: torch.Tensor, v_TNH: torch.Tensor, copies: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V with each head repeated ``copies`` times in place (head ``i`` -> heads ``i*copies ..
    i*copies + copies - 1``), differentiable; unchanged for ``copies`` 1."""
    if copies == 1:
        return k_TNH, v_TNH
    return k_TNH.repeat_interleave(copies, dim=1), v_TNH.repeat_interleave(copies, dim=1)
