"""qflow-passwd: set or delete a user of qflowd's users file (``--sasl-db``),
as Qpid's saslpasswd2 does for qpidd.

    qflow-passwd --sasl-db FILE USER            # the password from standard input
    qflow-passwd --sasl-db FILE --delete USER

On a terminal the password is prompted for twice, unechoed; otherwise it is
the first line of standard input (its line end removed). The file keeps a
salted SCRAM-SHA-256 verifier (PBKDF2-HMAC-SHA-256), never the password, and
is written atomically with mode 0600; a running qflowd reads it again at the
next connection. Exit codes: 0 done, 1 the file cannot be read or written
(or the user to delete does not exist), 2 a usage error.
"""

from __future__ import annotations

import argparse
import getpass
import sys

from qflow.auth.users_file import SaslDb, SaslDbError, check_user_name
from qflow.protocol.sasl import DEFAULT_ITERATIONS, MAX_ITERATIONS, MIN_ITERATIONS, make_verifier

from ._options import add_tool_options

PROG = "qflow-passwd"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line on stderr, exit 2
        sys.stderr.write(f"{PROG}: {message}\n")
        sys.exit(2)


def _iterations(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not MIN_ITERATIONS <= value <= MAX_ITERATIONS:
        raise argparse.ArgumentTypeError(f"must be {MIN_ITERATIONS}..{MAX_ITERATIONS}, got {value}")
    return value


def read_password() -> str:
    """Prompted twice on a terminal; else standard input's first line."""
    if sys.stdin.isatty():
        first = getpass.getpass("Password: ")
        if getpass.getpass("Again: ") != first:
            raise ValueError("the passwords do not match")
        return first
    line = sys.stdin.readline()
    return line[:-1] if line.endswith("\n") else line


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog=PROG, description="Set (password from standard input) or delete a user of qflowd's "
                                       "--sasl-db users file.")
    p.add_argument("--sasl-db", required=True, metavar="FILE", help="the users file (created if missing)")
    p.add_argument("--delete", action="store_true", help="remove the user")
    p.add_argument("--iterations", type=_iterations, default=DEFAULT_ITERATIONS,
                   help=f"PBKDF2 rounds of the new verifier (default {DEFAULT_ITERATIONS})")
    p.add_argument("user")
    add_tool_options(p)  # --version and --print-completion, as on every tool
    args = p.parse_args(argv)
    try:
        check_user_name(args.user)
    except ValueError as exc:
        p.error(str(exc))
    try:
        db = SaslDb.open(args.sasl_db, missing_ok=not args.delete)
        if args.delete:
            if db.users.pop(args.user, None) is None:
                sys.stderr.write(f"{PROG}: no user {args.user!r} in {args.sasl_db}\n")
                return 1
        else:
            try:
                password = read_password()
            except (ValueError, EOFError) as exc:
                sys.stderr.write(f"{PROG}: {exc or 'no password given'}\n")
                return 1
            if not password:
                sys.stderr.write(f"{PROG}: the password must not be empty\n")
                return 1
            db.users[args.user] = make_verifier(password, args.iterations)
        db.save()
    except SaslDbError as exc:
        sys.stderr.write(f"{PROG}: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
