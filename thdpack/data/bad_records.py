"""Bad records: what is wrong with one, and the policy that fails on it or skips and counts it.

A bad record cannot become a sample as written (a line that is not JSON, an empty chat, no
assistant turn, an unknown role, a mistyped field, another kind than the one set). Readers and
templates raise ``BadRecord`` naming the record and the reason; the pass's ``BadRecords`` policy
raises it (``"fail"``) or drops it, counts it per reason and logs it as a JSON line (``"skip"``).
A record of another kind than the one set names the kind to set, since skipping would drop every
record.

>>> bad = BadRecords("skip")
>>> bad.handle(BadRecord(RecordOrigin("chats.jsonl", line=2), "empty_conversation", "'conversations' is empty"))
>>> bad.counts, bad.total
({'empty_conversation': 1}, 1)
>>> BadRecords("fail").handle(BadRecord("record 0", "no_assistant_turn", "no assistant message"))
Traceback (most recent call last):
...
thdpack.data.bad_records.BadRecord: record 0: no assistant message; ...
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any, Literal, get_args

OnBadRecord = Literal["fail", "skip"]
ON_BAD_RECORD: tuple[str, ...] = get_args(OnBadRecord)
BadRecordReason = Literal[
    "malformed_json",
    "not_an_object",
    "unknown_kind",
    "wrong_kind",
    "missing_field",
    "wrong_type",
    "empty_conversation",
    "unknown_role",
    "no_assistant_turn",
    "chat_template_error",
]
BAD_RECORD_REASONS: tuple[str, ...] = get_args(BadRecordReason)
SKIP_HINT = (
    "pass on_bad_record='skip' (--on-bad-record skip) to skip such records; they are counted per reason "
    "and listed in skipped_records.jsonl"
)


class RecordOrigin(str):
    """Where a record is, as the text error messages use ("data.jsonl line 7"), with its parts.

    A ``str``, so it goes wherever an origin string goes; the skip log reads ``path``, ``line``,
    ``record`` (index in a JSON array) and ``row`` (parquet / datasets) from it.

    >>> origin = RecordOrigin("data.json", record=3, line=9)
    >>> str(origin), origin.fields()
    ('data.json record 3 (line 9)', {'path': 'data.json', 'line': 9, 'record': 3})
    """

    path: str
    line: int | None
    record: int | None
    row: int | None

    def __new__(
        cls, path: str | os.PathLike[str], *, line: int | None = None, record: int | None = None, row: int | None = None
    ) -> RecordOrigin:
        if record is not None:
            text = f"{path} record {record}" + (f" (line {line})" if line is not None else "")
        elif row is not None:
            text = f"{path} row {row}"
        elif line is not None:
            text = f"{path} line {line}"
        else:
            text = str(path)
        origin = super().__new__(cls, text)
        origin.path, origin.line, origin.record, origin.row = str(path), line, record, row
        return origin

    def fields(self) -> dict[str, Any]:
        """The known parts, for a JSON log line."""
        parts = {"path": self.path, "line": self.line, "record": self.record, "row": self.row}
        return {k: v for k, v in parts.items() if v is not None}


class BadRecord(ValueError):
    """A record that cannot become a sample: ``origin`` (where), ``reason`` (one of
    ``BAD_RECORD_REASONS``) and ``detail`` (what is wrong, with the offending value)."""

    def __init__(self, origin: str, reason: BadRecordReason, detail: str) -> None:
        if reason not in BAD_RECORD_REASONS:
            raise ValueError(f"unknown bad-record reason {reason!r}; use one of {list(BAD_RECORD_REASONS)}")
        self.origin = origin
        self.reason = reason
        self.detail = detail
        super().__init__(f"{origin}: {detail}")


class BadRecords:
    """One pass's bad-record policy (``"fail"`` or ``"skip"``) and what it skipped.

    ``log``: a file to write one JSON line per skipped record to, created (or emptied) at the
    first skip, so it exists exactly when something was skipped. Call ``close()`` (or use it as
    a context manager) to close it.
    """

    def __init__(self, policy: OnBadRecord = "fail", *, log: str | os.PathLike[str] | None = None) -> None:
        if policy not in ON_BAD_RECORD:
            raise ValueError(f"unknown on_bad_record {policy!r}; use one of {list(ON_BAD_RECORD)}")
        self.policy = policy
        self.counts: dict[str, int] = {}
        self.log_path = Path(log) if log is not None else None
        self._log: IO[str] | None = None

    @property
    def total(self) -> int:
        """Records skipped so far."""
        return sum(self.counts.values())

    def handle(self, err: BadRecord) -> None:
        """Raise ``err`` under ``"fail"`` (with a hint how to skip); count and log it under ``"skip"``."""
        if self.policy == "fail":
            # a record of another kind than the one set: its fix is the kind; skipping would drop them all
            hint = "" if err.reason == "wrong_kind" else f"; {SKIP_HINT}"
            raise BadRecord(err.origin, err.reason, f"{err.detail}{hint}") from err
        self.counts[err.reason] = self.counts.get(err.reason, 0) + 1
        if self.log_path is not None:
            if self._log is None:
                self._log = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115 (closed by close())
            origin = err.origin.fields() if isinstance(err.origin, RecordOrigin) else {}
            entry = {"origin": str(err.origin), **origin, "reason": err.reason, "message": err.detail}
            self._log.write(json.dumps(entry, ensure_ascii=False) + "\n")

    def summary(self) -> dict[str, Any]:
        """For manifests: ``{"policy", "total", "by_reason", "file"}``."""
        return {
            "policy": self.policy,
            "total": self.total,
            "by_reason": dict(sorted(self.counts.items())),
            "file": self.log_path.name if self.log_path is not None and self.total else None,
        }

    def __str__(self) -> str:
        if not self.counts:
            return f"0 bad records (on_bad_record={self.policy!r})"
        reasons = ", ".join(f"{reason} {n:,}" for reason, n in sorted(self.counts.items()))
        where = f"; listed in {self.log_path}" if self.log_path is not None else ""  # there is one skip at least
        return f"skipped {self.total:,} bad records ({reasons}){where}"

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> BadRecords:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
