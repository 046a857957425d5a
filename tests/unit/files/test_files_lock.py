"""``thdpack.files.lock``: one writer per folder; a second is refused with the error its owner names."""

from __future__ import annotations

import pickle
import re

import pytest

from thdpack.data import StoreBusyError
from thdpack.files.lock import FolderBusyError, FolderLock, lock_file_of, shared_lock


def test_a_second_writer_gets_a_folder_busy_error_naming_the_holder(tmp_path):
    folder = tmp_path / "out"
    with FolderLock(folder) as first:
        assert first.held and lock_file_of(folder) == tmp_path / ".out.lock"
        busy = rf"{folder} is being written by another process \(pid \d+ on .*; lock file {tmp_path / '.out.lock'}\)"
        with pytest.raises(FolderBusyError, match=busy + "; wait for it to finish, or write to another folder") as err:
            FolderLock(folder).acquire()
        assert err.value.folder == folder and err.value.problem.startswith("is being written by another process")
        with pytest.raises(FolderBusyError, match=busy + "; wait for it to finish, then run again"), shared_lock(folder):
            pass
    assert not lock_file_of(folder).exists()  # the holder removes its lock file
    with shared_lock(folder), FolderLock(folder):  # free again; a reader without a lock file takes none
        pass


def test_the_folders_owner_names_the_busy_error(tmp_path):
    folder = tmp_path / "store"
    with FolderLock(folder):
        with pytest.raises(StoreBusyError, match=re.escape(f"{folder} is being written")):
            FolderLock(folder, busy_error=StoreBusyError).acquire()
        with pytest.raises(StoreBusyError, match="then run again"), shared_lock(folder, busy_error=StoreBusyError):
            pass


def test_a_file_is_not_a_folder_to_lock(tmp_path):
    (tmp_path / "notes").write_text("mine")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'notes'} is an existing file, not a folder")):
        FolderLock(tmp_path / "notes").acquire()
    assert (tmp_path / "notes").read_text() == "mine" and not lock_file_of(tmp_path / "notes").exists()


def test_the_busy_error_pickles_with_its_parts(tmp_path):
    err = FolderBusyError(tmp_path, "is being written by another process (pid 7)", "wait")
    clone = pickle.loads(pickle.dumps(err))
    assert (clone.folder, clone.problem, clone.fix, str(clone)) == (err.folder, err.problem, err.fix, str(err))
