"""``tlm_model._folder.Folder``: a file that is absent from the version of the folder it opened means "read the
folder again" once that version was replaced or removed, and "no such file" only while it is still the folder's.

(The module is private: the import-based test selection of ``tools/mutate.py`` does not pick this file for it; pass
``--tests packages/tlm-model/tests/test_folder.py``.)"""

import os

import pytest

from tlm_model._folder import Folder, Retired


@pytest.fixture
def folder(tmp_path):
    path = tmp_path / "hf"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def test_a_file_absent_from_the_current_folder_is_none(folder):
    with Folder(folder) as opened:
        assert opened.open("model.safetensors") is None
        with opened.open("config.json") as handle:
            assert handle.read() == b"{}"


def test_a_file_absent_from_a_replaced_folder_means_read_again(folder):
    with Folder(folder) as opened:
        os.rename(folder, folder.with_name("old"))  # the swap of tlm_core.atomic.replace_dir: the old one still exists
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"new")
        with pytest.raises(Retired):
            opened.open("model.safetensors")


def test_a_file_absent_from_a_removed_folder_means_read_again(folder):
    with Folder(folder) as opened:
        (folder / "config.json").unlink()
        folder.rmdir()
        with pytest.raises(Retired):
            opened.open("config.json")
