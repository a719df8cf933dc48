"""docs/operators.md's shell examples, every one run as written, in order, by
the machinery of the README's walk-through (tests/shell_walkthrough.py).

The reader of the guide has followed the README: the tools are on PATH (the
venv's bin first, as ``. .venv/bin/activate`` leaves it). Each ``sh`` block's
commands are typed into a terminal, whole commands at a time (a here-document
or a ``for`` loop at once), and each must exit 0. What the guide's markings
(an HTML comment before a block, invisible on the page) and its comments ask
for:

* ``<!-- walkthrough: background, ready when it prints "qflowd ready"; the
  broker the later examples use -->``: the first qflowd runs in a terminal of
  its own until the end (then Ctrl-C, and it must say ``qflowd stopped``);
  every later example talks to it. Its HOME is a directory of its own, so
  that its ``~/.qflowd`` is not the one of the examples below (as if it ran
  on another machine).
* ``<!-- walkthrough: each qflowd in a terminal of its own, until "qflowd
  ready", then Ctrl-C -->``: the guide's other qflowd command lines are
  alternatives, each a broker that runs until stopped. Each is started in a
  terminal of its own, must print its ready line, and is stopped with Ctrl-C
  (it must exit 0) before the next one starts.
  The block's other commands (writing a configuration file) run in the
  first terminal.
* ``<!-- walkthrough: a command that says "Ctrl-C to stop" ... -->``: such a
  command (``qflow-stat --watch``) runs in a terminal of its own until it has
  shown the queues, then gets Ctrl-C.
* ``<!-- walkthrough: after the senders started with &, the test waits ... -->``:
  before the next command, the test waits until each background qflow-send
  has its whole window held by flow control, as the reader waits to see them
  stop. A background command other than qflow-send fails the test.
* A command whose comment starts ``# refused`` must exit 1 saying
  ``Failed:``; a ``curl`` must not answer an error (curl -s exits 0 on a 4xx).

The only changes made to the commands, so that the test never touches a
broker or a directory of yours: the ports 5672 and 8672 (and 5673, for the
configuration-file example) become free ones, and ``-b localhost:P`` is added
to a qflow- tool that has no ``-b``, as the README tells the reader to do when
the default ports are taken; ``/var/lib/qflowd`` becomes a temporary
directory. HOME is a temporary directory. Every terminal has
``QFLOWD_PORT=0`` and ``QFLOWD_MGMT_PORT=0`` (the guide's own variables): a
qflowd example that names no port then takes free ones rather than 5672 and
8672, and a port on its command line still wins.

Fenced blocks without a language are output the guide shows; one that starts
with a command (qflowd, a qflow- tool, curl) fails the test, so that no shell
example escapes it by missing its ``sh``.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.shell_walkthrough import MARK, ROOT, Terminal, api, blocks, commands, free_port, wait_until

GUIDE = ROOT / "docs" / "operators.md"
BROKER = "<!-- walkthrough: background, ready when it prints \"qflowd ready\""
EXAMPLE_BROKERS = "<!-- walkthrough: each qflowd in a terminal of its own"
CTRL_C = "<!-- walkthrough: a command that says \"Ctrl-C to stop\""
BACKGROUND_SENDERS = "<!-- walkthrough: after the senders started with &"
COMMAND = re.compile(r"(qflowd|qflow-[a-z]+|curl)( -|$)")


def substitute(command: str, ports: dict[str, int], tmp: Path) -> str:
    """The changes the module's docstring lists, and no other."""
    for port, free in ports.items():
        command = re.sub(rf"\b{port}\b", str(free), command)
    command = command.replace("/var/lib/qflowd", str(tmp / "var-lib-qflowd"))
    if " -b " not in command:
        command = re.sub(r"^(qflow-(?:config|stat|send|receive)) ", rf"\1 -b localhost:{ports['5672']} ", command)
    return command


def starts_qflowd(command: str) -> bool:
    words = [w for w in command.split() if not re.match(r"[A-Z_]+=", w)]
    return bool(words) and words[0] == "qflowd"


def senders_held(mgmt_port: int, count: int) -> bool:
    """``count`` qflow-send connections, each with its whole window held."""
    held = [s for c in api(mgmt_port, "/api/connections") if c["name"].startswith("qflow-send")
            for s in c["sessions"] if s["senderCapacity"] and s["heldTransfers"] == s["senderCapacity"]]
    return len(held) == count


