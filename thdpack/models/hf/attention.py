"""Feed THD batches to Hugging Face ``transformers`` models, and run them on thdpack's attention.

``hf_packed_kwargs`` turns a THD batch (or a CP shard) into a model call's keyword arguments,
``register_hf_attention`` registers thdpack's attention as an ``attn_implementation``, and
``check_hf_attention`` refuses what is not exact on a packed row or a CP shard (transformers'
own implementations under CP, softcapping, short sliding windows, chunked layers). What
transformers does with packed rows, and why those are refused: docs/guides/hugging-face.md.

Legend: ``T`` tokens of the batch (this rank's under CP), ``N`` heads, ``H`` head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from thdpack._optional import require
from thdpack.attention.api import thd_attention
from thdpack.attention.config import AttentionConfig
from thdpack.cp.topology import CpGroupLike
from thdpack.thd.carriage import META_KEY, thd_meta

THD_KWARG = "thdpack_thd"
"""Model-call keyword that carries the THD metadata to ``hf_attention_forward``."""
CP_GROUP_KWARG = "thdpack_cp_group"
"""Model-call keyword that carries the ``CpTopology`` (or CP group) to ``hf_attention_forward``."""
ATTENTION_CONFIG_KWARG = "thdpack_attention"
"""Optional model-call keyword: the ``AttentionConfig`` (backend, CP exchange) of thdpack's
attention; the layer's own causality and softmax scale override its ``causal`` / ``softmax_scale``."""

_METADATA_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", META_KEY, "cp_size", "cp_rank")


def hf_packed_kwargs(
    thd: Mapping[str, Any],
    *,
    cp_group: CpGroupLike | None = None,
    include_labels: bool = False,
    model: torch.nn.Module | None = None,
) -> dict[str, Any]:
    """Keyword arguments of a Hugging Face model call for a THD batch (``model(**kwargs)``).

    Args:
        thd: a THD batch (``thdpack.to_thd``) or a CP shard (``thdpack.cp.shard``): ``input_ids``,
            ``position_ids`` (T,) integer; ``cu_seqlens`` / ``cu_seqlens_padded`` (N+1,) int32
            (``[0] == 0``, non-decreasing, ``cu_seqlens_padded[-1] == T * cp_size``);
            ``max_seqlen`` a Python int; ``labels`` (T,) (already shifted) with ``include_labels``.
        cp_group: the run's ``CpTopology``, or the plain CP process group a shard was sharded for
            (``thd_attention``'s ``cp_group``; None for a batch that is not a shard); thdpack's
            attention checks it against the shard's record.
        include_labels: add ``labels`` and ``shift_labels`` (1, T) so the model computes the loss
            without shifting the already-shifted labels a second time.
        model: the model the kwargs are for; its attention implementation is checked
            (:func:`check_hf_attention`). Required for a CP shard, where only thdpack's registered
            attention is exact.

    Returns:
        ``input_ids``, ``position_ids``: (1, T) int64. For an unsharded batch also the
        ``FlashAttentionKwargs`` ``cu_seq_lens_q = cu_seq_lens_k`` ((N+1,) int32, the storage
        slots ``cu_seqlens_padded``: the varlen kernel indexes rows by them, and padding follows
        its sequence's real tokens, so causal attention of every real token is exact) and
        ``max_length_q = max_length_k`` (int). Always ``thdpack_thd``, the batch's metadata
        with its record, for thdpack's attention; with a ``cp_group`` also ``thdpack_cp_group``;
        for a shard no ``cu_seq_lens_*``, which no Hugging Face backend could use on a CP shard.

    >>> pack = {"input_ids": torch.tensor([[5, 6, 7, 0, 8, 9, 0, 0]]),
    ...         "labels": torch.tensor([[6, 7, -100, -100, 9, -100, -100, -100]]),
    ...         "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]),
    ...         "seq_lens": torch.tensor([[3, 2]]), "seq_lens_padded": torch.tensor([[4, 4]])}
    >>> from thdpack.thd import to_thd
    >>> kwargs = hf_packed_kwargs(to_thd(pack), include_labels=True)
    >>> kwargs["input_ids"].shape, kwargs["cu_seq_lens_q"].tolist(), kwargs["max_length_q"]
    (torch.Size([1, 8]), [0, 4, 8], 4)
    >>> kwargs["shift_labels"].tolist() == kwargs["labels"].tolist() == [pack["labels"][0].tolist()]
    True
    """
    missing = [
        key for key in ("input_ids", "position_ids", "cu_seqlens", "cu_seqlens_padded", "max_seqlen") if key not in thd
    ]
    if include_labels and "labels" not in thd:
        missing.append("labels")
    if missing:
        raise ValueError(f"the THD batch lacks {missing}; build it with thdpack.to_thd / thd_collate")
    cp_size = thd_meta(thd).cp_size
    if model is not None:
        check_hf_attention(model, thd)
    elif cp_size > 1:
        raise ValueError(
            "pass model= with a CP shard: only thdpack's registered attention is exact on one, and thdpack checks "
            "the model's attn_implementation before any sequence can attend across ranks wrongly"
        )
    kwargs: dict[str, Any] = {
        "input_ids": thd["input_ids"].long().unsqueeze(0),
        "position_ids": thd["position_ids"].long().unsqueeze(0),
        # a cache makes transformers skip its packed-sequence detection from position_ids, and
        # sdpa / eager / flex then attend across the whole row (measured: 0.1-0.4 logit error)
        "use_cache": False,
        THD_KWARG: {key: thd[key] for key in _METADATA_KEYS if key in thd},
    }
    if cp_group is not None:  # thdpack's attention checks it against the shard (ThdMeta.check_cp_group)
        kwargs[CP_GROUP_KWARG] = cp_group
    if cp_size == 1:
        cu = thd["cu_seqlens_padded"].to(torch.int32)
        kwargs.update(
            cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=thd["max_seqlen"], max_length_k=thd["max_seqlen"]
        )
    if include_labels:
        labels_1T = thd["labels"].long().unsqueeze(0)
        kwargs.update(labels=labels_1T, shift_labels=labels_1T)
    return kwargs


