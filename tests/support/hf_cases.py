"""Real Hugging Face ``transformers`` models for the packing exactness tests: tiny random configs
built here (no download), float64 kept float64 inside transformers, one packed training step
(a whole row, or one CP rank's shard of it) and the unpacked per-sequence reference.

Needs transformers (``thdpack[dev]`` installs it).

Why ``keep_float64``: transformers computes some steps in float32 whatever the model's dtype:
RMSNorm (``hidden_states.to(torch.float32)``, Gemma's ``x.float()``), RoPE (``inv_freq`` and
the positions ``.float()``), eager attention's ``softmax(..., dtype=torch.float32)`` and the loss
(``logits.float()``). A float64 model then agrees with itself packed vs alone only to float32
rounding: eager's float32 softmax sums a 40-token row and a 5-token sequence in different orders
(4e-8 on logits), and the float32 RMSNorm turns any last-bit float64 difference into a float32
one. Inside ``keep_float64`` those casts of float64 tensors are no-ops, so the comparison is
float64 throughout and 1e-10 means something. Only casts made by transformers' own code are
kept: a float32 cast in thdpack would still show.

Legend: ``T`` tokens of the row (this rank's under CP), ``V`` vocabulary.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch.overrides import TorchFunctionMode

from thdpack.attention.config import AttentionConfig
from thdpack.cp import shard
from thdpack.cp.topology import CpTopology
from thdpack.layout.placement import PackPlacement
from thdpack.layout.rules import cp_multiple
from thdpack.loss import count_loss_tokens
from thdpack.models.hf.attention import ATTENTION_CONFIG_KWARG, hf_packed_kwargs
from thdpack.packing.packer import pack_from_segments
from thdpack.thd import THDBatch, thd_collate
from thdpack.verify.exactness import make_samples

SMALL = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "Llama": {},
    "Qwen2": {},  # q/k/v biases
    "Mistral": {},  # its default sliding_window=4096: the sliding-window mask path, longer than every sequence
    "Gemma": {"head_dim": 8},  # scaled embeddings, (1 + w) RMSNorm, GeLU MLP, its own head_dim
}
LENGTHS = (13, 1, 4, 9, 2, 8, 6, 3, 11, 5, 7)
ONE_PROCESS = CpTopology.single()
"""One row's sequences: a length 1 (no loss token), 2, 4 and 8 (exactly 2*cp_size for cp 1, 2, 4)
and lengths CP padding rounds up; every third masks its first third out of the loss."""


def hf_model(arch: str, implementation: str, **extra: Any) -> torch.nn.Module:
    """``{arch}ForCausalLM`` of the tiny config, float64, the same weights for every implementation."""
    config = getattr(transformers, f"{arch}Config")(**SMALL, **{**ARCHITECTURES.get(arch, {}), **extra})
    config._attn_implementation = implementation
    torch.manual_seed(0)
    return getattr(transformers, f"{arch}ForCausalLM")(config).double().eval()


def samples(lengths: Sequence[int] = LENGTHS) -> list[dict[str, np.ndarray]]:
    return make_samples(lengths, SMALL["vocab_size"], seed=0)


def packed_row(row_samples: Sequence[Mapping[str, Any]], cp_size: int = 1) -> THDBatch:
    """Every sample in one row, in order, slots padded for ``cp_size``, plus two CP chunks of tail."""
    m = cp_multiple(cp_size)
    lengths = [len(s["input_ids"]) for s in row_samples]
    pack_size = sum(-(-n // m) * m for n in lengths) + 2 * m
    n = len(lengths)
    return thd_collate([pack_from_segments(row_samples, (range(n), [0] * n, lengths), pack_size, cp_size=cp_size)])


def placed_row(row_samples: Sequence[Mapping[str, Any]], cp_size: int) -> THDBatch:
    """Every sample in one row laid out by a per-sequence CP placement: the longest split over all
    ranks, the next two over a pair of ranks each (cp >= 4; else over all), the rest whole on the
    least-loaded rank; two tokens of tail padding per rank."""
    lengths = [len(s["input_ids"]) for s in row_samples]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: dict[tuple[int, int], list[int]] = {}
    load = [0] * cp_size

    def put(i: int, start: int, size: int) -> None:
        groups.setdefault((start, size), []).append(i)
        slot = -(-lengths[i] // (2 * size)) * 2 * size if size > 1 else lengths[i]
        for r in range(start, start + size):
            load[r] += slot // size

    pairs = [(0, 2), (2, 2)] if cp_size >= 4 else [(0, cp_size), (0, cp_size)]
    for i, (start, size) in zip(order[:3], [(0, cp_size), *pairs], strict=True):
        put(i, start, size)
    for i in order[3:]:
        put(i, load.index(min(load)), 1)
    pack_size = cp_size * (max(load) + 2)
    placement = PackPlacement.from_groups(lengths, groups, cp_size=cp_size, pack_size=pack_size)
    n = len(lengths)
    segments = (range(n), [0] * n, lengths)
    return thd_collate([pack_from_segments(row_samples, segments, pack_size, cp_size=cp_size, placement=placement)])


@dataclass
class StepResult:
    loss: float
    grads: dict[str, torch.Tensor]


def packed_step(
    model: torch.nn.Module,
    thd: THDBatch,
    *,
    topology: CpTopology = ONE_PROCESS,
    drop_position_ids: bool = False,
    attention: AttentionConfig | None = None,
) -> StepResult:
    """The row's loss and gradients the documented way: transformers' own loss on thdpack's
    pre-shifted labels, ``num_items_in_batch`` = the global loss-token count, and under CP the
    ranks' loss and gradients summed (each rank holds a disjoint part of every sequence).
    ``drop_position_ids`` plants a bug for a test to catch: transformers then numbers the
    tokens it is given 0..T-1, so RoPE is wrong after the first sequence (or CP chunk).
    ``attention``: thdpack's attention settings for the call (e.g. ``cp_comm_type="a2a"``)."""
    cp_group = topology.cp_group if topology.cp_size > 1 else None
    local = shard(thd, topology.cp_size, topology.cp_rank) if cp_group is not None else thd
    denominator = count_loss_tokens([local["labels"]], group=cp_group)
    model.zero_grad(set_to_none=True)
    kwargs = hf_packed_kwargs(local, cp_group=topology, include_labels=True, model=model)
    if drop_position_ids:
        del kwargs["position_ids"]
    if attention is not None:
        kwargs[ATTENTION_CONFIG_KWARG] = attention
    with keep_float64():
        loss = model(**kwargs, num_items_in_batch=denominator).loss
        loss.backward()
    loss = loss.detach()
    grads = _grads(model)
    if cp_group is not None:
        dist.all_reduce(loss, group=cp_group)
        for grad in grads.values():
            dist.all_reduce(grad, group=cp_group)
    return StepResult(float(loss), grads)


