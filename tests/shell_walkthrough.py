"""Running a document's shell examples as a reader would: the machinery of
tests/test_readme.py (README.md) and tests/test_operators_doc.py
(docs/operators.md).

A document's fenced blocks are read with the HTML comment before each (a
block's marking, invisible on the rendered page). Commands are typed into a
real bash (a "terminal") one at a time, as a person types them; a command
that spans lines (a trailing backslash, a here-document, a ``for`` loop) is
typed whole. Every wait has a deadline, so a command that hangs fails the
test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 120.0  # seconds for any one step on a slow, loaded machine; never a timing assertion
MARK = "__WALKTHROUGH_RC__"


def blocks(text: str) -> list[tuple[str, str, list[str]]]:
    """(language, the HTML comment just before it or "", lines) for each fenced
    block, indented ones (in a list item) too, their lines without that indent."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"( *)```(\w*)\s*$", lines[i])
        if m:
            indent = m.group(1)
            before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            end = lines.index(f"{indent}```", i + 1)
            body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end]]
            out.append((m.group(2), before if before.startswith("<!--") else "", body))
            i = end
        i += 1
    return out


def commands(lines: list[str]) -> list[str]:
    """A block's lines grouped into whole commands, as bash reads them: lines
    continued by a backslash, a here-document up to its delimiter, a compound
    command (``for ... done``) up to its end. Blank lines and comments alone
    are left out."""
    out: list[str] = []
    pending: list[str] = []
    for line in lines:
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending.append(line)
        text = "\n".join(pending)
        if line.endswith("\\") or not _complete(text):
            continue
        out.append(text)
        pending = []
    assert not pending, f"an unfinished command in the document: {pending}"
    return out


def _complete(text: str) -> bool:
    check = subprocess.run(["bash", "-n"], input=text + "\n", capture_output=True, text=True, timeout=DEADLINE)
    return not ("unexpected end of file" in check.stderr or "delimited by end-of-file" in check.stderr)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Terminal:
    """A bash the test types lines into, as a person would. A thread reads its
    output all the time (a program that writes a lot, a broker logging at
    debug, never blocks on a full pipe); the test reads it back line by line."""

    def __init__(self, env: dict[str, str], cwd: Path = ROOT) -> None:
        self.proc = subprocess.Popen(["bash", "--noprofile", "--norc"], cwd=cwd, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.output: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def type(self, command: str) -> None:
        self.proc.stdin.write(f"{command}\necho {MARK}$?\n")
        self.proc.stdin.flush()

    def read_until(self, predicate: Callable[[str], bool], deadline: float = DEADLINE) -> str:
        """Output lines until one satisfies ``predicate`` (returned); fails if
        the shell ends first, or nothing satisfies it within ``deadline`` s."""
        end = time.monotonic() + deadline
        while True:
            try:
                line = self._lines.get(timeout=max(end - time.monotonic(), 0))
            except queue.Empty:
                raise AssertionError(f"not seen within {deadline:.0f} s; the terminal's last output:\n"
                                     + "".join(self.output[-40:])) from None
            if line is None:
                self._lines.put(None)
                raise AssertionError("the terminal ended:\n" + "".join(self.output[-40:]))
            self.output.append(line)
            if predicate(line):
                return line

    def run(self, command: str) -> tuple[int, str]:
        """Type a command and wait for it to finish: (exit status, its output)."""
        start = len(self.output)
        self.type(command)
        rc = int(self.read_until(lambda text: text.startswith(MARK))[len(MARK):])
        return rc, "".join(self.output[start:-1])

    def interrupt(self) -> None:
        """Ctrl-C: SIGINT to the terminal's process group (the shell this test started, and its children)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=DEADLINE)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def api(mgmt_port: int, path: str) -> object:
    with urllib.request.urlopen(f"http://127.0.0.1:{mgmt_port}{path}", timeout=DEADLINE) as response:
        return json.loads(response.read())


def wait_until(predicate: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.1)  # polling the broker for an event


def held_senders(mgmt_port: int) -> list[dict]:
    """The qflow-send connections held by flow control now."""
    return [c for c in api(mgmt_port, "/api/connections")
            if c["name"].startswith("qflow-send") and any(s["heldBy"] for s in c["sessions"])]
