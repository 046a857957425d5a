"""Activation checkpointing of decoder layers: keep each layer's input, recompute its inside in
the backward pass (memory for one layer's activations instead of all of them, about one more
forward of compute).

Each layer's ``forward`` is wrapped in place (``torch.utils.checkpoint``, non-reentrant), so
parameter names, state dicts and checkpoints stay those of the plain model, and FSDP2 can shard
the layers afterwards as usual. The recomputation is the same computation on the same inputs, so
losses and gradients equal those without it (tested bit for bit on the CPU); under CP the
recomputed forward repeats the layer's K/V exchange, in the same order on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_MARK = "_thdpack_checkpointed"


def checkpoint_layers(layers: Iterable[nn.Module]) -> int:
    """Wrap every layer's forward in ``torch.utils.checkpoint``; returns how many were wrapped
    (a layer wrapped before is left as it is)."""
    wrapped = 0
    for layer in layers:
        if getattr(layer, _MARK, False):
            continue
        layer.forward = functools.partial(_checkpointed, layer.forward)
        setattr(layer, _MARK, True)
        wrapped += 1
    return wrapped


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # evaluation: nothing to save memory for
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
