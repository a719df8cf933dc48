"""qflow-config: declare, list, modify and delete queues, exchanges and
bindings through qflowd's management API, as qpid-config does for qpidd.

    qflow-config [-b HOST:PORT] [--mgmt-url URL] [--json]  broker summary
    qflow-config queues [-r] [FILTER]                    queues with their flow settings and state
    qflow-config exchanges [-r] [FILTER]
    qflow-config add queue NAME [--durable] [--max-queue-size N] [--max-queue-count N]
                 [--limit-policy none|reject|ring|ring-strict] [--flow-stop-size N] [--flow-resume-size N]
                 [--flow-stop-count N] [--flow-resume-count N] [--argument KEY=VALUE]...
    qflow-config modify queue NAME [the same limit and flow options]
    qflow-config del queue NAME [--force | --force-if-not-empty | --force-if-used]
    qflow-config purge queue NAME
    qflow-config add exchange TYPE NAME [--durable]
    qflow-config del exchange NAME
    qflow-config bind EXCHANGE QUEUE [KEY]
    qflow-config unbind EXCHANGE QUEUE [KEY]
    qflow-config reload-acl                              read qflowd's --acl-file again
    qflow-config log-level [LEVEL]                       show, or change at run time, qflowd's log level
    qflow-config close-connection PEER                   close a client's connection (PEER as qflow-stat -c shows it)

-b is the broker's address, as for qflow-send (default localhost:5672): the
management API's port is learnt from the broker, or given with --mgmt-url.
As with qpid-config, options may come before or after the command, success is
silent, a refusal prints ``Failed: <the broker's message>`` on stderr and exits
1, and a usage error exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
from typing import Any

from ._addresses import broker_address, mgmt_address
from ._errors import ToolError
from ._management import Management, add_address_options, name_path, open_management
from ._options import add_tool_options, non_negative, positive_float
from ._output import print_json, table

# qpid-config option -> queue argument, in the order `queues` shows them.
QUEUE_OPTIONS = (
    ("max_queue_size", "qpid.max_size"),
    ("max_queue_count", "qpid.max_count"),
    ("limit_policy", "qpid.policy_type"),
    ("flow_stop_size", "qpid.flow_stop_size"),
    ("flow_resume_size", "qpid.flow_resume_size"),
    ("flow_stop_count", "qpid.flow_stop_count"),
    ("flow_resume_count", "qpid.flow_resume_count"),
)

USAGE = """qflow-config [OPTIONS]
       qflow-config [OPTIONS] queues [-r] [FILTER]
       qflow-config [OPTIONS] exchanges [-r] [FILTER]
       qflow-config [OPTIONS] add queue NAME [QUEUE OPTIONS]
       qflow-config [OPTIONS] modify queue NAME [QUEUE OPTIONS]
       qflow-config [OPTIONS] del queue NAME [--force]
       qflow-config [OPTIONS] purge queue NAME
       qflow-config [OPTIONS] add exchange TYPE NAME [--durable]
       qflow-config [OPTIONS] del exchange NAME
       qflow-config [OPTIONS] bind EXCHANGE QUEUE [KEY]
       qflow-config [OPTIONS] unbind EXCHANGE QUEUE [KEY]
       qflow-config [OPTIONS] reload-acl
       qflow-config [OPTIONS] log-level [debug|info|warning|error]
       qflow-config [OPTIONS] close-connection PEER"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qflow-config", usage=USAGE,
                                description="Configure a qflow broker's queues, exchanges and bindings.")
    p.add_argument("command", nargs="*", help=argparse.SUPPRESS)
    add_address_options(p)
    p.add_argument("-t", "--timeout", type=positive_float, default=10.0, metavar="SECS",
                   help="seconds to wait for the broker (default 10)")
    p.add_argument("-r", "--recursive", action="store_true", help="queues/exchanges: show bindings")
    p.add_argument("--json", action="store_true",
                   help="print the management API's JSON (the summary, queues, exchanges, or what a change made)")
    add_tool_options(p)
    q = p.add_argument_group("queue options (add queue, modify queue)")
    q.add_argument("--durable", action="store_true", help="the queue (or exchange) is durable")
    q.add_argument("--max-queue-size", type=non_negative, metavar="N", help="maximum bytes (qpid.max_size)")
    q.add_argument("--max-queue-count", type=non_negative, metavar="N", help="maximum messages (qpid.max_count)")
    q.add_argument("--limit-policy", choices=("none", "reject", "ring", "ring-strict"),
                   help="what happens at the limit (qpid.policy_type; default reject)")
    q.add_argument("--flow-stop-size", type=non_negative, metavar="N",
                   help="flow control starts above N bytes (qpid.flow_stop_size)")
    q.add_argument("--flow-resume-size", type=non_negative, metavar="N",
                   help="flow control ends below N bytes (qpid.flow_resume_size)")
    q.add_argument("--flow-stop-count", type=non_negative, metavar="N",
                   help="flow control starts above N messages (qpid.flow_stop_count)")
    q.add_argument("--flow-resume-count", type=non_negative, metavar="N",
                   help="flow control ends below N messages (qpid.flow_resume_count)")
    q.add_argument("--argument", action="append", default=[], metavar="KEY=VALUE",
                   help="a queue (or exchange) argument; a whole-number VALUE is sent as a number (repeatable)")
    d = p.add_argument_group("delete options (del queue)")
    d.add_argument("--force", action="store_true", help="delete even if the queue is in use or not empty")
    d.add_argument("--force-if-not-empty", action="store_true", help="delete even if the queue is not empty")
    d.add_argument("--force-if-used", action="store_true", help="delete even if the queue has consumers")
    return p


