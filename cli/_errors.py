"""How a qflow tool fails: the refusal it reports, and its exit status.

Exit codes, as in the Qpid tools: 0 success, 1 the broker (or the network)
refused, 2 a usage error (argparse's own).
"""

from __future__ import annotations

import sys


class ToolError(Exception):
    """A refusal to report on stderr with exit status 1."""


def fail(prog: str, message: str) -> int:
    """Report ``message`` on stderr as ``prog: message``; the exit status of a refusal, 1."""
    sys.stderr.write(f"{prog}: {message}\n")
    return 1


def single_error(group: BaseExceptionGroup) -> BaseException:
    """The one exception a nursery's group carries (the group itself if it carries several)."""
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error
