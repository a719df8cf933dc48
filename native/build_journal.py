"""cffi build script for ``qflow._journal_native`` (out-of-line API mode): the
journal's batch encoder (native/journal.h) and its sync thread (native/sync_thread.h).

Referenced from setup.py as ``native/build_journal.py:ffibuilder``; can also
be run directly (``python native/build_journal.py``) to compile into the
current directory.
"""

import os

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))

# Mirrors native/journal.h; in API mode cffi checks these against it.
CDEF = """
#define QF_JOURNAL_ENTRY_HEAD ...

typedef struct qf_journal_batch {
    const uint8_t *names;
    size_t names_len, nnames;
    const uint8_t *entries;
    size_t entries_len;
    const uint32_t *entry_lens;
    const uint32_t *enq_names;
    const uint32_t *enq_bodies;
    size_t nenq;
    const uint32_t *body_entries;
    size_t nbodies;
    const uint32_t *deq_names;
    const uint64_t *deq_seqs;
    size_t ndeq;
    const uint32_t *del_names;
    size_t ndel;
    const uint8_t *section_ops;
    const uint32_t *section_counts;
    size_t nsections;
} qf_journal_batch;

int64_t qf_journal_encode(const qf_journal_batch *b, uint8_t *out, size_t cap);

typedef struct qf_sync_thread qf_sync_thread;
qf_sync_thread *qf_sync_start(int event_fd);
int qf_sync_submit(qf_sync_thread *t, int fd, const qf_journal_batch *b, uint8_t *out, size_t size);
int64_t qf_sync_result(qf_sync_thread *t);
void qf_sync_stop(qf_sync_thread *t);
uint32_t qf_crc32(uint32_t crc, const uint8_t *buf, size_t len);
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "qflow._journal_native",
    '#include "journal.h"\n#include "sync_thread.h"',
    sources=[os.path.relpath(os.path.join(_HERE, name)) for name in ("journal.c", "sync_thread.c")],
    include_dirs=[_HERE],
    extra_compile_args=["-O2", "-pthread"],
    extra_link_args=["-pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
