"""What the broker tells a store about configuration changes. No I/O.

The broker calls one of these methods for every queue, exchange and binding
change, whatever asked for it (a client's command, the management API,
qflow-config). Each call comes *after* every check the change must pass and
*before* the broker makes it, so a store that writes the change ahead of it
(qflow.store) never records something the broker then refuses, and a store
that cannot write can refuse the change by raising ``CommandError``: the broker
is then left exactly as it was. The broker does not filter: a store decides
itself what is durable (it sees ``durable`` and the objects).

The one change that cannot be refused is a deletion the broker makes on its
own (an auto-delete queue losing its last consumer, an exclusive queue's
session ending): :meth:`Broker.delete_queue_now` logs the refusal and deletes
anyway.

This base class does nothing; the broker holds one until a store replaces it
(``Broker.config_hooks``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qflow.broker.exchange import Exchange
    from qflow.broker.queue import Queue


class ConfigHooks:
    def declare_queue(self, name: str, durable: bool, auto_delete: bool, arguments: dict[str, Any]) -> None:
        """A queue is about to be created."""

    def modify_queue(self, q: Queue, arguments: dict[str, Any]) -> None:
        """``q``'s arguments are about to become ``arguments`` (the whole merged set)."""

    def delete_queue(self, q: Queue) -> None:
        """``q`` is about to be deleted, and with it every binding to it."""

    def declare_exchange(self, name: str, type_: str, durable: bool, arguments: dict[str, Any]) -> None:
        """An exchange is about to be created."""

    def delete_exchange(self, ex: Exchange) -> None:
        """``ex`` is about to be deleted, and with it every binding from it."""

    def bind(self, ex: Exchange, q: Queue, key: str) -> None:
        """A binding that does not exist yet is about to be added."""

    def unbind(self, ex: Exchange, q: Queue, key: str) -> None:
        """A binding that exists is about to be removed."""
