"""Take docs/console.png: the web console at the moment a queue is flow-stopped.

``make console-screenshot`` (or ``python tools/console_screenshot.py [OUT]``):
starts its own qflowd on free loopback ports (qflow.testing.start), declares
``orders`` as the README does (stop 900, resume 500) and a quiet ``audit``
queue, opens the console in headless Chromium (Debian's, as the tests), runs
the README's producer (qflow-send, 5000 messages, window 50, at 250 a
second so that the chart shows it rise) until the queue stops it, drains 600
messages so the queue resumes and stops again, and
takes the picture once it is stopped the second time, so the chart shows two
shaded stopped periods. Everything it started (the broker, the producer) is
stopped by PID. It writes only OUT (docs/console.png by default).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from playwright.sync_api import expect, sync_playwright

from qflow.testing import Daemon, chromium, start

ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 120.0  # seconds for any step on a loaded machine


def tool(name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", f"qflow.cli.{name.replace('-', '_')}", *args]


def run(*argv: str) -> None:
    subprocess.run(argv, check=True, timeout=DEADLINE, stdin=subprocess.DEVNULL, capture_output=True)


def queue(d: Daemon, name: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{d.mgmt_port}/api/queues/{name}", timeout=DEADLINE) as r:
        return json.loads(r.read())


def wait(what: str, check: Any) -> None:
    deadline = time.monotonic() + DEADLINE
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"console_screenshot: gave up waiting for {what}")
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=str(ROOT / "docs" / "console.png"))
    args = parser.parse_args()
    d = start("--mgmt-port", "0")
    producer = None
    try:
        b = ["-b", d.address]
        run(*tool("qflow-config", *b, "add", "queue", "orders", "--max-queue-count", "10000",
                  "--flow-stop-count", "900", "--flow-resume-count", "500"))
        run(*tool("qflow-config", *b, "add", "queue", "audit", "--max-queue-count", "1000"))
        run(*tool("qflow-send", *b, "-a", "audit", "--messages", "120", "--content-size", "200"))
        with sync_playwright() as p, tempfile.TemporaryDirectory(prefix="qflow-screenshot-") as profile:
            browser = chromium(p, profile, timeout=DEADLINE, viewport={"width": 1280, "height": 940})
            try:
                page = browser.new_page()
                page.goto(f"http://127.0.0.1:{d.mgmt_port}/", timeout=DEADLINE * 1000)
                stopped = page.locator('#queues tr[data-queue="orders"] td.flowStopped')
                expect(stopped).to_have_text("N", timeout=DEADLINE * 1000)
                time.sleep(3)  # a few seconds of flat history before the producer starts: only for the picture
                producer = subprocess.Popen(tool("qflow-send", *b, "-a", "orders", "--messages", "5000",
                                                 "--content-size", "64", "--capacity", "50",
                                                 "--send-rate", "250"),
                                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)
                wait("orders to stop its producer", lambda: queue(d, "orders")["flowStopped"])
                time.sleep(4)
                run(*tool("qflow-receive", *b, "-a", "orders", "--messages", "600", "--print-content", "no"))
                wait("orders to stop again", lambda: queue(d, "orders")["flowStoppedCount"] >= 2
                     and queue(d, "orders")["flowStopped"])
                expect(stopped).to_have_text("Y", timeout=DEADLINE * 1000)
                time.sleep(4)  # the second stopped period grows a little wider on the chart
                page.screenshot(path=args.out, full_page=True)
            finally:
                browser.close()
    finally:
        if producer is not None and producer.poll() is None:
            producer.kill()
            producer.wait()
        d.stop()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
