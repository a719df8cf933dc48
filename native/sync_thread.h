/* The journal's sync thread (qflow/store/sync_thread.py, docs/store.md "Group
 * commit, on the loop and off it"): a POSIX thread that encodes a commit's
 * batch (qf_journal_encode), checksums it, appends it to a segment file as one
 * record and fdatasyncs it, all without the GIL, then says so through an
 * eventfd that the event loop waits on. The loop hands it one commit at a
 * time; nothing in it touches Python objects, so the writer and the loop
 * never take turns at the GIL.
 *
 * The record is u32 length | u32 crc32(payload) | payload, little-endian
 * (qflow/store/journal.py), and crc32 is zlib's (the IEEE polynomial,
 * reflected), so that recovery, in Python, checks it with zlib.crc32. */
#ifndef QFLOW_SYNC_THREAD_H
#define QFLOW_SYNC_THREAD_H

#include <stddef.h>
#include <stdint.h>

#include "journal.h"

typedef struct qf_sync_thread qf_sync_thread;

/* Start the thread; it writes 1 to ``event_fd`` (an eventfd) after each
 * commit. NULL, with errno set, if it cannot. */
qf_sync_thread *qf_sync_start(int event_fd);

/* Hand over one commit: encode ``b`` into out[0, size), append the record to
 * ``fd`` and fdatasync it. The caller keeps ``b``'s buffers and ``out`` alive,
 * and hands over nothing more, until the eventfd says it is done. Returns 0,
 * or -1 if a commit is still under way or the thread has stopped. */
int qf_sync_submit(qf_sync_thread *t, int fd, const qf_journal_batch *b, uint8_t *out, size_t size);

/* The result of the last commit, once the eventfd said it is done: 0, an
 * errno (> 0) if the write or the sync failed, or the encoder's negative
 * code (qf_journal_encode; -4: it returned another length than ``size``). */
int64_t qf_sync_result(qf_sync_thread *t);

/* Wait for the commit under way, if any, then end the thread and free it. */
void qf_sync_stop(qf_sync_thread *t);

/* zlib's crc32 (exposed for the tests). */
uint32_t qf_crc32(uint32_t crc, const uint8_t *buf, size_t len);

#endif
