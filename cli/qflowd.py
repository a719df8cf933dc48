"""qflowd: the qflow broker.

    qflowd --host 127.0.0.1 --port 5672 --mgmt-port 8672 [--mgmt-allowed-host NAME]... [--data-dir DIR | --no-data-dir]
           [--store-overfull-size BYTES [--store-underfull-size BYTES]] [--store-segment-size BYTES]
           [--memory-high-watermark BYTES|FRACTION] [--memory-low-watermark BYTES|FRACTION]
           [--auth yes|no] [--sasl-db FILE]
           [--ssl-cert-file FILE [--ssl-key-file FILE] [--ssl-port PORT] [--mgmt-ssl yes|no]
            [--ssl-ca-file FILE [--ssl-require-client-authentication]] [--require-encryption]]

Authentication (SASL SCRAM-SHA-256 and PLAIN on the messaging port, HTTP
Basic on the management port) is on with ``--auth yes``, against the users
of ``--sasl-db FILE`` (written by qflow-passwd). Without ``--auth`` it is
off when qflowd listens on loopback only (or on when --sasl-db is given);
asked to listen on any other address with no ``--auth``, qflowd refuses to
start (exit 2), naming ``--auth``.

With ``--ssl-cert-file``, TLS is served on ``--ssl-port`` (beside the plain
messaging port) and the management API is https on ``--mgmt-port`` (unless
``--mgmt-ssl no``). ``--ssl-ca-file`` lets clients present a certificate its
CAs signed, which authenticates them as the certificate's CN (SASL EXTERNAL;
on the management API, instead of HTTP Basic);
``--ssl-require-client-authentication`` refuses TLS clients without one.
``--require-encryption`` (qpidd's) refuses every connection on the plain
messaging port, telling the client to use TLS on ``--ssl-port``.

The data directory (default ~/.qflowd) keeps the durable configuration across
restarts and is locked: a second qflowd on it exits 1, naming the holder's PID.
Prints ``qflowd ready port=P mgmt-port=M`` once both the protocol port and
the management HTTP port (qflow.management) listen. SIGINT/SIGTERM stop it
cleanly (exit 0); a bad option exits 2 with a one-line message; a port that
cannot be bound, or a data directory that cannot be used, exits 1 with a
one-line message.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import socket
import sys
from datetime import UTC, datetime
from typing import Any

import trio

from qflow import __version__
from qflow.auth.users_file import SaslDbError
from qflow.broker.settings import FlowDefaults, SettingsError
from qflow.management import DEFAULT_PORT as DEFAULT_MGMT_PORT
from qflow.management import DEFAULT_TIMEOUT as DEFAULT_MGMT_TIMEOUT
from qflow.management.guard import allowed_host_problem
from qflow.protocol.framing import DEFAULT_MAX_FRAME_SIZE, MIN_MAX_FRAME_SIZE
from qflow.server.admission import ConnectionLimits
from qflow.server.amqp_pump import DEFAULT_CREDIT_WINDOW
from qflow.server.daemon import AclFileError, ListenError, TlsError, run
from qflow.server.memory_monitor import DEFAULT_HIGH_SHARE, DEFAULT_LOW_SHARE, available_memory
from qflow.store import StoreError
from qflow.store.journal import DEFAULT_SEGMENT_SIZE, SMALLEST_JOURNAL
from qflow.store.quota import QuotaError, QuotaLimits

from ._options import add_tool_options, yes_no

log = logging.getLogger("qflow")

DEFAULT_DATA_DIR = "~/.qflowd"
# Each default is the model's own (one place): the flow defaults' and the connection limits'.
FLOW = FlowDefaults()
LIMITS = ConnectionLimits()
MIN_SEGMENT_SIZE, MAX_SEGMENT_SIZE = 4096, 1 << 30


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line on stderr, exit 2
        sys.stderr.write(f"qflowd: {message}\n")
        sys.exit(2)


ENV_PREFIX = "QFLOWD_"
NOT_SETTINGS = ("help", "config", "version", "print_completion")  # options a file or the environment cannot set


def _settings(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every long option a file or the environment may set, by its name without dashes."""
    return {opt[2:]: action for opt, action in p._option_string_actions.items()
            if opt.startswith("--") and action.dest not in NOT_SETTINGS}


