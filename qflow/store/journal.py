"""The message journal of the durable store (docs/store.md). No trio.

An append-only journal of segment files, one crc32-checksummed record per
batch of work. The event loop *stages* enqueues, dequeues and queue deletions;
a commit writes everything staged as one record and ``fdatasync``s it. The
commit is split so that the sync can run in a worker thread while the loop
stages the next batch:

* :meth:`Journal.take_staged` (loop): closes the staged batch, places it in a
  segment, decides carry-forward and which segments die; returns a
  :class:`Batch`, which nothing on the loop touches again;
* :meth:`Journal.write_and_sync` (worker thread, one at a time): encodes the
  batch (in C, ``native/journal.c``, with the GIL released: one call per
  batch, not one per message), ``os.writev`` + ``os.fdatasync``, then unlinks
  the segments it killed. A batch that only appends to the open segment
  (:meth:`Journal.fd_for` says which) may instead go to the native sync
  thread (qflow.store.sync_thread), which writes the same record without
  the GIL;
* :meth:`Journal.committed` (loop, after the sync): the size counter.

:meth:`Journal.commit` does the three in a row for a single-threaded caller.
The loop-side state (what is live where) and the file side (descriptors)
are disjoint, so the hand-over needs no lock; only one commit may be in flight.

On disk (all integers little-endian)::

    segment  = NNNNNNNN.jrn: a header record, then batch records
    record   = u32 length | u32 crc32(payload) | payload   (length = len(payload))
    header payload = u8 1 | b"QFJ1" | u16 version (1) | u64 segment number | u8 checksum (1 = zlib crc32)
    batch payload  = u8 2 | u32 nnames | nnames x (u16 len | utf-8 queue name)
                   | u32 nbodies | nbodies x (u64 body size | u32 tail length)
                   | u32 nsections | sections | the tails, back to back
    section  = u8 op | u32 n | n items, in staging order:
               op 1 enqueue: u32 name index | u64 sequence | u32 body index
               op 2 dequeue: u32 name index | u64 sequence
               op 3 delete:  u32 name index  (every message of the queue so far is gone)

A *tail* is a stored entry without its fixed head (qflow.protocol.entries):
exchange, routing key, properties and body, as the broker holds them. With the
body size and the sequence number it rebuilds the entry exactly. Several
enqueues naming one body index are a fanout: the body is stored once.

A segment is unlinked once nothing live remains in it and every older segment
is gone (a dequeue record in a later segment may be what keeps a message of an
older one dead). When the oldest segment has under ``carry_below`` of a
segment's bytes live, its live messages are staged again (the journal keeps
each live entry in memory; the broker holds it anyway) and the segment dies
with that commit: a slow queue cannot pin the whole journal.

Recovery reads the segments in order. A bad record (short, wrong length or
crc, or malformed) at the end of the last segment is a write cut short (by a
crash, or a full disk): nothing in it was confirmed, so it is cut off (and
kept in ``dropped/`` if the disk has room). A bad record anywhere else is
skipped, by its length field, when that leads to the segment's end or to a
good record (else the rest of its segment is skipped: nothing is scanned for
what looks like a record, since a message body could hold one), and the
recovery goes on, logging the file, the offset and what was wrong. The
messages live before a skipped record are withheld, not restored, unless a
later record settles them (enqueues them again, dequeues them or deletes
their queue): the skipped record may have dequeued them, and a consumed
message must not come back. Their segments are hard-linked into ``dropped/``
(no new space) for ``qflow-salvage``. Recovered entries are marked
redelivered: the journal does not record deliveries, so any of them may have
been delivered (and, a removal being lazy, even accepted) before the crash. AMQP 0-10's
redelivered flag means "may have been delivered before"; qpidd marks only
what it knows was delivered, but it records deliveries, and we do not.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import zlib
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import groupby, repeat
from pathlib import Path

from qflow._journal_native import ffi as _ffi
from qflow._journal_native import lib as _lib
from qflow.protocol.entries import ENTRY_HEAD_SIZE, Entry, new_entry, seq_and_size
from qflow.store.datadir import fsync_dir
from qflow.store.records import RECORD, BadRecord, read_record

log = logging.getLogger("qflow.store")

SUFFIX = ".jrn"
MAGIC = b"QFJ1"
VERSION = 1
CRC32 = 1
KIND_HEADER, KIND_BATCH = 1, 2
# A batch record's section kinds (native/journal.h's QF_JOURNAL_OP_*): not the broker's op log codes (qflow.broker.ops)
REC_ENQUEUE, REC_DEQUEUE, REC_DELETE = 1, 2, 3

DEFAULT_SEGMENT_SIZE = 32 << 20  # the quota's step (qflowd --store-segment-size, docs/store.md)
# Space kept aside beside the segments (the file ``reserve``), released at a start on a nearly full
# disk: the commits that record consumers' removals, which free space, then have room to be written.
RESERVE_NAME = "reserve"
RESERVE_SIZE = 256 * 1024

_RECORD = RECORD  # length, crc32: every store file's framing (qflow.store.records)
_HEADER = struct.Struct("<B4sHQB")
_U8, _U16, _U32 = struct.Struct("<B"), struct.Struct("<H"), struct.Struct("<I")
_SECTION = struct.Struct("<BI")
_BODY = struct.Struct("<QI")
_ENQ = struct.Struct("<IQI")
_DEQ = struct.Struct("<IQ")
_ABSENT = object()
_seq_tuple = struct.Struct(">2xQ").unpack_from  # (seq,) of an entry: map()ped with no Python call per entry


class JournalError(Exception):
    """The journal was used out of order (staging before recovery, two commits at once)."""


class _BadRecord(Exception):
    """A record that ends a recovery."""


class _Group:
    """The live messages one batch enqueued (or one segment held at recovery):
    queue -> seq -> entry, with their count and bytes. The journal maps each
    live message to its group, and a group to its segment once the batch is
    taken (``segment`` None: staged), so that taking a batch moves its
    messages into a segment in one step, whatever their number."""

    __slots__ = ("segment", "members", "live", "live_bytes")

    def __init__(self, segment: _Segment | None = None) -> None:
        self.segment = segment
        self.members: dict[str, dict[int, Entry]] = {}
        self.live = 0
        self.live_bytes = 0

    def add(self, queue: str, seq: int, entry: Entry) -> None:
        self.members.setdefault(queue, {})[seq] = entry
        self.count(1, len(entry))

    def count(self, n: int, nbytes: int) -> None:
        """``n`` messages of ``nbytes`` came (negative: went)."""
        self.live += n
        self.live_bytes += nbytes
        seg = self.segment
        if seg is not None:
            seg.live += n
            seg.live_bytes += nbytes

    def remove(self, queue: str, seq: int) -> None:
        self.count(-1, -len(self.members[queue].pop(seq)))


class _Segment:
    """A segment file as the loop sees it: its size so far and what is live in it."""

    __slots__ = ("number", "size", "live", "live_bytes", "groups")

    def __init__(self, number: int) -> None:
        self.number = number
        self.size = 0  # bytes placed in it (the header included), written or about to be
        self.live = 0
        self.live_bytes = 0
        self.groups: list[_Group] = []  # its live messages, by the batch that wrote them

    def take(self, group: _Group) -> None:
        """``group``'s batch is written here."""
        group.segment = self
        self.groups.append(group)
        self.live += group.live
        self.live_bytes += group.live_bytes

    def members(self) -> list[tuple[str, dict[int, Entry]]]:
        """Its live messages: (queue, seq -> entry), a queue possibly more than once."""
        return [(q, m) for g in self.groups for q, m in g.members.items() if m]


