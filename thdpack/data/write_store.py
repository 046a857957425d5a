"""Read inputs, tokenize them and write a token store (the library half of ``thdpack prepare``).

``write_token_store`` is what ``thdpack prepare`` and the trainer's token cache both call: one
pass, bounded memory. What a stage skips is counted in ``manifest.json`` and printed; bad records
stop the pass naming the file and line, or with ``on_bad_record="skip"`` are counted and listed
in ``skipped_records.jsonl``.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from thdpack.data._progress import progress_bar
from thdpack.data.bad_records import BadRecords
from thdpack.data.encode import SampleEncoder, TokenizeConfig, record_batches
from thdpack.data.prepared_plan import PLAN_FILE
from thdpack.data.sources import Source, SourceConfig
from thdpack.data.store import TokenStore, TokenStoreWriter
from thdpack.data.tokenizer import load_tokenizer
from thdpack.files.lock import FolderLock

SKIPPED_FILE = "skipped_records.jsonl"


class NoSamplesError(ValueError):
    """The inputs gave no sample to store. ``str()`` adds the fix in the library's terms; a front end
    (``thdpack prepare``, the trainer) puts ``summary`` into its own words, naming its own settings."""

    def __init__(self, summary: str) -> None:
        self.summary = summary
        super().__init__(f"{summary}; check the inputs, and TokenizeConfig.kind / text_key")


def write_token_store(
    inputs: list[str],
    out: Path,
    *,
    tokenizer: str = "gpt2",
    source_config: SourceConfig | None = None,
    tokenize_config: TokenizeConfig | None = None,
    sample_format: str = "labels",
    limit: int | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    verbose: bool = True,
    lock: FolderLock | None = None,
) -> TokenStore:
    """Read ``inputs``, tokenize them and write a token store in ``out``; return it opened.

    The shared first half of ``thdpack prepare`` and of the trainer's data setup. Records and
    tokens that a stage skips are counted in the store's ``manifest.json`` and printed; bad
    records follow ``tokenize_config.on_bad_record`` (skipped ones are listed in
    ``out/skipped_records.jsonl``). ``lock``: ``out``'s ``FolderLock``, held by the caller (else
    the writer takes it).
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    source_config = source_config or SourceConfig()
    tokenize_config = tokenize_config or TokenizeConfig()
    skip = tokenize_config.on_bad_record == "skip"
    # one policy and tally for the whole pass: sources skip lines that are not JSON, the encoder the rest
    bad_records = BadRecords(tokenize_config.on_bad_record, log=out / SKIPPED_FILE if skip else None)
    sources = [Source(path, source_config, bad_records=bad_records) for path in inputs]
    encoder = SampleEncoder(load_tokenizer(tokenizer), tokenize_config, bad_records=bad_records)
    start = time.perf_counter()
    writer = TokenStoreWriter(
        out,
        tokenizer=encoder.tokenizer,
        sample_format=sample_format,
        source=[s.describe() for s in sources],
        overwrite=overwrite,
        lock=lock,
    )
    # an older plan or skip list must never sit next to a new store
    (out / PLAN_FILE).unlink(missing_ok=True)
    (out / SKIPPED_FILE).unlink(missing_ok=True)
    with writer, bad_records:
        bar = progress_bar(total=limit, desc="tokenize", unit="rec", enabled=progress)

        def read() -> Iterator[tuple[list[dict[str, Any]], list[str]]]:
            for batch in record_batches(_records(sources, limit), tokenize_config, lambda item: item[1]):
                bar.update(len(batch))
                yield [record for _, record in batch], [origin for origin, _ in batch]

        try:
            for samples in encoder.encode_stream(read()):
                writer.add_all(samples)
                bar.set_postfix_str(f"{writer.num_tokens:,} tokens")
        finally:
            bar.close()
        if writer.num_samples == 0:
            raise NoSamplesError(f"no samples to store: {encoder.report}; {bad_records}")
        seconds = time.perf_counter() - start
        template = encoder.chat_template
        writer.close(
            extra={
                "prepare": {
                    "inputs": [{**s.describe(), **dataclasses.asdict(s.report)} for s in sources],
                    "limit": limit,
                    "tokenize": {**dataclasses.asdict(tokenize_config), "eos_id": encoder.eos_id},
                    "tokenize_report": dataclasses.asdict(encoder.report),
                    "chat_template": {"source": template.source, "sha256": template.sha256} if template else None,
                    "seconds": round(seconds, 3),
                },
                "skipped_records": bad_records.summary(),
            }
        )
    if verbose:
        _print_reading(sources, encoder, writer, seconds, limit)
    return TokenStore(out)


def _records(sources: list[Source], limit: int | None) -> Iterator[tuple[str, dict[str, Any]]]:
    records = itertools.chain.from_iterable(s.records_with_origin() for s in sources)
    return itertools.islice(records, limit)


def _print_reading(
    sources: list[Source], encoder: SampleEncoder, writer: TokenStoreWriter, seconds: float, limit: int | None
) -> None:
    for source in sources:
        print(f"read {source.describe()['path']} ({source.format}): {source.report}")
    if limit is not None:
        print(f"stopped after the first {limit:,} records (--limit)")
    report = encoder.report
    print(f"tokenized ({encoder.tokenizer.name}): {report}")
    if encoder.chat_template is not None and report.chat_template:
        print(f"chat records rendered with the chat template of {encoder.chat_template.source}")
    if encoder.bad_records.policy == "skip":
        print(str(encoder.bad_records))
    print(
        f"stored {writer.num_samples:,} samples, {writer.num_tokens:,} tokens ({writer.dtype.name}) in "
        f"{seconds:.1f} s: {report.records / seconds:,.0f} records/s, "
        f"{writer.num_tokens / seconds:,.0f} tokens/s"
    )
