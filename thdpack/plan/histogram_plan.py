"""HistogramPlan: packs as templates x counts, the form the histogram planners work in.

A pack's content is a path in a tree of *nodes*: node ``t`` adds ``node_reps[t]`` items of size
``node_size[t]`` to the content of ``node_parent[t]`` (node 0 is the empty pack). A *group* is
``group_count[g]`` identical packs whose content ends at node ``group_node[g]``.

>>> hp = HistogramPlan(capacity=10, node_parent=np.array([-1, 0, 1]), node_size=np.array([0, 5, 3]),
...                    node_reps=np.array([0, 1, 1]), group_node=np.array([2, 1]), group_count=np.array([2, 1]))
>>> hp.num_packs, hp.pack_contents(0), hp.node_load().tolist()
(3, [(5, 1), (3, 1)], [0, 5, 8])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class HistogramPlan:
    """Packs as templates x counts. Sizes are in slot units (tokens / ``unit``)."""

    capacity: int
    """Pack capacity in slot units."""
    node_parent: np.ndarray
    """(M,) int64: parent node; -1 for node 0, the empty pack."""
    node_size: np.ndarray
    """(M,) int64: size (slot units) of the items a node adds."""
    node_reps: np.ndarray
    """(M,) int64: how many items of ``node_size`` a node adds."""
    group_node: np.ndarray
    """(G,) int64: the content node shared by every pack of a group."""
    group_count: np.ndarray
    """(G,) int64: packs in the group."""
    fit_packs: int | None = None
    """Packs of the decreasing fit alone when the improvement phase (``thdpack.plan.improve``)
    ran and saved some; None otherwise."""

    @property
    def num_packs(self) -> int:
        return int(self.group_count.sum())

    def pack_contents(self, group: int) -> list[tuple[int, int]]:
        """[(size, reps), ...] of one pack of ``group``, in placement order."""
        out = []
        node = int(self.group_node[group])
        while node > 0:
            out.append((int(self.node_size[node]), int(self.node_reps[node])))
            node = int(self.node_parent[node])
        return out[::-1]

    def node_items(self) -> np.ndarray:
        """(M,) int64: items in a pack whose content ends at each node."""
        return path_sums(self.node_parent, self.node_reps)

    def node_load(self) -> np.ndarray:
        """(M,) int64: slot units used by a pack whose content ends at each node."""
        return path_sums(self.node_parent, self.node_reps * self.node_size)


def path_sums(parent: np.ndarray, value: np.ndarray) -> np.ndarray:
    """(M,) sum of ``value`` over each node's path to the root (node 0, value 0), by pointer doubling.

    >>> path_sums(np.array([-1, 0, 1, 1, 0]), np.array([0, 2, 3, 4, 5])).tolist()
    [0, 2, 5, 6, 5]
    """
    up = parent.copy()
    up[0] = 0  # the root points to itself and adds nothing
    total = value.copy()
    total[0] = 0
    while np.any(up):
        total = total + total[up]
        up = up[up]
    return total
