"""The contract every attention backend meets, and the record a call hands it.

A backend (:class:`AttentionBackend`, one row of ``select.BACKEND_TABLE``) says why its kernel
cannot run a call (``kernel_problem``), attends whole sequences (``attend``) and names, per
``cp_comm_type``, the algorithm that runs a CP shard (``cp``: ``"own"`` when it exchanges K/V
itself, as Transformer Engine does, else thdpack's ``"ring_math"``, ``"ring_flash"``,
``"all_gather"`` or ``"a2a"``). A placed shard runs in parts: split sequences by the backend's
``split_algorithm``, whole ones by its kernel. :class:`AttentionCall` is the one record a
backend receives besides q/k/v: the batch, its ``ThdMeta``, the config, the resolved scale, the
CP group and the topology.

Legend: ``T`` tokens on this rank, ``N`` heads (``Nq`` query, ``Nkv`` key/value), ``H`` head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist

from thdpack.attention.config import AttentionConfig, Backend, CpCommType
from thdpack.attention.flash_kernel import HALF_DTYPES, unavailable_reason
from thdpack.cp.partition import local_placement
from thdpack.cp.topology import CpTopology
from thdpack.thd.meta import ThdMeta

CpAlgorithm = Literal["own", "ring_math", "ring_flash", "all_gather", "a2a"]
CP_ALGORITHM_NAMES: tuple[CpAlgorithm, ...] = get_args(CpAlgorithm)
AttentionOutput = tuple[torch.Tensor, torch.Tensor | None]
"""``(out (T, Nq, Hv) in q's dtype, lse (Nq, T) natural log, or None)``."""


@dataclass(frozen=True, kw_only=True)
class CallFacts:
    """The facts of one call that decide which backends can run it."""

    device: torch.device
    dtype: torch.dtype
    cp: bool
    """A CP group of size > 1."""
    cp_comm_type: CpCommType
    need_lse: bool
    need_grad: bool
    head_dim: int | None = None
    """Q's and K's head dim (None: not checked)."""
    head_dim_v: int | None = None
    """V's head dim (None: not checked)."""
    capability: tuple[int, int] | None = None
    """The CUDA device's compute capability, e.g. (9, 0) on an H100 (None: not CUDA / not checked)."""
    placed: bool = False
    """A CP shard of a per-sequence placement: split sequences run a CP algorithm, whole ones the
    backend's own kernel, without CP."""
    num_heads: int | None = None
    """Q's heads (None: not checked)."""
    num_kv_heads: int | None = None
    """K's and V's heads (None: not checked)."""
    cp_size: int = 1
    """Ranks of the CP group (1 without CP)."""
    padded: bool = False
    """A slot of the batch holds padding after its real tokens (Transformer Engine's ``pad_between_seqs``)."""

    @property
    def cuda_half(self) -> bool:
        return self.device.type == "cuda" and self.dtype in HALF_DTYPES

    def flash_problem(self) -> str | None:
        """Why FlashAttention-2 kernels cannot run this call (``flash_kernel.unavailable_reason``)."""
        return unavailable_reason(
            self.device, self.dtype, capability=self.capability, head_dim=self.head_dim, head_dim_v=self.head_dim_v
        )

    @classmethod
    def of(
        cls,
        q_TNH: torch.Tensor,
        k_TNH: torch.Tensor,
        v_TNH: torch.Tensor,
        *,
        cp: bool,
        cp_comm_type: CpCommType,
        need_lse: bool,
        placed: bool = False,
        cp_size: int = 1,
        padded: bool = False,
    ) -> CallFacts:
        """The facts of a call on ``q, k, v`` (device, dtype, heads, head dims, the GPU's capability)."""
        device = q_TNH.device
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        return cls(
            device=device,
            dtype=q_TNH.dtype,
            cp=cp,
            cp_comm_type=cp_comm_type,
            need_lse=need_lse,
            need_grad=torch.is_grad_enabled() and any(t.requires_grad for t in (q_TNH, k_TNH, v_TNH)),
            head_dim=q_TNH.shape[-1],
            head_dim_v=v_TNH.shape[-1],
            capability=capability,
            placed=placed,
            num_heads=q_TNH.shape[1],
            num_kv_heads=k_TNH.shape[1],
            cp_size=cp_size,
            padded=padded,
        )

    def without_cp(self) -> CallFacts:
        """The facts of the same call on one device (a placed shard's whole sequences)."""
        return dataclasses.replace(self, cp=False, placed=False)


@dataclass(frozen=True, kw_only=True)
class AttentionCall:
    """Everything a backend needs besides q/k/v; built once per ``thd_attention`` call."""

    thd: Mapping[str, Any]
    """The batch's metadata mapping (``cu_seqlens``, ``cu_seqlens_padded``, ...), for kernels and masks."""
    meta: ThdMeta
    """Its validated record (which also holds its ``cu_seqlens`` tensors: :meth:`cu_seqlens`)."""
    config: AttentionConfig
    scale: float
    """The softmax scale (``config.softmax_scale`` or ``H ** -0.5``)."""
    cp_group: dist.ProcessGroup | None
    """The context-parallel group, or None when the call is not sharded (CP size 1)."""
    return_lse: bool
    topology: CpTopology | None = None
    """The run's topology when the caller passed one: the placement groups a placed shard's split
    sequences run over (:mod:`thdpack.attention.placed`)."""

    @property
    def causal(self) -> bool:
        return self.config.causal

    def cu_seqlens(self, key: str, device: torch.device) -> torch.Tensor:
        """The batch's ``key`` tensor as a kernel reads it (int32, on ``device``): ``ThdMeta.cu_tensor``."""
        return self.meta.cu_tensor(key, device)

    def varlen_operands(
        self, k_TNH: torch.Tensor, v_TNH: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
        """``(k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` for a varlen kernel.

        Queries run over the padded slots. Causal attention is exact over them for every real
        token (its slot's padding follows it), so the keys are the same slots; non-causal
        attention feeds only the real keys (a prefix of every slot) with the real ``cu_seqlens``,
        because FlashAttention-style kernels cannot mask keys inside a sequence.
        """
        device = k_TNH.device
        cu_q = self.cu_seqlens("cu_seqlens_padded", device)
        if self.causal or not self.meta.has_padding:
            return k_TNH, v_TNH, cu_q, cu_q, self.meta.max_seqlen, self.meta.max_seqlen
        keep = local_placement(self.meta, device).valid_index
        cu_k = self.cu_seqlens("cu_seqlens", device)
        return (
            k_TNH.index_select(0, keep),
            v_TNH.index_select(0, keep),
            cu_q,
            cu_k,
            self.meta.max_seqlen,
            max(self.meta.lengths),
        )


AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionCall], AttentionOutput]
"""``(q (T, Nq, H), k (T, Nkv, H), v (T, Nkv, Hv), call) -> AttentionOutput``; ``Nq % Nkv == 0``."""


