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

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.shell_walkthrough import (
    DEADLINE,
    MARK,
    ROOT,
    Terminal,
    blocks,
    free_port,
    held_senders,
    wait_until,
)


def substitute(line: str, port: int, mgmt_port: int) -> str:
    """What the README tells the reader to change when its ports are taken."""
    line = re.sub(r"^make run\b", f"make run PORT={port} MGMT_PORT={mgmt_port}", line)
    return re.sub(r"^(qflow-(?:config|stat|send|receive)) ", rf"\1 -b localhost:{port} ", line)


def held_sender(mgmt_port: int) -> bool:
    return bool(held_senders(mgmt_port))


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
