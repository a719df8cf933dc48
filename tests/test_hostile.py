"""Attacks on a real qflowd as a hostile client would make them (the
attacks themselves are bench/hostile.py's, which measures them at full size):
each test bounds what the attack costs the broker, in resident memory (from
/proc) or in another client's worst round trip, with room for a slow,
crowded machine."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import msgpack
import pytest

from qflow import protocol as P
from tests.conftest import start_qflowd

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("bench_hostile", os.path.join(HERE, "..", "bench", "hostile.py"))
hostile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hostile)

pytestmark = pytest.mark.native_only
MIB = 1024


def test_nested_array_claims_cost_kilobytes_not_megabytes():
    """Ten connections each send an unfinished transfer whose properties are
    1,000 nested array16(65535) heads (3 KB): each is closed at once with 506
    (its claims cannot fit the maximum frame size), and qflowd's resident set
    grows by a few MB at most (before: 68 MB per connection, 680 MB in all)."""
    d = start_qflowd("--no-data-dir")
    try:
        got = hostile.attack_nested_claims(d.port, d.proc.pid, connections=10, depth=1000)
        assert got["closed_by_broker"] == 10, got
        assert got["closes"][0][:2] == [P.CLOSE, P.RESOURCE_LIMIT_EXCEEDED], got
        assert "maximum frame size" in got["closes"][0][2], got
        assert got["rss_held_kib"] - got["rss_base_kib"] < 40 * MIB, got
    finally:
        d.stop()


def test_nested_array_claims_within_the_limit_cost_at_most_their_bound():
    """Heads of 64 elements (the most taken as they come) nested 1,020 deep
    are held, at about 600 KiB each: ten connections stay well under 40 MB."""
    d = start_qflowd("--no-data-dir")
    try:
        got = hostile.attack_nested_claims(d.port, d.proc.pid, connections=10, depth=1020, claim=64)
        assert got["rss_held_kib"] - got["rss_base_kib"] < 40 * MIB, got
    finally:
        d.stop()


def test_nesting_too_deep_closes_with_a_reason_naming_it():
    """A transfer whose properties nest 10,000 arrays: the close says why
    (before: 'malformed frame: ', empty)."""
    d = start_qflowd("--no-data-dir")
    try:
        s = hostile.raw_session(d.port)
        s.sendall(b"\x96\x1e\x00\xa0\xa1q" + b"\x91" * 10000 + b"\xc0\xc4\x00")
        close = next(f for f in hostile.read_frames(s) if f[0] == P.CLOSE)
        s.close()
        assert close[1] == 501 and "containers nested more than 1024 deep" in close[2], close
    finally:
        d.stop()


def test_qflowd_restarts_on_the_full_disk_it_stopped_on():
    """A durable producer fills a 2 MiB tmpfs until qflowd stops (ENOSPC).
    Started again on the still-full disk, qflowd recovers (before: it died
    copying the torn tail into dropped/), a consumer drains the queue, and
    the space comes back. The tmpfs is mounted in a mount namespace of its
    own (unshare), which goes with the attack's process."""
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    proc = subprocess.run([*unshare, sys.executable, os.path.join(HERE, "..", "bench", "hostile.py"), "disk-full"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["first_exit"] == 1 and got["free_bytes_before_restart"] < 64 * 1024, got
    assert got["restarted"], got
    assert got["recovered"] > 0 and got["alive_after_drain"], got
    assert got["free_bytes_after_drain"] > 1024 * 1024, got


def test_one_flipped_byte_in_the_journal_costs_one_batch_not_every_later_one():
    """10 batches of 500 persistent messages, byte 44 of the first journal
    segment XORed (inside the first batch record): the recovery skips that
    record, says so, and brings back the others (before: 0 of 5,000)."""
    got = hostile.attack_flipped_byte()
    assert got["recovered"] >= 4500, got
    assert any("at offset 24" in line and "skipped" in line for line in got["log"]), got


@pytest.mark.parametrize("scram", [False, True], ids=["plain-wrong-password", "scram-garbage-proof"])
def test_password_guessing_is_slowed_per_address_and_its_log_throttled(scram):
    """Four threads guessing for 8 s, each guess a new connection (before:
    PLAIN 2,564 attempts and SCRAM 15,953, each with a WARNING line). Failed
    addresses wait their turn: a few dozen attempts at most, a few log lines
    (one per address per 10 s, with the count of those not logged), and a
    client authenticated before the flood is still served."""
    got = hostile.attack_auth_flood(threads=4, duration=8.0, scram=scram)
    assert got["attempts"] <= 100, got
    assert got["log_lines"] <= 5, got
    assert got["probe_worst_ms"] < 5000, got  # served throughout (a loose bound: this is not a timing test)


def _http(port: int, request: bytes) -> tuple[int, bytes]:
    """One raw HTTP/1.1 exchange: the status and the body of the first response."""
    import socket
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
                data.partition(b"content-length: ")[2].split(b"\r\n")[0] or b"0"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ", 2)[1]), data.partition(b"\r\n\r\n")[2]


def test_the_management_api_refuses_request_smuggling_shapes_and_foreign_absolute_targets():
    """A request with both Content-Length and Transfer-Encoding (before: 201,
    the queue made) is refused with 400, and nothing is made; an absolute-form
    target naming another host (before: answered) is refused with 421, as a
    foreign Host is; one naming the broker is answered."""
    d = start_qflowd("--no-data-dir")
    try:
        status, body = _http(d.mgmt_port, b"PUT /api/queues/smuggled HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                          b"Content-Type: application/json\r\nContent-Length: 2\r\n"
                                          b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
        assert status == 400 and b"both Content-Length and Transfer-Encoding" in body, (status, body)
        status, _ = _http(d.mgmt_port, b"GET /api/queues/smuggled HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert status == 404
        status, body = _http(d.mgmt_port, b"GET http://evil.example/api/queues HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert status == 421 and b"evil.example" in body, (status, body)
        status, _ = _http(d.mgmt_port, f"GET http://127.0.0.1:{d.mgmt_port}/api/queues HTTP/1.1\r\n"
                                       "Host: 127.0.0.1\r\n\r\n".encode())
        assert status == 200
    finally:
        d.stop()


@pytest.mark.parametrize("char", ["\u202e", "\u2066", "\u200d", "\u200b", "\ufeff"])
def test_names_with_bidirectional_or_invisible_characters_are_refused_naming_the_character(char):
    """A queue named with a right-to-left override (or an isolate, a zero-width
    joiner or space, a BOM) would show in the console as another name: refused
    over both the messaging protocol and the management API, the character
    named (before: accepted)."""
    import urllib.parse
    d = start_qflowd("--no-data-dir")
    try:
        name = f"invoice{char}fdp.exe"
        s = hostile.raw_session(d.port)
        s.sendall(msgpack.packb([P.QUEUE_DECLARE, 0, name, False, False, False, {}, False]))
        s.settimeout(30)
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        reply = None
        while reply is None:
            unpacker.feed(s.recv(65536))
            reply = next((f for f in unpacker if f[0] in (P.EXCEPTION, P.RESULT)), None)
        s.close()
        assert reply[0] == P.EXCEPTION and reply[3] == 542, reply
        assert f"\\u{ord(char):04x}" in reply[4] and "at position 7" in reply[4], reply
        status, body = _http(d.mgmt_port, f"PUT /api/queues/{urllib.parse.quote(name)} HTTP/1.1\r\n"
                                          "Host: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                          "Content-Length: 2\r\n\r\n{}".encode())
        assert status == 400 and f"\\\\u{ord(char):04x}".encode() in body, (status, body)
    finally:
        d.stop()


def test_the_memory_alarm_bounds_memory_against_a_producer_with_a_huge_capacity():
    """A producer with capacity 1,000,000 sends 100,000 messages of 4 KiB to
    a queue that never stops, with the high watermark at 100 MB: while the
    alarm is on, its connection is not read (TCP back-pressure), so qflowd's
    resident set stays near the watermark (before: 450 MB, 350 above it);
    once a consumer drains, every message is completed and delivered."""
    got = hostile.attack_alarm_flood(high_mb=100, count=100_000)
    assert got["sent"] == got["drained"] == 100_000, got
    assert got["peak_over_high_mb"] < 150, got
