"""cffi build script for ``qflow._transfers_native`` (out-of-line API mode).

Referenced from setup.py as ``native/build_transfers.py:ffibuilder``; can also
be run directly (``python native/build_transfers.py``) to compile into the
current directory.
"""

import os
import sys

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import shared_header  # noqa: E402

shared_header.write()  # the numbers the C code shares with Python, written from the Python definitions

# Mirrors native/transfers.h; in API mode cffi checks these against it.
CDEF = """
#define QF_ENTRY_HEAD ...
#define QF_OP_WORDS ...
#define QF_OP_TRANSFER ...
#define QF_OP_ENQUEUE ...
#define QF_OP_END ...
#define QF_OP_TRANSFER1 ...
#define QF_OP_HOLD ...

typedef struct qf_run {
    size_t count;
    size_t end;
    size_t key_len;
    size_t exchange, exchange_len;
    size_t routing_key, routing_key_len;
    size_t properties, properties_len;
    size_t id_at;
    size_t rest_len;
    unsigned varied;
    unsigned channel;
} qf_run;

typedef struct qf_stored {
    size_t count;
    size_t consumed;
    uint64_t nbytes;
    size_t entry_bytes;
} qf_stored;

size_t qf_scan_transfers(const uint8_t *buf, size_t len, size_t pos, size_t max_frame, size_t max_count,
                         qf_run *run);
void qf_store_transfers(const uint8_t *buf, size_t len, size_t pos, const qf_run *run, size_t count,
                        uint64_t max_bytes, uint64_t first_seq, int64_t session, int64_t first_command,
                        int64_t queue, uint8_t *entries, size_t entries_cap, uint32_t *entry_ends, int64_t *ops,
                        qf_stored *out);
void qf_fanout_ops(const uint8_t *buf, size_t len, size_t pos, const qf_run *run, size_t count, int64_t session,
                   int64_t first_command, const int64_t *queues, size_t nq, const int64_t *holders, size_t nh,
                   int64_t *ops);
void qf_transfer1_ops(const uint64_t *sizes, size_t count, int64_t session, int64_t first_command, int64_t queue,
                      int64_t *ops);
int64_t qf_scan_entries(const uint8_t *buf, size_t len, size_t count, int64_t *offsets);
int64_t qf_entries_size(const uint8_t *buf, size_t len);
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "qflow._transfers_native",
    '#include "transfers.h"',
    sources=[os.path.relpath(os.path.join(_HERE, "transfers.c"))],
    include_dirs=[_HERE],
    extra_compile_args=["-O2"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
