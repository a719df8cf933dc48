"""The qflow wire protocol, sans I/O: nothing here imports trio, the broker or
the client, and both sides use it.

* ``spec``: frame codes, error codes, command schemas and their validation
  (re-exported here, so ``from qflow import protocol as P; P.TRANSFER``).
* ``framing``: bytes to frames and frames to bytes.
* ``entries``: a stored message as the broker keeps it and delivers it.
* ``ranges``: sets of command ids as ranges.
* ``names``: what a queue or exchange name may hold, and escaping client-chosen
  strings for log lines.
* ``commands``: a session's command bookkeeping on either side (ids,
  completion, what to report).
"""

from qflow.protocol.spec import *  # noqa: F403 - the protocol's constants are its namespace
from qflow.protocol.spec import CommandError, check_properties, command_name, parse_command  # noqa: F401
