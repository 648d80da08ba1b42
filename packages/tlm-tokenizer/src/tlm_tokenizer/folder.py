"""A tokenizer folder on disk: written as one unit, read as one version, never over a user's files.

``write_folder`` builds the new folder under a temporary name and swaps it in with
``tlm_core.atomic.replace_dir`` (on Linux one ``renameat2`` exchange), so a reader, or a process
killed at any moment, finds the old complete folder or the new one. ``read_folder`` opens every file
relative to one handle on the folder (``tlm_core.atomic.read_dir_files``), so a folder replaced
while it is read is read again rather than mixed.

Where the file system cannot exchange two folders, ``replace_dir`` moves the old folder aside to
``.<name>.<pid>-<random>.old`` and then renames the new one in: between the two renames the folder
is missing, and a writer killed there leaves the old tokenizer only under that hidden name.
``read_folder`` then reads that copy, so a tokenizer that was saved never fails to load.

``write_folder`` also writes ``tlm_sha256.json``, the SHA-256 of each file, and ``read_folder`` checks the files it
reads against it (a ValueError names the damaged file); a folder without it is read as it is.
"""

import hashlib
import json
import os
import re
from pathlib import Path

from tlm_core.atomic import read_dir_files, remove_leftovers, replace_dir

__all__ = ["DIGESTS", "READ_NAMES", "TOKENIZER_FILES", "read_folder", "write_folder"]

#: The SHA-256 of each file ``write_folder`` wrote, checked by ``read_folder``: a later run trusts these files.
DIGESTS = "tlm_sha256.json"

# What may be in a folder that save() replaces: the files tlm writes and those HF's save_pretrained
# writes for a tokenizer. Anything else means the folder is not only a tokenizer.
TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
        DIGESTS,
    }
)
READ_NAMES = ("tokenizer.json",)
_RETRIES = 20  # attempts at a folder that is missing: a racing writer puts it back within one


def write_folder(directory: str | os.PathLike[str], files: dict[str, bytes]) -> Path:
    """Replace the folder ``directory`` by one holding exactly ``files`` (name -> bytes), as one unit.

    Refuses (ValueError) a path that is a file, or a folder holding anything but tokenizer files, so
    that saving into the wrong place never deletes a user's files.
    """
    target = Path(os.path.abspath(directory))  # "." has no name to build a temporary one from
    if target.is_dir():
        others = sorted(name for name in os.listdir(target) if name not in TOKENIZER_FILES)
        if others:
            shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
            raise ValueError(
                f"directory must be a new folder or a tokenizer folder, got {target}, which holds {shown}; "
                "save into a new or empty folder"
            )
    elif target.exists():
        raise ValueError(f"directory must be a folder (or not exist yet), got the file {target}")

    digests = {name: hashlib.sha256(data).hexdigest() for name, data in sorted(files.items())}
    files = {**files, DIGESTS: (json.dumps({"sha256": digests}, indent=2) + "\n").encode()}

    def fill(folder: Path) -> None:
        for name, data in files.items():
            (folder / name).write_bytes(data)

    replace_dir(target, fill)
    remove_leftovers(target.parent, target.name)  # temporary folders of savers that were killed
    return target


def read_folder(directory: str | os.PathLike[str], names: tuple[str, ...] = READ_NAMES) -> dict[str, bytes]:
    """The bytes of those of ``names`` present in the folder ``directory``, all from one version of it.

    When the folder is missing, a copy that a writer moved aside (see the module's docstring) is read
    instead, if it holds any of ``names``; a copy being deleted by a writer that just finished is
    passed over and the folder, back in place by then, read again. Raises FileNotFoundError when
    there is neither.
    """
    folder = Path(directory)
    for _ in range(_RETRIES):
        for candidate in (folder, *_moved_aside(folder)):
            try:
                files = read_dir_files(candidate, [], optional=(*names, DIGESTS))
            except FileNotFoundError:
                continue
            record = files.pop(DIGESTS, None)
            if files or candidate == folder:
                _verify(candidate, files, record)
                return files
    raise FileNotFoundError(f"directory must be a tokenizer folder, got {folder} (no such folder)")


def _moved_aside(folder: Path) -> list[Path]:
    """``.<name>.<pid>-<random>.old`` folders beside ``folder``: where replace_dir's fallback keeps the
    old folder between its two renames."""
    pattern = re.compile(rf"\.{re.escape(folder.name)}\.\d+-[0-9a-f]{{16}}\.old")
    try:
        entries = os.listdir(folder.parent)
    except FileNotFoundError:
        return []
    return [folder.parent / name for name in sorted(entries) if pattern.fullmatch(name)]


def _verify(folder: Path, files: dict[str, bytes], record: bytes | None) -> None:
    """Each of ``files`` that ``write_folder`` recorded has its recorded SHA-256 (a folder written by HF, or by
    tlm-tokenizer before the record, has none and is read as it is)."""
    if record is None:
        return
    try:
        digests = json.loads(record)["sha256"]
    except (ValueError, TypeError, KeyError):
        digests = None
    if not isinstance(digests, dict):
        raise ValueError(f"{folder / DIGESTS}: not the record of digests write_folder writes; the folder is damaged")
    for name, data in files.items():
        if name in digests and hashlib.sha256(data).hexdigest() != digests[name]:
            raise ValueError(
                f"{folder / name}: its SHA-256 is not the one {DIGESTS} recorded when it was saved: the file is "
                f"damaged (save the tokenizer again, or copy an intact one) or was edited (then delete {DIGESTS})"
            )
