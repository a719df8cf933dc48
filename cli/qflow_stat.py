"""qflow-stat: a qflow broker's statistics, as qpid-stat shows qpidd's.

    qflow-stat [-b HOST:PORT] -g          broker summary (the default), unroutable messages, the store's quota state,
                                          the memory alarm
    qflow-stat [-b HOST:PORT] -q [NAME]   queues: depth, bytes, flow state, times stopped, held transfers;
                                          with NAME, every statistic of that queue
    qflow-stat [-b HOST:PORT] -e          exchanges: messages in, routed out, dropped unroutable
    qflow-stat [-b HOST:PORT] -u          subscriptions
    qflow-stat [-b HOST:PORT] -c          connections, their sessions and what holds them
    qflow-stat ... --watch SECS           refresh every SECS seconds until interrupted
    qflow-stat ... --json                 the management API's JSON instead of a table

-b is the broker's address, as for qflow-send: the management API's port is
learnt from the broker (or given with --mgmt-url). Reads qflowd's management
API; exit 1 with the reason if it cannot.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ._addresses import broker_address, mgmt_address
from ._errors import ToolError
from ._management import Management, add_address_options, name_path, open_management
from ._options import add_tool_options, positive_float
from ._output import duration, human_bytes, table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qflow-stat", description="Show a qflow broker's statistics.")
    add_address_options(p)
    view = p.add_mutually_exclusive_group()
    view.add_argument("-g", "--general", dest="view", action="store_const", const="general",
                      help="broker summary (default)")
    view.add_argument("-q", "--queues", dest="queue", nargs="?", const="", default=None, metavar="NAME",
                      help="queues; with NAME, every statistic of that queue")
    view.add_argument("-e", "--exchanges", dest="view", action="store_const", const="exchanges",
                      help="exchanges: messages in, routed out and dropped unroutable")
    view.add_argument("-u", "--subscriptions", dest="view", action="store_const", const="subscriptions",
                      help="subscriptions (consumers)")
    view.add_argument("-c", "--connections", dest="view", action="store_const", const="connections",
                      help="connections and their held sessions")
    p.add_argument("-S", "--sort-by", metavar="COLUMN", help="sort the rows by this column (descending for numbers)")
    p.add_argument("-L", "--limit", type=int, default=0, metavar="N", help="show at most N rows")
    p.add_argument("--watch", type=positive_float, metavar="SECS", help="refresh every SECS seconds")
    p.add_argument("--json", action="store_true", help="print the management API's JSON instead of a table")
    p.add_argument("-t", "--timeout", type=positive_float, default=10.0, metavar="SECS",
                   help="seconds to wait for the broker (default 10)")
    add_tool_options(p)
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
    if args.queue:
        return queue_detail(api, args)
    if args.json:
        return dump(api.get("/api/queues"))
    rows = [(q["name"], q["durable"], q["autoDelete"], q["exclusive"], q["msgDepth"], q["msgTotalEnqueues"],
             q["msgTotalDequeues"], q["byteDepth"], q["byteTotalEnqueues"], q["byteTotalDequeues"],
             q["consumerCount"], q["bindingCount"], q["flowStopped"], q["flowStoppedCount"], q["heldTransfers"])
            for q in api.get("/api/queues")]
    return "Queues\n" + table(QUEUE_HEADERS, _sorted(QUEUE_HEADERS, rows, args))


CONNECTION_HEADERS = ("connection", "name", "user", "protocol", "connected", "session", "capacity", "incomplete", "held", "unacked",
                      "heldBy")


def queue_detail(api: Management, args: argparse.Namespace) -> str:
    """-q NAME: every statistic of one queue, one per line."""
    q = api.get(name_path("/api/queues", args.queue))
    if args.json:
        return dump(q)
    width = max(len(k) for k in q)
    lines = [f"  {k.ljust(width)}  {_cell_text(v)}" for k, v in q.items() if k != "name"]
    return f"Properties of queue '{_cell_text(q['name'])}'\n" + "\n".join(lines)


def _cell_text(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, dict | list | bool) or value is None else str(value)
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


EXCHANGE_HEADERS = ("exchange", "type", "dur", "bind", "msgIn", "msgOut", "msgDrop", "byteIn", "byteOut",
                    "byteDrop")


def exchanges_view(api: Management, args: argparse.Namespace) -> str:
    exchanges = api.get("/api/exchanges")
    if args.json:
        return dump(exchanges)
    rows = [(e["name"] or "<default>", e["type"], e["durable"], e["bindingCount"], e["msgReceives"], e["msgRoutes"],
             e["msgDrops"], e["byteReceives"], e["byteRoutes"], e["byteDrops"]) for e in exchanges]
    return "Exchanges\n" + table(EXCHANGE_HEADERS, _sorted(EXCHANGE_HEADERS, rows, args))


SUBSCRIPTION_HEADERS = ("subscr", "queue", "conn", "connName", "protocol", "session", "browse", "acked", "excl", "creditMode",
                        "delivered")


def subscriptions_view(api: Management, args: argparse.Namespace) -> str:
    subs = api.get("/api/subscriptions")
    if args.json:
        return dump(subs)
    # An unnamed session (most are) by its channel number, as -c shows it: 0 is a session too.
    rows = [(s["subscription"], s["queue"], s["connection"], s["connectionName"], s["protocol"],
             s["session"] or str(s["channel"]),
             s["browse"], s["acked"], s["exclusive"], s["creditMode"], s["delivered"]) for s in subs]
    return "Subscriptions\n" + table(SUBSCRIPTION_HEADERS, _sorted(SUBSCRIPTION_HEADERS, rows, args))


def connections_view(api: Management, args: argparse.Namespace) -> str:
    if args.json:
        return dump(api.get("/api/connections"))
    rows = []
    for c in api.get("/api/connections"):
        sessions = c["sessions"] or [None]
        for s in sessions:
            if s is None:
                rows.append((c["peer"], c["name"], c["user"], c["protocol"], duration(c["connectedSeconds"]), "", "", "",
                             "", "", ""))
                continue
            held_by = ", ".join(f"{h.get('queue') or h['holder']} ({duration(h['heldSeconds'])})" for h in s["heldBy"])
            rows.append((c["peer"], c["name"], c["user"], c["protocol"], duration(c["connectedSeconds"]),
                         s["name"] or str(s["channel"]),
                         s["senderCapacity"], s["incompleteCommands"], s["heldTransfers"], s["unackedDeliveries"],
                         held_by))
    return "Connections\n" + table(CONNECTION_HEADERS, _sorted(CONNECTION_HEADERS, rows, args))


def general_view(api: Management, args: argparse.Namespace) -> str:
    """-g: two tables, the broker's traffic and its resources (the store, the memory alarm), each
    narrow enough for a terminal; sizes in human units (:func:`human_bytes`)."""
    info = api.get("/api/broker")
    if args.json:
        return dump(info)
    t, o = info["totals"], info["options"]
    traffic = [(duration(info["uptimeSeconds"]), t["connections"], t["sessions"], t["exchanges"], t["queues"],
                t["msgDepth"], human_bytes(t["byteDepth"]), t["flowStoppedQueues"], t["heldSessions"],
                t["heldTransfers"], t["discardsNoRoute"])]
    traffic_head = ("uptime", "conn", "sess", "exch", "queue", "msg", "bytes", "flowStopped", "heldSess", "held",
                    "unroutable")
    resources = [(human_bytes(info["storeSize"]), info["storeOverfull"], info["storeOverfullCount"],
                  human_bytes(info["memoryUsed"]), human_bytes(info["memoryHighWatermark"]),
                  human_bytes(info["memoryLowWatermark"]), info["memoryAlarm"], info["memoryAlarmCount"])]
    resources_head = ("storeSize", "storeOverfull", "overfulls", "memoryUsed", "memHigh", "memLow", "memoryAlarm",
                      "alarms")
    quota = f"store quota {o['storeOverfullSize']}/{o['storeUnderfullSize']} bytes" \
        if o.get("storeOverfullSize") else "no store quota"
    return (f"Broker Summary (qflowd {info['version']} at {api.address}, accounting {o['accounting']}, flow defaults "
            f"{o['defaultFlowStopThreshold']}%/{o['defaultFlowResumeThreshold']}%)\n"
            + table(traffic_head, traffic)
            + f"\n\nResources ({quota}; sizes in bytes, K/M/G/T = 1024^1..4)\n" + table(resources_head, resources))


def dump(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True)


VIEWS = {"general": general_view, "queues": queues_view, "exchanges": exchanges_view,
         "subscriptions": subscriptions_view, "connections": connections_view}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    view = VIEWS["queues" if args.queue is not None else args.view or "general"]
    broker_address(parser, args.broker)  # usage errors before anything is sent
    if args.mgmt_url:
        mgmt_address(parser, args.mgmt_url)
    in_place = sys.stdout.isatty()
    api = None
    try:
        api = open_management(parser, args, "qflow-stat")
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
        if api is not None:
            api.close()


if __name__ == "__main__":
    sys.exit(main())
