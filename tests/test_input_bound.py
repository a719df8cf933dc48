"""Input held in unfinished frames (issue 17: "half-sent frames cost about
2 MB of RSS per connection"): the decoder holds a pending byte once, and
qflowd bounds the total over its connections (--max-unfinished-input)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgpack

from qflow import protocol as P
from qflow.protocol.framing import KEEP_PENDING, PROTOCOL_HEADER, FrameDecoder

KIB = 1024

# Run in a fresh interpreter: its resident set grows by what the decoders keep.
# A fixed mmap threshold makes every large buffer its own mapping, so a freed
# one leaves the resident set, and pages allocated but never written are not in it.
_HALF_FRAMES = r"""
import json, os, re, sys
import msgpack
from qflow import protocol as P
from qflow.protocol.framing import FrameDecoder, PROTOCOL_HEADER

def rss():
    return int(re.search(r"VmRSS:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

n, size, read = int(sys.argv[1]), int(sys.argv[2]), 64 * 1024
decoders = []
before = rss()
held = 0
for _ in range(n):
    d = FrameDecoder(expect_header=True)
    frame = msgpack.packb([P.TRANSFER, 0, "", "q", None, os.urandom(size)])
    data = PROTOCOL_HEADER + frame[: len(frame) // 2]
    del frame
    for i in range(0, len(data), read):  # as qflowd reads it: a read at a time, each decoded
        d.feed(data[i:i + read])
        assert list(d.frames()) == []
    held += d.pending
    del data
    decoders.append(d)
print(json.dumps({"pending": held, "grown": rss() - before}))
"""


def test_a_half_sent_frame_is_held_once():
    """The issue's finding, as a unit: 20 decoders each fed the first half of
    a 500 KB transfer frame, a 64 KiB read at a time, grow the resident set by
    about the bytes pending, not twice them (the decoder kept its own chunks
    besides the msgpack Unpacker's buffer: 2.0x before the fix)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", _HALF_FRAMES, "20", "500000"], env=env, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    got = json.loads(out)
    assert got["pending"] == 20 * (len(msgpack.packb([P.TRANSFER, 0, "", "q", None, bytes(500000)])) // 2)
    assert got["grown"] <= 1.2 * got["pending"], got


def test_a_large_frame_over_many_reads_decodes_whole():
    """Past KEEP_PENDING the decoder no longer keeps the frame's first reads:
    the frame still decodes whole, and frame_tail says None (the broker
    encodes the message again) instead of returning wrong bytes."""
    body = os.urandom(3 * KEEP_PENDING)
    small = msgpack.packb([P.TRANSFER, 0, "", "q", None, b"x"])
    data = PROTOCOL_HEADER + msgpack.packb([P.TRANSFER, 0, "", "q", None, body]) + small
    d = FrameDecoder()
    frames, tails = [], []
    for i in range(0, len(data), 10_000):
        d.feed(data[i:i + 10_000])
        for frame in d.frames():
            frames.append(frame)
            tails.append(d.frame_tail(b"\x96\x1e\x00"))
    assert [f[5] for f in frames] == [body, b"x"]
    assert tails == [None, small[3:]]
    assert d.pending == 0
