"""The exceptions of the NeMo drop-ins: thdpack's ``ValueError`` and, at once, the class NeMo raises.

A NeMo AutoModel caller catches what NeMo raises (``except KeyError`` around
``make_cp_batch_for_te``, ``except RuntimeError`` around the collater); thdpack reports the same
faults as a ``ValueError`` that says what is wrong and how to fix it. These classes are both, so
either ``except`` clause catches them, and their message reads as written (``KeyError`` alone
would show it quoted).

>>> try:
...     raise NemoKeyError("batch['seq_lens'] is missing")
... except KeyError as err:
...     print(err, isinstance(err, ValueError))
batch['seq_lens'] is missing True
"""

from __future__ import annotations


class NemoKeyError(ValueError, KeyError):
    """A key NeMo reads with ``batch[key]`` is missing: NeMo raises ``KeyError``, thdpack ``ValueError``."""

    def __str__(self) -> str:
        return ValueError.__str__(self)


class NemoRuntimeError(ValueError, RuntimeError):
    """A fault where NeMo's torch call raises ``RuntimeError`` (``torch.stack`` of packs of different
    lengths), and thdpack a ``ValueError`` first."""
