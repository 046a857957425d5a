"""The whole-step model: every rank's time in every round of every step, and the step time.

Per rank and micro-batch round: the linear work of the tokens it holds, the attention of its
sequences (``thdpack.perf.costs``) with a fixed cost per kernel call, the exposed part of each CP
algorithm's communication, and the host's eager ops (``thdpack.perf.host``), combined as the longer
of host and device on a GPU and their sum on a CPU. Groups wait for their slowest rank every
layer, every rank for the slowest after the last round; then the gradient reduction and the
optimizer. The breakdown (``PARTS``) is the mean rank's and adds up to the step.
docs/design/step_model.md has each term.

Legend: ``S`` steps, ``M`` rounds, ``R`` ranks, ``G`` groups, ``E`` entries, ``Q`` (group, rank) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from thdpack.perf.comm import Comm, Topology
from thdpack.perf.costs import SequenceCosts, split_slot
from thdpack.perf.host import THDPACK, THDPACK_CPU, HostOps
from thdpack.perf.machine import MachineProfile
from thdpack.perf.mesh import COMMS, MeshRun
from thdpack.perf.shape import ModelShape

PARTS: tuple[str, ...] = ("linear", "attention", "comm", "host", "wait", "dp", "optimizer")
"""The breakdown of a step, in seconds, summing to it."""


@dataclass(frozen=True, kw_only=True)
class TrainingSpec:
    """How the run trains, beside the model and the machine."""

    grad_itemsize: int = 4
    """Bytes per gradient element the data-parallel all-reduce sends (fp32: thdpack's trainer reduces
    in fp32; Megatron-LM's default is bf16, 2)."""
    optimizer_bytes_per_param: float = 40.0
    """HBM bytes the optimizer step moves per parameter: Adam with fp32 master weights reads and
    writes the fp32 parameter, gradient and both moments (28), copies the bf16 gradient to fp32 (6),
    reads it once more for the gradient norm (4) and writes the bf16 parameter (2)."""
    optimizer_shards: int = 1
    """Ranks one parameter's update is spread over (a distributed optimizer: the DP size)."""
    overlap_dp: bool = True
    """The gradient all-reduce overlaps the last round's backward (DDP's buckets, FSDP2; Megatron-LM
    only with ``--overlap-grad-reduce``)."""
    host: HostOps | None = None
    """The training stack whose eager ops the host issues (``thdpack.perf.host``); None: thdpack's
    own (``THDPACK`` where the device runs asynchronously, ``THDPACK_CPU`` on a CPU)."""


@dataclass(frozen=True)
class StepTimes:
    """Seconds of every step and its breakdown (``PARTS``, the mean rank's)."""

    step: np.ndarray
    """(S,) seconds of each step."""
    parts: dict[str, np.ndarray]
    """``PARTS`` -> (S,) seconds; they add up to ``step``."""
    busy: np.ndarray = field(repr=False)
    """(S, R) seconds each rank works in each step (linear + attention + exposed comm)."""
    slowest: np.ndarray = field(repr=False)
    """(S,) seconds until the last rank finishes its last round (before dp and the optimizer)."""

    def summary(self) -> dict[str, float]:
        """Mean milliseconds per step: ``step`` and every part."""
        out = {"step_ms": 1e3 * float(self.step.mean()) if len(self.step) else 0.0}
        out.update({f"{k}_ms": 1e3 * float(v.mean()) if len(v) else 0.0 for k, v in self.parts.items()})
        return out


class StepModel:
    """The step-time model of one model on one machine: ``run(mesh_run)`` times every step.

    Args:
        profile: the machine's constants (``load_profile``).
        shape: the model's sizes (``load_shape``).
        topology: where the ranks sit (``Topology.of(profile)``, or the run's own nodes).
        spec: how the run trains (gradient bytes, optimizer, DP overlap, the host's training
            stack); None: ``TrainingSpec()``, thdpack's own trainer.
    """

    def __init__(
        self, profile: MachineProfile, shape: ModelShape, topology: Topology, spec: TrainingSpec | None = None
    ) -> None:
        self.profile, self.shape, self.topology = profile, shape, topology
        self.spec = spec or TrainingSpec()
        self.costs = SequenceCosts(profile, shape)
        self.comm = Comm(profile, topology)
        self.host = self.spec.host or (THDPACK if profile.host.asynchronous else THDPACK_CPU)

    # -- per group ------------------------------------------------------------------------

    def group_times(self, run: MeshRun) -> dict[str, np.ndarray]:
        """Per (group, rank) pair ``Q`` (groups in order, ranks ``first ..``): ``attention``
        (compute + call costs), ``exposed`` (communication not hidden), ``backward`` (seconds of the
        backward half, for the dp overlap); all layers, forward + backward."""
        layers = self.shape.layers
        k = self.costs.kernels
        n_groups = len(run.group_size)
        size_G = run.group_size
        pair_start = np.concatenate(([0], np.cumsum(size_G)))
        n_pairs = int(pair_start[-1])
        att_f, att_b = np.zeros(n_pairs), np.zeros(n_pairs)
        exp_f, exp_b = np.zeros(n_pairs), np.zeros(n_pairs)
        comm_E = run.group_comm[run.entry_group]
        size_E = size_G[run.entry_group]
        domains_G = self.topology.domains(run.group_first, run.group_first + size_G - 1)
        calls_G = np.where(run.group_comm == COMMS.index("ring"), size_G, 1).astype(np.float64)
        has_work = np.bincount(run.entry_group, minlength=n_groups) > 0

        def per_group(values_E: np.ndarray, mask: np.ndarray) -> np.ndarray:
            return np.bincount(run.entry_group[mask], weights=values_E, minlength=n_groups)

        def spread(values_G: np.ndarray) -> np.ndarray:
            return np.repeat(values_G, size_G)

        # whole and a2a: one causal block per sequence (a2a: 1/g of the heads on every rank)
        for name in ("whole", "a2a"):
            mask = comm_E == COMMS.index(name)
            if not mask.any():
                continue
            f, b = k.causal(run.entry_length[mask].astype(np.float64))
            share = 1.0 / size_E[mask]
            att_f += spread(per_group(f * share, mask))
            att_b += spread(per_group(b * share, mask))
        # ring: step 0's causal tile and the later steps' full tiles, K/V sends overlapped
        ring = run.group_comm == COMMS.index("ring")
        if ring.any():
            t0f, t0b, t1f, t1b, sent = (np.zeros(n_groups) for _ in range(5))
            for g in np.unique(size_G[ring]).tolist():
                mask = (comm_E == COMMS.index("ring")) & (size_E == g)
                lengths = run.entry_length[mask]
                parts = (*self.costs.ring_tiles(lengths, g), self.costs.ring_bytes(lengths, g))
                for total, part in zip((t0f, t0b, t1f, t1b, sent), parts, strict=True):
                    total += per_group(part, mask)
            g = size_G.astype(np.float64)
            compute_f = t0f + (g - 1) * t1f
            compute_b = t0b + (g - 1) * t1b
            ring_f, ring_b = self.ring_seconds((t0f, t0b, t1f, t1b), sent, g, domains_G)
            ring_f, ring_b = np.where(ring & has_work, ring_f, 0.0), np.where(ring & has_work, ring_b, 0.0)
            att_f += spread(np.where(ring, compute_f, 0.0))
            att_b += spread(np.where(ring, compute_b, 0.0))
            exp_f += spread(np.where(ring, ring_f - compute_f, 0.0))
            exp_b += spread(np.where(ring, ring_b - compute_b, 0.0))
        # all-gather: per group rank j, its two chunks against every earlier key; K/V gathered
        gather = run.group_comm == COMMS.index("allgather")
        if gather.any():
            sent = np.zeros(n_groups)
            for g in np.unique(size_G[gather]).tolist():
                mask = (comm_E == COMMS.index("allgather")) & (size_E == g)
                lengths = run.entry_length[mask]
                f, b = self.costs.allgather_blocks(lengths, g)
                pair = pair_start[run.entry_group[mask]][:, None] + np.arange(g)
                np.add.at(att_f, pair, f)
                np.add.at(att_b, pair, b)
                sent += per_group(split_slot(lengths, g) / g * self.shape.kv_bytes_per_token, mask)
            gathered = sent * size_G  # nccl-tests' size: the all-gather's output, the reduce-scatter's input
            kv = self.comm.collective("all_gather", gathered, size_G, domains_G)
            dkv = self.comm.collective("reduce_scatter", gathered * self.spec.grad_itemsize / self.shape.itemsize,
                                       size_G, domains_G)  # fmt: skip
            exp_f += spread(np.where(gather & has_work, kv, 0.0))
            exp_b += spread(np.where(gather & has_work, dkv, 0.0))
        # a2a: Q, K, V in and the output back, forward; dO in and dQ, dK, dV back, backward
        a2a = run.group_comm == COMMS.index("a2a")
        if a2a.any():
            held_G = run.tokens.reshape(-1)[run.cells()]
            copies = np.array([self.shape.kv_copies(int(g)) for g in size_G])
            qkv = held_G * self.shape.qkv_bytes_per_token(copies)
            out = held_G * self.shape.out_bytes_per_token()
            both = (self.comm.collective("all_to_all", qkv, size_G, domains_G)
                    + self.comm.collective("all_to_all", out, size_G, domains_G))  # fmt: skip
            exp_f += spread(np.where(a2a & has_work, both, 0.0))
            exp_b += spread(np.where(a2a & has_work, both, 0.0))
        call_f, call_b = k.calls(spread(np.where(has_work, calls_G, 0.0)))
        return {
            "attention": layers * (att_f + att_b + call_f + call_b),
            "exposed": layers * (exp_f + exp_b),
            "backward": layers * (att_b + exp_b + call_b),
            "host_ops": spread(np.where(has_work, layers * self.attention_host_ops(run), 0.0)),
            "pair_start": pair_start,
        }

    def attention_host_ops(self, run: MeshRun) -> np.ndarray:
        """(G,) eager ops of one layer's attention call of each group, forward + backward, per rank
        (``thdpack.perf.host``: the local kernel, the ring's steps and exchanges, an all-gather or
        all-to-all call)."""
        host = self.host
        size_G = run.group_size
        ops_G = np.zeros(len(size_G))
        for name, ops in (("whole", host.attention), ("allgather", host.allgather), ("a2a", host.a2a)):
            ops_G[run.group_comm == COMMS.index(name)] = ops.total
        ring = run.group_comm == COMMS.index("ring")
        for g in np.unique(size_G[ring]).tolist():
            ops_G[ring & (size_G == g)] = host.ring_ops(int(g)).total
        return ops_G

    def call_seconds(self, group_size: int) -> tuple[float, float]:
        """``(device, host)`` seconds, every layer forward + backward, that one attention call of a
        group of ``group_size`` ranks (1: the local kernel on whole sequences) costs each of its
        ranks beside its sequences' work: its kernel launches (one per ring step) and the host's
        eager ops (``HostOps.ring_ops``)."""
        forward, backward = self.costs.kernels.calls(group_size)
        host = self.host.ring_ops(group_size).total * self.profile.host.op_s
        return self.shape.layers * float(forward + backward), self.shape.layers * host

    def ring_seconds(
        self, tiles: tuple[np.ndarray, ...], sent: np.ndarray, g: np.ndarray, domains: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) seconds of one layer's ring over groups of ``g`` ranks touching
        ``domains`` NVLink domains: ``tiles`` (``SequenceCosts.ring_tiles``, summed over each group's
        sequences) and the bytes each step sends, TE's overlap (the module docstring)."""
        t0f, t0b, t1f, t1b = tiles
        send = self.comm.send(sent, domains)
        grad_send = self.comm.send(sent * self.spec.grad_itemsize / self.shape.itemsize, domains)
        ring_f = np.maximum(t0f, send) + (g - 2) * np.maximum(t1f, send) + t1f
        ring_b = np.maximum(t0b, send + grad_send) + (g - 2) * np.maximum(t1b, send + grad_send) + t1b + grad_send
        return ring_f, ring_b

    # -- the step -------------------------------------------------------------------------

    def run(self, run: MeshRun) -> StepTimes:
        """Step times and breakdown of ``run`` (see the module docstring)."""
        S, M, R = run.steps, run.rounds, run.world
        n_cells = S * M * R
        times = self.group_times(run)
        pair_start = times["pair_start"]
        size_G = run.group_size
        pair_group = np.repeat(np.arange(len(size_G)), size_G)
        pair_cell = np.repeat(run.cells(), size_G) + (np.arange(int(pair_start[-1])) - pair_start[pair_group])
        linear = self.costs.kernels.linear(run.tokens.reshape(-1))
        attention = np.bincount(pair_cell, weights=times["attention"], minlength=n_cells)
        exposed = np.bincount(pair_cell, weights=times["exposed"], minlength=n_cells)
        backward = np.bincount(pair_cell, weights=times["backward"], minlength=n_cells) + linear * 2 / 3
        device = linear + attention + exposed
        host = self._host_seconds(run, np.bincount(pair_cell, weights=times["host_ops"], minlength=n_cells))
        own_flat = np.maximum(device, host) if self.profile.host.asynchronous else device + host
        own = own_flat.reshape(S, M, R)
        sync = self._sync_sets(run, pair_group, pair_cell, n_cells).reshape(S, M, R)
        ready = np.zeros((S, R))
        for m in range(M):
            ids = sync[:, m, :].reshape(-1)
            start = _group_max(ids, ready.reshape(-1))
            length = _group_max(ids, own[:, m, :].reshape(-1))
            ready = (start + length).reshape(S, R)
        slowest = ready.max(axis=1) if R else np.zeros(S)
        busy = own.sum(axis=1)
        dp = self._dp_seconds(run, backward.reshape(S, M, R))
        optimizer = self._optimizer_seconds()
        step_host = self.host.step_ops(self.shape.layers) * self.profile.host.op_s
        after = max(optimizer, step_host) if self.profile.host.asynchronous else optimizer + step_host

        def per_rank(values: np.ndarray) -> np.ndarray:
            return values.reshape(S, M, R).sum(axis=1).mean(axis=1)

        parts = {
            "linear": per_rank(linear),
            "attention": per_rank(attention),
            "comm": per_rank(exposed),
            "host": per_rank(own_flat - device) + (after - optimizer),
            "wait": (slowest[:, None] - busy).mean(axis=1),
            "dp": dp,
            "optimizer": np.full(S, optimizer),
        }
        return StepTimes(step=slowest + dp + after, parts=parts, busy=busy, slowest=slowest)

    def round_host_ops(self) -> float:
        """Eager ops a working rank issues in a round beside its attention calls: its micro-batch and
        every layer."""
        return self.host.micro_batch.total + self.shape.layers * self.host.layer.total

    def _host_seconds(self, run: MeshRun, attention_ops: np.ndarray) -> np.ndarray:
        """(S*M*R,) host seconds of each rank in each round: its micro-batch and layers when it holds
        tokens, and its attention calls (``attention_ops``, per cell)."""
        working = run.tokens.reshape(-1) > 0
        return (np.where(working, self.round_host_ops(), 0.0) + attention_ops) * self.profile.host.op_s

    def _sync_sets(self, run: MeshRun, pair_group: np.ndarray, pair_cell: np.ndarray, n_cells: int) -> np.ndarray:
        """(S*M*R,) int64 id of the rank set each cell waits with in its round: its largest
        communicating group, or the cell alone (ids ``>= G``)."""
        order = np.argsort(run.group_size, kind="stable")
        rank_by_size = np.empty_like(order)
        rank_by_size[order] = np.arange(len(order))
        talking = run.group_comm[pair_group] != COMMS.index("whole")
        key = np.full(n_cells, -1, dtype=np.int64)
        np.maximum.at(key, pair_cell[talking], rank_by_size[pair_group[talking]])
        return np.where(key >= 0, order[np.maximum(key, 0)], len(order) + np.arange(n_cells))

    def dp_reduce_seconds(self, world: int) -> float:
        """Seconds of the gradient all-reduce over ``world`` ranks (no overlap)."""
        nbytes = self.shape.parameters() * self.spec.grad_itemsize
        domains = self.topology.domains(np.array([0]), np.array([world - 1]))
        return float(self.comm.collective("all_reduce", nbytes, world, domains)[0])

    def _dp_seconds(self, run: MeshRun, backward_SMR: np.ndarray) -> np.ndarray:
        reduce = np.full(run.steps, self.dp_reduce_seconds(run.world))
        if not self.spec.overlap_dp or run.rounds == 0:
            return reduce
        return np.maximum(reduce - backward_SMR[:, -1, :].mean(axis=1), 0.0)

    def _optimizer_seconds(self) -> float:
        spec = self.spec
        nbytes = self.shape.parameters() * spec.optimizer_bytes_per_param / spec.optimizer_shards
        return nbytes / self.profile.memory_bandwidth


def _group_max(ids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``values`` replaced by the largest value among the entries sharing their id."""
    unique, inverse = np.unique(ids, return_inverse=True)
    best = np.full(len(unique), -np.inf)
    np.maximum.at(best, inverse, values)
    return best[inverse]
