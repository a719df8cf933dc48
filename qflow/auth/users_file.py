"""The users file (qflowd ``--sasl-db FILE``, written by ``qflow-passwd``).

One JSON document: for each user a SCRAM-SHA-256 verifier (salt, iteration
count, StoredKey, ServerKey; qflow.protocol.sasl), never the password nor
anything that logs in without cracking it. Written atomically (a temporary
file in the same directory, synced, renamed over the old one) with mode
0600. qflowd reads it again when it changes, so ``qflow-passwd`` takes
effect for the next connection without a restart; a file that has become
unreadable keeps the users last read (and says so in the log).

    {"format": "qflow-sasldb 1",
     "users": {"alice": {"mechanism": "SCRAM-SHA-256", "iterations": 10000,
                         "salt": "<base64>", "storedKey": "<base64>", "serverKey": "<base64>"}}}
"""

from __future__ import annotations

import base64
import json
import logging
import os
import tempfile
from collections import Counter
from pathlib import Path

from qflow.protocol.sasl import DEFAULT_ITERATIONS, MAX_ITERATIONS, MIN_ITERATIONS, SCRAM_SHA_256, Verifier

log = logging.getLogger("qflow.auth")

FORMAT = "qflow-sasldb 1"
MAX_USER = 255  # bytes of UTF-8


class SaslDbError(Exception):
    """The users file cannot be read or written; the text names the file and why."""


def check_user_name(user: str) -> None:
    """Raises ValueError naming what is wrong with ``user`` as a user name."""
    if not user:
        raise ValueError("a user name must not be empty")
    if len(user.encode("utf-8", "surrogatepass")) > MAX_USER:
        raise ValueError(f"a user name must be at most {MAX_USER} bytes")
    if not user.isprintable() or "/" in user or "@" in user or ":" in user:
        # '/', '@' and ':' would make USER/PASS@HOST:PORT ambiguous; control characters would reach logs.
        raise ValueError(f"user name {user!r} must be printable, without '/', '@' or ':'")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _verifier(user: str, entry: object) -> Verifier:
    try:
        if not isinstance(entry, dict) or entry.get("mechanism") != SCRAM_SHA_256:
            raise ValueError("not a SCRAM-SHA-256 verifier")
        iterations = entry["iterations"]
        if type(iterations) is not int or not MIN_ITERATIONS <= iterations <= MAX_ITERATIONS:
            raise ValueError(f"iterations must be {MIN_ITERATIONS}..{MAX_ITERATIONS}")
        keys = [base64.b64decode(entry[k], validate=True) for k in ("salt", "storedKey", "serverKey")]
        if len(keys[1]) != 32 or len(keys[2]) != 32 or not keys[0]:
            raise ValueError("wrong key lengths")
        return Verifier(keys[0], iterations, keys[1], keys[2])
    except (KeyError, TypeError, ValueError) as exc:
        raise SaslDbError(f"user {user!r}: {exc}") from None


class SaslDb:
    """The users of one file, as qflowd and qflow-passwd see them."""

    def __init__(self, path: str | os.PathLike[str], users: dict[str, Verifier] | None = None) -> None:
        self.path = Path(path)
        self.users: dict[str, Verifier] = users or {}
        self._stamp: tuple[int, int, int] | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str], missing_ok: bool = False) -> SaslDb:
        """The users in ``path``; raises SaslDbError if it cannot be read or is
        not a users file (a missing one is empty with ``missing_ok``)."""
        db = cls(path)
        try:
            db._load()
        except FileNotFoundError:
            if not missing_ok:
                raise SaslDbError(f"users file {db.path} does not exist (create users with qflow-passwd)") from None
        return db

    def _load(self) -> None:
        try:
            with open(self.path, "rb") as f:
                stat = os.fstat(f.fileno())
                data = f.read()
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise SaslDbError(f"cannot read users file {self.path}: {exc.strerror or exc}") from None
        try:
            doc = json.loads(data)
        except ValueError as exc:
            raise SaslDbError(f"users file {self.path} is not valid JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("users"), dict):
            raise SaslDbError(f"{self.path} is not a qflow users file (format {FORMAT!r})")
        try:
            self.users = {user: _verifier(user, entry) for user, entry in doc["users"].items()}
        except SaslDbError as exc:
            raise SaslDbError(f"users file {self.path}: {exc}") from None
        self._stamp = (stat.st_ino, stat.st_size, stat.st_mtime_ns)

    def refresh(self) -> None:
        """Read the file again if it changed since it was last read (a stat
        per call). If it cannot be read now, the users last read stay."""
        try:
            stat = os.stat(self.path)
            if (stat.st_ino, stat.st_size, stat.st_mtime_ns) == self._stamp:
                return
            self._load()
            log.info("users file %s read again: %d users", self.path, len(self.users))
        except (OSError, SaslDbError) as exc:
            if self._stamp is not None:
                log.warning("users file %s: %s; keeping the %d users last read", self.path, exc, len(self.users))
                self._stamp = None  # warn once, then try again at each connection

    @property
    def usual_iterations(self) -> int:
        """The iteration count most users have (an unknown user's decoy shows it)."""
        counts = Counter(v.iterations for v in self.users.values())
        return counts.most_common(1)[0][0] if counts else DEFAULT_ITERATIONS

    def verifier(self, user: str) -> Verifier | None:
        """The user's verifier, from the file as it is now (None: no such user)."""
        self.refresh()
        return self.users.get(user)

    def save(self) -> None:
        """Write every user to the file, atomically, mode 0600."""
        doc = {"format": FORMAT, "users": {
            user: {"mechanism": SCRAM_SHA_256, "iterations": v.iterations, "salt": _b64(v.salt),
                   "storedKey": _b64(v.stored_key), "serverKey": _b64(v.server_key)}
            for user, v in sorted(self.users.items())}}
        data = (json.dumps(doc, indent=1) + "\n").encode()
        directory = self.path.parent
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=directory)  # mkstemp: mode 0600
        except OSError as exc:
            raise SaslDbError(f"cannot write users file {self.path}: {exc.strerror or exc}") from None
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), 0o600)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise SaslDbError(f"cannot write users file {self.path}: {exc.strerror or exc}") from None
