"""docs/architecture.md names only files that exist.

Every ``name.py`` (or ``.c``, ``.h``) it writes in backquotes must be a file
of the tree: a name with a folder (``broker/queue.py``) from the checkout's
root or from ``qflow/``; a bare name (``pump.py``) in the folder of its table
row (``qflow/server/``), or, outside the table, somewhere in the tree. A
module renamed or moved without the guide fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "architecture.md"
SOURCE_DIRS = ("qflow", "cli", "native", "tests", "bench", "tools")

# Files the build writes, not kept in git (.gitignore), each with the file that writes it.
GENERATED = {"native/qflow_shared.h": "native/shared_header.py"}

NAME = re.compile(r"`([A-Za-z0-9_./-]+\.(?:py|c|h))`")
ROW_FOLDER = re.compile(r"^\|\s*`([A-Za-z0-9_./-]+/)`")


def named_files(text: str) -> list[tuple[int, str, str | None]]:
    """Each file name in backquotes in ``text``: (line number, name, the
    folder of the table row it is in, or None outside a table row)."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        row = ROW_FOLDER.match(line)
        found.extend((number, name, row.group(1) if row else None) for name in NAME.findall(line))
    return found


def exists(name: str, folder: str | None, root: Path = ROOT) -> bool:
    """Whether ``name``, as the guide writes it (in the table row of ``folder``), is a file of ``root``."""
    if name in GENERATED:
        return (root / GENERATED[name]).is_file()
    if "/" in name:
        return (root / name).is_file() or (root / "qflow" / name).is_file()
    if folder is not None:
        return (root / folder / name).is_file()
    return any(path.is_file() for top in SOURCE_DIRS for path in (root / top).rglob(name))


def test_the_guide_names_files():
    """The check below cannot pass vacuously: the guide names many files."""
    assert len(named_files(GUIDE.read_text())) > 40


@pytest.mark.parametrize(("line", "name", "folder"), named_files(GUIDE.read_text()),
                         ids=lambda v: str(v) if v is not None else "-")
def test_every_file_the_guide_names_exists(line, name, folder):
    where = f" (in the row of {folder})" if folder else ""
    assert exists(name, folder), f"docs/architecture.md:{line} names {name}{where}, which is not in the tree"


def test_a_wrong_name_is_caught(tmp_path):
    """The checker itself: a name the tree lacks fails, with or without a
    folder, in a table row or not; one that is there passes."""
    (tmp_path / "qflow" / "server").mkdir(parents=True)
    (tmp_path / "qflow" / "server" / "pump.py").write_text("")
    text = ("| `qflow/server/` | `pump.py`, `gone.py` |\n"
            "prose: `server/pump.py`, `qflow/server/pump.py`, `server/gone.py`, `pump.py`, `gone.py`\n")
    verdicts = {(name, folder): exists(name, folder, tmp_path) for _, name, folder in named_files(text)}
    assert verdicts == {("pump.py", "qflow/server/"): True, ("gone.py", "qflow/server/"): False,
                        ("server/pump.py", None): True, ("qflow/server/pump.py", None): True,
                        ("server/gone.py", None): False, ("pump.py", None): True, ("gone.py", None): False}
