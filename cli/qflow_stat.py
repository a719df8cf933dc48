"""qflow-stat: a qflow broker's statistics, as qpid-stat shows qpidd's.

    qflow-stat [-b HOST:PORT] -g          broker summary (the default), the store's size and quota state
    qflow-stat [-b HOST:PORT] -q          queues: depth, bytes, flow state, times stopped, held transfers
    qflow-stat [-b HOST:PORT] -c          connections, their sessions and what holds them
    qflow-stat ... --watch SECS           refresh every SECS seconds until interrupted

Reads qflowd's management API; exit 1 with the reason if it cannot.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ._common import (
    DEFAULT_MGMT,
    Management,
    ToolError,
    broker_address,
    duration,
    positive_float,
    table,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qflow-stat", description="Show a qflow broker's statistics.")
    p.add_argument("-b", "--broker", "-a", "--broker-addr", dest="broker", default=DEFAULT_MGMT,
                   metavar="[USER/PASS@]HOST:PORT",
                   help=f"the broker's management address, with the credentials of a user when it runs --auth yes "
                        f"(default {DEFAULT_MGMT})")
    view = p.add_mutually_exclusive_group()
    view.add_argument("-g", "--general", dest="view", action="store_const", const="general",
                      help="broker summary (default)")
    view.add_argument("-q", "--queues", dest="view", action="store_const", const="queues", help="queues")
    view.add_argument("-c", "--connections", dest="view", action="store_const", const="connections",
                      help="connections and their held sessions")
    p.add_argument("-S", "--sort-by", metavar="COLUMN", help="sort the rows by this column (descending for numbers)")
    p.add_argument("-L", "--limit", type=int, default=0, metavar="N", help="show at most N rows")
    p.add_argument("--watch", type=positive_float, metavar="SECS", help="refresh every SECS seconds")
    p.add_argument("-t", "--timeout", type=positive_float, default=10.0, metavar="SECS",
                   help="seconds to wait for the broker (default 10)")
    return p


def _sorted(headers: tuple[str, ...], rows: list[tuple[Any, ...]], args: argparse.Namespace) -> list[tuple[Any, ...]]:
    if args.sort_by:
        if args.sort_by not in headers:
            raise ToolError(f"no column {args.sort_by!r}; columns: {', '.join(headers)}")
        i = headers.index(args.sort_by)
        numbers = all(isinstance(r[i], int | float) for r in rows)
        rows = sorted(rows, key=lambda r: r[i] if numbers else str(r[i]), reverse=numbers)
    return rows[: args.limit] if args.limit > 0 else rows


QUEUE_HEADERS = ("queue", "dur", "autoDel", "excl", "msg", "msgIn", "msgOut", "bytes", "bytesIn", "bytesOut",
                 "cons", "bind", "flowStopped", "stops", "held")


def queues_view(api: Management, args: argparse.Namespace) -> str:
    rows = [(q["name"], q["durable"], q["autoDelete"], q["exclusive"], q["msgDepth"], q["msgTotalEnqueues"],
             q["msgTotalDequeues"], q["byteDepth"], q["byteTotalEnqueues"], q["byteTotalDequeues"],
             q["consumerCount"], q["bindingCount"], q["flowStopped"], q["flowStoppedCount"], q["heldTransfers"])
            for q in api.get("/api/queues")]
    return "Queues\n" + table(QUEUE_HEADERS, _sorted(QUEUE_HEADERS, rows, args))


CONNECTION_HEADERS = ("connection", "name", "user", "connected", "session", "capacity", "incomplete", "held", "unacked",
                      "heldBy")


def connections_view(api: Management, args: argparse.Namespace) -> str:
    rows = []
    for c in api.get("/api/connections"):
        sessions = c["sessions"] or [None]
        for s in sessions:
            if s is None:
                rows.append((c["peer"], c["name"], c["user"], duration(c["connectedSeconds"]), "", "", "", "", "", ""))
                continue
            held_by = ", ".join(f"{h['queue']} ({duration(h['heldSeconds'])})" for h in s["heldBy"])
            rows.append((c["peer"], c["name"], c["user"], duration(c["connectedSeconds"]), s["name"] or str(s["channel"]),
                         s["senderCapacity"], s["incompleteCommands"], s["heldTransfers"], s["unackedDeliveries"],
                         held_by))
    return "Connections\n" + table(CONNECTION_HEADERS, _sorted(CONNECTION_HEADERS, rows, args))


def general_view(api: Management, args: argparse.Namespace) -> str:
    info = api.get("/api/broker")
    t, o = info["totals"], info["options"]
    rows = [(f"qflowd {info['version']}", duration(info["uptimeSeconds"]), t["connections"], t["sessions"],
             t["exchanges"], t["queues"], t["msgDepth"], t["byteDepth"], t["flowStoppedQueues"], t["heldSessions"],
             t["heldTransfers"], info["storeSize"], info["storeOverfull"], info["storeOverfullCount"])]
    head = ("broker", "uptime", "conn", "sess", "exch", "queue", "msg", "bytes", "flowStopped", "heldSess", "held",
            "storeSize", "storeOverfull", "overfulls")
    quota = f", store quota {o['storeOverfullSize']}/{o['storeUnderfullSize']} bytes" \
        if o.get("storeOverfullSize") else ""
    return (f"Broker Summary ({api.address}, accounting {o['accounting']}, flow defaults "
            f"{o['defaultFlowStopThreshold']}%/{o['defaultFlowResumeThreshold']}%{quota})\n" + table(head, rows))


VIEWS = {"general": general_view, "queues": queues_view, "connections": connections_view}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    url = broker_address(parser, args.broker, 8672)
    view = VIEWS[args.view or "general"]
    api = Management(url.host, url.port, args.timeout, url.username, url.password)
    in_place = sys.stdout.isatty()
    try:
        while True:
            text = view(api, args)
            if args.watch is None:
                print(text)
                return 0
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            header = f"{stamp}  every {args.watch:g}s  (Ctrl-C to stop)\n"
            if in_place:
                # Home the cursor and clear the screen: redraw in place, as watch(1) does.
                sys.stdout.write("\x1b[H\x1b[2J" + header + text + "\n")
            else:
                sys.stdout.write(header + text + "\n\n")
            sys.stdout.flush()
            time.sleep(args.watch)
    except ToolError as exc:
        sys.stderr.write(f"Failed: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 0  # the way out of --watch
    finally:
        api.close()


if __name__ == "__main__":
    sys.exit(main())
