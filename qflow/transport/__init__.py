"""What qflow's trio glue needs of the transport beneath the wire protocol, for
either role: TLS (what a handshake established, or why it failed) and the C
allocator's settings for socket reads. No qflow imports: the client, the
server and the management API share it.
"""
