"""The latency benchmark's tracing shim (bench/latency.py --trace), for its processes only.

Python imports ``sitecustomize`` at start-up from sys.path: bench/latency.py
puts this folder on PYTHONPATH, with QFLOW_LATENCY_TRACE naming the file to
write, for the producer, the consumer and qflowd of a traced point, and for
no other process. Nothing of qflow is changed: the shim wraps trio's
``SocketStream.send_all`` and ``receive_some``, which qflowd's connections
and the client's use, and stamps (CLOCK_MONOTONIC, ns) every traced message
found whole in the bytes written (as the write began) or read (as the read
returned). A traced message's body holds bench/latency.py's tag and,
after it, its sequence number. At exit (qflowd: SIGTERM) the stamps are
written as JSON: ``{"sent": [[seq, ns], ...], "received": [...]}``.
"""

import os

_OUT = os.environ.get("QFLOW_LATENCY_TRACE")

if _OUT:
    import atexit
    import json
    import struct
    import time

    import trio

    TAG = b"\xffQFLTRC\xff"  # bench/latency.py's TRACE_TAG
    _seq = struct.Struct("<q").unpack_from
    _clock = time.monotonic_ns
    _stamps: dict = {"sent": [], "received": []}

    def _find(data, into: list, t: int) -> None:
        if not isinstance(data, (bytes, bytearray)):
            data = bytes(data)
        i = data.find(TAG)
        while i >= 0:
            if i + 16 <= len(data):
                into.append((_seq(data, i + 8)[0], t))
            i = data.find(TAG, i + 16)

    _send_all = trio.SocketStream.send_all
    _receive_some = trio.SocketStream.receive_some

    async def send_all(self, data) -> None:
        t = _clock()  # as the write begins: the peer may read the bytes before the call returns
        await _send_all(self, data)
        _find(data, _stamps["sent"], t)

    async def receive_some(self, max_bytes=None):
        data = await _receive_some(self, max_bytes)
        _find(data, _stamps["received"], _clock())
        return data

    trio.SocketStream.send_all = send_all
    trio.SocketStream.receive_some = receive_some

    @atexit.register
    def _write() -> None:
        with open(_OUT, "w") as f:
            json.dump(_stamps, f)
