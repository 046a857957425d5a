"""HostOps: the eager ops a training stack issues on the host, the host side of a step.

An eager step launches every kernel from Python, one op at a time, and each op costs the host
microseconds whatever the kernel computes: where kernels are short the step is host-bound. This
module counts the ops per micro-batch, layer, attention call, ring step and exchange;
the profile prices one (``MachineProfile.host``) and ``thdpack.perf.step`` combines host and
device. ``THDPACK`` is counted from thdpack's own code (``tests/unit/perf/test_perf_host.py``
recounts it), ``MEGATRON_TE`` from Megatron-LM's and Transformer Engine's sources
(``HostOps.sources``); docs/design/step_model.md ("The host side of a step") has the unit and
the counts.

>>> [round(n, 1) for n in MEGATRON_TE.ring_ops(4)]   # TE's p2p ring over 4 ranks, one layer
[71.2, 71.0]
>>> [round(n, 1) for n in MEGATRON_TE.attention]      # the same layer without CP
[3.7, 5]
>>> THDPACK.ring_ops(1) == THDPACK.attention   # a group of one rank runs the local kernel
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

TE_MODULE_OVERHEAD = 99.66 / 37.08 - 1
"""Ops a Transformer Engine module call costs beyond its kernels: TE issue #2053 (GB200, bf16,
hidden 2048, 8192 tokens) measured ``te.Linear``'s forward at 99.66 us of host time against
37.08 us for ``torch.nn.Linear``'s one op."""


class Ops(NamedTuple):
    """Eager ops of the forward and of the backward."""

    forward: float
    backward: float

    def __add__(self, other: object) -> Ops:
        assert isinstance(other, Ops)
        return Ops(self.forward + other.forward, self.backward + other.backward)

    def __sub__(self, other: object) -> Ops:
        assert isinstance(other, Ops)
        return Ops(self.forward - other.forward, self.backward - other.backward)

    def scaled(self, factor: float) -> Ops:
        return Ops(self.forward * factor, self.backward * factor)

    @property
    def total(self) -> float:
        return self.forward + self.backward


@dataclass(frozen=True, kw_only=True)
class HostOps:
    """The eager ops of one training stack (see the module docstring)."""

    name: str
    layer: Ops
    """One decoder layer outside its attention core."""
    attention: Ops
    """One call of the local kernel on whole sequences, its wrapper included."""
    ring: Ops
    """One ring attention call, beyond its steps and exchanges."""
    ring_step: Ops
    """One ring step: the tile's kernel call and the merge of its result."""
    exchange: float
    """One point-to-point exchange with the ring's neighbours: buffers, send, receive, waits."""
    grad_exchanges_apart: bool
    """The backward sends dK/dV in exchanges of their own (``2g - 1`` in all), not with K/V (``g``)."""
    allgather: Ops
    """One all-gather attention call: K/V gathered, its kernel calls, dK/dV reduce-scattered."""
    a2a: Ops
    """One all-to-all attention call: Q/K/V and the output exchanged and reordered, its kernel call."""
    micro_batch: Ops
    """One micro-batch outside the layers: preparation, embedding, final norm, head, loss."""
    step: float
    """One optimizer step: the optimizer, the gradient reduction's launches, the loss read back."""
    per_parameter: float
    """More ops per parameter tensor per step (an optimizer or gradient copy looping over them)."""
    parameters_per_layer: int
    """Parameter tensors of a decoder layer."""
    parameters_outside_layers: int
    """Parameter tensors outside the layers (embeddings, final norm, an untied head)."""
    sources: tuple[str, ...]
    """Where each count comes from."""

    def ring_ops(self, group_size: int) -> Ops:
        """Ops of one ring attention call over ``group_size`` ranks (the local kernel for one rank)."""
        g = group_size
        if g == 1:
            return self.attention
        grad_exchanges = g - 1 + g if self.grad_exchanges_apart else g
        exchanges = Ops(self.exchange * (g - 1), self.exchange * grad_exchanges)
        return self.ring + self.ring_step.scaled(g) + exchanges

    def parameters(self, layers: int) -> int:
        """Parameter tensors of a model of ``layers`` layers."""
        return layers * self.parameters_per_layer + self.parameters_outside_layers

    def step_ops(self, layers: int) -> float:
        """Ops of one optimizer step of a model of ``layers`` layers."""
        return self.step + self.per_parameter * self.parameters(layers)


