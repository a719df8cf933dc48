"""The attack of issue 16, in a real headless Chromium (Debian's, installed by
``make install``), against a real qflowd:

> A page from another origin, in headless Chromium, purged two queues and
> added a binding using plain HTML forms. A foreign Host header is accepted,
> so DNS rebinding exposes DELETE and every read too.

An "evil" page, served from another origin on 127.0.0.1, auto-submits
today's HTML-form attacks (purges and bindings with ``text/plain`` and
form-urlencoded bodies, the JSON-in-text/plain trick, a binding in the query
string) and tries ``fetch()`` (a no-cors POST, a DELETE, a JSON PUT, a read).
Then a second page plays DNS rebinding: Chromium resolves ``evil.example`` to
127.0.0.1, so the page at ``http://evil.example:<management port>/`` is, to
the browser, same-origin with the broker. Afterwards every queue still has
its messages, no binding or queue was added, and the broker's log shows the
refusals. Before the guard (qflow.management.guard) this test failed: the
forms purged the queues and added the bindings, and the rebound page read
and purged.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import sync_playwright

from qflow.testing import Daemon, chromium
from tests.conftest import start_qflowd
from tests.test_tools import config, ok, run

# The browser and HTTP do not depend on the accounting implementation: run once.
pytestmark = pytest.mark.native_only

DEADLINE = 90.0  # seconds: a browser starting on a loaded two-core machine
VICTIMS = ("victim1", "victim2", "victim3", "rebound")
MESSAGES = 3

EVIL_PAGE = """<!doctype html>
<html><head><title>cute cats</title></head><body>
<script>
const M = "http://127.0.0.1:%(mgmt)d";
window.results = {};
let pending = 1;
function done() { if (--pending === 0) window.attackDone = true; }

// Today's form attacks: each posts into its own iframe, so the page stays.
function form(id, action, enctype, fields) {
  const frame = document.createElement("iframe");
  frame.name = id;
  document.body.appendChild(frame);
  const f = document.createElement("form");
  f.method = "POST"; f.action = action; f.enctype = enctype; f.target = id;
  for (const [name, value] of fields) {
    const input = document.createElement("input");
    input.type = "hidden"; input.name = name; input.value = value;
    f.appendChild(input);
  }
  document.body.appendChild(f);
  pending++;
  frame.addEventListener("load", () => { window.results[id] = "answered"; done(); }, {once: true});
  f.submit();
}
form("purge-text", M + "/api/queues/victim1/purge", "text/plain", []);
form("purge-form", M + "/api/queues/victim2/purge", "application/x-www-form-urlencoded", []);
form("bind-query", M + "/api/bindings?exchange=amq.direct&queue=victim1&key=evil",
     "application/x-www-form-urlencoded", []);
form("bind-json-in-text", M + "/api/bindings", "text/plain",
     [['{"exchange": "amq.fanout", "queue": "victim2", "key": "x', '"}']]);

