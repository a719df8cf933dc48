/* The message journal's batch record payload (qflow/store/journal.py, docs/store.md),
 * encoded in one call per commit, so that the writer thread encodes a batch of N
 * messages with the GIL released (cffi releases it around the call) instead of
 * making N Python calls that hold it. The Python twin is qflow.store.journal's
 * encode_python; tests/test_journal_encoder.py compares their bytes.
 *
 * The payload, all integers little-endian:
 *
 *     u8 2 | u32 nnames | nnames x (u16 len | utf-8 queue name)
 *     | u32 nbodies | nbodies x (u64 body size | u32 tail length)
 *     | u32 nsections | sections | the tails, back to back
 *     section = u8 op | u32 n | n items
 *         op 1 enqueue: u32 name index | u64 sequence | u32 body index
 *         op 2 dequeue: u32 name index | u64 sequence
 *         op 3 delete:  u32 name index
 *
 * The input is the staged batch as qflow.store.journal.Batch holds it: the
 * entries of the enqueues back to back (each a stored entry: a 19-byte head,
 * big-endian, with the sequence at byte 2 and the message size at byte 11,
 * then its tail), one per enqueue item in staging order; per item its name
 * index and body index; per body the entry carrying its tail and size; the
 * dequeue and delete items; and the sections as (op, count), each taking the
 * next count items of its op. */
#ifndef QFLOW_JOURNAL_H
#define QFLOW_JOURNAL_H

#include <stddef.h>
#include <stdint.h>

#define QF_JOURNAL_ENTRY_HEAD 19
#define QF_JOURNAL_KIND_BATCH 2
#define QF_JOURNAL_OP_ENQUEUE 1
#define QF_JOURNAL_OP_DEQUEUE 2
#define QF_JOURNAL_OP_DELETE 3

typedef struct qf_journal_batch {
    const uint8_t *names;           /* nnames x (u16 len | utf-8), encoded already */
    size_t names_len, nnames;
    const uint8_t *entries;         /* the enqueued entries back to back */
    size_t entries_len;
    const uint32_t *entry_lens;     /* per enqueue item: its entry's length */
    const uint32_t *enq_names;      /* per enqueue item */
    const uint32_t *enq_bodies;     /* per enqueue item */
    size_t nenq;
    const uint32_t *body_entries;   /* per body: the enqueue item whose entry carries it */
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

/* Write the payload of ``b`` into out[0, cap). Returns its length, or
 * -1 when it does not fit, -2 when the input is inconsistent (lengths that
 * do not add up, an entry shorter than its head, a body naming no item,
 * sections that take more items than there are, an unknown op), -3 when
 * memory runs out. Nothing is checked that the recovery checks anyway
 * (a name or body index an item gives). */
int64_t qf_journal_encode(const qf_journal_batch *b, uint8_t *out, size_t cap);

#endif
