"""What the AMQP 1.0 connection core tells its user (see :mod:`.connection`).

Each event is a NamedTuple. Sessions are named by their channel number and
links by (channel, handle): the core answers each peer's session and link on
the same channel and handle numbers as the peer's, so one number serves both
directions.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class SaslInitReceived(NamedTuple):
    """The client chose a SASL mechanism; answer with ``sasl_challenge`` or ``sasl_outcome``."""
    mechanism: str
    initial_response: bytes | None
    hostname: str | None


class SaslResponseReceived(NamedTuple):
    """The client answered a challenge."""
    response: bytes


class ConnectionOpened(NamedTuple):
    """The peer's open; answer with ``Connection.open()``. ``max_frame_size``
    is the peer's offer; the core's limits are applied when it answers."""
    container_id: str
    hostname: str | None
    max_frame_size: int
    channel_max: int
    idle_time_out: int | None
    properties: dict | None
    offered_capabilities: tuple | None
    desired_capabilities: tuple | None


class SessionBegun(NamedTuple):
    """The peer began a session on ``channel``; answer with ``Connection.begin(channel)``."""
    channel: int
    next_outgoing_id: int
    incoming_window: int
    outgoing_window: int
    handle_max: int


class SessionEnded(NamedTuple):
    """The session ended: by the peer (``by_peer``; the core has answered its end),
    or by the core because the peer broke a session rule (``error`` says which).
    Its links are gone with it."""
    channel: int
    error: Any
    by_peer: bool


class LinkAttached(NamedTuple):
    """The peer attached a link; answer with ``Connection.attach`` or ``Connection.refuse_link``.

    ``peer_is_sender``: the peer sends on it (its target is where messages
    go); otherwise the peer receives (its source is where they come from).
    ``address`` is the target's address for a sending peer, the source's for
    a receiving one. ``unsupported`` names each requested feature the core
    does not implement (filters, transactions, link resume, ...): a broker
    refuses such a link with amqp:not-implemented rather than ignore them.
    """
    channel: int
    handle: int
    name: str
    peer_is_sender: bool
    address: str | None
    dynamic: bool
    distribution_mode: str | None
    snd_settle_mode: int
    rcv_settle_mode: int
    initial_delivery_count: int | None
    max_message_size: int | None
    source: Any
    target: Any
    properties: dict | None
    unsupported: tuple[str, ...]


class FlowReceived(NamedTuple):
    """A flow frame. ``handle`` None: session-level only. For a link the peer
    receives on, ``credit`` is how many deliveries may now be sent (its
    link-credit as of this side's delivery-count); ``drain``: send what there
    is, then call ``Connection.drained``."""
    channel: int
    handle: int | None
    delivery_count: int | None
    link_credit: int | None
    credit: int
    drain: bool
    echo: bool
    available: int | None


class TransferReceived(NamedTuple):
    """One whole delivery (the frames of a multi-frame one, joined). ``payload``
    is the encoded message, byte for byte as sent. Deliveries arrive as
    :class:`~.transfer_runs.TransferRun` events (many per event);
    ``TransferRun.transfers()`` gives them one by one in this form."""
    channel: int
    handle: int
    delivery_id: int
    delivery_tag: bytes | None
    settled: bool
    payload: bytes
    message_format: int


class DispositionReceived(NamedTuple):
    """The peer's disposition of deliveries ``first`` to ``last`` (inclusive);
    ``role`` True: the peer is the receiver (it settles what this side sent)."""
    channel: int
    role: bool
    first: int
    last: int
    settled: bool
    state: Any


class LinkDetached(NamedTuple):
    """The link is gone: detached by the peer (``by_peer``; the core has
    answered) or by the core because the peer broke a link rule (``error``)."""
    channel: int
    handle: int
    closed: bool
    error: Any
    by_peer: bool


class ConnectionClosed(NamedTuple):
    """The connection is over. ``by_peer``: the peer sent close (answered by
    the core); otherwise the core closed it for ``error`` (an
    :class:`~.performatives.Error`: condition and description), having
    written the close frame. Send what ``data_to_send`` returns, then close
    the socket."""
    error: Any
    by_peer: bool
