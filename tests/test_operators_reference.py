"""docs/operators.md explains every statistic a queue shows (not only docs/protocol.md), and
docs/store.md, the design note, sends an operator to the guide's data directory and quota."""

from __future__ import annotations

from pathlib import Path

from qflow.broker import Broker
from qflow.management.views import queue_view

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def test_every_queue_statistic_is_explained_in_the_guide() -> None:
    broker = Broker()
    q, _ = broker.declare_queue("q")
    section = _section((DOCS / "operators.md").read_text(), "What the statistics mean")
    missing = [key for key in queue_view(broker, q) if f"`{key}`" not in section]
    assert missing == []
    assert "the stop count plus the sender capacities" in section  # worstCaseDepth, explained
    assert "how many times flow control has come on" in section  # flowStoppedCount


def test_the_store_design_note_points_to_the_guide() -> None:
    guide = (DOCS / "operators.md").read_text()
    note = (DOCS / "store.md").read_text()
    for anchor, title in (("the-data-directory", "The data directory"),
                          ("the-stores-disk-quota", "The store's disk quota")):
        assert f"operators.md#{anchor}" in note and f"\n## {title}\n" in guide
    data_dir = _section(guide, "The data directory")
    assert "**Recovery.**" in data_dir and "**The message journal.**" in data_dir
