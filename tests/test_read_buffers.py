"""qflow's reads stay in the C allocator's heap (qflow.transport.read_buffers).

Each read asks for 256 KiB; above glibc's default mmap threshold that is a
fresh mapping per read, whose pages fault in every time. The end-to-end test
counts qflowd's page faults while it reads about 10 MB: one per 4 KiB page
read without the raised threshold (checked by running it with glibc's own
tunable pinning the threshold to its default), a few with it.
"""

from __future__ import annotations

import os

import pytest
import trio

import qflow
from qflow.testing import Daemon, start
from qflow.transport.read_buffers import keep_read_buffers_in_heap

COUNT = 150_000
SIZE = 64


def test_the_thresholds_are_set_once_per_process_on_glibc() -> None:
    assert keep_read_buffers_in_heap() is True
    assert keep_read_buffers_in_heap() is True  # the second call finds them set


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # field 10, minflt


async def _traffic(port: int) -> int:
    """Send COUNT messages through queue ``faults`` and fetch them; the bytes sent."""
    async with qflow.open_connection("127.0.0.1", port) as conn:
        ssn = await conn.session()
        await ssn.declare_queue("faults", arguments={"qpid.flow_stop_count": 0, "qpid.flow_stop_size": 0,
                                                     "qpid.max_size": 0})
        sender = ssn.sender("faults", capacity=1000)
        receiver = await ssn.receiver("faults", capacity=1000)
        left = COUNT

        async def consume() -> None:
            nonlocal left
            while left:
                left -= len(await receiver.fetch_many(left, timeout=60))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume)
            for _ in range(COUNT // 1000):
                await sender.send_many([b"x" * SIZE] * 1000)
            await sender.sync()
    return COUNT * SIZE


@pytest.mark.parametrize("pinned", [False, True], ids=["qflow's thresholds", "glibc's default pinned"])
def test_qflowd_reads_without_faulting_in_a_page_per_page_read(pinned: bool) -> None:
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"} if pinned else None
    d: Daemon = start("--no-data-dir", env=env)
    try:
        trio.run(_traffic, d.port)  # warm: queues, buffers and caches at their size
        before = _minor_faults(d.proc.pid)
        body_bytes = trio.run(_traffic, d.port)
        faults = _minor_faults(d.proc.pid) - before
    finally:
        d.stop()
    pages = body_bytes // 4096
    if pinned:  # the test can fail: with reads mapped afresh, about one fault per page read
        assert faults > pages // 2, (faults, pages)
    else:
        assert faults < pages // 5, (faults, pages)
