"""The cost of authentication on connection setup (``make bench``): the time
from opening the socket to the broker's connection.open-ok, for ANONYMOUS
(a broker with --auth no), PLAIN and SCRAM-SHA-256 (a broker with --auth yes
and a users file at qflow-passwd's default iteration count), and over TLS
(the same broker's --ssl-port, certificates made by trustme at run time):
PLAIN over TLS, and EXTERNAL with a client certificate (mutual TLS), measured
interleaved in one run. Message throughput once connected is the
``64b_auth`` workload of bench/run.py.
"""

from __future__ import annotations

import os
import ssl
import statistics
import tempfile
import time

import trio

import qflow
from qflow import testing
from qflow.auth.users_file import SaslDb
from qflow.protocol.sasl import make_verifier

USER, PASSWORD = "bench", "bench-password"


# The ACL of the 64b_acl workload (bench/run.py) and of core.py --acl: a few
# rules ahead of the ones that let the benchmark's user (or anonymous) work,
# as a real file would have, ending in qpidd's deny-all.
BENCH_ACL = """group admins admin ops
group producers bench anonymous
acl allow admins all
acl deny all purge queue name=audit.*
acl deny producers publish exchange name=amq.topic routingkey=secret.*
acl allow producers create queue name=bench*
acl allow producers access queue
acl allow producers consume queue name=bench*
acl allow producers publish exchange name=amq.default routingkey=bench
acl deny all all
"""


def acl_file(directory: str) -> str:
    path = os.path.join(directory, "bench.acl")
    with open(path, "w") as f:
        f.write(BENCH_ACL)
    return path


def users_file(directory: str) -> str:
    """A users file with the benchmark's user, as qflow-passwd writes it (default iterations)."""
    path = os.path.join(directory, "users.json")
    SaslDb(path, {USER: make_verifier(PASSWORD)}).save()
    return path


def tls_files(directory: str) -> tuple[tuple[str, ...], dict[str, ssl.SSLContext], ssl.SSLContext]:
    """qflowd's TLS options (client certificates optional, from the same test CA), and the client contexts:
    the CA only, and the CA with a client certificate."""
    import trustme  # a test dependency: the benchmark runs from a checkout set up by make install

    ca = trustme.CA()
    ca.cert_pem.write_to_path(os.path.join(directory, "ca.pem"))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(os.path.join(directory, "broker.pem"))
    client = ca.issue_cert("bench.example", common_name=USER)
    client.private_key_and_cert_chain_pem.write_to_path(os.path.join(directory, "client.pem"))
    args = ("--ssl-cert-file", os.path.join(directory, "broker.pem"), "--ssl-ca-file",
            os.path.join(directory, "ca.pem"))
    server_only = qflow.tls_context(os.path.join(directory, "ca.pem"))
    mutual = qflow.tls_context(os.path.join(directory, "ca.pem"), os.path.join(directory, "client.pem"))
    return args, server_only, mutual


async def _connect_ms(port: int, **credentials: object) -> float:
    t0 = time.perf_counter()
    async with qflow.open_connection("127.0.0.1", port, **credentials):
        elapsed = time.perf_counter() - t0
    return elapsed * 1000


def measure(rounds: int) -> dict:
    """Median ms per connection setup, each kind measured ``rounds`` times, interleaved."""
    with tempfile.TemporaryDirectory(prefix="qflow-bench-auth-") as tmp:
        open_broker = testing.start("--log-level", "warning", "--no-data-dir")
        tls_args, server_only, mutual = tls_files(tmp)
        auth_broker = testing.start("--log-level", "warning", "--no-data-dir", "--auth", "yes",
                                    "--sasl-db", users_file(tmp), *tls_args)
        try:
            kinds: dict[str, tuple[int, dict[str, object]]] = {
                "anonymous": (open_broker.port, {}),
                "plain": (auth_broker.port, {"username": USER, "password": PASSWORD, "mechanism": "PLAIN"}),
                "scram": (auth_broker.port, {"username": USER, "password": PASSWORD}),
                "tls_plain": (auth_broker.ssl_port, {"username": USER, "password": PASSWORD, "mechanism": "PLAIN",
                                                     "ssl_context": server_only}),
                "tls_external": (auth_broker.ssl_port, {"mechanism": "EXTERNAL", "ssl_context": mutual}),
            }
            times: dict[str, list[float]] = {k: [] for k in kinds}
            for _ in range(rounds):
                for kind, (port, credentials) in kinds.items():
                    times[kind].append(trio.run(lambda p=port, c=credentials: _connect_ms(p, **c)))
            return {f"connect_ms_{k}": round(statistics.median(v), 2) for k, v in times.items()}
        finally:
            open_broker.stop()
            auth_broker.stop()
