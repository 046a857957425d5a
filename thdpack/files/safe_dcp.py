"""``torch.distributed.checkpoint.load`` without running code from the checkpoint.

By itself DCP reads ``.metadata`` with a bare ``pickle.load`` and a state's non-tensor values (an
optimizer's ``lr``, ``betas``) with ``torch.load(weights_only=False)``. ``load_dcp`` reads the first
through an unpickler that resolves only the checkpoint metadata's own classes
(``DCP_METADATA_GLOBALS``), the second weights-only; a refusal raises
``thdpack.files.safe_load.UnsafeFileError`` naming the file.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from thdpack.files.publish import wrapped_errors
from thdpack.files.safe_load import UnsafeFileError, refused_global

DCP_METADATA = ".metadata"
"""The file ``torch.distributed.checkpoint`` writes its (pickled) index into."""
DCP_METADATA_GLOBALS = frozenset(
    {
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in (
                "Metadata",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "MetadataIndex",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("collections", "OrderedDict"),
    }
)
"""What a DCP ``.metadata`` may name (besides ``torch.<dtype>``): data classes whose construction
runs no code of the file's choosing."""


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves ``DCP_METADATA_GLOBALS`` and torch's dtypes; any other global is refused."""

    def __init__(self, file: io.BufferedIOBase, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeFileError(self.path, f"the global {module}.{name}")


def read_dcp_metadata(path: Path) -> Metadata:
    """The ``Metadata`` pickled in ``path`` (a DCP ``.metadata``), unpickled without running code."""
    with path.open("rb") as f:
        metadata = _MetadataUnpickler(f, path).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeFileError(path, f"a {type(metadata).__name__} where a checkpoint's Metadata belongs")
    return metadata


class SafeDCPReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read by ``read_dcp_metadata``, on construction: a refusal
    raises here, not inside ``dcp.load`` (which would catch it and try per-rank metadata files)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self.metadata = read_dcp_metadata(Path(path) / DCP_METADATA)

    def read_metadata(self) -> Metadata:  # type: ignore[override]
        if getattr(self.metadata, "storage_meta", None) is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        return self.metadata


class SafeDCPPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that refuses a non-tensor value holding anything but plain values.

    The bytes are loaded weights-only first; only bytes that pass reach torch's own loader.
    """

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        data = value.read()
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as err:
            asked = f"{refused_global(err)} in the value {read_item.dest_index.fqn!r}"
            raise UnsafeFileError(self.folder, asked) from None
        super().load_bytes(read_item, io.BytesIO(data))


def load_dcp(state: dict[str, Any], folder: Path) -> None:
    """``torch.distributed.checkpoint.load(state)`` from ``folder`` through ``SafeDCPReader`` and
    ``SafeDCPPlanner`` (collective when a process group exists); a refusal raises ``UnsafeFileError``
    itself, not the ``CheckpointException`` that DCP wraps a rank's error in."""
    try:
        dcp.load(state, storage_reader=SafeDCPReader(folder), planner=SafeDCPPlanner(folder))
    except CheckpointException as err:
        refused = next((e for e in wrapped_errors(err) if isinstance(e, UnsafeFileError)), None)
        if refused is None:
            raise
        raise refused from None
