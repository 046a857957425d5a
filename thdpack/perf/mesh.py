"""MeshRun: what every rank of a data x context parallel mesh runs in each training step.

A step is a sequence of micro-batch *rounds*; in a round, **groups** of consecutive ranks each
attend some sequences (**entries**) one way (``COMMS``): ``whole`` on one rank, ``ring`` or
``allgather`` in TE's dual-chunk layout over the group, or ``a2a`` (every sequence whole on every
rank for ``1/g`` of the heads); ``tokens`` holds what each rank's linear layers run on.
``placed_run`` builds a run from thdpack's placed packs, ``thdpack.perf.megatron`` from
Megatron-LM's schedulers.

Legend: ``G`` groups, ``E`` entries (sequences), ``P`` packs, ``S`` steps, ``M`` rounds, ``R`` ranks.

>>> run = placed_run(offsets=np.array([0, 2, 3]), lengths=np.array([100, 60, 30]), group_size=np.array([2, 1, 1]),
...                  group_start=np.array([0, 1, 0]), pack_step=np.array([0, 0]), pack_round=np.array([0, 0]),
...                  pack_dp=np.array([0, 1]), cp_size=2, dp_size=2, pack_size=256)
>>> run.group_first.tolist(), run.group_size.tolist(), [COMMS[c] for c in run.group_comm]
([1, 0, 2], [1, 2, 1], ['whole', 'ring', 'whole'])
>>> run.tokens[0, 0].tolist()    # every rank holds its budget, pack_size / cp_size
[128.0, 128.0, 128.0, 128.0]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

Comm = Literal["whole", "ring", "allgather", "a2a"]
COMMS: tuple[Comm, ...] = ("whole", "ring", "allgather", "a2a")


@dataclass(frozen=True, eq=False)
class MeshRun:
    """The groups, entries and held tokens of every step (see the module docstring)."""

    world: int
    """Ranks of the mesh (dp x cp)."""
    steps: int
    """Optimizer steps."""
    rounds: int
    """Micro-batch rounds per step (a rank without work in a round idles through it)."""
    group_step: np.ndarray
    """(G,) int64 step of each group."""
    group_round: np.ndarray
    """(G,) int64 round of each group."""
    group_first: np.ndarray
    """(G,) int64 first rank of each group (its ranks: ``first .. first + size - 1``)."""
    group_size: np.ndarray
    """(G,) int64 ranks of each group."""
    group_comm: np.ndarray
    """(G,) int64 index into ``COMMS``; ``whole`` groups have one rank."""
    entry_group: np.ndarray
    """(E,) int64 the group of each entry."""
    entry_length: np.ndarray
    """(E,) int64 tokens of each entry the kernel runs on (a split one is padded to ``2g`` more)."""
    tokens: np.ndarray
    """(S, M, R) float64 tokens each rank's linear layers run on in each round."""

    def __post_init__(self) -> None:
        for name in ("group_step", "group_round", "group_first", "group_size", "group_comm", "entry_group",
                     "entry_length"):  # fmt: skip
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.int64))
        object.__setattr__(self, "tokens", np.asarray(self.tokens, dtype=np.float64))
        g = len(self.group_size)
        if any(len(getattr(self, n)) != g for n in ("group_step", "group_round", "group_first", "group_comm")):
            raise ValueError("every group array needs one value per group")
        if self.tokens.shape != (self.steps, self.rounds, self.world):
            raise ValueError(f"tokens must be (steps, rounds, world) = {(self.steps, self.rounds, self.world)}, "
                             f"got {self.tokens.shape}")  # fmt: skip
        if g and ((self.group_first < 0).any() or (self.group_first + self.group_size > self.world).any()):
            raise ValueError(f"a group reaches past rank {self.world - 1} of the mesh")
        whole = self.group_comm == COMMS.index("whole")
        if (self.group_size[whole] != 1).any() or (self.group_size < 1).any():
            raise ValueError("a whole group has exactly one rank; every group has at least one")
        if len(self.entry_group) != len(self.entry_length):
            raise ValueError("entry_group and entry_length need one value per entry")
        if len(self.entry_group) and (self.entry_group.min() < 0 or self.entry_group.max() >= g):
            raise ValueError(f"an entry names a group outside 0..{g - 1}")

    def cells(self) -> np.ndarray:
        """(G,) int64 flat (step, round, first rank) cell of each group in ``tokens``."""
        return (self.group_step * self.rounds + self.group_round) * self.world + self.group_first


