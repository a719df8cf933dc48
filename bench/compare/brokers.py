"""The two brokers of ``bench/compare``, each for the whole run: one qflowd,
started as ``make bench`` starts it, and a private RabbitMQ node (Debian's
``rabbitmq-server``, installed with apt-get if missing) on loopback only, with
its own epmd, data, logs and config in a temporary folder. Both sides declare
and delete a run's queues, and are stopped by PID: nothing else on the
machine is touched. Also the /proc readings of a broker's CPU."""

from __future__ import annotations

import collections
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

RABBIT_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and its live descendants."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rindex(")") + 2:].split()
        stats[int(name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    children: dict[int, list[int]] = collections.defaultdict(list)
    for p, (ppid, _) in stats.items():
        children[ppid].append(p)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        if p in stats:
            total += stats[p][1]
        todo.extend(children.get(p, ()))
    return total


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        out.extend(kids)
        todo.extend(kids)
    return out


class QflowSide:
    name = "qflow"

    def __init__(self) -> None:
        from qflow import testing as qflowd

        self.daemon = qflowd.start("--log-level", "warning")  # as `make bench` starts it
        self.proc, self.port = self.daemon.proc, self.daemon.port
        self.pid = self.proc.pid

    def _admin(self, fn) -> object:
        import trio

        import qflow

        async def go():
            async with await qflow.connect("127.0.0.1", self.port) as conn:
                return await fn(await conn.session())

        return trio.run(go)

    def setup(self, queues: list[str], arguments: dict, fanout: str | None = None, durable: bool = False) -> None:
        async def fn(ssn):
            for q in queues:
                await ssn.declare_queue(q, arguments=arguments, durable=durable)
            if fanout:
                await ssn.declare_exchange(fanout, "fanout")
                for q in queues:
                    await ssn.bind(fanout, q)

        self._admin(fn)

    def teardown(self, queues: list[str], fanout: str | None = None) -> dict:
        async def fn(ssn):
            stats = {q: await ssn.query_queue(q) for q in queues}
            for q in queues:
                await ssn.delete_queue(q)
            if fanout:
                await ssn.delete_exchange(fanout)
            return stats

        stats = self._admin(fn)
        return {"flow_stops": sum(s.get("flowStoppedCount", 0) for s in stats.values()),
                "left": sum(s.get("msgDepth", 0) for s in stats.values())}

    def stop(self) -> None:
        self.daemon.stop()


class RabbitSide:
    name = "rabbitmq"

    def __init__(self, log) -> None:
        self.log = log
        self.dir = tempfile.mkdtemp(prefix="qflow-bench-rabbitmq-")
        self.port, self.dist_port, self.epmd_port = free_port(), free_port(), free_port()
        self.node = f"qflowbench{os.getpid()}@localhost"
        self.epmd: subprocess.Popen | None = None
        self.proc: subprocess.Popen | None = None
        self.conn = None
        self.version = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "rabbitmq-server"],
                                      capture_output=True, text=True).stdout.strip()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        d = self.dir
        with open(os.path.join(d, "enabled_plugins"), "w") as f:
            f.write("[].\n")  # no plugins at all: no management plugin
        with open(os.path.join(d, "rabbitmq.conf"), "w") as f:
            f.write(f"listeners.tcp.default = 127.0.0.1:{self.port}\n"
                    "disk_free_limit.absolute = 50MB\n"
                    "loopback_users = none\n")
        env = {
            **os.environ,
            "HOME": d,  # the Erlang cookie goes here
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "ERL_EPMD_PORT": str(self.epmd_port),
            "ERL_CRASH_DUMP": os.path.join(d, "erl_crash.dump"),
            "RABBITMQ_CONF_ENV_FILE": os.path.join(d, "rabbitmq-env.conf"),  # not /etc/rabbitmq's
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_USE_LONGNAME": "false",
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_CONFIG_FILE": os.path.join(d, "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": os.path.join(d, "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": os.path.join(d, "mnesia"),
            "RABBITMQ_LOG_BASE": os.path.join(d, "log"),
            "RABBITMQ_PLUGINS_EXPAND_DIR": os.path.join(d, "plugins-expand"),
            "RABBITMQ_PID_FILE": os.path.join(d, "rabbitmq.pid"),
            # Erlang distribution on loopback only, on the port chosen above.
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }
        open(env["RABBITMQ_CONF_ENV_FILE"], "w").close()
        # Our own epmd on its own loopback port: the node registers there, and
        # stopping it cannot disturb any other Erlang node on this machine.
        self.epmd = subprocess.Popen([shutil.which("epmd") or "epmd", "-address", "127.0.0.1",
                                      "-port", str(self.epmd_port)], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.epmd_port, 10, self.epmd)
        self.out = open(os.path.join(d, "stdout.log"), "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen([RABBIT_SERVER], env=env, cwd=d, stdout=self.out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        import amqp

        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rabbitmq-server exited with {self.proc.returncode}:\n{self._tail()}")
            try:
                conn = amqp.Connection(f"127.0.0.1:{self.port}", heartbeat=0, connect_timeout=2)
                conn.connect()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rabbitmq-server not ready after 120 s:\n{self._tail()}") from None
                time.sleep(0.5)
        self.conn = conn
        self.ch = conn.channel()
        pids = [self.proc.pid, *descendants(self.proc.pid)]
        self.log(f"RabbitMQ {self.version} ready in {time.monotonic() - t0:.1f} s on 127.0.0.1:{self.port} "
                 f"(node {self.node}, pids {pids}, epmd pid {self.epmd.pid} port {self.epmd_port}, dir {d})")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _tail(self) -> str:
        try:
            with open(os.path.join(self.dir, "stdout.log")) as f:
                return "".join(f.readlines()[-20:])
        except OSError:
            return ""

    def beam_pid(self) -> int:
        for p in [self.proc.pid, *descendants(self.proc.pid)]:
            try:
                with open(f"/proc/{p}/comm") as f:
                    if f.read().strip() == "beam.smp":
                        return p
            except OSError:
                pass
        return self.proc.pid

    def setup(self, queues: list[str], arguments: dict, fanout: str | None = None, durable: bool = False) -> None:
        for q in queues:
            self.ch.queue_declare(q, durable=durable, auto_delete=False, arguments=arguments)
        if fanout:
            self.ch.exchange_declare(fanout, "fanout", durable=False, auto_delete=False)
            for q in queues:
                self.ch.queue_bind(q, fanout, "")

    def teardown(self, queues: list[str], fanout: str | None = None) -> dict:
        left = 0
        for q in queues:
            left += self.ch.queue_declare(q, passive=True).message_count
            self.ch.queue_delete(q)
        if fanout:
            self.ch.exchange_delete(fanout)
        return {"left": left}

    def stop(self) -> None:
        """Stop only what we started, by PID: the node (SIGTERM to beam.smp,
        RabbitMQ's orderly shutdown), then our epmd."""
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:
                pass
            self.conn = None
        if self.proc is not None and self.proc.poll() is None:
            tree = descendants(self.proc.pid)
            try:
                os.kill(self.beam_pid(), signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                for p in [*tree, self.proc.pid]:
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self.proc.wait()
            for p in tree:  # e.g. erl_child_setup, if it outlived beam.smp
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.epmd is not None and self.epmd.poll() is None:
            self.epmd.terminate()
            try:
                self.epmd.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.epmd.kill()
                self.epmd.wait()
        if getattr(self, "out", None):
            self.out.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _wait_port(port: int, seconds: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.args[0]} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {seconds} s")


def ensure_rabbitmq(log) -> None:
    if os.path.exists(RABBIT_SERVER):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SystemExit(f"{RABBIT_SERVER} is missing: install Debian's rabbitmq-server (needs root and apt-get)")
    log("installing Debian's rabbitmq-server with apt-get ...")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "rabbitmq-server"], check=True,
                   env=env, stdout=subprocess.DEVNULL)

