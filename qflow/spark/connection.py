"""The data source's conversations with the broker.

Each is one short trio program (``trio.run``) with a connection of its own:
the driver's, to plan or commit a batch; a task's, to read or write its
partition. The connection is opened with ``qflow.open_connection`` in a
nursery of that program's own task, and is closed before the program
returns. So nothing the source, its readers or its writers hold is a
socket, a task or a lock, and they pickle, as Spark needs.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

import qflow
from qflow.spark.options import Endpoint

log = logging.getLogger("qflow.spark")

PROFILE_ENV = "QFLOW_SPARK_PROFILE"


@asynccontextmanager
async def open_session(endpoint: Endpoint) -> AsyncIterator[qflow.Session]:
    """A session on a connection of its own to the broker at ``endpoint``,
    for the ``async with`` block.

    The connection's tasks run in a nursery of the calling task and end
    with the block, which closes the connection. Opening it, and attaching
    the session, may each take ``endpoint.connect_timeout`` seconds; what
    the block does takes as long as it takes.

    Args:
      endpoint: the broker, the credentials and the TLS files.

    Raises:
      ConnectionError: if the broker cannot be reached, or does not answer
        within the timeout, naming the option to look at.
      QflowOptionError: if a TLS file cannot be read or used.
      qflow.ConnectionClosed: if the broker refuses the connection
        (qflow.TlsError: the TLS handshake fails).
      trio.TooSlowError: if the session is not attached in time.
    """
    credentials = endpoint.connect_options()
    opened = False
    try:
        with trio.CancelScope(deadline=trio.current_time() + endpoint.connect_timeout) as opening:
            async with qflow.open_connection(endpoint.host, endpoint.port, name="qflow.spark",
                                             **credentials) as conn:
                opened = True
                opening.deadline = math.inf  # the timeout is the opening's, not the block's
                with trio.fail_after(endpoint.connect_timeout):
                    ssn = await conn.session()
                yield ssn
    except OSError as exc:
        if opened:  # the block's own
            raise
        raise ConnectionError(f"qflow: cannot connect to the broker at {endpoint.host}:{endpoint.port} "
                              f"(option broker): {exc}") from None
    if opening.cancelled_caught:
        raise ConnectionError(f"qflow: no answer from the broker at {endpoint.host}:{endpoint.port} "
                              f"within {endpoint.connect_timeout:g} s (option connectTimeout)")


def on_session(endpoint: Endpoint, fn: Any, *args: Any) -> Any:
    """Run ``await fn(endpoint, session, *args)`` as one trio program, on a
    session of its own (:func:`open_session`).

    Args:
      endpoint: the broker to talk to.
      fn: an async function taking the endpoint, the session and ``args``.
      *args: passed on to ``fn``.

    Returns:
      What ``fn`` returns.

    Raises:
      What :func:`open_session` raises, and what ``fn`` raises.
    """
    async def conversation() -> Any:
        async with open_session(endpoint) as ssn:
            return await fn(endpoint, ssn, *args)

    return trio.run(conversation)


def profiled(name: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, profiled when $QFLOW_SPARK_PROFILE names a directory.

    Profiled, it runs under cProfile and its stats are written to that
    directory as ``NAME-PID-TIME.prof`` (for pstats), with a warning naming
    the file: where a task's time goes, measured inside Spark's Python
    worker. Meant for a task's whole work, once per task.

    Args:
      name: the first part of the stats file's name.
      fn: what to run.
      *args: passed on to ``fn``.

    Returns:
      What ``fn`` returns.
    """
    directory = os.environ.get(PROFILE_ENV)
    if not directory:
        return fn(*args)
    import cProfile

    profile = cProfile.Profile()
    started = time.perf_counter()
    try:
        return profile.runcall(fn, *args)
    finally:
        path = os.path.join(directory, f"{name}-{os.getpid()}-{started:.6f}.prof")
        profile.dump_stats(path)
        log.warning("qflow: %s took %.3f s; profile in %s", name, time.perf_counter() - started, path)