def placed_run(
    *,
    offsets: np.ndarray,
    lengths: np.ndarray,
    group_size: np.ndarray,
    group_start: np.ndarray,
    pack_step: np.ndarray,
    pack_round: np.ndarray,
    pack_dp: np.ndarray,
    cp_size: int,
    dp_size: int,
    pack_size: int,
    split_comm: Comm = "ring",
    pack_a2a: np.ndarray | None = None,
) -> MeshRun:
    """The run of packs placed on CP groups.

    Args:
        offsets: (P+1,) pack boundaries over the entries (a ``CpPlacement``'s arrays, as the next three).
        lengths: (E,) every entry's tokens.
        group_size: (E,) ranks of each entry's group (1: whole on one rank).
        group_start: (E,) the group's first rank within the pack's ``cp_size`` ranks.
        pack_step: (P,) the step each pack runs in.
        pack_round: (P,) its micro-batch round within the step.
        pack_dp: (P,) its data-parallel rank (mesh ranks ``dp * cp_size ..``).
        cp_size: ranks per CP group.
        dp_size: data-parallel ranks.
        pack_size: tokens per pack: every rank of a pack holds ``pack_size / cp_size`` (thdpack pads
            each pack to its size).
        split_comm: how split entries communicate: ``"ring"`` or ``"allgather"``; ``"a2a"``: every
            pack is one all-to-all group of its raw lengths, the placement's groups ignored.
        pack_a2a: (P,) bool, the packs attended by all-to-all (``cp_placement="auto"``), or None.

    Returns:
        The ``MeshRun``: per step and round, every group's ranks, way and entries, and every rank's tokens.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    pack_E = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    steps = int(np.max(pack_step)) + 1 if len(pack_step) else 0
    rounds = int(np.max(pack_round)) + 1 if len(pack_round) else 0
    world = dp_size * cp_size
    base_P = np.asarray(pack_dp, dtype=np.int64) * cp_size
    a2a_P = np.full(len(offsets) - 1, split_comm == "a2a") if pack_a2a is None or split_comm == "a2a" else (
        np.asarray(pack_a2a, dtype=bool))  # fmt: skip
    a2a_E = a2a_P[pack_E]
    size_E = np.where(a2a_E, cp_size, np.asarray(group_size, dtype=np.int64))
    start_E = np.where(a2a_E, 0, np.asarray(group_start, dtype=np.int64))
    key = (pack_E * (cp_size + 1) + size_E) * cp_size + start_E
    unique, entry_group = np.unique(key, return_inverse=True)
    pack_G, rest = np.divmod(unique, (cp_size + 1) * cp_size)
    size_G, start_G = np.divmod(rest, cp_size)
    split_G = np.where(a2a_P[pack_G], COMMS.index("a2a"), COMMS.index("ring" if split_comm == "a2a" else split_comm))
    comm_G = np.where(size_G == 1, COMMS.index("whole"), split_G)
    tokens = np.zeros((steps, rounds, world))
    packs = np.arange(len(offsets) - 1)
    cells = (np.asarray(pack_step)[packs] * rounds + np.asarray(pack_round)[packs]) * world + base_P[packs]
    flat = tokens.reshape(-1)
    for r in range(cp_size):
        flat[cells + r] = pack_size / cp_size
    return MeshRun(
        world=world,
        steps=steps,
        rounds=rounds,
        group_step=np.asarray(pack_step)[pack_G],
        group_round=np.asarray(pack_round)[pack_G],
        group_first=base_P[pack_G] + start_G,
        group_size=size_G,
        group_comm=comm_G,
        entry_group=entry_group.reshape(-1),
        entry_length=np.asarray(lengths, dtype=np.int64),
        tokens=tokens,
    )