def _argument_value(text: str) -> Any:
    # qpidd accepts numbers as strings; qflowd wants real integers, so convert what looks like one.
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return text


def queue_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The arguments map for add/modify queue: --argument first, then the named
    options, which win on a clash (as in qpid-config)."""
    arguments: dict[str, Any] = {}
    for item in args.argument:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--argument expects KEY=VALUE, got {item!r}")
        arguments[key] = _argument_value(value)
    for option, key in QUEUE_OPTIONS:
        value = getattr(args, option)
        if value is not None:
            arguments[key] = value
    return arguments


def _need(parser: argparse.ArgumentParser, words: list[str], low: int, high: int, usage: str) -> None:
    if not low <= len(words) <= high:
        parser.error(f"usage: qflow-config {usage}")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser, api: Management) -> None:
    words = list(args.command)
    if not words:
        return summary(api)
    cmd, rest = words[0], words[1:]
    if cmd == "queues":
        _need(parser, rest, 0, 1, "queues [-r] [FILTER]")
        return list_queues(api, rest[0] if rest else "", args.recursive)
    if cmd == "exchanges":
        _need(parser, rest, 0, 1, "exchanges [-r] [FILTER]")
        return list_exchanges(api, rest[0] if rest else "", args.recursive)
    if cmd in ("add", "del", "modify", "purge"):
        if not rest or rest[0] not in ("queue", "exchange"):
            parser.error(f"usage: qflow-config {cmd} queue|exchange ...")
        kind, rest = rest[0], rest[1:]
        if kind == "queue":
            _need(parser, rest, 1, 1, f"{cmd} queue NAME [options]")
            name = rest[0]
            if cmd == "add":
                body: dict[str, Any] = {"durable": args.durable, "arguments": queue_arguments(args, parser)}
                api.request("PUT", name_path("/api/queues", name), body)
            elif cmd == "modify":
                if args.durable:
                    parser.error("modify queue: durability cannot change on a live queue")
                arguments = queue_arguments(args, parser)
                if not arguments:
                    parser.error("modify queue: give at least one limit, flow or --argument option")
                api.request("PATCH", name_path("/api/queues", name), {"arguments": arguments})
            elif cmd == "del":
                # qpid-config refuses to delete a queue in use or holding messages unless forced.
                checks = []
                if not (args.force or args.force_if_not_empty):
                    checks.append("if_empty=true")
                if not (args.force or args.force_if_used):
                    checks.append("if_unused=true")
                query = "?" + "&".join(checks) if checks else ""
                api.request("DELETE", name_path("/api/queues", name, query))
            else:
                api.request("POST", name_path("/api/queues", name, "/purge"))
            return None
        if cmd == "add":
            _need(parser, rest, 2, 2, "add exchange TYPE NAME")
            body = {"type": rest[0], "durable": args.durable}
            if args.argument:  # qflow's exchanges take none: the broker says why it refuses each
                body["arguments"] = queue_arguments(args, parser)
            api.request("PUT", name_path("/api/exchanges", rest[1]), body)
        elif cmd == "del":
            _need(parser, rest, 1, 1, "del exchange NAME")
            api.request("DELETE", name_path("/api/exchanges", rest[0]))
        else:
            parser.error(f"usage: qflow-config {cmd} queue NAME")
        return None
    if cmd == "log-level":
        _need(parser, rest, 0, 1, "log-level [debug|info|warning|error]")
        if rest:
            api.request("PUT", "/api/broker/log-level", {"level": rest[0]})
        else:
            print(api.get("/api/broker/log-level")["level"])
        return None
    if cmd in ("bind", "unbind"):
        _need(parser, rest, 2, 3, f"{cmd} EXCHANGE QUEUE [KEY]")
        body = {"exchange": rest[0], "queue": rest[1], "key": rest[2] if len(rest) > 2 else ""}
        api.request("POST" if cmd == "bind" else "DELETE", "/api/bindings", body)
        return None
    if cmd == "close-connection":
        _need(parser, rest, 1, 1, "close-connection PEER (the client's address, as qflow-stat -c shows it)")
        api.request("DELETE", name_path("/api/connections", rest[0]))
        return None
    if cmd == "reload-acl":
        _need(parser, rest, 0, 0, "reload-acl")
        api.request("POST", "/api/acl/reload")
        return None
    parser.error(f"unknown command {cmd!r}")
    return None


def summary(api: Management) -> None:
    info = api.get("/api/broker")
    totals, options = info["totals"], info["options"]
    print(f"Broker:          {api.address} (qflowd {info['version']}, up {int(info['uptimeSeconds'])}s)")
    print(f"Total Exchanges: {totals['exchanges']}")
    print(f"   Total Queues: {totals['queues']}")
    print(f"Bindings:        {totals['bindings']}")
    print(f"Flow defaults:   stop {options['defaultFlowStopThreshold']}%, resume "
          f"{options['defaultFlowResumeThreshold']}%, default queue limit {options['defaultQueueLimit']} bytes")


def _attributes(q: dict[str, Any]) -> str:
    """The queue's declared settings in qpid-config option syntax, to copy into `add queue`."""
    parts = ["--durable"] if q["durable"] else []
    args = dict(q["arguments"])
    for option, key in QUEUE_OPTIONS:
        if key in args:
            parts.append(f"--{option.replace('_', '-')}={args.pop(key)}")
    parts += [f"--argument={k}={v}" for k, v in args.items()]
    if q["exclusive"]:
        parts.append("exclusive")
    if q["autoDelete"]:
        parts.append("auto-delete")
    return " ".join(parts)


