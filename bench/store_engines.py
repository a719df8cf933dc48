"""Durable store engines for issue 14, measured on the broker's workload shape.

No broker is involved: each candidate engine is driven the way the broker
would drive it. Messages are opaque byte strings (64 B or 1 KiB) with a small
store header (queue id, sequence number in that queue). They arrive in batches
of ``--batch`` enqueues (one socket read's worth); every batch is made durable
with one sync (one ``os.fdatasync``, one SQLite ``synchronous=FULL`` WAL
commit, one LMDB write transaction), and the consumer's accepts (removals)
follow ``--lag`` batches behind, each accept batch written with the next
enqueue batch's sync.

Engines:

* ``journal-msg``: an append-only segmented journal of our own, one record per
  message (``length, crc32, type, queue, seq, body``) and one per accepted range.
* ``journal-batch``: the same journal, one record per batch (Kafka's record
  batch): a header of runs ``(queue, first seq, count)``, the bodies' lengths,
  the bodies, one crc32 over it all. Nothing of a batch was confirmed before
  its sync returned, so losing a torn batch whole loses nothing confirmed.
* ``journal-batch-crc32c``: journal-batch with CRC-32C (the ``crc32c`` package,
  hardware instructions) instead of ``zlib.crc32``.
* ``journal-batch-nocompact``: the same without carry-forward compaction:
  segments are deleted from the head only, so one unconsumed old message pins
  the journal (only run in the ``steady`` phase, to show that).
* ``sqlite``: stdlib sqlite3, WAL, ``synchronous=FULL``, ``auto_vacuum=INCREMENTAL``,
  one rowid table keyed by ``queue << 40 | seq``.
* ``lmdb``: the ``lmdb`` package (optional extra ``store-bench``), keys
  ``queue, seq`` big-endian, default (fully synced) commits.

Phases, for each engine and body size, repeated ``--reps`` times interleaved:

* ``fill``: enqueue ``--messages`` messages, no accepts, one sync per batch.
* ``recover``: close, drop the store's files from the page cache
  (``posix_fadvise DONTNEED``), then in a fresh process (as a restarted broker:
  a new heap) reopen and rebuild every queue as a Python list of bytes, in
  order; its wall time and peak RSS.
* ``drain``: accept every message of the full store, in batches, one sync each;
  then the engine's reclaim step (SQLite ``incremental_vacuum`` + WAL truncate,
  LMDB compacting copy; the journal needs none: dead segments are unlinked).
* ``steady``: a fresh store, enqueue + accept with the consumer ``--lag`` batches
  behind, plus one message enqueued first on another queue and never accepted
  (the pin: a slow queue must not keep the disk from shrinking). Run twice:
  ``serial`` (prepare, write and sync inline) and ``group`` (trio: the loop
  prepares batches while a worker thread from ``trio.to_thread`` writes and
  syncs everything pending, at most ``--window`` batches unconfirmed).

Also ``--probe``: crc32 implementations per record size, and the cost of one
fdatasync by write size and file mode (append, fallocated, pre-zeroed).

Figures drift on these shared 2-core machines: compare within one run, read the
load average and spin-loop probe printed with them. The last line is JSON.
"""

from __future__ import annotations

import argparse
import array
import gc
import itertools
import json
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
import zlib
from collections import deque

try:
    import lmdb
except ImportError:  # optional extra: pip install -e '.[store-bench]'
    lmdb = None
try:
    import crc32c as crc32c_mod
except ImportError:
    crc32c_mod = None

crc32 = zlib.crc32

# ---------------------------------------------------------------------------
# helpers


def spin_loop() -> float:
    """The same fixed pure-Python workload as bench/run.py: this machine's speed now."""
    t0 = time.perf_counter()
    x = 0
    for i in range(3_000_000):
        x += i & 7
    return time.perf_counter() - t0


def disk_usage(path: str) -> tuple[int, int]:
    """(apparent bytes, allocated bytes) of every file under ``path``."""
    size = alloc = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                st = os.stat(os.path.join(root, f))
            except FileNotFoundError:
                continue
            size += st.st_size
            alloc += st.st_blocks * 512
    return size, alloc


def drop_cache(path: str) -> None:
    """Evict the store's own (clean, synced) pages from the page cache: a cold open."""
    for root, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def filesystem_of(path: str) -> str:
    path = os.path.realpath(path)
    best = ("", "?", "?")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype, opts = line.split()[:4]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                best = (mnt, f"{fstype} on {dev}", opts)
    return f"{best[1]} mounted at {best[0]} ({best[2]})"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Run:
    """One run of enqueued messages of one queue, consecutive sequence numbers.

    The broker would keep the segment number on each message; the benchmark
    keeps it per run (a batch's messages to one queue)."""

    __slots__ = ("qid", "first", "bodies", "done", "seg")

    def __init__(self, qid: int, first: int, bodies: list, seg: int) -> None:
        self.qid = qid
        self.first = first
        self.bodies = bodies
        self.done = 0  # accepted from the front
        self.seg = seg


# ---------------------------------------------------------------------------
# engine (a): an append-only segmented journal

U32 = struct.Struct("<I")
FRAME = struct.Struct("<II")  # payload length, crc32 of payload
MSG_HEAD = struct.Struct("<BIQ")  # type, queue, seq (journal-msg's enqueue record)
RANGE = struct.Struct("<IQI")  # queue, first seq, count
BATCH_HEAD = struct.Struct("<BI")  # type, number of runs
T_MSG, T_DEQ, T_BATCH = 1, 2, 3


