"""Optimizer steps cut from the stream of every epoch's packs, dealt to the data-parallel ranks.

Every rank plans the same epochs (:class:`thdpack.packing.dealing.Epochs`), so the global order of
packs needs no communication. Each step takes the next ``world_size x micro_batches x
packs_per_micro_batch`` packs of that order (an epoch's last packs and the next epoch's first may
share a step: no pack is dropped or repeated), deals them to the ranks with balanced work
(:func:`thdpack.packing.dealing.deal`) and builds only this rank's packs. Each epoch is planned
once, also when a step straddles two. The stream's state is two integers, so a resumed run
continues with exactly the packs the uninterrupted run would have seen.

>>> from thdpack.packing import PackedDataset
>>> samples = [{"input_ids": list(range(1, n + 1))} for n in (3, 5, 2, 6, 4, 7)]
>>> dataset = PackedDataset(samples, 8, dp_rank=1, dp_size=2, seed=0)   # DP rank 1 of 2
>>> step = dataset.step_stream(micro_batches=1, packs_per_micro_batch=1).next_step()
>>> step.tokens, step.capacity                    # the step's 2 packs (both ranks)
(15, 16)
>>> [pack["seq_lens"].tolist() for pack in step.micro_batches[0]]   # rank 1's pack
[[6, 2]]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from thdpack._settings import check_int
from thdpack.packing.dealing import Balance, Epochs, Imbalance, deal, imbalance, pack_costs
from thdpack.packing.packer import Pack
from thdpack.packing.saved_settings import check_saved_settings


@dataclass(frozen=True)
class Step:
    """One optimizer step: this rank's micro-batches and the step's global counts."""

    epoch: int
    """Epoch of the step's first pack."""
    micro_batches: list[list[Pack]]
    """This rank's packs, ``micro_batches x packs_per_micro_batch``."""
    tokens: int
    """Real tokens of the whole step (all ranks)."""
    capacity: int
    """Token slots of the whole step (packs x pack_size)."""
    sequences: int
    """Sequences (pieces) of the whole step."""
    imbalance: Imbalance
    """max / mean work over the ranks."""


class StepStream:
    """The steps of ``epochs`` for data-parallel ``rank`` of ``world_size``; stateful for exact resume.

    ``build(epoch, index)`` makes the pack at ``index`` of epoch ``epoch``'s order (the packs of
    this rank only are built); ``balance`` says how a step's packs are dealt (``dealing.pack_costs``).
    """

    def __init__(
        self,
        epochs: Epochs,
        build: Callable[[int, int], Pack],
        *,
        rank: int,
        world_size: int,
        balance: Balance,
        micro_batches: int,
        packs_per_micro_batch: int,
    ) -> None:
        self.micro_batches = check_int("micro_batches", micro_batches, 1)
        self.packs_per_micro_batch = check_int("packs_per_micro_batch", packs_per_micro_batch, 1)
        self.epochs, self.build, self.rank, self.world_size, self.balance = epochs, build, rank, world_size, balance
        self.packs_per_step = world_size * self.micro_batches * self.packs_per_micro_batch
        self.epoch = 0
        self.position = 0  # next pack of `epoch`'s whole order

    def _take(self) -> list[tuple[int, int]]:
        """The next step's (epoch, pack index) references, advancing the stream."""
        refs: list[tuple[int, int]] = []
        while len(refs) < self.packs_per_step:
            available = len(self.epochs[self.epoch]) - self.position
            take = min(self.packs_per_step - len(refs), available)
            refs += [(self.epoch, self.position + i) for i in range(take)]
            self.position += take
            if take == available:
                self.epoch, self.position = self.epoch + 1, 0
        return refs

    def next_step(self) -> Step:
        refs = self._take()
        lengths = [self.epochs[epoch].segments(index)[2] for epoch, index in refs]
        hands = deal(pack_costs(lengths, self.balance), self.world_size)
        mine = sorted(hands[self.rank], key=lambda k: refs[k])  # build epoch by epoch
        packs = [self.build(*refs[k]) for k in mine]
        per_micro = self.packs_per_micro_batch
        return Step(
            epoch=refs[0][0],
            micro_batches=[packs[m * per_micro : (m + 1) * per_micro] for m in range(self.micro_batches)],
            tokens=int(sum(int(x.sum()) for x in lengths)),
            capacity=self.packs_per_step * self.epochs.config.pack_size,
            sequences=int(sum(len(x) for x in lengths)),
            imbalance=imbalance(lengths, hands),
        )

    def fingerprint(self) -> dict[str, Any]:
        """The settings that define the stream: the same on every rank (the rank is not one)."""
        return {"packs_per_step": self.packs_per_step, "balance": self.balance, **self.epochs.fingerprint()}

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands, plus the settings that define it (checked on load)."""
        return {"epoch": self.epoch, "position": self.position, **self.fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_saved_settings("StepStream", state, self.fingerprint())
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