def _convert(p: argparse.ArgumentParser, action: argparse.Action, name: str, text: str, where: str) -> Any:
    """A setting's value from text, as the command line would take it; a bad one is a usage error naming
    ``where`` it came from."""
    if action.nargs == 0:  # a flag (--no-data-dir): yes or no
        low = text.strip().lower()
        if low in ("yes", "true", "1", "on"):
            return action.const
        if low in ("no", "false", "0", "off"):
            return _UNSET
        p.error(f"{where}: {name} is a flag: give yes or no, not {text!r}")
    try:
        value = action.type(text) if action.type is not None else text
    except (ValueError, argparse.ArgumentTypeError) as exc:
        # Python's own texts ("invalid literal for int() with base 10") say nothing to an operator.
        why = {int: "expected a whole number", float: "expected a number"}.get(action.type, str(exc))
        p.error(f"{where}: bad value {text!r} for {name}: {why}")
    if action.choices is not None and value not in action.choices:
        p.error(f"{where}: {name} must be one of {', '.join(map(str, action.choices))}, not {text!r}")
    return value


_UNSET = object()


def _file_settings(p: argparse.ArgumentParser, path: str) -> list[tuple[str, str, str]]:
    """(name, value, where) for each ``name=value`` line of a qpidd-style configuration file."""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        p.error(f"--config {path}: cannot read it: {getattr(exc, 'strerror', None) or exc}")
    found = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        name, eq, value = text.partition("=")
        if not eq:
            p.error(f"{path}:{number}: expected NAME=VALUE (the long option's name, no dashes), got {text!r}")
        found.append((name.strip().removeprefix("--"), value.strip(), f"{path}:{number}"))
    return found


def _env_settings(environ: dict[str, str]) -> list[tuple[str, str, str]]:
    return [(key[len(ENV_PREFIX):].lower().replace("_", "-"), value, key)
            for key, value in sorted(environ.items())
            if key.startswith(ENV_PREFIX) and key != ENV_PREFIX + "CONFIG"]