FLASH_TILE = Ops(3, 6)
"""thdpack's FlashAttention-2 tile: the kernel and the LSE's normalisation forward; buffers, the
LSE's conversion and the kernel backward (``thdpack.attention.flash_kernel``'s tile functions)."""

_THDPACK_SOURCES = (
    "counted under TorchDispatchMode (non-view ATen ops), fp32 on the CPU, torch 2.13: "
    "tests/unit/perf/test_perf_host.py recounts every number below",
    "layer: thdpack/models/layers.py DecoderBlock (RMSNorm, apply_rope, Attention, SwiGLU, the residuals): "
    "33 forward, 65 backward (autograd's engine)",
    "micro_batch: thdpack/cp/partition.py shard (5), thdpack/models/transformer.py Transformer.forward (embedding, "
    "rope_cos_sin, final norm, head: 18 forward, 21 backward), thdpack/loss.py StepLoss.begin (3 per "
    "micro-batch, 3 and the all-reduce per step) and StepLoss.__call__ (12 forward, 5 backward)",
    "attention / ring_step: FLASH_TILE per kernel call (thdpack/attention/flash_kernel.py); "
    "differentiable_attention's backward bookkeeping (thdpack/attention/merge.py): 6",
    "ring: thdpack/attention/ring.py ring_forward and merge_partials (merge.py): 13.5 ops per step "
    "forward, 1.5 fewer per call (step 0 selects no half); ring_backward: 6 per step and 6 per call",
    "exchange: thdpack/cp/comm.py RingComm.send_recv (two receive buffers, isend / irecv pairs) and its wait: 6",
    "allgather: thdpack/attention/allgather.py and cp/comm.py all_gather_rows / reduce_scatter_rows: 6 forward, "
    "12 backward, plus one kernel call",
    "a2a: thdpack/attention/a2a.py _to_heads / _to_sequence and cp/comm.py all_to_all_blocks: 12 forward, "
    "12 backward, plus one kernel call",
)
_THDPACK = {
    "layer": Ops(33, 65),
    "attention": FLASH_TILE + Ops(0, 6),
    "ring": Ops(-1.5, 6),
    "ring_step": Ops(13.5, 6) + FLASH_TILE,
    "exchange": 6.0,
    "grad_exchanges_apart": True,
    "allgather": Ops(6, 12) + FLASH_TILE + Ops(0, 6),
    "a2a": Ops(12, 12) + FLASH_TILE + Ops(0, 6),
    "micro_batch": Ops(5 + 18 + 3 + 12, 21 + 5),
    "parameters_per_layer": 9,
    "parameters_outside_layers": 2,
}

THDPACK = HostOps(
    name="thdpack",
    step=4 + 1 + 12 + 6 + 2 + 3,
    per_parameter=2,
    sources=(
        *_THDPACK_SOURCES,
        "step (thdpack.train on CUDA): StepLoss.begin (4), the loss read back (1), torch.optim.AdamW with foreach "
        "(one call per _foreach op of _multi_tensor_adamw: 12), clip_grad_norm (_foreach_norm, stack, norm, clamp, "
        "_foreach_mul_: 6), DDP's all-reduce of its buckets (3); per parameter: parameters_finite's isfinite and "
        "all (thdpack/train/forward_backward.py)",
    ),
    **_THDPACK,
)
"""thdpack's trainer on CUDA: its decoder, thdpack's CP attention with FlashAttention-2 tiles, DDP,
AdamW with ``foreach``."""

