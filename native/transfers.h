/* Runs of message.transfer frames, scanned and stored in one call each, and
 * runs of deliveries scanned (qf_scan_entries, at the end).
 *
 * The broker's per-message path in C, batch-shaped (a per-frame C call would
 * cost more than the Python it replaces). A *run* is a sequence of complete
 * frames, back to back in one buffer, each exactly
 *
 *     [30, channel, exchange, routing_key, properties, body]
 *
 * encoded as a fixarray of 6, the code 30, the channel as a positive fixint,
 * exchange and routing key as msgpack str, properties as nil or a map, and
 * the body as msgpack bin; every frame of a run has the same bytes from the
 * channel through the properties (the run's *key*), except that when the
 * first frame's properties are a map whose first key is "message_id" with an
 * ASCII str value (fixstr or str8), the frames may differ in that value alone
 * (each message its own id, as a writer that lets consumers drop duplicates
 * sends them: qflow.client.Sender.send_many's message_ids). Anything else ends a run,
 * and the Python decoder takes the frame: it decodes, checks and reports
 * errors for every frame, so nothing here needs to.
 *
 * A message's *size* (docs/protocol.md, "Message size") is what its queue's
 * byte depth, byte limits and flow thresholds and a consumer's byte credit
 * count: its exchange, routing key, properties and body as the transfer
 * encoded them (the frame's bytes after its code and channel), less the bin
 * header msgpack needs for the body's length (2, 3 or 5 bytes). The frame-by-frame path
 * (qflow.protocol.entries.message_size) counts the same. */
#ifndef QFLOW_TRANSFERS_H
#define QFLOW_TRANSFERS_H

#include <stddef.h>
#include <stdint.h>

#include "qflow_shared.h" /* written from qflow/broker/ops.py and qflow/protocol/entries.py at build time */

#define QF_ENTRY_HEAD QFLOW_ENTRY_HEAD /* redelivered flag, 0xcf + sequence, 0xcf + message size */
#define QF_OP_WORDS QFLOW_OP_WORDS
#define QF_OP_TRANSFER QFLOW_OP_TRANSFER /* the accounting's op codes */
#define QF_OP_ENQUEUE QFLOW_OP_ENQUEUE
#define QF_OP_END QFLOW_OP_END
#define QF_OP_TRANSFER1 QFLOW_OP_TRANSFER1
#define QF_OP_HOLD QFLOW_OP_HOLD

typedef struct qf_run {
    size_t count;          /* frames in the run */
    size_t end;            /* offset just past its last frame */
    size_t key_len;        /* bytes from the channel through the properties */
    size_t exchange, exchange_len;        /* offsets of the str payloads in the buffer */
    size_t routing_key, routing_key_len;
    size_t properties, properties_len;    /* the encoded properties (nil: 0xc0) */
    size_t id_at;          /* in the key, where the message id's str starts (0: no id may vary) */
    size_t rest_len;       /* the key's bytes after the message id */
    unsigned varied;       /* 1 if some frame's message id differs from the first's */
    unsigned channel;
} qf_run;

typedef struct qf_stored {
    size_t count;          /* frames stored */
    size_t consumed;       /* bytes of the buffer they span, from pos */
    uint64_t nbytes;       /* their messages' total size */
    size_t entry_bytes;    /* bytes written to entries */
} qf_stored;

/* Scan the run starting at buf[pos] (at most max_count frames, each no longer
 * than max_frame, all within buf[0, len)). Returns its frame count, 0 when
 * the frame at pos does not start one. */
size_t qf_scan_transfers(const uint8_t *buf, size_t len, size_t pos, size_t max_frame, size_t max_count,
                         qf_run *run);

/* Store the first frames of a run scanned at pos, stopping before the one
 * that would take the messages' sizes past max_bytes or the entries past
 * entries_cap: for frame i, the queue entry (the 19-byte head for sequence
 * first_seq + i and the message's size, then the frame from the exchange on)
 * goes into entries, ending at entry_ends[i], and the op (OP_TRANSFER1,
 * session, first_command + i, queue, size) into ops. */
void qf_store_transfers(const uint8_t *buf, size_t len, size_t pos, const qf_run *run, size_t count, uint64_t max_bytes,
                        uint64_t first_seq, int64_t session, int64_t first_command, int64_t queue,
                        uint8_t *entries, size_t entries_cap, uint32_t *entry_ends, int64_t *ops,
                        qf_stored *out);

/* The ops of the first count frames of a run scanned at pos going to several
 * queues (a fanout), or to queues with outside holders: for each, OP_TRANSFER
 * (session, first_command + i), one OP_ENQUEUE (queue, size) per queue, one
 * OP_HOLD (holder) per holder, OP_END; (2 + nq + nh) * QF_OP_WORDS words per
 * frame. The entries come from qf_store_transfers, once per queue. */
void qf_fanout_ops(const uint8_t *buf, size_t len, size_t pos, const qf_run *run, size_t count, int64_t session,
                   int64_t first_command, const int64_t *queues, size_t nq, const int64_t *holders, size_t nh,
                   int64_t *ops);

/* The ops of count transfers to one queue whose entries were made elsewhere (an AMQP 1.0 run,
 * qflow/protocol/amqp/entries.py): OP_TRANSFER1 (session, first_command + i, queue, sizes[i]) each. */
void qf_transfer1_ops(const uint64_t *sizes, size_t count, int64_t session, int64_t first_command, int64_t queue,
                      int64_t *ops);

/* The other way: a message.deliver-run frame (docs/protocol.md) carries
 * ``count`` queue entries back to back, each the 19-byte head above, then
 * exchange and routing key (str), properties (nil or a map) and the body
 * (bin), the head's size being the message's size. Checks that buf[0, len) is exactly
 * that and writes offsets[2i] = where entry i starts, offsets[2i + 1] = where
 * its body's bytes start, and offsets[2 count] = len (so entry i's body ends
 * at offsets[2i + 2]). Returns count, or -(i + 1) when entry i is malformed
 * (i = count: bytes are left over). The client's per-message path. */
int64_t qf_scan_entries(const uint8_t *buf, size_t len, size_t count, int64_t *offsets);

/* The total size of the entries back to back in buf[0, len), -1 if they
 * are not well formed: the broker's dequeue of many at once. */
int64_t qf_entries_size(const uint8_t *buf, size_t len);

#endif