// fetch(): a "simple" request is sent without asking; the others need a CORS preflight.
function attempt(key, promise) {
  pending++;
  promise.then(v => { window.results[key] = v; }, e => { window.results[key] = "blocked: " + e; }).finally(done);
}
attempt("fetch-purge", fetch(M + "/api/queues/victim3/purge",
        {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"}, body: ""}).then(r => r.type));
attempt("fetch-delete", fetch(M + "/api/queues/victim3", {method: "DELETE"}).then(r => r.status));
attempt("fetch-put", fetch(M + "/api/queues/planted",
        {method: "PUT", headers: {"Content-Type": "application/json"}, body: "{}"}).then(r => r.status));
attempt("fetch-read", fetch(M + "/api/connections").then(r => r.text()));
done();
</script>
</body></html>
"""

# What a DNS-rebinding page runs once ``evil.example`` resolves to the broker: in
# the origin http://evil.example:<management port>, so same-origin to the browser.
REBIND_SCRIPT = """async () => {
  const results = {};
  for (const [key, path, init] of [
      ["read", "/api/queues", {}],
      ["purge", "/api/queues/rebound/purge", {method: "POST", headers: {"Content-Type": "application/json"}}],
      ["delete", "/api/queues/rebound", {method: "DELETE", headers: {"Content-Type": "application/json"}}]]) {
    try {
      const r = await fetch(path, init);
      results[key] = r.status + " " + await r.text();
    } catch (e) {
      results[key] = "blocked: " + e;
    }
  }
  return results;
}"""


class _EvilHandler(BaseHTTPRequestHandler):
    page = b""

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(self.page)))
        self.end_headers()
        self.wfile.write(self.page)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def evil_server() -> Iterator[ThreadingHTTPServer]:
    """The attacker's site: another origin (another port) on 127.0.0.1."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _EvilHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=DEADLINE)


@pytest.fixture
def broker() -> Iterator[Daemon]:
    d = start_qflowd("--mgmt-port", "0")
    try:
        for name in VICTIMS:
            ok(config(d, "add", "queue", name))
            ok(run("qflow-send", "-b", d.address, "-a", name, "-m", str(MESSAGES), "--content-string", "precious"))
        yield d
    finally:
        d.stop()


def api(d: Daemon, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{d.mgmt_port}{path}", timeout=DEADLINE) as response:
        return json.loads(response.read())


def depths(d: Daemon) -> dict[str, int]:
    return {q["name"]: q["msgDepth"] for q in api(d, "/api/queues")}


def bindings(d: Daemon) -> set[tuple[str, str, str]]:
    return {(b["exchange"], b["queue"], b["key"]) for b in api(d, "/api/bindings")}


def test_a_foreign_page_in_chromium_cannot_drive_the_management_api(
        broker: Daemon, evil_server: ThreadingHTTPServer, tmp_path: Path) -> None:
    d = broker
    mgmt = d.mgmt_port
    before = bindings(d)
    assert depths(d) == dict.fromkeys(VICTIMS, MESSAGES)
    _EvilHandler.page = (EVIL_PAGE % {"mgmt": mgmt}).encode()
    evil_url = f"http://127.0.0.1:{evil_server.server_address[1]}/"

    with sync_playwright() as p:
        browser = chromium(p, str(tmp_path / "profile"), "--host-resolver-rules=MAP evil.example 127.0.0.1",
                           timeout=DEADLINE)
        try:
            page = browser.new_page()
            page.goto(evil_url, timeout=DEADLINE * 1000)
            page.wait_for_function("window.attackDone === true", timeout=DEADLINE * 1000)
            results = page.evaluate("window.results")

            # DNS rebinding: the attacker's page was loaded from evil.example, whose name now resolves
            # (the resolver rule) to 127.0.0.1; its script runs in that origin, with the broker's port.
            rebound = browser.new_page()
            rebound.goto(f"http://evil.example:{mgmt}/", timeout=DEADLINE * 1000)
            rebind_results = rebound.evaluate(REBIND_SCRIPT)
        finally:
            browser.close()

    # Every form was submitted and answered; the simple fetch was sent; the others never got past
    # the preflight, and the read was not shown to the page.
    assert {results[k] for k in ("purge-text", "purge-form", "bind-query", "bind-json-in-text")} == {"answered"}, results
    assert results["fetch-purge"] == "opaque", results
    for key in ("fetch-delete", "fetch-put", "fetch-read"):
        assert str(results[key]).startswith("blocked: "), results
    # The rebound page reached the broker (same origin to the browser) and was refused by its Host.
    for key in ("read", "purge", "delete"):
        assert rebind_results[key].startswith("421 "), rebind_results
        assert "Host 'evil.example:" in rebind_results[key], rebind_results

    # Nothing changed: every message is there, no binding or queue was added.
    assert depths(d) == dict.fromkeys(VICTIMS, MESSAGES)
    assert bindings(d) == before
    assert "planted" not in depths(d)

    # The broker's log names each refusal.
    evil_origin = f"http://127.0.0.1:{evil_server.server_address[1]}"
    expected = ["refused POST /api/queues/victim1/purge from 127.0.0.1:",
                "refused POST /api/queues/victim2/purge from 127.0.0.1:",
                "refused POST /api/bindings?exchange=amq.direct&queue=victim1&key=evil from 127.0.0.1:",
                "refused POST /api/bindings from 127.0.0.1:",
                "refused POST /api/queues/victim3/purge from 127.0.0.1:",
                f"Origin '{evil_origin}' is not this management API's own origin",
                "refused GET /api/queues from 127.0.0.1:",
                "refused POST /api/queues/rebound/purge from 127.0.0.1:",
                "refused DELETE /api/queues/rebound from 127.0.0.1:",
                f"Host 'evil.example:{mgmt}' is not a name of this broker"]
    deadline = time.monotonic() + DEADLINE
    while not all(text in d.log() for text in expected):
        assert time.monotonic() < deadline, [t for t in expected if t not in d.log()]
        time.sleep(0.05)