def _u32s() -> array:
    return array("I")


@dataclass
class Batch:
    """One commit's worth, handed from the loop to the writer. Immutable once taken.

    Held as flat columns, so that staging a run of N messages costs a few
    bulk calls and the writer hands the whole batch to C in one call
    (native/journal.h says what each column is); :attr:`sections` and
    :attr:`bodies` show it item by item."""

    names: list[str] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)  # per enqueue item: its entry (sequence, and tail)
    enq_names: array = field(default_factory=_u32s)  # per enqueue item: its queue's index in names
    enq_bodies: array = field(default_factory=_u32s)  # per enqueue item: its body's index
    body_entries: array = field(default_factory=_u32s)  # per body: the enqueue item whose entry carries it
    deq_names: array = field(default_factory=_u32s)
    deq_seqs: array = field(default_factory=lambda: array("Q"))
    del_names: array = field(default_factory=_u32s)
    section_ops: bytearray = field(default_factory=bytearray)  # in staging order: each takes the next
    section_counts: array = field(default_factory=_u32s)  # section_counts items of its op
    tail_bytes: int = 0
    segment: int = 0  # the segment it is written to
    new_segment: bool = False  # the writer creates that segment first
    unlink: list[int] = field(default_factory=list)  # segments that die once this batch is durable
    record_size: int = 0  # the record's bytes (a new segment's header included)

    def __bool__(self) -> bool:
        return bool(self.section_ops)

    @property
    def bodies(self) -> list[tuple[int, Entry]]:
        """(body size, the entry carrying that tail), by body index."""
        return [(seq_and_size(self.entries[i])[1], self.entries[i]) for i in self.body_entries]

    @property
    def sections(self) -> list[tuple[int, list[tuple[int, ...]]]]:
        """(op, items) in staging order, each item as the record holds it:
        (name, sequence, body), (name, sequence) or (name,)."""
        out: list[tuple[int, list[tuple[int, ...]]]] = []
        taken = {REC_ENQUEUE: 0, REC_DEQUEUE: 0, REC_DELETE: 0}
        for op, n in zip(self.section_ops, self.section_counts, strict=True):
            i = taken[op]
            taken[op] = i + n
            if op == REC_ENQUEUE:
                items: list[tuple[int, ...]] = [(self.enq_names[k], seq_and_size(self.entries[k])[0],
                                                 self.enq_bodies[k]) for k in range(i, i + n)]
            elif op == REC_DEQUEUE:
                items = list(zip(self.deq_names[i:i + n], self.deq_seqs[i:i + n], strict=True))
            else:
                items = [(k,) for k in self.del_names[i:i + n]]
            out.append((op, items))
        return out

    def payload_size(self) -> int:
        """The bytes :func:`encode` makes of it."""
        return 1 + 4 + sum(2 + len(n.encode()) for n in self.names) + 4 + _BODY.size * len(self.body_entries) \
            + 4 + _SECTION.size * len(self.section_ops) + _ENQ.size * len(self.enq_names) \
            + _DEQ.size * len(self.deq_names) + _U32.size * len(self.del_names) + self.tail_bytes


