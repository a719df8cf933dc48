"""The broker model, with no I/O: queues, exchanges, consumers, flow control
and transfer completion. Connections (qflow.server) feed it commands and send
what it writes for them."""

from qflow.broker.broker import Broker, BrokerSession

__all__ = ["Broker", "BrokerSession"]
