"""``thdpack.files.publish.disk_full_note``: a failed write is put down to a full disk when it was one
(issue 17: "[Errno 28] No space left on device" named no path; torch's "unexpected pos" said
nothing of the disk). ``/dev/full`` answers every write with ENOSPC, as a full disk does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from thdpack.files.publish import disk_full_note, wrapped_errors

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full (Linux only)")


def enospc() -> OSError:
    with pytest.raises(OSError) as caught, open("/dev/full", "wb", buffering=0) as f:
        f.write(b"x")
    return caught.value


def test_enospc_is_a_full_disk_named_by_the_folder(tmp_path):
    note = disk_full_note(tmp_path, enospc(), by_free_space=False)
    assert note is not None and note.startswith(f"the disk that holds {tmp_path} ran out of space (")
    assert disk_full_note(tmp_path, FileNotFoundError(2, "No such file"), by_free_space=False) is None


def test_an_enospc_wrapped_by_another_error_is_found(tmp_path):
    """torch.distributed.checkpoint raises a CheckpointException holding each rank's failure."""
    cause = enospc()

    class Wrapper(BaseException):
        def __init__(self, failure: BaseException) -> None:
            self.failures = {0: (failure, None)}  # (exception, its stack), as torch keeps them

    try:
        raise RuntimeError("saving failed") from cause
    except RuntimeError as err:
        assert disk_full_note(tmp_path, err, by_free_space=False) is not None
    inner = RuntimeError("unexpected pos 704 vs 598")
    inner.__context__ = cause
    wrapper = Wrapper(inner)
    assert [type(e).__name__ for e in wrapped_errors(wrapper)] == ["Wrapper", "RuntimeError", "OSError"]
    assert disk_full_note(Path(tmp_path), wrapper, by_free_space=False) is not None