class Journal:
    """The journal in ``directory`` (created if missing). Call :meth:`recover`
    once, then stage and commit. ``segment_size`` is the size a segment is
    rolled over at (a record larger than that gets a segment of its own);
    ``carry_below`` is the share of it below which the oldest segment's live
    messages are carried forward."""

    def __init__(self, directory: str | os.PathLike[str], *, segment_size: int = DEFAULT_SEGMENT_SIZE,
                 carry_below: float = 0.25) -> None:
        if segment_size < 64:
            raise ValueError(f"segment_size {segment_size}: must be at least 64 bytes")
        if not 0 <= carry_below < 1:
            raise ValueError(f"carry_below {carry_below}: must be in [0, 1)")
        self.directory = Path(directory)
        self.segment_size = segment_size
        self.carry_below = carry_below
        self._segments: dict[int, _Segment] = {}  # oldest first (insertion order)
        self._live: dict[str, dict[int, _Group]] = {}  # queue -> seq -> its group
        self._staged = Batch()
        self._staging = _Group()  # enqueued in the staged batch, still live
        self._name_index: dict[str, int] = {}
        self._current: _Segment | None = None
        self._in_flight = False
        self._failed: str | None = None  # why the last write failed: no commit may follow it
        self._recovered = False
        self._size = 0  # bytes of the segment files that exist or are being written
        self._fd = -1  # the writer's: the current segment's file
        self._fd_segment = -1
        self._roll = False  # the next commit opens a new segment (compact_to_fit)
        self.dropped: list[str] = []  # what the recovery dropped or skipped, and why (also logged)
        self.withheld: dict[str, int] = {}  # per queue, messages not restored after a skipped record

    # -- staging (the loop) ---------------------------------------------------
    def _name(self, queue: str) -> int:
        i = self._name_index.get(queue)
        if i is None:
            i = self._name_index[queue] = len(self._staged.names)
            self._staged.names.append(queue)
        return i

    def _section(self, op: int, n: int) -> None:
        """The next ``n`` staged items of ``op`` follow the ones staged so far."""
        staged = self._staged
        ops = staged.section_ops
        if ops and ops[-1] == op:
            staged.section_counts[-1] += n
        else:
            ops.append(op)
            staged.section_counts.append(n)

    def enqueue(self, queue: str, entry: Entry) -> None:
        """Stage ``entry`` (a stored entry, qflow.protocol.entries) on ``queue``."""
        self.enqueue_fanout(((queue, entry),))

    def enqueue_fanout(self, placements: Sequence[tuple[str, Entry]]) -> None:
        """Stage one message on several queues, its body stored once:
        ``placements`` are (queue, entry) with entries that differ only in
        their heads (the same message routed to each queue)."""
        if not self._recovered:
            raise JournalError("stage after recover(): the journal is not open yet")
        if not placements:
            return
        staged = self._staged
        first = placements[0][1]
        body = len(staged.body_entries)
        staged.body_entries.append(len(staged.entries))
        staged.tail_bytes += len(first) - ENTRY_HEAD_SIZE
        self._section(REC_ENQUEUE, len(placements))
        live, group = self._live, self._staging
        for queue, entry in placements:
            seq = seq_and_size(entry)[0]
            staged.entries.append(entry)
            staged.enq_names.append(self._name(queue))
            staged.enq_bodies.append(body)
            old = live.setdefault(queue, {}).get(seq)
            if old is not None:  # a second copy (carry-forward): the newest is the one that counts
                old.remove(queue, seq)
            live[queue][seq] = group
            group.add(queue, seq, entry)

    def enqueue_run(self, queue: str, entries: Sequence[Entry], seqs: Sequence[int] | None = None) -> None:
        """Stage ``entries``, distinct messages, on ``queue``: what
        :meth:`enqueue_fanout` does for each, in one call (a run of transfers
        to one queue is the usual input). ``seqs``: their sequence numbers, if
        the caller knows them (else read from the entries)."""
        if not self._recovered:
            raise JournalError("stage after recover(): the journal is not open yet")
        n = len(entries)
        if not n:
            return
        staged = self._staged
        first, body = len(staged.entries), len(staged.body_entries)
        name = self._name(queue)
        # Bulk calls, no Python loop per message: a run is the store's usual input.
        staged.entries += entries
        staged.enq_names.extend(repeat(name, n))
        staged.enq_bodies.extend(range(body, body + n))
        staged.body_entries.extend(range(first, first + n))
        nbytes = sum(map(len, entries))
        staged.tail_bytes += nbytes - ENTRY_HEAD_SIZE * n
        self._section(REC_ENQUEUE, n)
        if seqs is None:
            seqs = [seq for (seq,) in map(_seq_tuple, entries)]
        live = self._live.setdefault(queue, {})
        if not live.keys().isdisjoint(seqs):
            for seq in seqs:
                old = live.get(seq)
                if old is not None:  # a second copy (carry-forward): the newest is the one that counts
                    old.remove(queue, seq)
        group = self._staging
        live.update(zip(seqs, repeat(group)))
        members = group.members.get(queue)
        if members is None:
            group.members[queue] = dict(zip(seqs, entries, strict=True))
        else:
            members.update(zip(seqs, entries, strict=True))
        group.count(n, nbytes)

    def dequeue_many(self, queue: str, entries: Iterable[Entry]) -> list[int]:
        """:meth:`dequeue` for each of ``entries`` (stored entries) of ``queue``,
        in one call; returns the sequence numbers of those the journal does not
        hold (nothing staged for them)."""
        seqs = [seq for (seq,) in map(_seq_tuple, entries)]
        live = self._live.get(queue)
        if live is None:
            return seqs
        groups = list(map(live.pop, seqs, repeat(None)))
        if groups and groups[0] is not None and groups.count(groups[0]) == len(groups):
            removed, missing = seqs, []  # the usual: all written by one batch
            self._remove_from(groups[0], queue, seqs)
        else:
            removed, missing = [], []
            pos = 0
            for group, same in groupby(groups):  # runs of one group (consecutive messages were written together)
                k = len(list(same))
                part = seqs[pos:pos + k]
                pos += k
                if group is None:
                    missing += part
                else:
                    removed += part
                    self._remove_from(group, queue, part)
        if removed:
            staged = self._staged
            staged.deq_names.extend(repeat(self._name(queue), len(removed)))
            staged.deq_seqs.extend(removed)
            self._section(REC_DEQUEUE, len(removed))
        return missing

    @staticmethod
    def _remove_from(group: _Group, queue: str, seqs: list[int]) -> None:
        gone = list(map(group.members[queue].pop, seqs))
        group.count(-len(gone), -sum(map(len, gone)))

    def dequeue(self, queue: str, seq: int) -> bool:
        """Stage the removal of message ``seq`` of ``queue``; False (and nothing
        staged) if the journal does not hold it: a transient message, or one gone already."""
        segs = self._live.get(queue)
        if segs is None or seq not in segs:
            return False
        segs.pop(seq).remove(queue, seq)
        self._staged.deq_names.append(self._name(queue))
        self._staged.deq_seqs.append(seq)
        self._section(REC_DEQUEUE, 1)
        return True

    def delete_queue(self, queue: str) -> None:
        """Stage the deletion of ``queue``: every message it has now is gone for good."""
        if not self._recovered:
            raise JournalError("stage after recover(): the journal is not open yet")
        for seq, group in self._live.pop(queue, {}).items():
            group.remove(queue, seq)
        self._staged.del_names.append(self._name(queue))
        self._section(REC_DELETE, 1)

    def has_staged(self) -> bool:
        return bool(self._staged)

    def live_messages(self) -> int:
        """How many messages the journal holds live (staged ones included)."""
        return sum(len(s) for s in self._live.values())

    # -- the hand-over ----------------------------------------------------------
    def take_staged(self) -> Batch | None:
        """Close the staged batch and place it (loop side); None if nothing is
        staged. The result goes to :meth:`write_and_sync`, then :meth:`committed`."""
        if self._in_flight:
            raise JournalError("take_staged() while a commit is in flight: call committed() first")
        if self._failed is not None:
            raise JournalError(f"a write failed ({self._failed}): records after a possibly partial one "
                               "would be lost to recovery; recover() in a new Journal")
        self._carry_forward()
        batch = self._staged
        roll, self._roll = self._roll, False
        if not batch and not roll:
            return None
        self._staged, self._name_index = Batch(), {}
        record = _RECORD.size + batch.payload_size()
        cur = self._current
        # Roll over when the record does not fit, and also when nothing at all is live and the current
        # segment is over 1/8 full: then every segment dies with this commit, and the size falls to
        # almost nothing after a drain instead of staying at up to a segment.
        if cur is None or roll or (cur.size + record > self.segment_size and cur.size > _HEADER_RECORD_SIZE) \
                or (cur.size > self.segment_size // 8 and not any(s.live for s in self._segments.values())):
            number = cur.number + 1 if cur is not None else self._next_number
            cur = self._current = self._segments[number] = _Segment(number)
            cur.size = _HEADER_RECORD_SIZE
            batch.new_segment = True
            record += _HEADER_RECORD_SIZE
        batch.segment = cur.number
        batch.record_size = record
        cur.size += record - (_HEADER_RECORD_SIZE if batch.new_segment else 0)
        self._size += record
        if self._staging.live:  # else all dequeued or deleted before this take
            cur.take(self._staging)
        self._staging = _Group()
        for seg in list(self._segments.values()):  # oldest first: each dies only after all older ones
            if seg is cur or seg.live:
                break
            batch.unlink.append(seg.number)
            del self._segments[seg.number]
            self._size -= seg.size
        self._in_flight = True
        return batch

    def _oldest(self) -> _Segment | None:
        return next(iter(self._segments.values()), None)

    def _carry_forward(self) -> None:
        head = self._oldest()
        if head is None or head is self._current or not head.live \
                or head.live_bytes >= self.carry_below * self.segment_size:
            return
        self._carry((head,))

    def _carry(self, segments: Iterable[_Segment]) -> None:
        """Stage the live messages of ``segments`` again, so that they die with the next commit."""
        # Entries that differ only in their heads are one message on several queues (fanout,
        # topic): carried forward together, their body is still stored once.
        copies: dict[memoryview, list[tuple[str, Entry]]] = {}
        for seg in segments:
            for queue, seqs in seg.members():
                for entry in list(seqs.values()):
                    copies.setdefault(memoryview(entry)[ENTRY_HEAD_SIZE:], []).append((queue, entry))
        for placements in copies.values():
            self.enqueue_fanout(placements)

    def compact_to_fit(self, limit: int) -> bool:
        """Make the next commit rewrite every live message into a new segment,
        so that every older segment dies with it, if that brings the journal
        under ``limit`` bytes (it is not under it now). Loop side, between commits.

        This is the disk quota's way down (qflow.store.quota): otherwise space
        comes back a whole segment at a time, and a quota below the segment
        size would never see a segment end. It costs one rewrite of what is
        live, and only when that clears the quota, so at most once per
        overfull spell. The estimate is an upper bound: a rewrite never lands
        above ``limit``.

        Returns:
          True if the next commit compacts (call for it: something may have to
          be committed that would otherwise wait); False if it would not fit
          under ``limit``, or the journal is under it already.
        """
        if self._in_flight or self._roll or self._size < limit:
            return False
        segments = list(self._segments.values())
        live = sum(s.live for s in segments)
        live_bytes = sum(s.live_bytes for s in segments)
        names = sum(2 + len(q.encode()) for q, seqs in self._live.items() if seqs)
        projected = (_HEADER_RECORD_SIZE + _RECORD.size + self._staged.payload_size() + _SECTION.size
                     + live_bytes + live * (_ENQ.size + _BODY.size) + names)
        if projected >= limit or projected >= self._size:
            return False
        self._carry(segments)
        self._roll = True
        return True

    # -- the writer (a worker thread) -------------------------------------------
    def write_and_sync(self, batch: Batch) -> None:
        """Write ``batch`` as one record and make it durable; then unlink the
        segments it killed. Blocking: run it off the event loop. Touches only
        the file side of the journal, never what the loop stages."""
        try:
            if batch.new_segment:
                self._open_segment(batch.segment)
            payload = encode(batch)
            head = _RECORD.pack(len(payload), zlib.crc32(payload))
            written = os.writev(self._fd, [head, payload])
            if written != len(head) + len(payload):
                raise OSError(f"short write to segment {batch.segment}: {written} of {len(head) + len(payload)} bytes")
            os.fdatasync(self._fd)
            if batch.new_segment:  # the new name counts only once the directory says so
                fsync_dir(self.directory)
        except BaseException as exc:
            self._failed = f"{type(exc).__name__}: {exc}"
            raise
        if batch.unlink:
            for number in batch.unlink:
                os.unlink(self._path(number))
            fsync_dir(self.directory)  # dead segments are removed head first: never leave a gap behind

    def _open_segment(self, number: int) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        fd = os.open(self._path(number), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        header = _U8.pack(KIND_HEADER) + _HEADER.pack(0, MAGIC, VERSION, number, CRC32)[1:]
        os.write(fd, _RECORD.pack(len(header), zlib.crc32(header)) + header)
        self._fd, self._fd_segment = fd, number

    def fd_for(self, batch: Batch) -> int:
        """The open segment's descriptor if writing ``batch`` is only appending
        a record to it and syncing (no new segment, nothing to unlink), so that
        the sync thread (qflow.store.sync_thread) may do it; else -1, and
        :meth:`write_and_sync` must."""
        if batch.new_segment or batch.unlink or self._fd_segment != batch.segment:
            return -1
        return self._fd

    def write_failed(self, reason: str) -> None:
        """A write of a batch from :meth:`fd_for` failed: no commit may follow it."""
        self._failed = reason

    def committed(self, batch: Batch) -> None:
        """The loop's side of a finished (or failed) :meth:`write_and_sync`: the next commit may start."""
        self._in_flight = False

    def commit(self) -> None:
        """Take, write, sync and finish what is staged, inline (tests, tools, a single-threaded caller)."""
        batch = self.take_staged()
        if batch is not None:
            try:
                self.write_and_sync(batch)
            finally:
                self.committed(batch)

    def size_on_disk(self) -> int:
        """The bytes of the journal's segment files, as placed by the commits
        taken so far (no ``stat``): it falls as soon as a commit that kills a
        segment is taken, in segment-sized steps."""
        return self._size

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _path(self, number: int) -> Path:
        return self.directory / f"{number:08d}{SUFFIX}"

    # -- recovery -----------------------------------------------------------------
    def recover(self) -> dict[str, list[Entry]]:
        """Read the journal: per queue name, its live entries in sequence order,
        marked redelivered. Opens the journal for staging; the next commit goes
        to a new segment, never after a possibly torn tail."""
        if self._recovered:
            raise JournalError("recover() twice")
        self.directory.mkdir(parents=True, exist_ok=True)
        numbers = sorted(int(p.name[:-len(SUFFIX)]) for p in self.directory.glob("*" + SUFFIX)
                         if p.name[:-len(SUFFIX)].isdigit())
        read = _read_journal(self.directory, numbers)
        state, suspects, sizes, torn = read.state, read.suspects, read.sizes, read.torn
        for msg in read.skipped:
            log.error("journal recovery: %s", msg)
            self.dropped.append(msg)
        if torn is not None:
            i, number, offset, length, reason = torn
            self._drop(number, offset, length, reason)
            if offset > 0:
                sizes[number] = offset
            kept = numbers[:i + (1 if offset > 0 else 0)]
        else:
            kept = numbers
        if read.first_skip is not None:
            self._keep_aside(numbers, "skipped-{:08d}-at-{}".format(*read.first_skip))
        self.withheld = {q: len(m) for q, m in suspects.items() if m}
        for queue, n in self.withheld.items():
            log.error("journal recovery: %d message(s) of queue '%s' written before a skipped record are not "
                      "restored: the skipped record may have dequeued them (the segments are kept in %s; "
                      "qflow-salvage lists them)", n, queue, self.directory / "dropped" / "skipped-{:08d}-at-{}"
                      .format(*read.first_skip))
        self._next_number = (kept[-1] + 1) if kept else 1
        for number in kept:
            self._segments[number] = _Segment(number)
            self._segments[number].size = sizes[number]
        self._size = sum(sizes.values())
        result: dict[str, list[Entry]] = {}
        groups: dict[int, _Group] = {}  # per segment, what it holds live
        for queue, msgs in state.items():
            if not msgs:
                continue
            segs = self._live[queue] = {}
            entries = result[queue] = []
            for seq in sorted(msgs):  # per message: kept to dict stores and counters (a million at a start)
                number, entry = msgs[seq]
                group = groups.get(number)
                if group is None:
                    group = groups[number] = _Group()  # placed in its segment below, with its counts
                members = group.members.get(queue)
                if members is None:
                    members = group.members[queue] = {}
                members[seq] = entry
                group.live += 1
                group.live_bytes += len(entry)
                segs[seq] = group
                entries.append(entry)
        for number, group in groups.items():
            self._segments[number].take(group)
        # Segments with nothing live die with the first commit (head first, as always).
        self._recovered = True
        self._keep_reserve()
        return result

    def _keep_reserve(self) -> None:
        """Keep :data:`RESERVE_SIZE` bytes aside in the file ``reserve`` while
        the disk has room for it twice; on a nearly full disk, release it, so
        that the commits recording what consumers take (which free whole
        segments) can be written."""
        path = self.directory / RESERVE_NAME
        try:
            st = os.statvfs(self.directory)
            free = st.f_bavail * st.f_frsize
            if free < 2 * RESERVE_SIZE:
                if path.exists():
                    path.unlink()
                    log.warning("journal: the disk holding %s is nearly full (%d bytes free): its reserve of %d "
                                "bytes is released, so that consumers' removals can be written and free space",
                                self.directory, free, RESERVE_SIZE)
            elif not path.exists() or path.stat().st_size < RESERVE_SIZE:
                with open(path, "wb") as f:
                    f.write(bytes(RESERVE_SIZE))
                    f.flush()
                    os.fsync(f.fileno())
        except OSError as exc:  # the reserve is a help, never a reason not to start
            log.warning("journal: cannot keep the reserve in %s: %s", self.directory, exc.strerror or exc)

    def _drop(self, number: int, offset: int, length: int, reason: str) -> None:
        """Cut the last segment's torn tail at ``offset``. What is cut off is
        kept in ``dropped/`` if the disk has room for it; on a full disk it is
        not (a copy would need new space, and a broker that cannot recover
        cannot be drained either): the cut needs none."""
        where = self.directory / "dropped"
        path = self._path(number)
        msg = f"{path} at offset {offset} of {length}: {reason}; dropped {length - offset} bytes"
        log.error("journal recovery stopped: %s", msg)
        self.dropped.append(msg)
        try:
            where.mkdir(exist_ok=True)
            with open(path, "rb") as f:
                f.seek(offset)
                tail = f.read()
            copy = where / f"{number:08d}.at-{offset}"
            try:
                copy.write_bytes(tail)
            except OSError:
                copy.unlink(missing_ok=True)
                raise
        except OSError as exc:
            if exc.errno not in _NO_SPACE:
                raise
            log.error("journal recovery: no space to keep a copy of the %d bytes cut from %s (%s): they are "
                      "not kept", length - offset, path, exc.strerror)
            self.dropped.append(f"{path}: the {length - offset} bytes cut off could not be kept ({exc.strerror})")
        if offset > 0:
            os.truncate(path, offset)
        else:
            os.unlink(path)
        fsync_dir(self.directory)

    def _keep_aside(self, numbers: list[int], name: str) -> None:
        """Hard-link segments ``numbers`` (all of them, as this recovery read
        them) into ``dropped/NAME/``, once per skipped record: the messages it
        withheld stay on disk once the journal lets their segments die, and
        qflow-salvage replays that snapshot to list them. A link needs no new
        space for the data."""
        where = self.directory / "dropped" / name
        if where.exists():  # a recovery before this one kept it: that is the one that decided
            return
        try:
            where.mkdir(parents=True)
            for n in numbers:
                if self._path(n).exists():
                    os.link(self._path(n), where / self._path(n).name)
            fsync_dir(where)
        except OSError as exc:
            log.error("journal recovery: could not keep the segments in %s (%s): the messages not restored "
                      "will be gone with them", where, exc.strerror)


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_HEADER_RECORD_SIZE = _RECORD.size + _HEADER.size
# The smallest a journal can be: one segment, its header and an empty batch (compact_to_fit's floor).
SMALLEST_JOURNAL = _HEADER_RECORD_SIZE + _RECORD.size + Batch().payload_size()


def _item_size(op: int) -> int:
    return _ENQ.size if op == REC_ENQUEUE else _DEQ.size if op == REC_DEQUEUE else _U32.size


def _encoded_names(names: list[str]) -> bytes:
    parts = []
    for name in names:
        raw = name.encode()
        parts += (_U16.pack(len(raw)), raw)
    return b"".join(parts)


def encode_python(batch: Batch) -> bytes:
    """The batch record's payload (the module's doc says its layout): the
    reference :func:`encode_native` is compared with (tests/test_journal_encoder.py)."""
    parts: list[bytes | memoryview] = [_U8.pack(KIND_BATCH), _U32.pack(len(batch.names)),
                                       _encoded_names(batch.names)]
    bodies = batch.bodies
    parts.append(_U32.pack(len(bodies)))
    parts += [_BODY.pack(size, len(entry) - ENTRY_HEAD_SIZE) for size, entry in bodies]
    sections = batch.sections
    parts.append(_U32.pack(len(sections)))
    for op, items in sections:
        parts.append(_SECTION.pack(op, len(items)))
        pack = (_ENQ if op == REC_ENQUEUE else _DEQ if op == REC_DEQUEUE else _U32).pack
        parts += [pack(*item) for item in items]
    parts += [memoryview(entry)[ENTRY_HEAD_SIZE:] for _, entry in bodies]
    return b"".join(parts)


def encode_native(batch: Batch) -> bytearray:
    """:func:`encode_python`'s bytes, made by native/journal.c in one call (the
    GIL released while it runs): the writer thread's Python work per batch is
    a join of its entries and a list of their lengths, whatever their number."""
    b, keep, out, size = native_batch(batch)
    n = _lib.qf_journal_encode(b, keep[-1], size)
    if n != size:
        raise JournalError(f"the batch encoder returned {n} for a payload of {size} bytes "
                           "(-1: too small, -2: inconsistent columns, -3: out of memory)")
    return out


def native_batch(batch: Batch) -> tuple[object, tuple[object, ...], bytearray, int]:
    """``batch`` as native/journal.h's ``qf_journal_batch``: the struct, the
    cdata it points into (keep them alive while C reads it; the last one is the
    output buffer's), the output buffer and the payload's size."""
    entries = b"".join(batch.entries)
    names = _encoded_names(batch.names)
    size = batch.payload_size()
    out = bytearray(size)
    fb = _ffi.from_buffer
    b = _ffi.new("qf_journal_batch *")
    # The cdata from from_buffer must outlive the call: the struct holds only their pointers.
    keep = (fb(names), fb(entries), fb("uint32_t[]", array("I", map(len, batch.entries))),
            fb("uint32_t[]", batch.enq_names), fb("uint32_t[]", batch.enq_bodies),
            fb("uint32_t[]", batch.body_entries), fb("uint32_t[]", batch.deq_names),
            fb("uint64_t[]", batch.deq_seqs), fb("uint32_t[]", batch.del_names), fb(batch.section_ops),
            fb("uint32_t[]", batch.section_counts), fb(out, require_writable=True))
    (b.names, b.entries, b.entry_lens, b.enq_names, b.enq_bodies, b.body_entries, b.deq_names, b.deq_seqs,
     b.del_names, b.section_ops, b.section_counts) = keep[:11]
    b.names_len, b.nnames = len(names), len(batch.names)
    b.entries_len, b.nenq, b.nbodies = len(entries), len(batch.entries), len(batch.body_entries)
    b.ndeq, b.ndel, b.nsections = len(batch.deq_names), len(batch.del_names), len(batch.section_ops)
    if len(batch.enq_names) != b.nenq or len(batch.enq_bodies) != b.nenq or len(batch.deq_seqs) != b.ndeq \
            or len(batch.section_counts) != b.nsections:
        raise JournalError("the batch's columns differ in length")
    return b, keep, out, size


def encoder_for(kind: str | None = None) -> Callable[[Batch], bytes | bytearray]:
    """The batch encoder: native (C) unless ``kind`` or ``$QFLOW_ACCOUNTING``
    says python, so that make test's second pass runs every store test on the twin."""
    kind = kind or os.environ.get("QFLOW_ACCOUNTING") or "native"
    return encode_python if kind == "python" else encode_native


encode = encoder_for()


@dataclass
class _Read:
    """What reading a journal's segments found (:func:`_read_journal`)."""

    state: dict[str, dict[int, tuple[int, Entry]]] = field(default_factory=dict)  # queue -> seq -> (segment, entry)
    # Live before a record that had to be skipped, and not settled by a good record since: that
    # record may have dequeued them, so they are not restored (module doc; docs/store.md).
    suspects: dict[str, dict[int, tuple[int, Entry]]] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)  # segment -> its bytes read whole
    skipped: list[str] = field(default_factory=list)  # each record skipped, said for the log
    first_skip: tuple[int, int] | None = None  # (segment, offset) of the first record skipped
    torn: tuple[int, int, int, int, str] | None = None  # (index, segment, offset, size, why): the last one's tail


def _read_journal(directory: Path, numbers: list[int]) -> _Read:
    """Read segments ``numbers`` (in order) of the journal in ``directory``;
    nothing on disk changes."""
    read = _Read()
    for i, number in enumerate(numbers):
        path = directory / f"{number:08d}{SUFFIX}"
        if i and number != numbers[i - 1] + 1:
            log.warning("journal %s: segments %d to %d are missing (messages they removed may come back)",
                        directory, numbers[i - 1] + 1, number - 1)
        data = path.read_bytes()
        skips, tail = _read_segment(data, number, read.state, read.suspects, i == len(numbers) - 1)
        for offset, nbytes, reason in skips:
            read.skipped.append(f"{path} at offset {offset} of {len(data)}: {reason}; skipped {nbytes} bytes and "
                                f"went on with the next good record")
            if read.first_skip is None:
                read.first_skip = (number, offset)
        if tail is None:
            read.sizes[number] = len(data)
        else:
            read.torn = (i, number, tail[0], len(data), tail[1])
    return read


def salvage(directory: str | os.PathLike[str]) -> Iterator[tuple[str, str, int, Entry]]:
    """The messages a recovery withheld after skipping a damaged record, from
    the snapshots it kept in ``directory/dropped/skipped-*`` (``directory``:
    the journal's): (snapshot, queue, sequence, entry), each snapshot replayed
    as that recovery read it. Reads only."""
    for snapshot in sorted((Path(directory) / "dropped").glob("skipped-*")):
        numbers = sorted(int(p.name[:-len(SUFFIX)]) for p in snapshot.glob("*" + SUFFIX)
                         if p.name[:-len(SUFFIX)].isdigit())
        read = _read_journal(snapshot, numbers)
        for queue, msgs in sorted(read.suspects.items()):
            for seq in sorted(msgs):
                yield snapshot.name, queue, seq, msgs[seq][1]


def _read_segment(data: bytes, number: int, state: dict[str, dict[int, tuple[int, Entry]]],
                  suspects: dict[str, dict[int, tuple[int, Entry]]],
                  last: bool) -> tuple[list[tuple[int, int, str]], tuple[int, str] | None]:
    """Apply segment ``number``'s good records to ``state``. Returns the bad
    records skipped, as (offset, bytes skipped, what was wrong), and the torn
    tail (its offset, what was wrong) if the segment is the journal's ``last``
    and ends in bad bytes (a write cut short: nothing in it was confirmed).

    A bad record is skipped when its length field leads to the segment's end
    or to a good record; then everything live in ``state`` becomes a suspect.
    A bad length field leaves nothing to go on in the segment: the rest of it
    is skipped (no scan for something that looks like a record: a message
    body could hold one)."""
    pos, end, first = 0, len(data), True
    skips: list[tuple[int, int, str]] = []
    view = memoryview(data)
    while pos < end:
        try:
            try:
                payload = read_record(view, pos)
            except BadRecord as exc:
                raise _BadRecord(str(exc)) from None
            start, length = pos + _RECORD.size, len(payload)
            kind = payload[0] if length else 0
            if first and kind == KIND_HEADER:
                if length != _HEADER.size:
                    raise _BadRecord("no segment header")
                _, magic, version, seg, algo = _HEADER.unpack(payload)
                if magic != MAGIC or version != VERSION or algo != CRC32:
                    raise _BadRecord(f"header: magic {magic!r} version {version} checksum {algo}, "
                                     f"expected {MAGIC!r} {VERSION} {CRC32}")
                if seg != number:
                    raise _BadRecord(f"header says segment {seg}")
            elif first and not skips:
                raise _BadRecord("no segment header")
            elif kind == KIND_BATCH:
                _apply_batch(payload, number, state, suspects)
            else:
                raise _BadRecord(f"unknown record kind {kind}")
            first = False
        except (_BadRecord, struct.error, IndexError, UnicodeDecodeError) as exc:
            reason = str(exc) if isinstance(exc, _BadRecord) else f"malformed batch: {exc}"  # a good crc, bad content
            nxt = _next_record(data, pos)
            if last and (nxt is None or nxt == end):
                return skips, (pos, reason)
            if nxt is None:
                nxt = end
                reason += "; its length leads to no good record: the rest of the segment"
            skips.append((pos, nxt - pos, reason))
            for queue, msgs in state.items():  # all live so far: the skipped record may have removed them
                suspects.setdefault(queue, {}).update(msgs)
            state.clear()
            first = False
            pos = nxt
            continue
        pos = start + length
    if first:
        return skips, (0, "empty segment: no header") if last else None
    return skips, None


def _next_record(data: bytes, pos: int) -> int | None:
    """Where the record after the bad one at ``pos`` starts, by its length
    field, if that is the segment's end or a good record's start; else None."""
    end = len(data)
    if end - pos < _RECORD.size:
        return None
    length, _ = _RECORD.unpack_from(data, pos)
    nxt = pos + _RECORD.size + length
    if nxt == end:
        return nxt
    try:
        read_record(data, nxt)
    except BadRecord:
        return None
    return nxt


def _apply_batch(p: memoryview, number: int, state: dict[str, dict[int, tuple[int, Entry]]],
                 suspects: dict[str, dict[int, tuple[int, Entry]]] | None = None) -> None:
    """Decode a batch payload and apply it to ``state``, all or nothing. A
    suspect (see _read_segment) it enqueues again (a carried copy: it was
    live then), dequeues or deletes is settled: no longer a suspect."""
    pos = 1
    (nnames,), pos = _U32.unpack_from(p, pos), pos + 4
    names = []
    for _ in range(nnames):
        (n,) = _U16.unpack_from(p, pos)
        if pos + 2 + n > len(p):
            raise IndexError("queue name past the end")
        names.append(bytes(p[pos + 2:pos + 2 + n]).decode())
        pos += 2 + n
    (nbodies,), pos = _U32.unpack_from(p, pos), pos + 4
    heads = list(_BODY.iter_unpack(p[pos:pos + nbodies * _BODY.size]))
    if len(heads) != nbodies:
        raise IndexError("body table past the end")
    pos += nbodies * _BODY.size
    (nsections,), pos = _U32.unpack_from(p, pos), pos + 4
    ops = []
    for _ in range(nsections):
        op, n = _SECTION.unpack_from(p, pos)
        pos += _SECTION.size
        if op not in (REC_ENQUEUE, REC_DEQUEUE, REC_DELETE):
            raise IndexError(f"section op {op}")
        width = _item_size(op) * n
        if pos + width > len(p):
            raise IndexError("section past the end")
        st = _ENQ if op == REC_ENQUEUE else _DEQ if op == REC_DEQUEUE else _U32
        ops.append((op, list(st.iter_unpack(p[pos:pos + width]))))
        pos += width
    tails = []
    for _size, tlen in heads:
        tails.append(p[pos:pos + tlen])
        pos += tlen
    if pos != len(p):
        raise IndexError(f"{len(p) - pos} bytes after the bodies")
    for op, items in ops:  # every index checked before anything is applied: a batch counts whole or not at all
        for item in items:
            if item[0] >= nnames or (op == REC_ENQUEUE and item[2] >= nbodies):
                raise IndexError(f"op {op} names queue {item[0]} of {nnames} or body {item[-1]} of {nbodies}")
    for op, items in ops:
        if op == REC_ENQUEUE:
            for qi, seq, bi in items:
                size, tail = heads[bi][0], tails[bi]
                state.setdefault(names[qi], {})[seq] = (
                    number, new_entry(seq, size, tail, redelivered=True))
        elif op == REC_DEQUEUE:
            for qi, seq in items:
                state.get(names[qi], {}).pop(seq, None)
        else:
            for (qi,) in items:
                state.pop(names[qi], None)
    if suspects:
        for op, items in ops:
            if op == REC_DELETE:
                for (qi,) in items:
                    suspects.pop(names[qi], None)
            else:
                for item in items:
                    held = suspects.get(names[item[0]])
                    if held:
                        held.pop(item[1], None)
