"""Sender.send's own cost per call, no I/O: another tree's qflow/client/sender.py
(A) against this tree's (B), both loaded into one process and timed in
alternation, so that the machine's drift falls on both alike (bench/README.md).

    git archive main qflow | tar -x -C /tmp/base
    .venv/bin/python bench/sender_path.py --base /tmp/base

Each sample is ``--sends`` calls of ``await sender.send(body)`` (64 bytes, one
size: the per-message fast path) on a sender whose session and connection are
stand-ins: transfers are numbered and their bytes queued as usual, nothing is
written, and the window never fills. Samples of A and B alternate (A B, B A, ...);
reported: each one's median ns per send, and the median over adjacent pairs of
B/A; for a plain sender, then a durable one. Only sender.py comes from
``--base``: everything it imports is this tree's. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import trio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from qflow.protocol.commands import OutgoingCommands  # noqa: E402


def load_sender(name: str, tree: str) -> type:
    spec = importlib.util.spec_from_file_location(name, os.path.join(tree, "qflow", "client", "sender.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Sender


class _Event:
    def set(self) -> None:
        pass


class _Encoder:
    def __init__(self) -> None:
        self.parts: list[bytes] = []


class _Connection:
    max_frame_size = 1024 * 1024  # the negotiated frame size a sender checks a new body size against

    def __init__(self) -> None:
        self.encoder = _Encoder()
        # The writer's wake-up, under both names a tree's sender may set it by.
        self.wakeup = self._wake = _Event()


class _Session:
    """What a Sender reads of its session on the fast path."""

    channel = 1
    error = None

    def __init__(self) -> None:
        self.commands = OutgoingCommands()
        self.conn = _Connection()

    def check(self) -> None:
        pass


async def sample(sender, sends: int, body: bytes) -> float:
    """ns per send over ``sends`` calls."""
    sender._parts.clear()
    sender.incomplete = 0
    send = sender.send
    t0 = time.perf_counter()
    for _ in range(sends):
        await send(body)
    return (time.perf_counter() - t0) / sends * 1e9


async def measure(a_cls: type, b_cls: type, samples: int, sends: int) -> dict:
    out: dict = {}
    body = b"x" * 64
    for durable in (False, True):
        kind = "durable" if durable else "plain"
        a = a_cls(_Session(), "", "bench", 1 << 40, None, 5.0, None, durable)
        b = b_cls(_Session(), "", "bench", 1 << 40, None, 5.0, None, durable)
        ra, rb = [], []
        for i in range(samples):
            if i % 2:
                rb.append(await sample(b, sends, body))
                ra.append(await sample(a, sends, body))
            else:
                ra.append(await sample(a, sends, body))
                rb.append(await sample(b, sends, body))
        pairs = [y / x for x, y in zip(ra, rb, strict=True)]
        out[kind] = {"A_ns_per_send": round(statistics.median(ra)), "B_ns_per_send": round(statistics.median(rb)),
                     "B_over_A": round(statistics.median(pairs), 3)}
        print(f"{kind:>8} sender: A {out[kind]['A_ns_per_send']} ns/send, B {out[kind]['B_ns_per_send']} ns/send, "
              f"B/A (median of {samples} adjacent pairs) {out[kind]['B_over_A']}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the other tree (its qflow/client/sender.py is A)")
    parser.add_argument("--samples", type=int, default=400, help="samples of each, alternated")
    parser.add_argument("--sends", type=int, default=5000, help="sends per sample")
    args = parser.parse_args()
    a_cls, b_cls = load_sender("sender_a", os.path.abspath(args.base)), load_sender("sender_b", ROOT)
    out = trio.run(measure, a_cls, b_cls, args.samples, args.sends)
    print(json.dumps({**out, "samples": args.samples, "sends": args.sends}))


if __name__ == "__main__":
    main()
