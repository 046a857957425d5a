"""Stream the records of a JSON array file (``[{...}, {...}]``) with bounded memory.

``json.load`` holds the whole file and every parsed record at once; this reader keeps one
read-ahead window and yields records one by one, with the record index and line number for
error messages.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from typing import IO, Any

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_CHUNK_CHARS = 1 << 20


class _Window:
    """A sliding window of decoded text over a binary stream; tracks the line of ``pos``."""

    def __init__(self, stream: IO[bytes], name: str, errors: str) -> None:
        self.stream = stream
        self.name = name
        self.decoder = codecs.getincrementaldecoder("utf-8-sig")(errors=errors)  # drops a leading BOM
        self.buf = ""
        self.pos = 0
        self.line = 1
        self.eof = False

    def fill(self, at_least: int = _CHUNK_CHARS) -> bool:
        """Read at least ``at_least`` more bytes (or up to EOF); False when nothing was left."""
        if self.eof:
            return False
        raw = self.stream.read(at_least)
        try:
            text = self.decoder.decode(raw, final=not raw)
        except UnicodeDecodeError as err:
            raise ValueError(
                f"{self.name} near line {self.line}: not valid UTF-8 ({err.reason}); re-encode the file as UTF-8"
            ) from err
        if not raw:
            self.eof = True
        elif self.pos > _CHUNK_CHARS:  # drop the consumed prefix so memory stays bounded
            self.buf = self.buf[self.pos :]
            self.pos = 0
        self.buf += text
        return bool(raw)

    def advance(self, end: int) -> None:
        self.line += self.buf.count("\n", self.pos, end)
        self.pos = end

    def skip_whitespace(self) -> str:
        """Move past whitespace; return the next character ('' at end of file)."""
        while True:
            self.advance(_WHITESPACE.match(self.buf, self.pos).end())
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.fill():
                return ""


def iter_json_array(stream: IO[bytes], name: str, *, errors: str = "strict") -> Iterator[tuple[int, int, Any]]:
    """Yield ``(record_index, line, record)`` for each element of a top-level JSON array.

    Raises ``ValueError`` naming ``name``, the record index and the line for a file that is not
    an array, a malformed record, or bytes that are not UTF-8 (with ``errors="strict"``).
    """
    window = _Window(stream, name, errors)
    decoder = json.JSONDecoder()
    first = window.skip_whitespace()
    if first != "[":
        found = repr(first) if first else "an empty file"
        raise ValueError(
            f"{name}: expected a JSON array of records starting with '[', found {found}; "
            "for one JSON object per line use format='jsonl'"
        )
    window.advance(window.pos + 1)
    index = 0
    while True:
        nxt = window.skip_whitespace()
        if nxt == "]" and index == 0:
            window.advance(window.pos + 1)
            break
        if not nxt:
            raise ValueError(f"{name}: the JSON array is not closed (file ends after record {index - 1})")
        read_size = _CHUNK_CHARS
        while True:
            try:
                record, end = decoder.raw_decode(window.buf, window.pos)
                break
            except json.JSONDecodeError as err:
                # a record cut by the read-ahead window fails like a malformed one: read more first
                if window.fill(read_size):
                    read_size *= 2
                    continue
                err_line = window.line + window.buf.count("\n", window.pos, err.pos)
                raise ValueError(f"{name} record {index} (line {err_line}): malformed JSON: {err.msg}") from err
        line = window.line
        window.advance(end)
        yield index, line, record
        index += 1
        sep = window.skip_whitespace()
        if sep == "]":
            window.advance(window.pos + 1)
            break
        if sep != ",":
            found = repr(sep) if sep else "the end of the file"
            raise ValueError(f"{name} line {window.line}: expected ',' or ']' after record {index - 1}, found {found}")
        window.advance(window.pos + 1)
    trailing = window.skip_whitespace()
    if trailing:
        raise ValueError(f"{name} line {window.line}: unexpected {trailing!r} after the closing ']'")
