"""The unpacked oracle of the model-level exactness tests, written independently of thdpack's
packer, collater and harness: each sample alone, labels shifted by hand, one hand-made THD
batch per sequence; and the comparison of a packed step against it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from thdpack.models import Transformer


def oracle_step(model: Transformer, samples: Sequence[Mapping[str, Any]], reduction: str) -> dict[str, Any]:
    """Loss, gradients and per-sample logits of every sample run alone, averaged over the batch."""
    model.zero_grad(set_to_none=True)
    sums, counts, logits = [], [], []
    for sample in samples:
        ids = torch.as_tensor(np.asarray(sample["input_ids"]), dtype=torch.long)
        n = len(ids)
        labels = torch.full((n,), -100)
        labels[:-1] = ids[1:]
        if "loss_mask" in sample:
            labels[torch.as_tensor(np.asarray(sample["loss_mask"])) == 0] = -100
        cu = torch.tensor([0, n], dtype=torch.int32)
        thd = {
            "input_ids": ids,
            "position_ids": torch.arange(n),
            "cu_seqlens": cu,
            "cu_seqlens_padded": cu,
            "max_seqlen": n,
        }
        out = model(thd)
        sums.append(F.cross_entropy(out, labels, ignore_index=-100, reduction="sum"))
        counts.append(int((labels != -100).sum()))
        logits.append(out.detach())
    if reduction == "token_mean":
        loss = torch.stack(sums).sum() / sum(counts)
    else:
        per_sequence = [s / c for s, c in zip(sums, counts, strict=True) if c > 0]
        loss = torch.stack(per_sequence).mean()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return {"loss": loss.item(), "grads": grads, "logits": logits}


def compare(results: Sequence[Any], oracle: Mapping[str, Any]) -> dict[str, float]:
    """Max abs errors of the ranks' ``PackedResult``s against the oracle (every rank's loss and
    gradients; the logits of every real token, each of which must appear exactly once)."""
    errors = {"loss": 0.0, "grads": 0.0, "logits": 0.0}
    seen = [torch.zeros(len(x), dtype=torch.long) for x in oracle["logits"]]
    for result in results:
        errors["loss"] = max(errors["loss"], abs(result.loss - oracle["loss"]))
        for name, grad in result.grads.items():
            errors["grads"] = max(errors["grads"], float((grad - oracle["grads"][name]).abs().max()))
        for tokens in result.tokens:
            real = tokens["real"]
            for logits_V, s, p in zip(
                tokens["logits"][real],
                tokens["sequence_index"][real].tolist(),
                tokens["sequence_position"][real].tolist(),
                strict=True,
            ):
                errors["logits"] = max(errors["logits"], float((logits_V - oracle["logits"][s][p]).abs().max()))
                seen[s][p] += 1
    assert all(bool((count == 1).all()) for count in seen), "some real token was computed twice or never"
    return errors
