"""qflow-salvage: the messages a journal recovery withheld.

    qflow-salvage [--data-dir DIR]

When qflowd's recovery skips a damaged journal record, it does not put back
the messages that were live before it (the record may have dequeued them:
docs/store.md, "Damaged records"); it keeps the journal's segments as it read
them in ``DIR/journal/dropped/skipped-*``. This lists those messages, one JSON
object a line: ``snapshot``, ``queue``, ``sequence``, ``exchange``,
``routing_key``, ``properties`` and ``body`` (base64), for an operator who
knows which were consumed to send the others again. It only reads; it does
not need qflowd stopped. Exit codes: 0 done (nothing listed: nothing was
withheld), 1 the directory cannot be read, 2 a usage error.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys

from qflow.protocol.entries import entry_tail
from qflow.store.journal import salvage

PROG = "qflow-salvage"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="~/.qflowd", metavar="DIR", help="qflowd's data directory (default ~/.qflowd)")
    args = p.parse_args(argv)
    journal = os.path.join(os.path.expanduser(args.data_dir), "journal")
    if not os.path.isdir(journal):
        sys.stderr.write(f"{PROG}: {journal}: no message journal there\n")
        return 1
    try:
        for snapshot, queue, seq, entry in salvage(journal):
            exchange, routing_key, properties, body = entry_tail(entry)
            sys.stdout.write(json.dumps({"snapshot": snapshot, "queue": queue, "sequence": seq, "exchange": exchange,
                                         "routing_key": routing_key, "properties": properties,
                                         "body": base64.b64encode(body).decode()}) + "\n")
    except OSError as exc:
        sys.stderr.write(f"{PROG}: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