THDPACK_CPU = HostOps(
    name="thdpack_cpu",
    step=4 + 1 + 2 + 3,
    per_parameter=10,
    sources=(
        *_THDPACK_SOURCES,
        "step (benchmarks/cp_throughput.py on the CPU): StepLoss.begin (4), the loss read back (1), DDP's bucket (3); "
        "torch.optim.AdamW without foreach on CPU tensors: 2 per step and 10 per parameter (_single_tensor_adamw)",
    ),
    **_THDPACK,
)
"""thdpack on the CPU as ``benchmarks/cp_throughput.py`` steps it: AdamW's per-parameter loop, no
clipping. (The math tiles' own ops are timed with the kernel; the flash tile's count is a few
ops too many there.)"""

_TE = TE_MODULE_OVERHEAD
MEGATRON_TE = HostOps(
    name="megatron_te",
    # layer forward: linear_qkv (TE LayerNormLinear: LN + GEMM), linear_proj (GEMM), linear_fc1 (LN + GEMM),
    # linear_fc2 (GEMM), each + the TE module overhead; bias-dropout-add x2, bias-GELU
    # layer backward: fc2 (dgrad, wgrad) +1, bias-GELU, fc1 (dgrad, wgrad, LN) +1, proj +1, qkv +1, the two
    # bias-dropout-adds and the residual branches' gradient sums (2 + 2); main_grad.add_ per parameter (12)
    layer=Ops(2 + 1 + 2 + 1 + 4 * _TE + 3, (2 + 1) + 1 + (3 + 1) + (2 + 1) + (3 + 1) + 2 + 2 + 12),
    # TE DotProductAttention -> FlashAttention, THD, no CP: module overhead + flash_attn_varlen_func;
    # backward: three empty_like + the kernel, autograd's bookkeeping
    attention=Ops(1 + 1 + _TE, 4 + 1),
    # AttnFuncWithCPAndKVP2P, THD, causal, FlashAttention-2, bf16 (context_parallel.py):
    # forward per call: DotProductAttention's overhead, cu_seqlens // cp (2), cat of K and V, an Event,
    # wait_stream, out.to x2, save (1); backward per call: thd_read_second_half_lse, dq buffer, two exchange
    # buffers and a copy, three fill_ of the padding, three arange / ge / index_put of the pad masks
    ring=Ops(_TE + 2 + 1 + 1 + 1 + 2 + 1, 1 + 1 + 2 + 1 + 3 + 9),
    # per step forward: stream in/out, cu_seqlens // cp (2), the halves' reads (1 on average), the
    # FlashAttention call, the LSE correction on the other stream (stream in/out, wait_event, the correction,
    # record_event) and the output correction; backward: the halves' reads (2 on average), three empty_like and
    # the kernel, dq correction, dk and dv corrections
    ring_step=Ops(2 + 2 + 1 + 1 + 5 + 1, 2 + 4 + 1 + 2),
    # forward: empty_like, isend, irecv, two waits (5); backward the same without the buffer, preallocated (4)
    exchange=4.5,
    grad_exchanges_apart=False,
    # AttnFuncWithCPAndKVAllGather, THD: two all-gathers (buffer + collective), two index_select, stream waits,
    # out buffers and cu_seqlens bookkeeping, per local chunk (2): stream switch, seqlen info, FlashAttention,
    # copy back; backward the same with reduce-scatters
    allgather=Ops(_TE + 4 + 2 + 1 + 2 + 6 + 2 * 10 + 1, 4 + 2 + 2 + 6 + 2 * 12 + 2),
    # AttnFuncWithCPAndQKVOA2A, THD: per exchanged tensor (Q, K, V, the output; dout, dQ, dK, dV) empty_like,
    # all_to_all_single, wait, stream in/out, contiguous and the THD reorder (4); the kernel call
    a2a=Ops(_TE + 4 * 10 + 2 + 1, 4 * 10 + 2 + 4),
    # get_batch_on_this_rank_for_sequence_packing (two H2D tensors, three .item(), the CP slice: 8), embedding
    # (word, position, add, transpose, dropout: 5), final LayerNorm (TE), output layer (GEMM + 1), vocab-parallel
    # cross entropy (16), loss_func (6); backward: cross entropy (6), loss (3), the backward call (1), embeddings
    # (5), final norm (4), output layer (3)
    micro_batch=Ops(8 + 5 + (1 + _TE) + 2 + 16 + 6, 6 + 3 + 1 + 5 + 4 + 3),
    # per step: the scheduler's fetch and gathers (8 samples, two all_gathers, .cpu().tolist(): 60), the reroute
    # (per key: cat, all_to_all_single, split: 20), the packed micro-batches (cat + to per key: 24), broadcasts (3);
    # DDP's one bucket (no --overlap-grad-reduce: 5); grad norm (multi_tensor_l2norm, all_reduce, .item(): 4),
    # clip (1), FusedAdam (5), main -> model params (2), zero_grad (2); logging every step (10);
    # per parameter: main_param.grad = main_grad.float()
    step=60 + 20 + 24 + 3 + 5 + 4 + 1 + 5 + 2 + 2 + 10,
    per_parameter=1,
    parameters_per_layer=12,
    parameters_outside_layers=4,
    sources=(
        "Transformer Engine d0067d0, transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py: "
        "flash_attn_p2p_communicate 96-135, cp_p2p_fwd_prepare_qkv 691-807, cp_p2p_fwd_flash_attn 969-1049, "
        "cp_p2p_bwd_prepare_qkv 1052-1115, cp_p2p_bwd_flash_attn 1257-1353, AttnFuncWithCPAndKVP2P.forward "
        "1369-2200 (per step 1698-1984, output correction 1990-2023), .backward 2203-2973 (per step 2445-2812, "
        "padding 2857-2945), AttnFuncWithCPAndKVAllGather 3014-4167, AttnFuncWithCPAndQKVOA2A 4170-4921, "
        "flash_attn_a2a_communicate 387-536",
        "Transformer Engine issue #2053 (High CPU overhead on Grace systems): te.Linear forward 99.66 us, "
        "torch.nn.Linear 37.08 us of host time on GB200 (90.53 / 33.17 on GH200): TE_MODULE_OVERHEAD",
        "Megatron-LM 10ce7bc: megatron/core/transformer/transformer_layer.py (TE spec: LayerNormLinear QKV and FC1, "
        "bias-dropout-add x2), megatron/core/distributed/distributed_data_parallel.py 449-475 (main_grad.add_ per "
        "parameter per micro-batch under --no-gradient-accumulation-fusion), 66-72 (one bucket without "
        "--overlap-grad-reduce), megatron/core/optimizer/optimizer.py 786-799 (one grad copy per parameter), "
        "clip_grads.py 55-114 (grad norm .item()), megatron/core/datasets/data_schedule.py 164-352 (the scheduler "
        "per step), 486-689 (per micro-batch: three .item())",
        "examples/dynamic_context_parallel/benchmark_dcp.sh: --transformer-impl transformer_engine, "
        "--attention-backend flash, --bf16, --clip-grad 1.0, --no-gradient-accumulation-fusion, --log-interval 1, "
        "--num-workers 0",
    ),
)
"""Megatron-LM's GPT on Transformer Engine as ``benchmark_dcp.sh`` runs it (TP 1, bf16, THD,
FlashAttention-2, learned absolute positions, GELU MLP with biases)."""

HOST_STACKS: dict[str, HostOps] = {s.name: s for s in (THDPACK, THDPACK_CPU, MEGATRON_TE)}
"""The stacks by name."""