def list_queues(api: Management, text: str, recursive: bool) -> None:
    queues = [q for q in api.get("/api/queues") if text in q["name"]]
    if recursive:
        bindings = api.get("/api/bindings")
        for q in queues:
            print(f"Queue '{q['name']}'")
            print(f"    bind [{q['name']}] => ''")
            for b in bindings:
                if b["queue"] == q["name"]:
                    print(f"    bind [{b['key']}] => {b['exchange']}")
        return
    rows = [(q["name"], q["msgDepth"], q["byteDepth"], q["flowStopCount"], q["flowResumeCount"], q["flowStopSize"],
             q["flowResumeSize"], q["flowStopped"], q["flowStoppedCount"], q["heldTransfers"], _attributes(q))
            for q in queues]
    print(table(("Queue Name", "msg", "bytes", "stopCount", "resumeCount", "stopSize", "resumeSize",
                 "flowStopped", "stops", "held", "Attributes"), rows))


def list_exchanges(api: Management, text: str, recursive: bool) -> None:
    exchanges = [e for e in api.get("/api/exchanges") if text in e["name"]]
    if recursive:
        bindings = api.get("/api/bindings")
        queues = api.get("/api/queues") if any(e["name"] == "" for e in exchanges) else []
        for e in exchanges:
            print(f"Exchange '{e['name']}' ({e['type']})")
            if e["name"] == "":
                for q in queues:  # the default exchange's implicit bindings
                    print(f"    bind [{q['name']}] => {q['name']}")
            for b in bindings:
                if b["exchange"] == e["name"]:
                    print(f"    bind [{b['key']}] => {b['queue']}")
        return
    rows = [(e["type"], e["name"], e["bindingCount"], "--durable" if e["durable"] else "") for e in exchanges]
    print(table(("Type", "Exchange Name", "Bindings", "Attributes"), rows))


class _Recording:
    """--json: the tables are not printed; the last answer of the management API is, as it came."""

    def __init__(self, api: Management) -> None:
        self._api = api
        self.address = api.address
        self.last: Any = None

    def request(self, method: str, path: str, body: Any = None) -> Any:
        self.last = self._api.request(method, path, body)
        return self.last

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def close(self) -> None:
        self._api.close()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    broker_address(parser, args.broker)  # usage errors before anything is sent
    if args.mgmt_url:
        mgmt_address(parser, args.mgmt_url)
    api = None
    try:
        api = open_management(parser, args, "qflow-config")
        if args.json:
            api = _Recording(api)
            with contextlib.redirect_stdout(io.StringIO()):  # the tables: the JSON replaces them
                run(args, parser, api)
            print_json(api.last)
        else:
            run(args, parser, api)
    except ToolError as exc:
        sys.stderr.write(f"Failed: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if api is not None:
            api.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