class Journal:
    """Segments ``NNNNNNNN.jrn`` of at most ``segment`` bytes, records framed as
    ``u32 length | u32 crc32(payload) | payload`` where the payload starts with a
    type byte. ``per_message``: one enqueue record per message (journal-msg),
    else one per batch (journal-batch).

    prepare() runs on the event loop: it encodes and does the bookkeeping
    (which segment each record lands in, live messages per segment, which
    segments die). commit() runs in a worker thread: one write per segment,
    one fdatasync per segment touched (nearly always one), then unlinks the dead
    segments. A segment dies when it has no live message and every older one
    is dead; with ``compact``, the head segment's few remaining live messages
    are re-appended (carried forward) when it holds under ``compact_ratio`` of a
    segment's bytes live, so one slow queue does not pin the journal."""

    def __init__(self, path: str, per_message: bool, segment: int = 32 << 20, compact: bool = True,
                 compact_ratio: float = 0.25, crc=zlib.crc32) -> None:
        self.path = path
        self.crc = crc
        self.per_message = per_message
        self.segment = segment
        self.compact = compact
        self.compact_ratio = compact_ratio
        os.makedirs(path, exist_ok=True)
        existing = sorted(int(f[:8]) for f in os.listdir(path) if f.endswith(".jrn"))
        # Never append after a possibly torn tail: a reopened journal starts a new segment.
        self.cur = (existing[-1] + 1) if existing else 0
        self.pos = 0
        self.live = {self.cur: 0}  # segment -> live messages
        self.live_bytes = {self.cur: 0}
        self.seg_runs: dict[int, set] = {self.cur: set()}
        self.queues: dict[int, deque] = {}
        self.fds: dict[int, int] = {}
        self.sync_s = 0.0
        self.syncs = 0
        self.carried = 0

    # -- loop side
    def _roll(self) -> None:
        self.cur += 1
        self.pos = 0
        self.live[self.cur] = 0
        self.live_bytes[self.cur] = 0
        self.seg_runs[self.cur] = set()

    def _place(self, nbytes: int) -> int:
        if self.pos and self.pos + nbytes > self.segment:
            self._roll()
        self.pos += nbytes
        return self.cur

    def _encode_runs(self, runs: list[tuple[int, int, list]], out: list) -> list[int]:
        """Append the records of enqueue runs to ``out`` = [(segment, [chunks], unframed)];
        returns each run's segment."""
        segs = []
        if self.per_message:
            head, frame, crc = MSG_HEAD.pack, FRAME.pack, self.crc
            for qid, first, bodies in runs:
                chunks = []
                nbytes = 0
                for seq, body in enumerate(bodies, first):
                    rec = head(T_MSG, qid, seq) + body
                    chunks.append(frame(len(rec), crc(rec)))
                    chunks.append(rec)
                    nbytes += 8 + len(rec)
                seg = self._place(nbytes)  # a run's records stay in one segment
                out.append((seg, chunks, False))
                segs.append(seg)
        else:
            parts = [BATCH_HEAD.pack(T_BATCH, len(runs)),
                     b"".join([RANGE.pack(q, f, len(b)) for q, f, b in runs])]
            lens = array.array("I")
            for _q, _f, bodies in runs:
                lens.extend(map(len, bodies))
            parts.append(lens.tobytes())
            for _q, _f, bodies in runs:
                parts.extend(bodies)
            # Joined and checksummed in commit(), on the worker thread: zlib.crc32 lets go of
            # the GIL above 5 KiB, so the loop pays for the header arrays only.
            seg = self._place(8 + sum(map(len, parts)))
            out.append((seg, parts, True))
            segs = [seg] * len(runs)
        return segs

    def prepare(self, enqueues: list[tuple[int, int, list]], accepts: list[tuple[int, int, int]]):
        out: list = []
        dead: list[int] = []
        if accepts:
            rec = BATCH_HEAD.pack(T_DEQ, len(accepts)) + b"".join([RANGE.pack(*a) for a in accepts])
            seg = self._place(8 + len(rec))
            out.append((seg, [FRAME.pack(len(rec), self.crc(rec)), rec], False))
            for qid, first, count in accepts:
                self._retire(qid, first, count)
        if enqueues:
            segs = self._encode_runs(enqueues, out)
            for (qid, first, bodies), seg in zip(enqueues, segs, strict=True):
                run = Run(qid, first, bodies, seg)
                self.queues.setdefault(qid, deque()).append(run)
                self.live[seg] += len(bodies)
                self.live_bytes[seg] += sum(map(len, bodies))
                self.seg_runs[seg].add(run)
        if self.compact:
            self._carry_forward(out)
        if self.live[self.cur] == 0 and self.pos >= self.segment // 8:
            self._roll()  # an active segment with nothing live left: start a new one, this one dies
        # The head segments with nothing live die, oldest first.
        head = min(self.live)
        while head < self.cur and self.live[head] == 0:
            del self.live[head], self.live_bytes[head], self.seg_runs[head]
            dead.append(head)
            head += 1
        return out, dead

    def _retire(self, qid: int, first: int, count: int) -> None:
        """Accept ``count`` messages of ``qid`` from ``first`` on (FIFO, as the benchmark's consumer)."""
        runs = self.queues[qid]
        while count:
            run = runs[0]
            assert run.first + run.done == first, "the benchmark accepts in order"
            n = min(count, len(run.bodies) - run.done)
            self.live[run.seg] -= n
            self.live_bytes[run.seg] -= sum(map(len, run.bodies[run.done:run.done + n]))
            run.done += n
            first += n
            count -= n
            if run.done == len(run.bodies):
                runs.popleft()
                self.seg_runs[run.seg].discard(run)

    def _carry_forward(self, out: list) -> None:
        head = min(self.live)
        if head >= self.cur - 1 or self.live[head] == 0:
            return
        if self.live_bytes[head] > self.compact_ratio * self.segment:
            return
        runs = sorted(self.seg_runs[head], key=lambda r: (r.qid, r.first + r.done))
        enq = [(r.qid, r.first + r.done, r.bodies[r.done:]) for r in runs]
        segs = self._encode_runs(enq, out)
        for r, seg in zip(runs, segs, strict=True):
            n = len(r.bodies) - r.done
            nb = sum(map(len, r.bodies[r.done:]))
            self.live[head] -= n
            self.live_bytes[head] -= nb
            self.live[seg] += n
            self.live_bytes[seg] += nb
            self.seg_runs[seg].add(r)
            r.seg = seg
            self.carried += n
        self.seg_runs[head].clear()

    # -- worker side
    def _fd(self, seg: int) -> int:
        fd = self.fds.get(seg)
        if fd is None:
            fd = os.open(os.path.join(self.path, f"{seg:08d}.jrn"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            fsync_dir(self.path)  # the new name is durable before anything in it counts
            self.fds[seg] = fd
        return fd

    def commit(self, prepared: list) -> None:
        by_seg: dict[int, list] = {}
        dead: list[int] = []
        for out, d in prepared:
            for seg, chunks, unframed in out:
                if unframed:
                    rec = b"".join(chunks)
                    chunks = [FRAME.pack(len(rec), self.crc(rec)), rec]
                by_seg.setdefault(seg, []).extend(chunks)
            dead.extend(d)
        for seg, chunks in by_seg.items():
            fd = self._fd(seg)
            for i in range(0, len(chunks), 1024):  # IOV_MAX
                part = chunks[i:i + 1024]
                want = sum(map(len, part))
                if os.writev(fd, part) != want:
                    raise OSError("short write")
        t0 = time.perf_counter()
        for seg in by_seg:
            os.fdatasync(self.fds[seg])
        self.sync_s += time.perf_counter() - t0
        self.syncs += 1
        for seg in list(self.fds):
            if seg < max(by_seg, default=self.cur):
                os.close(self.fds.pop(seg))
        for seg in dead:
            fd = self.fds.pop(seg, None)
            if fd is not None:
                os.close(fd)
            os.unlink(os.path.join(self.path, f"{seg:08d}.jrn"))
        # A lost unlink only brings back dequeued messages whose dequeue records
        # may be gone too: redelivery, never loss. No directory sync needed here.

    def reclaim(self) -> str:
        return "none needed (dead segments already unlinked)"

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    @staticmethod
    def recover(path: str, crc32=zlib.crc32) -> tuple[dict[int, list], dict]:
        """Scan every segment in order; stop at the first bad record."""
        queues: dict[int, dict] = {}
        reordered = False
        stats = {"records": 0, "torn": None}
        unpack_frame = FRAME.unpack_from
        for name in sorted(f for f in os.listdir(path) if f.endswith(".jrn")):
            with open(os.path.join(path, name), "rb") as f:
                data = f.read()
            mv = memoryview(data)
            off, n = 0, len(data)
            while off < n:
                if off + 8 > n:
                    stats["torn"] = (name, off)
                    break
                ln, crc = unpack_frame(data, off)
                start, end = off + 8, off + 8 + ln
                if ln == 0 or end > n or crc32(mv[start:end]) != crc:
                    stats["torn"] = (name, off)
                    break
                typ = data[start]
                if typ == T_MSG:
                    _t, qid, seq = MSG_HEAD.unpack_from(data, start)
                    q = queues.get(qid)
                    if q is None:
                        q = queues[qid] = {}
                    elif seq in q:
                        reordered = True  # a carried-forward copy
                    q[seq] = data[start + MSG_HEAD.size:end]
                elif typ == T_BATCH:
                    _t, nruns = BATCH_HEAD.unpack_from(data, start)
                    p = start + BATCH_HEAD.size
                    runs = list(RANGE.iter_unpack(data[p:p + nruns * RANGE.size]))
                    p += nruns * RANGE.size
                    total = sum(r[2] for r in runs)
                    lens = array.array("I")
                    lens.frombytes(data[p:p + 4 * total])
                    offs = list(itertools.accumulate(lens, initial=p + 4 * total))
                    i = 0
                    for qid, first, count in runs:
                        q = queues.get(qid)
                        if q is None:
                            q = queues[qid] = {}
                        elif first in q:
                            reordered = True
                        bodies = [data[a:b] for a, b in zip(offs[i:i + count], offs[i + 1:i + count + 1], strict=True)]
                        q.update(zip(range(first, first + count), bodies, strict=True))
                        i += count
                elif typ == T_DEQ:
                    _t, nr = BATCH_HEAD.unpack_from(data, start)
                    for qid, first, count in RANGE.iter_unpack(data[start + 5:start + 5 + nr * RANGE.size]):
                        q = queues.get(qid)
                        if q:
                            for seq in range(first, first + count):
                                q.pop(seq, None)
                stats["records"] += 1
                off = end
            if stats["torn"]:
                break
        if reordered:
            return {qid: [q[s] for s in sorted(q)] for qid, q in queues.items()}, stats
        return {qid: list(q.values()) for qid, q in queues.items()}, stats


# ---------------------------------------------------------------------------
# engine (b): SQLite in WAL mode


class SqliteStore:
    """One rowid table ``msg(id INTEGER PRIMARY KEY, body BLOB)``, id = queue << 40 | seq,
    so the table's own b-tree is the per-queue order. One transaction per commit;
    ``synchronous=FULL`` makes each COMMIT fsync the WAL."""

    SHIFT = 40

    def __init__(self, path: str) -> None:
        import sqlite3

        os.makedirs(path, exist_ok=True)
        self.path = path
        self.db = sqlite3.connect(os.path.join(path, "store.db"), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA auto_vacuum=INCREMENTAL")  # before the first table
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA journal_size_limit=8388608")  # truncate the WAL to 8 MiB after checkpoints
        self.db.execute("CREATE TABLE IF NOT EXISTS msg(id INTEGER PRIMARY KEY, body BLOB NOT NULL)")
        self.sync_s = 0.0
        self.syncs = 0

    def prepare(self, enqueues, accepts):
        rows = []
        for qid, first, bodies in enqueues:
            base = (qid << self.SHIFT) + first
            rows.extend(zip(range(base, base + len(bodies)), bodies, strict=True))
        ranges = [((q << self.SHIFT) + f, (q << self.SHIFT) + f + c - 1) for q, f, c in accepts]
        return rows, ranges

    def commit(self, prepared: list) -> None:
        db = self.db
        db.execute("BEGIN")
        for rows, ranges in prepared:
            if ranges:
                db.executemany("DELETE FROM msg WHERE id BETWEEN ? AND ?", ranges)
            if rows:
                db.executemany("INSERT INTO msg(id, body) VALUES (?, ?)", rows)
        t0 = time.perf_counter()
        db.execute("COMMIT")
        self.sync_s += time.perf_counter() - t0
        self.syncs += 1

    def reclaim(self) -> str:
        # Python's execute() steps this pragma once and frees one page; sqlite3_exec (executescript)
        # runs it to the end.
        self.db.executescript("PRAGMA incremental_vacuum;")
        self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        return "PRAGMA incremental_vacuum + wal_checkpoint(TRUNCATE)"

    def close(self) -> None:
        self.db.close()

    @staticmethod
    def recover(path: str) -> tuple[dict[int, list], dict]:
        import sqlite3

        db = sqlite3.connect(os.path.join(path, "store.db"), isolation_level=None)
        queues: dict[int, list] = {}
        shift = SqliteStore.SHIFT
        cur_q, lst = None, None
        for key, body in db.execute("SELECT id, body FROM msg ORDER BY id"):
            q = key >> shift
            if q != cur_q:
                cur_q = q
                lst = queues.setdefault(q, [])
            lst.append(body)
        db.close()
        return queues, {}


# ---------------------------------------------------------------------------
# engine (c): LMDB


KEY = struct.Struct(">IQ")


class LmdbStore:
    """One LMDB database, keys ``queue u32 | seq u64`` big-endian (ordered), the
    body as value. One write transaction per commit; lmdb's default ``sync``
    and ``metasync`` make a commit durable (data pages fdatasync'd, then the
    meta page written and synced)."""

    def __init__(self, path: str, map_size: int = 8 << 30) -> None:
        os.makedirs(path, exist_ok=True)
        self.path = path
        self.env = lmdb.open(path, map_size=map_size, sync=True, metasync=True, readahead=False)
        self.sync_s = 0.0
        self.syncs = 0

    def prepare(self, enqueues, accepts):
        pack = KEY.pack
        items = []
        for qid, first, bodies in enqueues:
            items.extend(zip([pack(qid, s) for s in range(first, first + len(bodies))], bodies, strict=True))
        return items, accepts

    def commit(self, prepared: list) -> None:
        txn = self.env.begin(write=True)
        try:
            cur = txn.cursor()
            for items, accepts in prepared:
                for qid, first, count in accepts:
                    if cur.set_key(KEY.pack(qid, first)):
                        for _ in range(count):
                            if not cur.delete():
                                break
                if items:
                    cur.putmulti(items)
        except BaseException:
            txn.abort()
            raise
        t0 = time.perf_counter()
        txn.commit()
        self.sync_s += time.perf_counter() - t0
        self.syncs += 1

    def reclaim(self) -> str:
        """LMDB never shrinks its file; a compacting copy (offline) is the only way."""
        tmp = self.path.rstrip("/") + ".compact"
        os.makedirs(tmp)
        self.env.copy(tmp, compact=True)
        self.env.close()
        for f in os.listdir(tmp):
            os.replace(os.path.join(tmp, f), os.path.join(self.path, f))
        os.rmdir(tmp)
        self.env = lmdb.open(self.path, map_size=8 << 30, sync=True, metasync=True, readahead=False)
        return "env.copy(compact=True) + swap (offline)"

    def close(self) -> None:
        self.env.close()

    @staticmethod
    def recover(path: str) -> tuple[dict[int, list], dict]:
        env = lmdb.open(path, map_size=8 << 30, readonly=True, lock=False, readahead=True)
        queues: dict[int, list] = {}
        cur_q, lst = None, None
        with env.begin(buffers=False) as txn:
            for key, body in txn.cursor().iternext():
                q = int.from_bytes(key[:4], "big")
                if q != cur_q:
                    cur_q = q
                    lst = queues.setdefault(q, [])
                lst.append(body)
        env.close()
        return queues, {}


SEGMENT = 32 << 20  # the journal's segment size (--segment-mib)


class NullStore:
    """No store: the transient baseline of the group phase (completion needs no disk)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sync_s = 0.0
        self.syncs = 0

    def prepare(self, enqueues, accepts):
        return None

    def commit(self, prepared: list) -> None:
        pass

    def close(self) -> None:
        pass


ENGINES = {
    "none": (NullStore, None),
    "journal-msg": (lambda p: Journal(p, per_message=True, segment=SEGMENT), Journal.recover),
    "journal-batch": (lambda p: Journal(p, per_message=False, segment=SEGMENT), Journal.recover),
    "journal-batch-nocompact": (lambda p: Journal(p, per_message=False, segment=SEGMENT, compact=False),
                                Journal.recover),
    "journal-batch-crc32c": (lambda p: Journal(p, per_message=False, segment=SEGMENT, crc=crc32c_mod.crc32c),
                             lambda p: Journal.recover(p, crc32c_mod.crc32c)),
    "sqlite": (SqliteStore, SqliteStore.recover),
    "lmdb": (LmdbStore, LmdbStore.recover),
}
STEADY_ONLY = {"journal-batch-nocompact"}
GROUP_ONLY = {"none"}


# ---------------------------------------------------------------------------
# workload


class Bodies:
    """Deterministic message bodies: body(q, seq) = pool[(q * 7919 + seq) % len(pool)]."""

    def __init__(self, size: int, pool: int = 4096) -> None:
        rnd = os.urandom(size * pool)
        self.pool = [rnd[i * size:(i + 1) * size] for i in range(pool)]

    def run(self, qid: int, first: int, count: int) -> list:
        p, n = self.pool, len(self.pool)
        k = (qid * 7919 + first) % n
        out = p[k:k + count]
        while len(out) < count:
            out += p[:count - len(out)]
        return out

    def check(self, queues: dict[int, list], expect: dict[int, tuple[int, int]]) -> None:
        """``expect``: queue -> (first live seq, count). Raises if the recovery differs."""
        got = {q: len(v) for q, v in queues.items() if v}
        want = {q: c for q, (_f, c) in expect.items() if c}
        if got != want:
            raise AssertionError(f"recovered counts {got} != {want}")
        for q, (first, count) in expect.items():
            if count and (queues[q] != self.run(q, first, count)):
                raise AssertionError(f"queue {q}: bodies out of order or wrong")


def steps(bodies: Bodies, n_msgs: int, batch: int, queues: int, lag: int | None, pin: bool = False):
    """The broker's batches: each step enqueues ``batch`` messages on one queue
    (round robin) and accepts the batch enqueued ``lag`` steps before (None: no
    accepts). ``pin``: step 0 also enqueues one message on queue 99, never accepted."""
    nbatches = (n_msgs + batch - 1) // batch
    nextseq = [0] * queues
    sent: list[tuple[int, int, int]] = []
    out = []
    for b in range(nbatches):
        q = b % queues
        count = min(batch, n_msgs - b * batch)
        enq = [(q, nextseq[q], bodies.run(q, nextseq[q], count))]
        if pin and b == 0:
            enq.append((99, 0, bodies.run(99, 0, 1)))
        sent.append((q, nextseq[q], count))
        nextseq[q] += count
        acc = [sent[b - lag]] if lag is not None and b >= lag else []
        out.append((enq, acc))
    if lag is not None:
        for b in range(max(0, nbatches - lag), nbatches):
            out.append(([], [sent[b]]))
    return out, sent


def accept_steps(sent: list, batch_per_step: int = 1):
    return [([], sent[i:i + batch_per_step]) for i in range(0, len(sent), batch_per_step)]


# ---------------------------------------------------------------------------
# drivers


def drive_serial(engine, work: list) -> dict:
    """prepare + commit inline, one sync per step."""
    disk_max = 0
    s0, n0 = engine.sync_s, engine.syncs
    c0, w0 = time.process_time(), time.perf_counter()
    for i, (enq, acc) in enumerate(work):
        engine.commit([engine.prepare(enq, acc)])
        if i % 64 == 0:
            disk_max = max(disk_max, disk_usage(engine.path)[1])
    wall = time.perf_counter() - w0
    cpu = time.process_time() - c0
    return {"wall_s": wall, "cpu_s": cpu, "sync_s": engine.sync_s - s0, "syncs": engine.syncs - n0,
            "disk_max": max(disk_max, disk_usage(engine.path)[1])}


LOOP_ITERS_PER_US = 0.0


def calibrate_loop_work() -> float:
    """Iterations of a pure-Python loop per µs on this machine now (single thread)."""
    n = 2_000_000
    best = min(_spin_iters(n) for _ in range(3))
    return n / (best * 1e6)


def _spin_iters(n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        pass
    return time.perf_counter() - t0


def loop_work(iters: int) -> None:
    """Stands for the broker's own work on the loop (decode, route, deliver): it holds the GIL."""
    for _ in range(iters):
        pass


def drive_group(engine, work: list, window: int, loop_work_us: float = 0.0) -> dict:
    """The loop (trio) prepares a step, does ``loop_work_us`` per message of the
    broker's own work, then goes on; a committer task hands everything pending
    to a worker thread (trio.to_thread.run_sync) for one write + sync; at most
    ``window`` steps unconfirmed (the producers' capacity). With NullStore
    nothing waits for a disk: the transient baseline."""
    import trio

    null = isinstance(engine, NullStore)

    res: dict = {}

    async def main() -> None:
        pending: list = []
        room = trio.Semaphore(window)
        wake = trio.Event()
        state = {"done": False, "commits": 0, "worker_cpu": 0.0, "disk_max": 0}

        def commit_in_thread(batch: list) -> float:
            t0 = time.thread_time()
            engine.commit(batch)
            return time.thread_time() - t0

        async def committer() -> None:
            nonlocal wake
            while True:
                if not pending:
                    if state["done"]:
                        return
                    await wake.wait()
                    wake = trio.Event()
                    continue
                take = pending[:]
                pending.clear()
                state["worker_cpu"] += await trio.to_thread.run_sync(commit_in_thread, take)
                state["commits"] += 1
                if state["commits"] % 64 == 0:
                    state["disk_max"] = max(state["disk_max"], disk_usage(engine.path)[1])
                for _ in take:
                    room.release()

        s0 = engine.sync_s
        t_loop0 = time.thread_time()
        c0, w0 = time.process_time(), time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(committer)
            for enq, acc in work:
                await room.acquire()
                pending.append(engine.prepare(enq, acc))
                if loop_work_us:
                    loop_work(int(loop_work_us * LOOP_ITERS_PER_US * sum(len(b) for _q, _f, b in enq)))
                if null:
                    pending.clear()
                    room.release()
                else:
                    wake.set()
                await trio.lowlevel.checkpoint()
            state["done"] = True
            wake.set()
        res.update(wall_s=time.perf_counter() - w0, cpu_s=time.process_time() - c0,
                   loop_cpu_s=time.thread_time() - t_loop0, worker_cpu_s=state["worker_cpu"],
                   sync_s=engine.sync_s - s0, syncs=state["commits"],
                   disk_max=max(state["disk_max"], disk_usage(engine.path)[1]))

    trio.run(main)
    return res


# ---------------------------------------------------------------------------
# phases


def measure_engine(name: str, size: int, args, base: str, pool: dict) -> dict:
    make, recover = ENGINES[name]
    bodies = pool.setdefault(size, Bodies(size))
    n = args.messages if size <= 64 else args.messages_1k
    out: dict = {"engine": name, "size": size, "messages": n}

    if name not in STEADY_ONLY and name not in GROUP_ONLY:
        # fill, recover, drain, reclaim
        path = tempfile.mkdtemp(prefix=f"{name}-{size}-fill-", dir=base)
        eng = make(path)
        work, sent = steps(bodies, n, args.batch, args.queues, None)
        r = drive_serial(eng, work)
        eng.close()
        out["fill"] = {**r, "msgs_s": n / r["wall_s"], "disk": disk_usage(path)}
        del work
        gc.collect()
        drop_cache(path)
        rec = recover_in_subprocess(name, path)
        if rec["count"] != n:
            raise AssertionError(f"{name}: recovered {rec['count']} of {n}")
        out["recover"] = {**rec, "msgs_s": n / rec["wall_s"]}
        if args.verify_steady:  # the bodies, in order (the tests check this too)
            queues, _st = recover(path)
            bodies.check(queues, {q: (0, sum(c for qq, _f, c in sent if qq == q)) for q in range(args.queues)})
            del queues
        if not isinstance(eng, Journal):
            eng = make(path)
        # (The journal object goes on with the bookkeeping its fill built, as
        # the broker's would with what recovery told it; its files were closed.)
        r = drive_serial(eng, accept_steps(sent))
        out["drain"] = {**r, "msgs_s": n / r["wall_s"], "disk": disk_usage(path)}
        t0 = time.perf_counter()
        how = eng.reclaim()
        out["reclaim"] = {"how": how, "wall_s": time.perf_counter() - t0, "disk": disk_usage(path)}
        eng.close()
        shutil.rmtree(path)

    for mode in ("serial", "group"):
        if (name in STEADY_ONLY and mode == "group") or (name in GROUP_ONLY and mode == "serial"):
            continue
        path = tempfile.mkdtemp(prefix=f"{name}-{size}-{mode}-", dir=base)
        eng = make(path)
        work, sent = steps(bodies, n, args.batch, args.queues, args.lag, pin=True)
        gc.collect()
        r = drive_serial(eng, work) if mode == "serial" else drive_group(eng, work, args.window, args.loop_work_us)
        eng.close()
        out[f"steady_{mode}"] = {**r, "msgs_s": n / r["wall_s"], "disk": disk_usage(path),
                                 "carried": getattr(eng, "carried", 0)}
        if args.verify_steady and recover is not None:
            queues, _st = recover(path)
            bodies.check(queues, {99: (0, 1)})
        shutil.rmtree(path)
    return out


def recover_in_subprocess(name: str, path: str) -> dict:
    """Recovery as a restarted broker does it: a fresh process (a fresh heap), cold files."""
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--recover-only", name, path]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def recover_only(name: str, path: str) -> None:
    recover = ENGINES[name][1]
    t0 = time.perf_counter()
    queues, stats = recover(path)
    wall = time.perf_counter() - t0
    with open("/proc/self/status") as f:  # (getrusage's maxrss carries the parent's over exec)
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"wall_s": wall, "count": sum(map(len, queues.values())), "queues": len(queues),
                      "maxrss_mib": hwm / 1024}))


