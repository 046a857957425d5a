"""The context-parallel layout, torch-free (numpy only): which token goes to which CP rank.

- ``rules``: the slot rule (a sequence split over ``g`` ranks takes a multiple of ``2g``, a whole
  one its length; Transformer Engine's ``2*cp_size`` is the rule with ``g = cp_size``), the CP
  size and group checks, the allowed groups, and ``IGNORE_INDEX``;
- ``entries``: ``CpLayout``, a batch's entries with their slots and groups, and its checks;
- ``placement``: ``CpPlacement`` / ``PackPlacement``, the plan's record of every sequence's group;
- ``ranks``: ``rank_indices``, the one map from a rank's local tokens to the global batch (TE's
  ``thd_get_partitioned_indices`` when every sequence is split over all ranks), and ``rank_parts``.

``thdpack.plan`` searches placements and ``thdpack.packing`` lays packs out by them;
``thdpack.thd`` and ``thdpack.cp`` read a batch's layout through this package.
"""

from __future__ import annotations

from thdpack.layout.entries import CpLayout
from thdpack.layout.placement import CpPlacement, PackPlacement
from thdpack.layout.ranks import rank_indices
from thdpack.layout.rules import slot_lengths

__all__ = ["CpLayout", "CpPlacement", "PackPlacement", "rank_indices", "slot_lengths"]
