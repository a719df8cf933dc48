"""The store-engine benchmark (``bench/store_engines.py``, issue 14) measures
engines that keep their word: what was synced comes back in order per queue,
accepted messages stay gone, a torn or corrupt journal record ends the
recovery with everything before it kept, and a slow queue does not keep the
journal from shrinking. Small stores, well under a second."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("bench_store_engines",
                                               os.path.join(HERE, "..", "bench", "store_engines.py"))
se = importlib.util.module_from_spec(_spec)
sys.modules["bench_store_engines"] = se
_spec.loader.exec_module(se)

ENGINES = ["journal-msg", "journal-batch", "sqlite"] + (["lmdb"] if se.lmdb is not None else [])


def _fill(engine, bodies, n=2000, batch=100, queues=3, lag=None, pin=False):
    work, sent = se.steps(bodies, n, batch, queues, lag, pin=pin)
    for enq, acc in work:
        engine.commit([engine.prepare(enq, acc)])
    return sent


@pytest.mark.parametrize("name", ENGINES)
def test_recovery_in_order_without_accepted(tmp_path, name):
    make, recover = se.ENGINES[name]
    bodies = se.Bodies(64, pool=97)
    eng = make(str(tmp_path / "s"))
    sent = _fill(eng, bodies)
    # accept the first two batches of every queue, in two commits (FIFO, as a consumer would)
    firsts = {}
    for q, first, count in sent:
        if firsts.get(q, (0, 0))[1] < 2:
            eng.commit([eng.prepare([], [(q, first, count)])])
            firsts[q] = (first + count, firsts.get(q, (0, 0))[1] + 1)
    eng.close()
    total = {q: sum(c for qq, _f, c in sent if qq == q) for q in range(3)}
    queues, _stats = recover(str(tmp_path / "s"))
    bodies.check(queues, {q: (firsts[q][0], total[q] - firsts[q][0]) for q in range(3)})


@pytest.mark.parametrize("per_message", [True, False])
def test_journal_stops_at_torn_tail_and_at_corruption(tmp_path, per_message):
    path = str(tmp_path / "j")
    j = se.Journal(path, per_message=per_message)
    bodies = se.Bodies(64, pool=97)
    _fill(j, bodies, n=1000, batch=100, queues=1)
    j.close()
    (seg,) = os.listdir(path)
    full, _ = se.Journal.recover(path)
    assert len(full[0]) == 1000

    with open(os.path.join(path, seg), "r+b") as f:  # a torn last write
        f.truncate(os.path.getsize(os.path.join(path, seg)) - 3)
    torn, stats = se.Journal.recover(path)
    assert stats["torn"] is not None
    kept = 999 if per_message else 900  # the last record only: a message, or a whole batch
    assert torn[0] == full[0][:kept]

    with open(os.path.join(path, seg), "r+b") as f:  # a flipped byte in a body well inside
        f.seek(os.path.getsize(os.path.join(path, seg)) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    bad, stats = se.Journal.recover(path)
    assert stats["torn"] is not None
    assert 0 < len(bad[0]) < kept and bad[0] == full[0][:len(bad[0])]


def test_carry_forward_lets_the_journal_shrink_past_a_pinned_message(tmp_path):
    bodies = se.Bodies(64, pool=97)
    sizes = {}
    for compact in (True, False):
        path = str(tmp_path / f"j{compact}")
        j = se.Journal(path, per_message=False, segment=64 << 10, compact=compact)
        _fill(j, bodies, n=20000, batch=200, queues=2, lag=3, pin=True)
        j.close()
        sizes[compact] = se.disk_usage(path)[0]
        queues, _ = se.Journal.recover(path)
        bodies.check(queues, {99: (0, 1)})  # only the pinned message is left, whatever was carried
    assert sizes[True] <= 3 * (64 << 10) < sizes[False]
