"""The command-line options the qflow tools share: argparse types for
counts, seconds and yes/no, and the option groups every tool, or every
messaging tool, takes.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ._addresses import DEFAULT_BROKER, BrokerUrl, broker_address
from ._errors import ToolError, fail
from ._security import add_tls_options, check_tls_options, connect_options


def non_negative(text: str) -> int:
    """A count that may be 0 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive(text: str) -> int:
    """A count of at least 1 (argparse type)."""
    value = non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be 1 or more")
    return value


def positive_float(text: str) -> float:
    """A number of seconds more than 0 (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < 1e9:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def seconds_or_zero(text: str) -> float:
    """A number of seconds, where 0 means "no limit", as in Qpid's tools."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 <= value < 1e9:
        raise argparse.ArgumentTypeError(f"must be 0 (no limit) or more, got {text}")
    return value


def yes_no(text: str) -> bool:
    """yes/no, true/false, y/n or 1/0, as Qpid's options take them (argparse type)."""
    low = text.lower()
    if low in ("yes", "true", "1", "y"):
        return True
    if low in ("no", "false", "0", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected yes or no, got {text!r}")


def add_tool_options(p: argparse.ArgumentParser) -> None:
    """What every tool has: --version, and --print-completion SHELL (shtab) to
    write its shell completion script: ``qflow-stat --print-completion bash >
    ~/.local/share/bash-completion/completions/qflow-stat``."""
    import shtab

    from qflow import __version__

    p.add_argument("--version", action="version", version=f"%(prog)s (qflow) {__version__}")
    shtab.add_argument_to(p, "--print-completion", help="print a shell completion script (bash, zsh or tcsh)")


def add_broker_option(p: argparse.ArgumentParser) -> None:
    """-b/--broker, the broker's protocol address, as qflow-send and qflow-receive take it."""
    p.add_argument("-b", "--broker", default=DEFAULT_BROKER, metavar="[amqps://][USER/PASS@]HOST:PORT",
                   help=f"the broker's protocol address (default {DEFAULT_BROKER}); amqps:// for its TLS port "
                        "(5671 by default)")


def add_connection_options(p: argparse.ArgumentParser, prog: str) -> None:
    """What a tool that opens a messaging connection takes besides -b: its
    connection's name, TLS and SASL, and every tool's --version and completion."""
    p.add_argument("--connection-name", default=f"{prog}[{os.getpid()}]", metavar="NAME",
                   help="the connection's name, shown by qflow-stat -c")
    add_tls_options(p)
    add_tool_options(p)


def client_setup(parser: argparse.ArgumentParser,
                 argv: list[str] | None) -> tuple[argparse.Namespace, BrokerUrl, dict[str, Any]]:
    """A messaging tool's arguments (add_broker_option, add_connection_options):
    (the arguments, the broker's address, the connection's options).

    Raises:
      SystemExit: status 2 through ``parser.error`` for an address or TLS/SASL
        options that do not fit; status 1, with the tool's one-line message,
        for TLS files that cannot be loaded.
    """
    args = parser.parse_args(argv)
    url = broker_address(parser, args.broker, 5672)
    check_tls_options(parser, args, url)
    try:
        return args, url, connect_options(args, url)
    except ToolError as exc:
        sys.exit(fail(parser.prog, str(exc)))
