"""The durable store: what survives a qflowd restart, kept in its
data directory. A layer above the broker: it may import qflow.broker and
qflow.protocol, and does its file I/O synchronously, with no trio; the server
(qflow.server.daemon) opens it and wires it to the broker.

* ``datadir``: the data directory and its lock (one qflowd per directory).
* ``definitions``: the durable queues, exchanges and bindings (``config.log``),
  recorded through the broker's config hooks and restored at start-up.
* ``journal``: persistent messages on durable queues, a segmented journal of
  checksummed batch records (docs/store.md).
* ``message_store``: the journal as an outside holder of transfers'
  completion (qflow.broker.completion.Holder); qflow.server.store_task runs
  its syncs off the event loop; qflow.server.daemon wires it (DIR/journal/).
* ``quota``: the journal's disk quota (overfull/underfull): while it is
  overfull, the message store keeps holding persistent transfers.
"""

from qflow.store.datadir import DataDir, DataDirLocked, StoreError
from qflow.store.definitions import DefinitionError, DefinitionStore

__all__ = ["DefinitionError", "DefinitionStore", "DataDir", "DataDirLocked", "StoreError"]