def unpacked_step(model: torch.nn.Module, row_samples: Sequence[Mapping[str, Any]]) -> StepResult:
    """Every sample alone through a plain transformers call (no thdpack), labels shifted by hand:
    sum of token losses over all samples / number of loss tokens."""
    model.zero_grad(set_to_none=True)
    sums, count = [], 0
    with keep_float64():
        for sample in row_samples:
            ids = torch.as_tensor(np.asarray(sample["input_ids"]), dtype=torch.long)
            labels = torch.full_like(ids, -100)
            labels[:-1] = ids[1:]
            if "loss_mask" in sample:
                labels[torch.as_tensor(np.asarray(sample["loss_mask"])) == 0] = -100
            logits_TV = model(input_ids=ids[None], use_cache=False).logits[0]
            sums.append(F.cross_entropy(logits_TV, labels, ignore_index=-100, reduction="sum"))
            count += int((labels != -100).sum())
        loss = torch.stack(sums).sum() / count
        loss.backward()
    return StepResult(float(loss.detach()), _grads(model))


def differences(packed: StepResult, reference: StepResult) -> dict[str, float]:
    """Max abs difference of the loss and of every parameter's gradient (``"grads"``: the worst)."""
    grads = {name: float((grad - reference.grads[name]).abs().max()) for name, grad in packed.grads.items()}
    assert grads.keys() == reference.grads.keys()
    return {"loss": abs(packed.loss - reference.loss), "grads": max(grads.values())}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for name, p in model.named_parameters()
    }


_F32, _F64 = torch.float32, torch.float64
_SOFTMAXES = (F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax)


class _KeepFloat64(TorchFunctionMode):
    """Turn transformers' casts of float64 tensors to float32 into no-ops (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if source is not None and source.dtype == _F64 and _from_transformers():
            if func is torch.Tensor.float:
                return source
            if func is torch.Tensor.to or func in _SOFTMAXES:
                args = tuple(_F64 if a is _F32 else a for a in args)
                kwargs = {k: _F64 if v is _F32 else v for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _from_transformers() -> bool:
    """Whether the torch call being handled comes from transformers' code: the first frame above
    ``__torch_function__`` outside torch (``F.softmax`` reaches it through ``torch.overrides``)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("torch."):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").startswith("transformers.")


@contextlib.contextmanager
def keep_float64() -> Iterator[None]:
    """Inside: transformers' float32 steps of a float64 model stay float64 (module docstring)."""
    with _KeepFloat64():
        yield
