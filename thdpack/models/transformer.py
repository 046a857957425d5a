"""``Transformer``: thdpack's reference decoder over THD batches, at any context-parallel size.

    embed -> n_layers x [RMSNorm -> GQA attention with RoPE -> + residual,
                         RMSNorm -> SwiGLU -> + residual] -> RMSNorm -> LM head

It takes a THD batch or one CP rank's shard and returns the logits of exactly the tokens it
holds. Nothing depends on how sequences were packed: RoPE reads each token's position in its
sequence from ``position_ids`` and attention never crosses a sequence, so a sequence's logits are
the same alone, packed, or spread over CP ranks.

Legend: ``T`` tokens on this rank, ``D`` model dim, ``H`` head dim, ``V`` vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from thdpack.cp.topology import CpGroupLike
from thdpack.models.config import ModelConfig
from thdpack.models.layers import DecoderBlock, LayerContext, RMSNorm, rope_cos_sin

_RESIDUAL_OUTPUTS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


class Transformer(nn.Module):
    """A Llama-style decoder that consumes THD batches through ``thd_attention``.

    Args:
        config: the architecture (``ModelConfig``).
        seed: weights come from ``init_weights(seed)``, so every rank that builds the model with
            the same seed holds identical weights, whatever its device or dtype.
        device, dtype: where and in which dtype the parameters live (default: torch's defaults).
            On the ``"meta"`` device no weights are drawn; call ``to_empty`` then ``init_weights``.

    Parameter names are Hugging Face Llama's (``embed_tokens``, ``layers.{i}.self_attn.q_proj``,
    ``layers.{i}.mlp.gate_proj``, ``norm``, ``lm_head``, ...) without the ``model.`` prefix.

    >>> from thdpack.thd import thd_collate
    >>> model = Transformer(ModelConfig.preset("tiny"), seed=0).double()
    >>> pack = {"input_ids": [5, 6, 7, 8, 9, 0], "labels": [6, 7, -100, 9, -100, -100],
    ...         "position_ids": [0, 1, 2, 0, 1, 2], "seq_lens": [3, 2], "seq_lens_padded": [3, 3]}
    >>> packed = model(thd_collate([pack]))                            # (6, 64) logits
    >>> alone = model(thd_collate([{"input_ids": [8, 9], "labels": [9, -100], "position_ids": [0, 1],
    ...                             "seq_lens": [2], "seq_lens_padded": [2]}]))
    >>> bool((packed[3:5] - alone).abs().max() < 1e-12)                 # sequence 2 is unaffected
    True
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a thdpack ModelConfig, got {type(config).__name__}")
        self.config = config
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim, **factory)
        self.layers = nn.ModuleList(DecoderBlock(config, **factory) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps, **factory)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False, **factory)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if self.embed_tokens.weight.device.type != "meta":
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int | torch.Generator = 0) -> None:
        """Draw every weight from ``seed`` (an int or a CPU ``torch.Generator``), deterministically.

        Matrices ~ N(0, init_std) (the residual output projections ``o_proj`` / ``down_proj``:
        N(0, init_std / sqrt(2 * n_layers))), norm weights 1. Values are drawn in fp64 on the CPU,
        parameter by parameter in ``named_parameters`` order, then cast and copied, so the weights
        do not depend on the device, and fp32 / bf16 weights are the roundings of the fp64 ones.
        With ``tie_embeddings`` it (re-)ties the LM head to the embedding first.
        """
        if self.config.tie_embeddings:  # Module.to_empty (the meta-device flow) unties shared weights
            self.lm_head.weight = self.embed_tokens.weight
        generator = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
        std = self.config.init_std
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            scale = std / math.sqrt(2 * self.config.n_layers) if name.endswith(_RESIDUAL_OUTPUTS) else std
            values = torch.randn(param.shape, generator=generator, dtype=torch.float64) * scale
            param.copy_(values)

    def forward(self, thd: Mapping[str, Any], *, cp_group: CpGroupLike | None = None) -> torch.Tensor:
        """Logits of the tokens of ``thd``.

        Args:
            thd: a THD batch or a CP shard of one, on the model's device: ``input_ids`` (T,)
                integer, ``position_ids`` (T,) integer (position inside each sequence; GLOBAL
                positions on a CP shard, as ``cp.shard`` keeps them), and the attention metadata
                ``cu_seqlens``, ``cu_seqlens_padded``, ``max_seqlen`` (global) with the batch's record
                ``thd_meta``, which on a shard says which CP rank's it is.
            cp_group: the run's ``CpTopology`` (or the plain CP process group the shard belongs to;
                ``thd_attention``); None without CP.

        Returns:
            (T, V) logits in the activation dtype, one row per token of ``thd`` in its order.
            Rows of padding tokens are finite but meaningless (their labels are -100).
        """
        input_ids_T, position_ids_T = _token_inputs(thd)
        x_TD = self.embed_tokens(input_ids_T)
        rope_TH = rope_cos_sin(position_ids_T, self.config.head_dim, self.config.rope_theta, x_TD.dtype)
        ctx = LayerContext(rope_TH, thd, cp_group)
        for layer in self.layers:
            x_TD = layer(x_TD, ctx)
        return self.lm_head(self.norm(x_TD))


def _token_inputs(thd: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    missing = [key for key in ("input_ids", "position_ids") if key not in thd]
    if missing:
        raise ValueError(
            f"the THD batch lacks {missing}; build it with thdpack.to_thd / thd_collate (and cp.shard under CP)"
        )
    input_ids_T, position_ids_T = thd["input_ids"], thd["position_ids"]
    for key, value in (("input_ids", input_ids_T), ("position_ids", position_ids_T)):
        if not isinstance(value, torch.Tensor) or value.dim() != 1:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{key} must be a 1-D (T,) tensor of a THD batch, got {shape}")
        if value.dtype.is_floating_point or value.dtype == torch.bool:
            raise TypeError(f"{key} must be an integer tensor, got {value.dtype}")
    if input_ids_T.shape != position_ids_T.shape:
        raise ValueError(f"input_ids has {input_ids_T.shape[0]} tokens but position_ids has {position_ids_T.shape[0]}")
    return input_ids_T, position_ids_T