@dataclass(frozen=True, kw_only=True)
class AttentionBackend:
    """One attention backend: availability, the kernel call, and its context-parallel support."""

    name: Backend
    cp: Mapping[CpCommType, CpAlgorithm]
    """The algorithm that attends a CP shard, per ``cp_comm_type``; a missing type is refused."""
    kernel_problem: Callable[[CallFacts], Exception | None]
    """Why this backend's own kernel cannot run in a situation (the exception to raise), or None."""
    attend: AttendFn
    """The kernel call on one device (with ``cp == "own"`` also on a CP shard)."""

    def __post_init__(self) -> None:
        for comm, algorithm in self.cp.items():
            assert algorithm in CP_ALGORITHM_NAMES, f"{self.name}: unknown CP algorithm {algorithm!r} for {comm!r}"

    def split_algorithm(self, cp_comm_type: CpCommType) -> CpAlgorithm | None:
        """What runs the split sequences of a per-sequence placement's shard: the algorithm ``cp``
        names, or for a backend without a CP path (``sdpa``, ``flex``: no LSE to merge in a ring,
        or no CPU backward) thdpack's math algorithm for ``cp_comm_type``; None when refused."""
        algorithm = self.cp.get(cp_comm_type)
        if algorithm is None and set(self.cp) <= {"a2a"}:  # no ring or all-gather of its own
            return MATH_CP.get(cp_comm_type)
        return algorithm

    def problem(self, s: CallFacts) -> Exception | None:
        """Why this backend cannot run a call in situation ``s`` (an exception to raise), or None."""
        if not s.cp:
            return self.kernel_problem(s)
        if s.placed and s.cp_comm_type == "a2a":
            # thdpack's all-to-all takes any layout to whole sequences, so the kernel runs without
            # CP (te's too: TE's own all-to-all assumes its layout)
            return self.kernel_problem(s.without_cp())
        if s.placed:  # the whole sequences run this backend's kernel on one device
            err = self.kernel_problem(s.without_cp())
            if err is not None:
                return err
            algorithm = self.split_algorithm(s.cp_comm_type)
        else:
            algorithm = self.cp.get(s.cp_comm_type)
        if algorithm == "own":
            return self.kernel_problem(s)
        if algorithm == "a2a":  # the kernel runs on whole sequences, as without CP
            return self.kernel_problem(s.without_cp())
        if algorithm is None:
            has = ", ".join(repr(comm) for comm in self.cp)
            return ValueError(
                f"backend {self.name!r} has no context-parallel path for cp_comm_type={s.cp_comm_type!r} (it has "
                f"{has}); use cp_comm_type={has.replace(', ', ' or ')}, or backend='math' (every cp_comm_type, any "
                "device) or 'te'"
            )
        reason = s.flash_problem() if algorithm == "ring_flash" else None
        if reason is not None:
            return ValueError(f"backend {self.name!r} under context parallelism: {reason}; use backend='math'")
        return None


MATH_CP: dict[CpCommType, CpAlgorithm] = {"p2p": "ring_math", "all_gather": "all_gather"}
"""thdpack's math-tile CP algorithm per exchange: the ``math`` backend's ``cp``."""


def needs_cuda_half(backend: str, s: CallFacts) -> Exception | None:
    """The error for a FlashAttention-family kernel outside CUDA fp16 / bf16, or None."""
    reason = s.flash_problem()
    if reason is None:
        return None
    return ValueError(f"backend {backend!r}: {reason}; use backend='math' (any device and dtype) or 'flex'")


def to_1NTH(*tensors_TNH: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(T, N, H) -> (1, N, T, H) views, the batch-first layout of SDPA and FlexAttention."""
    return tuple(t.transpose(0, 1).unsqueeze(0) for t in tensors_TNH)


def to_TNH(out_1NTH: torch.Tensor) -> torch.Tensor:
    """(1, N, T, H) -> (T, N, H), the inverse of :func:`to_1NTH`."""
    return out_1NTH[0].transpose(0, 1)