@pytest.mark.native_only
def test_every_shell_example_of_the_operators_guide(tmp_path: Path) -> None:
    guide = GUIDE.read_text()
    ports = {"5672": free_port(), "8672": free_port(), "5673": free_port()}
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("QFLOWD_") and k != "PYTHONHOME"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(HOME=str(home), QFLOWD_PORT="0", QFLOWD_MGMT_PORT="0")
    first = Terminal(env, cwd=home)
    broker: Terminal | None = None
    others: list[Terminal] = []
    outputs: list[tuple[str, str]] = []
    examples = 0

    def own_terminal(home_dir: Path) -> Terminal:
        home_dir.mkdir(exist_ok=True)
        term = Terminal({**env, "HOME": str(home_dir)}, cwd=home_dir)
        others.append(term)
        return term

    try:
        for lang, comment, lines in blocks(guide):
            if lang == "":
                assert not any(COMMAND.match(line) for line in lines[:1]), \
                    f"a shell example without its sh in {GUIDE.name}: {lines[0]}"
                continue
            if lang != "sh":
                continue
            background: list[str] = []
            for command in (substitute(c, ports, tmp_path) for c in commands(lines)):
                if comment.startswith(BROKER) and broker is None:
                    broker = own_terminal(tmp_path / "broker-home")
                    broker.type(command)
                    ready = broker.read_until(lambda text: text.startswith(("qflowd ready", MARK)))
                    assert ready.startswith("qflowd ready"), "".join(broker.output)
                    continue
                if comment.startswith(EXAMPLE_BROKERS) and starts_qflowd(command):
                    examples += 1
                    term = own_terminal(home)
                    term.type(command)
                    ready = term.read_until(lambda text: text.startswith(("qflowd ready", MARK)))
                    assert ready.startswith("qflowd ready"), (command, "".join(term.output))
                    outputs.append((command, ready))
                    term.interrupt()
                    rc = term.read_until(lambda text: text.startswith(MARK))  # it has exited
                    assert rc == f"{MARK}0\n", (command, "".join(term.output))
                    continue
                if comment.startswith(CTRL_C) and "Ctrl-C to stop" in command:
                    term = own_terminal(home)
                    term.type(command)
                    term.read_until(lambda text: text.startswith("orders "))
                    term.interrupt()
                    continue
                if command.rstrip().endswith("&"):
                    assert comment.startswith(BACKGROUND_SENDERS) and command.startswith("qflow-send "), command
                    background.append(command)
                    rc, out = first.run(command)
                    assert rc == 0, (command, out)
                    continue
                if background:
                    count = len(background)
                    wait_until(lambda: senders_held(ports["8672"], count),  # noqa: B023 (called here, at once)
                               "each background sender held by flow control")
                    background = []
                rc, out = first.run(command)
                outputs.append((command, out))
                if re.search(r"#\s*refused", command):
                    assert rc == 1 and "Failed:" in out, (command, out)
                else:
                    assert rc == 0, (command, out)
                assert "Traceback" not in out, (command, out)
                if command.startswith("curl "):
                    assert '"error"' not in out, (command, out)
        assert broker is not None and examples >= 7

        # A few of the guide's claims about what the reader sees.
        said = dict(outputs)

        def output_of(prefix: str) -> str:
            return next(out for cmd, out in said.items() if cmd.startswith(prefix))

        # "Above, qflowd listens on 5673 (the command line)": the ready line names it.
        assert f"port={ports['5673']} " in output_of("QFLOWD_LOG_LEVEL=warning qflowd --config")
        # "flowStopped Y, msg 110 = 50 + 10 + 20 + 30, held 60", while the three senders are held.
        stat = output_of(f"qflow-stat -b localhost:{ports['5672']} -q      # flowStopped Y")
        (row,) = [line.split() for line in stat.splitlines() if line.startswith("flow ")]
        assert row[1] == "110" and row[-3:] == ["Y", "1", "60"], stat
        # qpid-receive's --report-total columns.
        report = output_of(f"qflow-receive -b localhost:{ports['5672']} -a flow").splitlines()
        assert report[-2] == "tp(m/s)\tl-min\tl-max\tl-avg" and len(report[-1].split("\t")) == 4, report
        # "~/.qflowd, created if missing", and "another one".
        assert (home / ".qflowd" / "config.log").is_file()
        assert (tmp_path / "var-lib-qflowd" / "config.log").is_file()
        # The completion scripts were written where the guide puts them.
        completions = home / ".local" / "share" / "bash-completion" / "completions"
        assert sorted(p.name for p in completions.iterdir()) == sorted(
            ["qflowd", "qflow-config", "qflow-stat", "qflow-send", "qflow-receive"])

        # Stop the first broker with Ctrl-C.
        broker.interrupt()
        broker.read_until(lambda text: "qflowd stopped" in text)
    finally:
        for term in others:
            term.interrupt()
        for term in [first, *others]:
            term.close()