# ---------------------------------------------------------------------------
# probes: crc and sync cost


def probe_crc() -> list[dict]:
    import timeit

    funcs = {"zlib.crc32": zlib.crc32}
    if crc32c_mod is not None:
        funcs["crc32c.crc32c"] = crc32c_mod.crc32c
    rows = []
    for size in (64, 1024, 32 << 10, 512 << 10):
        data = os.urandom(size)
        for fname, f in funcs.items():
            number = max(10, (20 << 20) // size)
            best = min(timeit.repeat(lambda f=f, d=data: f(d), number=number, repeat=5)) / number
            rows.append({"func": fname, "bytes": size, "ns": best * 1e9, "GB_s": size / best / 1e9})
    return rows


def probe_sync(base: str, ops: int = 200) -> list[dict]:
    """Median cost of write + fdatasync, by write size and how the file was made."""
    rows = []
    for wsize in (4 << 10, 32 << 10, 512 << 10):
        buf = os.urandom(wsize)
        total = wsize * ops
        for mode in ("append", "fallocate", "prezeroed"):
            p = os.path.join(base, f"probe-{mode}")
            fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                if mode == "fallocate":
                    os.posix_fallocate(fd, 0, total)
                elif mode == "prezeroed":
                    zero = bytes(1 << 20)
                    for _ in range(0, total, len(zero)):
                        os.write(fd, zero)
                    os.fsync(fd)
                    os.lseek(fd, 0, os.SEEK_SET)
                os.fsync(fd)
                ts = []
                for _ in range(ops):
                    t0 = time.perf_counter()
                    os.write(fd, buf)
                    os.fdatasync(fd)
                    ts.append(time.perf_counter() - t0)
            finally:
                os.close(fd)
                os.unlink(p)
            rows.append({"write": wsize, "mode": mode, "median_ms": statistics.median(ts) * 1e3,
                         "p90_ms": sorted(ts)[int(0.9 * len(ts))] * 1e3})
    return rows


# ---------------------------------------------------------------------------
# report


def med(vals: list[float]) -> str:
    return f"{statistics.median(vals):.3g}"


def spread(vals: list[float]) -> str:
    m = statistics.median(vals)
    if len(vals) < 2 or m == 0:
        return ""
    return f"±{(max(vals) - min(vals)) / 2 / m * 100:.0f}%"


def mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def summarize(results: list[dict]) -> list[dict]:
    groups: dict[tuple, list] = {}
    for r in results:
        groups.setdefault((r["engine"], r["size"]), []).append(r)
    rows = []
    for (eng, size), rs in groups.items():
        row: dict = {"engine": eng, "size": size, "messages": rs[0]["messages"], "reps": len(rs)}
        for ph in ("fill", "recover", "drain", "steady_serial", "steady_group"):
            if ph not in rs[0]:
                continue
            vals = [r[ph]["msgs_s"] for r in rs]
            row[f"{ph}_msgs_s"] = statistics.median(vals)
            row[f"{ph}_spread"] = spread(vals)
            if ph == "recover":
                row["recover_s"] = statistics.median([r[ph]["wall_s"] for r in rs])
                row["recover_s_all"] = [round(r[ph]["wall_s"], 3) for r in rs]
                row["recover_maxrss_mib"] = statistics.median([r[ph]["maxrss_mib"] for r in rs])
                continue
            n = rs[0]["messages"]
            row[f"{ph}_cpu_us"] = statistics.median([r[ph]["cpu_s"] / n * 1e6 for r in rs])
            row[f"{ph}_sync_frac"] = statistics.median([r[ph]["sync_s"] / r[ph]["wall_s"] for r in rs])
            row[f"{ph}_syncs"] = statistics.median([r[ph]["syncs"] for r in rs])
            row[f"{ph}_disk_end"] = statistics.median([r[ph]["disk"][1] for r in rs])
            if "disk_max" in rs[0][ph]:
                row[f"{ph}_disk_max"] = statistics.median([r[ph]["disk_max"] for r in rs])
            if ph == "steady_group":
                row["group_loop_cpu_us"] = statistics.median([r[ph]["loop_cpu_s"] / n * 1e6 for r in rs])
                row["group_worker_cpu_us"] = statistics.median([r[ph]["worker_cpu_s"] / n * 1e6 for r in rs])
        if "reclaim" in rs[0]:
            row["reclaim_how"] = rs[0]["reclaim"]["how"]
            row["reclaim_s"] = statistics.median([r["reclaim"]["wall_s"] for r in rs])
            row["reclaim_disk"] = statistics.median([r["reclaim"]["disk"][1] for r in rs])
        rows.append(row)
    return rows


def print_tables(rows: list[dict]) -> None:
    def g(row, k, fmt="{:,.0f}"):
        v = row.get(k)
        return "-" if v is None else fmt.format(v)

    print("\nthroughput, msgs/s (median of reps, ± half the range), CPU µs per message, share of wall in sync")
    print(f"{'engine':26} {'size':>5} {'fill':>9} {'±':>4} {'cpu':>5} {'sync':>5} | {'drain':>9} {'±':>4}"
          f" | {'steady':>9} {'±':>4} {'cpu':>5} {'sync':>5} | {'group':>9} {'±':>4} {'loop':>5} {'wrk':>5}"
          f" {'m/sync':>6}")
    for r in rows:
        n = r["messages"]
        bps = n / r["steady_group_syncs"] if r.get("steady_group_syncs") else None
        print(f"{r['engine']:26} {r['size']:>5} {g(r, 'fill_msgs_s'):>9} {r.get('fill_spread', ''):>4}"
              f" {g(r, 'fill_cpu_us', '{:.2f}'):>5} {g(r, 'fill_sync_frac', '{:.0%}'):>5} |"
              f" {g(r, 'drain_msgs_s'):>9} {r.get('drain_spread', ''):>4} |"
              f" {g(r, 'steady_serial_msgs_s'):>9} {r.get('steady_serial_spread', ''):>4}"
              f" {g(r, 'steady_serial_cpu_us', '{:.2f}'):>5} {g(r, 'steady_serial_sync_frac', '{:.0%}'):>5} |"
              f" {g(r, 'steady_group_msgs_s'):>9} {r.get('steady_group_spread', ''):>4}"
              f" {g(r, 'group_loop_cpu_us', '{:.2f}'):>5} {g(r, 'group_worker_cpu_us', '{:.2f}'):>5}"
              f" {'-' if bps is None else f'{bps:,.0f}':>6}")
    print("\ndisk (allocated MiB) and recovery")
    print(f"{'engine':26} {'size':>5} {'filled':>8} {'drained':>8} {'reclaimed':>9} {'reclaim s':>9}"
          f" {'steady max':>10} {'steady end':>10} | {'recover s':>9} {'RSS MiB':>7} {'runs':>20}")
    for r in rows:
        print(f"{r['engine']:26} {r['size']:>5} {mib(r['fill_disk_end']) if 'fill_disk_end' in r else '-':>8}"
              f" {mib(r['drain_disk_end']) if 'drain_disk_end' in r else '-':>8}"
              f" {mib(r['reclaim_disk']) if 'reclaim_disk' in r else '-':>9}"
              f" {g(r, 'reclaim_s', '{:.2f}'):>9}"
              f" {mib(r['steady_serial_disk_max']) if 'steady_serial_disk_max' in r else '-':>10}"
              f" {mib(r['steady_serial_disk_end']) if 'steady_serial_disk_end' in r else '-':>10} |"
              f" {g(r, 'recover_s', '{:.2f}'):>9} {g(r, 'recover_maxrss_mib', '{:.0f}'):>7}"
              f" {str(r.get('recover_s_all', '-')):>20}")


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--recover-only":
        recover_only(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: " + ", ".join(ENGINES))
    ap.add_argument("--sizes", default="64,1024")
    ap.add_argument("--messages", type=int, default=1_000_000, help="messages per run, 64 B")
    ap.add_argument("--messages-1k", type=int, default=250_000, help="messages per run, 1 KiB")
    ap.add_argument("--batch", type=int, default=500, help="enqueues per sync (a socket read's worth)")
    ap.add_argument("--lag", type=int, default=4, help="steady: the consumer accepts this many batches behind")
    ap.add_argument("--window", type=int, default=4, help="group: at most this many batches unconfirmed")
    ap.add_argument("--queues", type=int, default=4)
    ap.add_argument("--segment-mib", type=float, default=32, help="the journal's segment size")
    ap.add_argument("--loop-work-us", type=float, default=1.0,
                    help="group: the broker's own loop work per message, µs of pure Python (0: none)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the stores go (default: the system temp dir)")
    ap.add_argument("--probe", action="store_true", help="also the crc and fdatasync probes")
    ap.add_argument("--verify-steady", action="store_true", help="recover after steady runs and check the pin")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the run, seconds (CPython's default: 0.005)")
    ap.add_argument("--quick", action="store_true", help="smoke: 20k messages (1 KiB: 5k), one rep")
    args = ap.parse_args()
    if args.quick:
        args.messages, args.messages_1k, args.reps = 20_000, 5_000, 1
        args.verify_steady = True
    engines = [e for e in args.engines.split(",") if e]
    if lmdb is None and "lmdb" in engines:
        print("lmdb not installed (pip install -e '.[store-bench]'): skipped", file=sys.stderr)
        engines.remove("lmdb")
    if crc32c_mod is None and "journal-batch-crc32c" in engines:
        engines.remove("journal-batch-crc32c")
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    global LOOP_ITERS_PER_US, SEGMENT
    SEGMENT = int(args.segment_mib * 2**20)
    LOOP_ITERS_PER_US = calibrate_loop_work()
    base = tempfile.mkdtemp(prefix="qflow-store-engines-", dir=args.dir)
    info = {"dir": base, "filesystem": filesystem_of(base), "loadavg_before": os.getloadavg(),
            "spin_loop_s_before": spin_loop(), "python": sys.version.split()[0],
            "lmdb": getattr(lmdb, "__version__", None), "sqlite": __import__("sqlite3").sqlite_version,
            "loop_iters_per_us": LOOP_ITERS_PER_US, "switch_interval": sys.getswitchinterval(), "args": vars(args)}
    print(f"store dir {base}: {info['filesystem']}")
    print(f"load average {info['loadavg_before']}, spin loop {info['spin_loop_s_before']:.3f} s")
    try:
        if args.probe:
            info["crc"] = probe_crc()
            for row in info["crc"]:
                print(f"crc {row['func']:14} {row['bytes']:>7} B {row['ns']:>9.0f} ns {row['GB_s']:6.2f} GB/s")
            info["sync"] = probe_sync(base)
            for row in info["sync"]:
                print(f"write {row['write']:>7} B + fdatasync, {row['mode']:9}: median {row['median_ms']:.3f} ms,"
                      f" p90 {row['p90_ms']:.3f} ms")
        results = []
        pool: dict = {}
        for rep in range(args.reps):
            for size in sizes:
                for name in engines:
                    t0 = time.perf_counter()
                    r = measure_engine(name, size, args, base, pool)
                    r["rep"] = rep
                    r["spin_loop_s"] = spin_loop()
                    r["loadavg"] = os.getloadavg()
                    results.append(r)
                    print(f"rep {rep} {name} {size} B: {time.perf_counter() - t0:.1f} s"
                          f" (load {r['loadavg'][0]:.2f}, spin {r['spin_loop_s']:.3f} s)", flush=True)
        rows = summarize(results)
        print_tables(rows)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    info["loadavg_after"] = os.getloadavg()
    info["spin_loop_s_after"] = spin_loop()
    print(f"load average after {info['loadavg_after']}, spin loop {info['spin_loop_s_after']:.3f} s")
    print(json.dumps({"info": info, "summary": rows, "runs": results}, default=str))


if __name__ == "__main__":
    main()