def hf_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """thdpack's ``thd_attention`` with the signature of a Hugging Face attention function.

    Args:
        module: the calling attention layer (its ``is_causal`` attribute, default True, applies
            when ``is_causal`` is None).
        query: (1, Nq, T, H); key, value: (1, Nkv, T, H) (GQA without repeated heads).
        attention_mask: must be None (packed rows carry no mask; see the module docstring).
        dropout, softcap: unsupported; 0.0 / None, else ``ValueError``.
        sliding_window: None, or a window no sequence of the batch is longer than (it changes
            nothing then); else ``ValueError`` naming ``config.sliding_window``.
        scaling: softmax scale (None = ``H ** -0.5``).
        kwargs: the model call's keywords: ``thdpack_thd`` (+ ``thdpack_cp_group``) from
            ``hf_packed_kwargs``, or at least ``cu_seq_lens_q`` and ``max_length_q``; optionally
            ``thdpack_attention``, an ``AttentionConfig`` for the backend and the CP exchange.

    Returns:
        ``(out, None)``: out (1, T, Nq, H) in query's dtype (under autocast: the autocast dtype, as
        sdpa computes there), no attention weights.
    """
    if attention_mask is not None:
        raise ValueError(
            f"thdpack attention got an attention_mask of shape {tuple(attention_mask.shape)}; packed rows need "
            "none: call the model with hf_packed_kwargs(thd) and no attention_mask"
        )
    if dropout:
        raise ValueError(f"thdpack attention has no dropout, got dropout={dropout}; set attention_dropout=0.0")
    if softcap is not None:
        raise ValueError(_softcap_refusal(softcap))
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(
            f"thdpack attention takes one packed row, query (1, heads, T, head_dim); got shape {tuple(query.shape)}"
        )
    thd = _metadata(kwargs, total_tokens=query.shape[2])
    if sliding_window is not None:
        _check_window(sliding_window, thd)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # what sdpa does under autocast: RoPE leaves q, k in float32 (its cos / sin are float32)
        # while v comes out of the autocast projection, so all three run in the autocast dtype
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    q_TNH, k_TNH, v_TNH = (t[0].transpose(0, 1) for t in (query, key, value))
    base = kwargs.get(ATTENTION_CONFIG_KWARG) or AttentionConfig()
    config = dataclasses.replace(base, causal=causal, softmax_scale=scaling)
    out_TNH = thd_attention(q_TNH, k_TNH, v_TNH, thd, config=config, cp_group=kwargs.get(CP_GROUP_KWARG))
    return out_TNH.unsqueeze(0), None


def register_hf_attention(name: str = "thdpack") -> str:
    """Register ``hf_attention_forward`` with transformers' ``AttentionInterface``. Needs ``transformers``.

    Args:
        name: the attention implementation's name.

    Returns:
        ``name``, for ``from_pretrained(..., attn_implementation=name)``.
    """
    transformers = require("transformers", "register_hf_attention")
    transformers.AttentionInterface.register(name, hf_attention_forward)
    _REGISTERED.add(name)
    return name


_REGISTERED: set[str] = set()
"""Names under which ``register_hf_attention`` registered thdpack's attention."""
POSITION_MASKED = ("eager", "sdpa", "flex_attention")
"""transformers implementations that find packed sequences from ``position_ids`` resets (no cache)."""
VARLEN = ("flash_attention_2", "flash_attention_3")
"""transformers implementations that take ``cu_seq_lens_q/k`` (hf_packed_kwargs passes them)."""


