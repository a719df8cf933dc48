"""``/metrics`` parses as Prometheus's text format 0.0.4 and, when the Accept
header asks for it as Prometheus does, as OpenMetrics 1.0, with
prometheus_client's own parsers; no gauge shares a family with a counter; the
samples are the same in both. Against a real qflowd with every kind of family
holding samples (a queue, an exchange, the store and the memory alarm).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families as text_families

import qflow
from qflow.management.metrics import (
    BROKER_METRICS,
    EXCHANGE_METRICS,
    QUEUE_METRICS,
    RESOURCE_METRICS,
    wants_openmetrics,
)
from qflow.testing import Daemon, start

# What Prometheus 2.x/3.x sends when it scrapes (its scrape_protocols' default order).
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


@pytest.fixture(scope="module")
def qflowd() -> Iterator[Daemon]:
    d = start()
    yield d
    d.stop()


def get(d: Daemon, accept: str | None) -> tuple[str, str]:
    headers = {} if accept is None else {"Accept": accept}
    request = urllib.request.Request(f"http://127.0.0.1:{d.mgmt_port}/metrics", headers=headers)
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.headers["Content-Type"], response.read().decode()


async def _traffic(d: Daemon) -> None:
    async with qflow.open_connection("127.0.0.1", d.port) as conn:
        ssn = await conn.session()
        await ssn.declare_queue("metered", arguments={"qpid.flow_stop_count": 5, "qpid.flow_resume_count": 2})
        await ssn.declare_exchange("events", "topic")
        await ssn.bind("events", "metered", "#")
        sender = ssn.sender("events/a")
        await sender.send_many([b"x"] * 3)
        await sender.sync()


def test_every_family_name_is_of_one_type() -> None:
    """The rule itself, over the tables: a counter's family is its name without _total."""
    families: dict[str, str] = {}
    tables = [(m, "gauge") for m, _h, _k in BROKER_METRICS] + [(m, t) for m, t, _h, _k in
                                                                 (*QUEUE_METRICS, *EXCHANGE_METRICS,
                                                                  *RESOURCE_METRICS)]
    for metric, type_ in tables:
        assert (type_ == "counter") == metric.endswith("_total"), metric
        name = metric.removesuffix("_total") if type_ == "counter" else metric
        assert families.setdefault(name, type_) == type_, f"{name} is both a {families[name]} and a {type_}"


async def test_metrics_parse_in_both_formats_with_the_same_samples(qflowd: Daemon) -> None:
    await _traffic(qflowd)
    plain_type, plain = get(qflowd, None)
    om_type, om = get(qflowd, PROMETHEUS_ACCEPT)
    assert plain_type.startswith("text/plain; version=0.0.4")
    assert om_type.startswith("application/openmetrics-text; version=1.0.0")
    assert om.endswith("# EOF\n") and "# EOF" not in plain

    by_text = list(text_families(plain))
    by_om = list(openmetrics_families(om))  # raises on anything OpenMetrics forbids
    for families in (by_text, by_om):
        names = [f.name for f in families]
        assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
        types = {f.name: f.type for f in families}
        assert types["qflow_store_overfull"] == "gauge" and types["qflow_store_overfull_events"] == "counter"
        assert types["qflow_memory_alarm"] == "gauge" and types["qflow_memory_alarm_events"] == "counter"
        assert types["qflow_queue_flow_stops"] == "counter"

    def samples(families: list) -> dict[tuple[str, tuple], float]:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}

    text_samples, om_samples = samples(by_text), samples(by_om)
    del text_samples[("qflow_uptime_seconds", ())], om_samples[("qflow_uptime_seconds", ())]  # two scrapes apart
    assert text_samples == om_samples
    assert text_samples[("qflow_queue_messages_enqueued_total", (("queue", "metered"),))] == 3
    assert text_samples[("qflow_exchange_messages_routed_total", (("exchange", "events"),))] == 3
    assert text_samples[("qflow_store_overfull_events_total", ())] == 0


@pytest.mark.parametrize(("accept", "openmetrics"), [
    ("", False),
    ("*/*", False),
    ("text/plain", False),
    (PROMETHEUS_ACCEPT, True),
    ("application/openmetrics-text", True),
    ("text/plain;version=0.0.4,application/openmetrics-text;version=1.0.0;q=0.5", False),
    ("application/openmetrics-text;q=0", False),
    ("application/openmetrics-text;q=nonsense", False),
    ("APPLICATION/OpenMetrics-Text; version=1.0.0, text/plain; q=0.9", True),
])
def test_the_format_follows_the_accept_header(accept: str, openmetrics: bool) -> None:
    assert wants_openmetrics(accept) is openmetrics