def _apply_settings(p: argparse.ArgumentParser, argv: list[str] | None, environ: dict[str, str]) -> None:
    """The defaults that the file (``--config FILE``, or QFLOWD_CONFIG) and
    then the QFLOWD_* variables give: the command line parsed afterwards wins
    over both, the environment over the file (as qpidd's options, its
    QPID_* variables and its --config file rank)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    path = known.config or environ.get(ENV_PREFIX + "CONFIG")
    settings = _settings(p)
    chosen: dict[str, Any] = {}
    for name, text, where in (_file_settings(p, path) if path else []) + _env_settings(environ):
        action = settings.get(name)
        if action is None:
            p.error(f"{where}: unknown option {name!r}; the names are qflowd's long options: "
                    f"{', '.join(sorted(settings))}")
        value = _convert(p, action, name, text, where)
        if value is not _UNSET:
            chosen[action.dest] = value
        elif chosen.get(action.dest, _UNSET) is action.const:
            del chosen[action.dest]  # "no-data-dir=no" undoes an earlier yes
    p.set_defaults(**chosen)


def parse_args(argv: list[str] | None, environ: dict[str, str] | None = None) -> argparse.Namespace:
    """qflowd's options: the command line, then QFLOWD_* variables (``environ``,
    os.environ by default), then the ``--config`` file, then the defaults."""
    p = _Parser(prog="qflowd", description="The qflow message broker.")
    p.add_argument("--config", metavar="FILE",
                   help="read options from FILE: one NAME=VALUE a line, NAME a long option without its dashes "
                        "(port=5672); '#' starts a comment. QFLOWD_NAME variables (QFLOWD_PORT=5672) win over "
                        "the file, and the command line over both")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=5672, help="protocol port; 0 picks a free one (default 5672)")
    p.add_argument("--mgmt-port", type=int, default=None, metavar="PORT",
                   help=f"management HTTP port; 0 picks a free one (default {DEFAULT_MGMT_PORT}, "
                        "or a free one when --port is 0)")
    p.add_argument("--queue-purge-interval", type=float, default=1.0, metavar="SECS",
                   help="seconds between two sweeps that drop expired messages from queues nobody reads "
                        "(qpidd's option; its default is 600, qflowd's 1: a sweep looks only at queues whose "
                        "earliest expiry has come; 0: no sweep)")
    p.add_argument("--mgmt-timeout", type=float, default=DEFAULT_MGMT_TIMEOUT, metavar="SECS",
                   help="seconds a management request may take to arrive, and an idle management "
                        f"connection may stay open (default {DEFAULT_MGMT_TIMEOUT:g})")
    p.add_argument("--mgmt-allowed-host", dest="mgmt_allowed_hosts", action="append", default=[], metavar="NAME",
                   help="another name the management API may be addressed by (its Host header), besides "
                        "localhost, the loopback and listening addresses and this machine's hostname; "
                        "repeatable")
    p.add_argument("--amqp-credit-window", type=int, default=DEFAULT_CREDIT_WINDOW, metavar="N",
                   help="an AMQP 1.0 sending link's credit: the most transfers it may have incomplete or in credit "
                        "at once, refilled as they complete and withheld while flow control (or the memory alarm, "
                        f"or the store's quota) holds one of them (default {DEFAULT_CREDIT_WINDOW}, as qpidd)")
    p.add_argument("--queue-patterns", dest="queue_patterns", action="append", default=[], metavar="PATTERN",
                   help="an AMQP 1.0 link to an address no queue or exchange has, matching PATTERN, creates a queue "
                        "of that name (as qpidd's option; the pattern is a topic binding key: words separated by "
                        "dots, '*' one word, '#' any number, e.g. 'qit.#'; the user needs the ACL's create); "
                        "repeatable")
    p.add_argument("--max-frame-size", type=int, default=DEFAULT_MAX_FRAME_SIZE,
                   help=f"largest frame accepted, bytes (default {DEFAULT_MAX_FRAME_SIZE})")
    p.add_argument("--max-connections", type=int, default=LIMITS.max_connections, metavar="N",
                   help="most client connections served at once; more are refused with a reason; 0 = no limit "
                        f"(default {LIMITS.max_connections}, as qpidd)")
    p.add_argument("--connection-limit-per-ip", type=int, default=LIMITS.per_ip, metavar="N",
                   help=f"most connections from one address at once; 0 = no limit (default {LIMITS.per_ip})")
    p.add_argument("--connection-limit-per-user", type=int, default=LIMITS.per_user, metavar="N",
                   help="most connections of one user at once (ANONYMOUS clients are the user 'anonymous'); "
                        f"0 = no limit (default {LIMITS.per_user})")
    p.add_argument("--max-negotiate-time", type=int, default=round(LIMITS.negotiate_time * 1000), metavar="MS",
                   help="milliseconds a new connection has to finish its handshake; 0 = no limit "
                        f"(default {round(LIMITS.negotiate_time * 1000)}, as qpidd)")
    p.add_argument("--idle-timeout", type=float, default=LIMITS.idle_timeout, metavar="SECS",
                   help="seconds a connection that negotiated no heartbeat may send nothing before it is "
                        f"closed; 0 = never (default {LIMITS.idle_timeout:g})")
    p.add_argument("--max-unfinished-input", type=int, default=LIMITS.max_unfinished_input,
                   metavar="BYTES",
                   help="most bytes held in unfinished frames over all connections (each holds at most one "
                        "frame); past it the connections holding the most are closed with a reason; 0 = no "
                        f"limit (default {LIMITS.max_unfinished_input})")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="least severe messages logged (default info); `qflow-config log-level L` changes it "
                        "while qflowd runs")
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="text lines, or one JSON object a line (time, level, logger, message) for log shippers")
    p.add_argument("--default-flow-stop-threshold", type=int, default=FLOW.stop_pct, metavar="PCT",
                   help=f"flow stop threshold, percent of a queue's maximum (default {FLOW.stop_pct})")
    p.add_argument("--default-flow-resume-threshold", type=int, default=FLOW.resume_pct, metavar="PCT",
                   help=f"flow resume threshold, percent of a queue's maximum (default {FLOW.resume_pct})")
    p.add_argument("--default-queue-limit", type=int, default=FLOW.queue_limit, metavar="BYTES",
                   help="maximum size of queues declared without qpid.max_size; 0 = none "
                        f"(default {FLOW.queue_limit})")
    p.add_argument("--auth", type=yes_no, default=None, metavar="yes|no",
                   help="require SASL authentication (SCRAM-SHA-256, PLAIN) on the messaging port and HTTP Basic "
                        "on the management port (default: no on loopback, yes with --sasl-db; required on other "
                        "addresses)")
    p.add_argument("--sasl-db", default=None, metavar="FILE",
                   help="the users file (qflow-passwd) clients authenticate against")
    p.add_argument("--acl-file", default=None, metavar="FILE",
                   help="access control list in Qpid's ACL syntax (docs/security.md); what no rule allows is "
                        "denied; reloaded by POST /api/acl/reload (qflow-config reload-acl)")
    p.add_argument("--ssl-cert-file", metavar="FILE",
                   help="the broker's TLS certificate chain (PEM): serve TLS connections on --ssl-port")
    p.add_argument("--ssl-key-file", metavar="FILE", help="its private key (PEM), if not in --ssl-cert-file")
    p.add_argument("--ssl-port", type=int, default=None, metavar="PORT",
                   help="the TLS messaging port; 0 picks a free one (default 5671, or a free one when --port is 0)")
    p.add_argument("--ssl-ca-file", metavar="FILE",
                   help="CA certificates (PEM) whose client certificates the broker trusts: a client presenting "
                        "one may authenticate as its CN (SASL EXTERNAL, HTTPS on the management port)")
    p.add_argument("--ssl-require-client-authentication", "--ssl-require-client-auth", dest="ssl_require_client_auth",
                   action="store_true",
                   help="mutual TLS: a TLS client (messaging or management) without a certificate signed by a CA "
                        "of --ssl-ca-file is refused in the handshake")
    p.add_argument("--require-encryption", action="store_true",
                   help="refuse plain connections on the messaging port (each told to connect with TLS to "
                        "--ssl-port, and logged); needs --ssl-cert-file")
    p.add_argument("--mgmt-ssl", type=yes_no, default=True, metavar="yes|no",
                   help="with --ssl-cert-file, serve the management API over TLS (https) on --mgmt-port "
                        "(default yes; no: plain http, for a broker behind a TLS proxy)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--data-dir", default=DEFAULT_DATA_DIR, metavar="DIR",
                       help="where durable queues, exchanges and bindings are kept; created if missing, and locked "
                            f"(default {DEFAULT_DATA_DIR})")
    where.add_argument("--no-data-dir", dest="data_dir", action="store_const", const=None,
                       help="keep nothing: every queue and exchange is gone after a restart")
    store = p.add_argument_group("message store quota (needs a data directory)")
    store.add_argument("--store-overfull-size", type=int, default=0, metavar="BYTES",
                       help="above this size of the message journal on disk, every producer of persistent "
                            "messages is held (flow control); 0 = no quota (default 0)")
    store.add_argument("--store-underfull-size", type=int, default=None, metavar="BYTES",
                       help="held producers are released once the journal is below this size "
                            "(default: the overfull size)")
    store.add_argument("--store-segment-size", type=int, default=DEFAULT_SEGMENT_SIZE, metavar="BYTES",
                       help="size of the journal's segment files: it frees space a segment at a time, and, "
                            "while over the quota, by copying what is queued to a new segment once that fits "
                            f"under the underfull size (default {DEFAULT_SEGMENT_SIZE})")
    memory = p.add_argument_group("memory alarm (RabbitMQ's vm_memory_high_watermark)")
    memory.add_argument("--memory-high-watermark", default=str(DEFAULT_HIGH_SHARE), metavar="BYTES|FRACTION",
                        help="above this much resident memory every producer is held until the alarm clears: a "
                             "number of bytes, or a fraction (with a point) of the memory available (the RAM, or "
                             f"the address-space limit if lower); 0 = no alarm (default {DEFAULT_HIGH_SHARE})")
    memory.add_argument("--memory-low-watermark", default=None, metavar="BYTES|FRACTION",
                        help="the alarm clears below this; bytes or a fraction as above (default "
                             f"{DEFAULT_LOW_SHARE:g} of the high watermark)")
    add_tool_options(p)
    _apply_settings(p, argv, dict(os.environ) if environ is None else environ)
    args = p.parse_args(argv)
    try:
        args.memory_high = _watermark("--memory-high-watermark", args.memory_high_watermark)
        args.memory_low = (int(args.memory_high * DEFAULT_LOW_SHARE) if args.memory_low_watermark is None
                           else _watermark("--memory-low-watermark", args.memory_low_watermark))
    except ValueError as exc:
        p.error(str(exc))
    if args.memory_low > args.memory_high:
        p.error(f"--memory-low-watermark ({args.memory_low} bytes) must not be above --memory-high-watermark "
                f"({args.memory_high} bytes)")
    if not 0 <= args.port <= 65535:
        p.error(f"--port must be 0..65535, not {args.port}")
    if args.mgmt_port is None:
        # An ephemeral broker (tests, side-by-side runs) must not collide on the fixed default.
        args.mgmt_port = 0 if args.port == 0 else DEFAULT_MGMT_PORT
    if not 0 <= args.mgmt_port <= 65535:
        p.error(f"--mgmt-port must be 0..65535, not {args.mgmt_port}")
    if not 0 <= args.queue_purge_interval < 86400:
        p.error(f"--queue-purge-interval must be 0 (no sweep) or more, and less than a day, "
                f"not {args.queue_purge_interval:g}")
    if not 0 < args.mgmt_timeout < 86400:
        p.error(f"--mgmt-timeout must be more than 0 seconds and less than a day, not {args.mgmt_timeout:g}")
    for name in args.mgmt_allowed_hosts:
        problem = allowed_host_problem(name)
        if problem is not None:
            p.error(f"--mgmt-allowed-host: {problem}")
    if args.data_dir == "":
        p.error("--data-dir must name a directory (or use --no-data-dir)")
    if args.data_dir is None:
        given = [opt for opt, value in (("--store-overfull-size", args.store_overfull_size),
                                        ("--store-underfull-size", args.store_underfull_size)) if value]
        if given or args.store_segment_size != DEFAULT_SEGMENT_SIZE:
            p.error(f"{(given or ['--store-segment-size'])[0]} needs a data directory: with --no-data-dir "
                    "nothing is stored")
    try:
        args.store_quota = QuotaLimits(args.store_overfull_size, args.store_underfull_size)
        args.store_quota.check_reachable(SMALLEST_JOURNAL)
    except QuotaError as exc:
        p.error(str(exc))
    if not MIN_SEGMENT_SIZE <= args.store_segment_size <= MAX_SEGMENT_SIZE:
        p.error(f"--store-segment-size must be {MIN_SEGMENT_SIZE}..{MAX_SEGMENT_SIZE} bytes, "
                f"not {args.store_segment_size}")
    for option in ("max_connections", "connection_limit_per_ip", "connection_limit_per_user", "max_negotiate_time",
                   "max_unfinished_input"):
        if getattr(args, option) < 0:
            p.error(f"--{option.replace('_', '-')} must be 0 (no limit) or more, not {getattr(args, option)}")
    if not 0 <= args.idle_timeout < 86400 * 365:  # NaN fails too: no timer takes it
        p.error(f"--idle-timeout must be 0 (never) or a number of seconds, not {args.idle_timeout:g}")
    args.limits = ConnectionLimits(args.max_connections, args.connection_limit_per_ip,
                                   args.max_negotiate_time / 1000, args.idle_timeout, args.connection_limit_per_user,
                                   args.max_unfinished_input)
    if args.amqp_credit_window < 1:
        p.error(f"--amqp-credit-window must be at least 1, not {args.amqp_credit_window}")
    if args.max_frame_size < MIN_MAX_FRAME_SIZE:
        p.error(f"--max-frame-size must be at least {MIN_MAX_FRAME_SIZE}")
    if args.ssl_cert_file is None and (args.ssl_key_file is not None or args.ssl_port is not None):
        p.error("--ssl-key-file and --ssl-port need --ssl-cert-file")
    if args.ssl_cert_file is None and (args.ssl_ca_file is not None or args.ssl_require_client_auth):
        p.error("--ssl-ca-file and --ssl-require-client-authentication need --ssl-cert-file (the broker's own "
                "certificate: client certificates are checked only on TLS connections)")
    if args.ssl_require_client_auth and args.ssl_ca_file is None:
        p.error("--ssl-require-client-authentication needs --ssl-ca-file FILE: the CA certificates that sign the "
                "clients' certificates")
    if args.require_encryption and args.ssl_cert_file is None:
        p.error("--require-encryption needs --ssl-cert-file (and --ssl-key-file): without TLS there would be no way in")
    if args.require_encryption and not args.mgmt_ssl:
        p.error("--require-encryption with --mgmt-ssl no would still take credentials in clear on the management "
                "port: leave --mgmt-ssl yes")
    args.mgmt_ssl = args.mgmt_ssl and args.ssl_cert_file is not None
    if args.ssl_port is None:
        args.ssl_port = 0 if args.port == 0 else 5671
    if not 0 <= args.ssl_port <= 65535:
        p.error(f"--ssl-port must be 0..65535, not {args.ssl_port}")
    if args.auth is None and not is_loopback(args.host):
        p.error(f"--host {args.host} is not a loopback address: say --auth yes (with --sasl-db FILE) or, to let "
                "anyone in, --auth no")
    if args.auth is None:
        args.auth = args.sasl_db is not None
    if args.auth and args.sasl_db is None:
        p.error("--auth yes needs --sasl-db FILE (create users with qflow-passwd --sasl-db FILE USER)")
    try:
        args.defaults = FlowDefaults(args.default_flow_stop_threshold, args.default_flow_resume_threshold,
                                     args.default_queue_limit)
    except SettingsError as exc:
        p.error(str(exc))
    return args


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one ('' and 0.0.0.0 are every interface)."""
    if not host:
        return False
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False  # qflowd then fails to listen, naming the host
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def _watermark(option: str, text: str) -> int:
    """A watermark in bytes: ``text`` is a whole number of bytes, or a fraction
    (0 < f <= 1, written with a point) of the memory available."""
    try:
        if "." in text:
            share = float(text)
            if not 0 < share <= 1:
                raise ValueError
            return int(share * available_memory())
        value = int(text)
        if value < 0:
            raise ValueError
        return value
    except ValueError:
        raise ValueError(f"{option} must be a number of bytes (0 or more) or a fraction of the memory "
                         f"available such as 0.4, not {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if args.log_format == "json"
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    log.info("qflowd %s starting (pid %d)", __version__, os.getpid())
    failed: BaseException | None = None
    try:
        trio.run(run, args)
    except* (ListenError, StoreError, SaslDbError, TlsError, AclFileError) as group:  # trio wraps what the nursery raised
        failed = group
        while isinstance(failed, BaseExceptionGroup):
            failed = failed.exceptions[0]
    if failed is not None:
        log.error("qflowd stopped: %s", failed)
        sys.stderr.write(f"qflowd: {failed}\n")
        return 1
    log.info("qflowd stopped (pid %d)", os.getpid())
    return 0


class JsonFormatter(logging.Formatter):
    """--log-format json: one JSON object a line, UTC time with milliseconds."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
                 .replace("+00:00", "Z"), "level": record.levelname.lower(), "logger": record.name,
                 "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


if __name__ == "__main__":
    sys.exit(main())