def check_hf_attention(model: torch.nn.Module, thd: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` unless ``model``'s attention is exact on the packed row ``thd``.

    Without CP, ``eager`` / ``sdpa`` / ``flex_attention`` are exact through transformers'
    detection of sequences from ``position_ids`` (``hf_packed_kwargs`` turns the cache off for
    it), ``flash_attention_2/3`` through ``cu_seq_lens_q/k``, thdpack's registered attention
    through the batch's metadata; any other implementation is refused, and so is
    ``flex_attention`` on a float64 CPU model (torch cannot compile it). On a CP shard only
    thdpack's registered attention is exact: the others would attend within the rank's chunks.
    thdpack's attention also refuses a config whose attention it does not implement
    (``config.attn_logit_softcapping``, a ``config.sliding_window`` shorter than a sequence of
    ``thd``, ``config.layer_types`` other than full and sliding attention).

    Args:
        model: the transformers model (its ``config`` says its attention implementation).
        thd: the THD batch or CP shard it is about to run.

    Returns:
        None; raises ``ValueError`` naming the setting and the fix.
    """
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    fix = f"load the model with attn_implementation={register_hf_attention.__name__}() (thdpack's attention)"
    if thd_meta(thd).cp_size > 1 and implementation not in _REGISTERED:
        raise ValueError(
            f"the model's attention {implementation!r} cannot run a CP shard: each rank holds only chunks of every "
            f"sequence and needs the other ranks' keys; {fix}"
        )
    if implementation in _REGISTERED:
        _check_config(config, thd)
        return
    if implementation not in (*POSITION_MASKED, *VARLEN):
        raise ValueError(
            f"the model's attention {implementation!r} is not known to be exact on a packed row (sequences could "
            f"attend to each other); use one of {', '.join(POSITION_MASKED + VARLEN)}, or {fix}"
        )
    parameter = next(model.parameters(), None)
    if implementation == "flex_attention" and parameter is not None and _float64_cpu(parameter):
        raise ValueError(
            "flex_attention cannot run a float64 model on the CPU: torch's CPU FlexAttention takes float32, "
            f"float16 and bfloat16 (torch {torch.__version__} fails to compile float64 with an InductorError); "
            "use attn_implementation='sdpa' or 'eager' for a float64 check, or run the model in float32"
        )


_ROW_FIX = "run transformers' own attention (attn_implementation='eager' / 'sdpa') on packed rows without CP"
_LAYER_KINDS = ("full_attention", "sliding_attention")
"""``config.layer_types`` entries thdpack's attention implements (a sliding layer within its window)."""


def _check_config(config: Any, thd: Mapping[str, Any]) -> None:
    """Refuse what the model's layers would ask of thdpack's attention and it cannot do, before
    any forward: the same rules ``hf_attention_forward`` applies to each layer's call."""
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(_softcap_refusal(softcap))
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted(set(layer_types) - set(_LAYER_KINDS))
    if other:
        raise ValueError(
            f"config.layer_types has {other} layers; thdpack attention implements {' and '.join(_LAYER_KINDS)} "
            f"only, and would attend wrongly in those; {_ROW_FIX}"
        )
    window = getattr(config, "sliding_window", None)
    # Mistral's layers all use config.sliding_window; Gemma 2/3 and Qwen2 only the "sliding_attention" ones
    if window is not None and (not layer_types or "sliding_attention" in layer_types):
        _check_window(window, thd)


def _check_window(window: int, thd: Mapping[str, Any]) -> None:
    """A sliding window lets query ``q`` see keys ``q - window < k <= q`` (transformers' rule): it
    changes nothing unless some real sequence is longer than ``window``. Reads host lengths."""
    if window >= thd.get("max_seqlen", 0):
        return  # no slot is wider than the window: nothing to look up
    lengths_S = thd_meta(thd).lengths_S
    if len(lengths_S) and int(lengths_S.max()) > window:
        s = int(lengths_S.argmax())
        raise ValueError(
            f"config.sliding_window={window} is shorter than sequence {s} of the batch ({int(lengths_S[s])} tokens): "
            "thdpack attention has no sliding window, so that sequence would attend beyond it; keep every sequence "
            f"within {window} tokens (pack_size <= {window} with overflow='split'), or {_ROW_FIX}"
        )


def _softcap_refusal(softcap: float) -> str:
    return (
        f"the model softcaps its attention scores (config.attn_logit_softcapping={softcap}) and thdpack attention "
        f"cannot, so every score would change; {_ROW_FIX} (eager applies the softcap, sdpa refuses it)"
    )


def _float64_cpu(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.float64 and tensor.device.type == "cpu"


def _metadata(kwargs: Mapping[str, Any], *, total_tokens: int) -> Mapping[str, Any]:
    if THD_KWARG in kwargs:
        return kwargs[THD_KWARG]
    if kwargs.get("cu_seq_lens_q") is None or kwargs.get("max_length_q") is None:
        raise ValueError(
            "thdpack attention needs the packing metadata: call the model with **hf_packed_kwargs(thd) "
            "(or at least cu_seq_lens_q and max_length_q)"
        )
    cu = kwargs["cu_seq_lens_q"].to(torch.int32)
    thd = {"cu_seqlens": cu, "cu_seqlens_padded": cu, "max_seqlen": int(kwargs["max_length_q"])}
    thd_meta(thd).check_token_count(total_tokens, "the row (query)")
    return thd
