"""qflowd: the qflow broker.

    qflowd --host 127.0.0.1 --port 5672

Prints ``qflowd ready port=P mgmt-port=M`` once listening. SIGINT/SIGTERM
stop it cleanly (exit 0); a bad option exits 2 with a one-line message.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys

import trio

from qflow.accounting import load_accounting
from qflow.broker import Broker
from qflow.flow import FlowDefaults, SettingsError
from qflow.framing import DEFAULT_MAX_FRAME_SIZE, MIN_MAX_FRAME_SIZE
from qflow.server import Server


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line on stderr, exit 2
        sys.stderr.write(f"qflowd: {message}\n")
        sys.exit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(prog="qflowd", description="The qflow message broker.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=5672, help="protocol port; 0 picks a free one (default 5672)")
    p.add_argument("--max-frame-size", type=int, default=DEFAULT_MAX_FRAME_SIZE,
                   help=f"largest frame accepted, bytes (default {DEFAULT_MAX_FRAME_SIZE})")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--default-flow-stop-threshold", type=int, default=80, metavar="PCT",
                   help="flow stop threshold, percent of a queue's maximum (default 80)")
    p.add_argument("--default-flow-resume-threshold", type=int, default=70, metavar="PCT",
                   help="flow resume threshold, percent of a queue's maximum (default 70)")
    p.add_argument("--default-queue-limit", type=int, default=104857600, metavar="BYTES",
                   help="maximum size of queues declared without qpid.max_size; 0 = none (default 104857600)")
    args = p.parse_args(argv)
    if not 0 <= args.port <= 65535:
        p.error(f"--port must be 0..65535, not {args.port}")
    if args.max_frame_size < MIN_MAX_FRAME_SIZE:
        p.error(f"--max-frame-size must be at least {MIN_MAX_FRAME_SIZE}")
    try:
        args.defaults = FlowDefaults(args.default_flow_stop_threshold, args.default_flow_resume_threshold,
                                     args.default_queue_limit)
    except SettingsError as exc:
        p.error(str(exc))
    return args


async def run(args: argparse.Namespace) -> None:
    accounting = load_accounting()
    logging.getLogger("qflow").info("accounting: %s", accounting.name)
    broker = Broker(args.defaults, accounting)
    server = Server(broker, args.max_frame_size)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve, args.host, args.port)
            # Long-lived start-up objects need no more cyclic-GC scans.
            gc.collect()
            gc.freeze()
            print(f"qflowd ready port={port} mgmt-port=0", flush=True)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        trio.run(run, args)
    except OSError as exc:
        sys.stderr.write(f"qflowd: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
