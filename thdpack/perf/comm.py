"""Communication times: where ranks sit, and what a send or a collective between them costs.

Ranks fill nodes in order; a group inside one NVLink domain (a node, or a GB200 NVL72 rack) talks
over NVLink, one that spans domains at the network's per-GPU bandwidth. Collectives follow
nccl-tests' bytes and bus factors and NCCL's ring latency model (docs/design/step_model.md,
"Communication").

Legend: ``G`` groups.

>>> from thdpack.perf.machine import load_profile
>>> comm = Comm(load_profile("h100_sxm"), Topology(gpus_per_node=8, nvlink_domain=8))
>>> inside, across = comm.collective("all_reduce", 1e9, 8, np.array([1, 2]))
>>> round(float(inside) * 1e3, 2), round(float(across) * 1e3, 2)   # 1 GB over 8 GPUs: NVLink, then 2 nodes
(3.94, 35.08)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from thdpack.perf.machine import MachineProfile


@dataclass(frozen=True)
class Topology:
    """Where ranks sit: ``gpus_per_node`` per node, ``nvlink_domain`` per NVLink fabric."""

    gpus_per_node: int
    nvlink_domain: int

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.nvlink_domain % self.gpus_per_node:
            raise ValueError(
                f"nvlink_domain={self.nvlink_domain} must be a multiple of gpus_per_node={self.gpus_per_node} >= 1"
            )

    @classmethod
    def of(cls, profile: MachineProfile, gpus_per_node: int | None = None) -> Topology:
        """The profile's topology, with another node size when given: a fabric that spans nodes
        (GB200 NVL72) keeps its domain, a node's own NVLink shrinks with the node."""
        if gpus_per_node is None or gpus_per_node == profile.gpus_per_node:
            return cls(profile.gpus_per_node, profile.nvlink_domain)
        spans_nodes = profile.nvlink_domain > profile.gpus_per_node
        domain = profile.nvlink_domain if spans_nodes and profile.nvlink_domain % gpus_per_node == 0 else gpus_per_node
        return cls(gpus_per_node, domain)

    def domains(self, first_rank: np.ndarray, last_rank: np.ndarray) -> np.ndarray:
        """(G,) NVLink domains a group of ranks from ``first_rank`` to ``last_rank`` touches."""
        return np.asarray(last_rank) // self.nvlink_domain - np.asarray(first_rank) // self.nvlink_domain + 1


class Comm:
    """Seconds of sends and collectives on one machine and topology."""

    def __init__(self, profile: MachineProfile, topology: Topology) -> None:
        self.profile, self.topology = profile, topology

    def _links(self, domains: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(bandwidth, hop latency) of groups touching ``domains`` NVLink domains."""
        spans = np.asarray(domains) > 1
        p = self.profile
        return (
            np.where(spans, p.inter_node.bandwidth, p.intra_node.bandwidth),
            np.where(spans, p.inter_node.latency_s, p.intra_node.latency_s),
        )

    def send(self, nbytes: np.ndarray, domains: np.ndarray) -> np.ndarray:
        """Seconds of one ring step's send of ``nbytes`` to the next rank of a group."""
        bandwidth, hop = self._links(domains)
        return self.profile.collective_base_latency_s + hop + np.asarray(nbytes, dtype=np.float64) / bandwidth

    def collective(self, kind: str, nbytes: np.ndarray | float, n: np.ndarray | int, domains: np.ndarray) -> np.ndarray:
        """Seconds of collective ``kind`` (``COLLECTIVES``) over ``n`` ranks on a buffer of ``nbytes``
        per rank; 0 where ``n == 1``."""
        n = np.asarray(n, dtype=np.float64)
        domains = np.asarray(domains, dtype=np.float64)
        bandwidth, _ = self._links(domains)
        p = self.profile
        steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
        between = np.where(domains > 1, (2 if kind == "all_reduce" else 1) * (domains - 1), 0.0)
        hops = (steps - between) * p.intra_node.latency_s + between * p.inter_node.latency_s
        moved = p.collective_factors[kind] * (n - 1) / np.maximum(n, 1) * np.asarray(nbytes, dtype=np.float64)
        return np.where(n > 1, p.collective_base_latency_s + hops + moved / bandwidth, 0.0)
