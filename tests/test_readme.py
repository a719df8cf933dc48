"""The README's walk-through, run as a newcomer would run it: every ```sh
block of README.md in order, each line typed into a shell (a "terminal"),
against a real qflowd started by the README's own ``make run``.

A block the README says to run in another terminal (a ``<!-- walkthrough:
background ... -->`` comment before it) gets a terminal of its own that keeps
running; the test waits for what the comment says it is ready on. A block
marked ``<!-- not run by tests/test_readme.py: ... -->`` is skipped, with its
reason in the README. The only change made to the commands is the one the
README tells the reader to make when the default ports are taken: ``make run
PORT=P MGMT_PORT=M`` and ``-b localhost:P`` on each qflow- command, with free
ports, so the test never touches a broker of yours. ``HOME`` is a temporary
directory (``make run`` keeps its data in ``~/.qflowd``), and PATH does not
have the venv: the README's ``. .venv/bin/activate`` must put the tools there.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 120.0  # seconds for any one step on a slow, loaded machine; never a timing assertion
MARK = "__README_RC__"


def blocks(text: str) -> list[tuple[str, str, list[str]]]:
    """(language, the HTML comment just before it or "", lines) for each fenced block."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"```(\w*)\s*$", lines[i])
        if m and m.group(1):
            before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            end = lines.index("```", i + 1)
            out.append((m.group(1), before if before.startswith("<!--") else "", lines[i + 1:end]))
            i = end
        i += 1
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Terminal:
    """A bash the test types lines into, as a person would; its output is read back."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(["bash", "--noprofile", "--norc"], cwd=ROOT, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.output: list[str] = []

    def type(self, line: str) -> None:
        self.proc.stdin.write(f"{line}\necho {MARK}$?\n")
        self.proc.stdin.flush()

    def read_until(self, predicate) -> str:
        """Output lines until one satisfies ``predicate`` (returned); fails if the shell ends first."""
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError("the terminal ended:\n" + "".join(self.output[-40:]))
            self.output.append(line)
            if predicate(line):
                return line

    def run(self, line: str) -> tuple[int, str]:
        """Type a command and wait for it to finish: (exit status, its output)."""
        start = len(self.output)
        self.type(line)
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


def substitute(line: str, port: int, mgmt_port: int) -> str:
    """What the README tells the reader to change when its ports are taken."""
    line = re.sub(r"^make run\b", f"make run PORT={port} MGMT_PORT={mgmt_port}", line)
    return re.sub(r"^(qflow-(?:config|stat|send|receive)) ", rf"\1 -b localhost:{port} ", line)


def api(mgmt_port: int, path: str) -> object:
    with urllib.request.urlopen(f"http://127.0.0.1:{mgmt_port}{path}", timeout=DEADLINE) as response:
        return json.loads(response.read())


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.1)  # polling the broker for an event


def held_sender(mgmt_port: int) -> bool:
    return any(c["name"].startswith("qflow-send") and any(s["heldBy"] for s in c["sessions"])
               for c in api(mgmt_port, "/api/connections"))


@pytest.mark.native_only
def test_readme_walkthrough(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    port, mgmt_port = free_port(), free_port()
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and Path(p).resolve() != Path(venv_bin).resolve())
    env["HOME"] = str(tmp_path)
    first = Terminal(env)
    others: list[Terminal] = []
    broker: Terminal | None = None
    ran = skipped = 0
    outputs: dict[str, str] = {}
    try:
        for lang, comment, lines in blocks(readme):
            if lang != "sh":
                continue
            if "not run by tests/test_readme.py" in comment:
                skipped += 1
                continue
            ran += 1
            commands = [substitute(line, port, mgmt_port) for line in lines if line.strip()]
            if comment.startswith("<!-- walkthrough: background"):
                term = Terminal(env)
                others.append(term)
                for command in commands:
                    term.type(command)
                if "qflowd ready" in comment:
                    broker = term
                    term.read_until(lambda text: text.startswith("qflowd ready"))
                elif "qflow-send" in comment:
                    wait_until(lambda: held_sender(mgmt_port), "the README's sender held by flow control")
                else:
                    raise AssertionError(f"the test does not know when this block is ready: {comment}")
                continue
            for command in commands:
                rc, out = first.run(command)
                assert rc == 0, (command, out)
                outputs[command] = out
        assert broker is not None and ran >= 4 and skipped >= 1

        # What the walk-through says the reader sees.
        stat_q = next(out for cmd, out in outputs.items() if cmd.endswith(" -q") or " -q  " in cmd)
        (row,) = [line.split() for line in stat_q.splitlines() if line.startswith("orders ")]
        assert "Y" in row  # flowStopped, while the sender was held
        one = next(out for cmd, out in outputs.items() if " -q orders" in cmd)
        fields = dict(line.split(None, 1) for line in one.splitlines()[1:])
        assert fields["msgDepth"] == "0" and int(fields["flowStoppedCount"]) >= 1
        # The held sender finished once the queue was drained, and reported its throughput.
        sender = others[1]
        sender_rc = int(sender.read_until(lambda text: text.startswith(MARK) and
                                          "tp(m/s)" in "".join(sender.output))[len(MARK):])
        assert sender_rc == 0 and "tp(m/s)" in "".join(sender.output), "".join(sender.output)

        # The README's Python client, against the same broker.
        python = next(lines for lang, _, lines in blocks(readme) if lang == "python" and "open_connection" in
                      "\n".join(lines))
        code = "\n".join(python).replace("5672", str(port))
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=DEADLINE)
        assert result.returncode == 0 and result.stdout == "b'hello'\n", result.stderr

        # "Stop the broker with Ctrl-C in its terminal."
        broker.interrupt()
        broker.read_until(lambda text: "qflowd stopped" in text)
    finally:
        for term in others:  # whatever is still running in the other terminals: Ctrl-C
            term.interrupt()
        for term in [first, *others]:
            term.close()
