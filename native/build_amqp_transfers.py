"""cffi build script for ``qflow._amqp_native`` (out-of-line API mode): runs of
AMQP 1.0 transfer frames (native/amqp_transfers.h).

Referenced from setup.py as ``native/build_amqp_transfers.py:ffibuilder``; can
also be run directly to compile into the current directory.
"""

import os

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))

# Mirrors native/amqp_transfers.h; in API mode cffi checks these against it.
CDEF = """
#define QA_ROW_WORDS ...

typedef struct qa_run {
    size_t count;
    size_t end;
    unsigned channel;
    uint32_t handle;
    int64_t message_format;
} qa_run;

typedef struct qa_stored {
    size_t count;
    uint64_t nbytes;
    size_t entry_bytes;
} qa_stored;

void qa_store_entries(const uint8_t *blob, size_t blob_len, int64_t base, const int64_t *rows, size_t count,
                      const uint8_t *prefix, size_t prefix_len, const uint8_t *plain, size_t plain_len,
                      const uint8_t *durable, size_t durable_len, uint64_t first_seq, uint64_t max_bytes,
                      uint8_t *entries, size_t cap, uint32_t *ends, uint64_t *sizes, qa_stored *out);

size_t qa_write_transfers(const uint8_t *buf, size_t len, const uint8_t *plain, size_t plain_len,
                          const uint8_t *durable, size_t durable_len, unsigned channel, uint32_t handle,
                          uint32_t first_delivery_id, uint64_t first_tag, int settled, size_t max_frame,
                          uint8_t *out, size_t cap, size_t *written, size_t *consumed);

size_t qa_scan_transfers(const uint8_t *buf, size_t len, size_t pos, size_t max_frame, size_t max_count,
                         int64_t *rows, qa_run *run);
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "qflow._amqp_native",
    '#include "amqp_transfers.h"',
    sources=[os.path.relpath(os.path.join(_HERE, "amqp_transfers.c"))],
    include_dirs=[_HERE],
    extra_compile_args=["-O2"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
