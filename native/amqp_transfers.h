/* Runs of AMQP 1.0 transfer frames, scanned in one call (qflow/protocol/amqp/transfer_runs.py).
 *
 * A *run* is a sequence of complete frames back to back in one buffer, each a
 * whole delivery on the same channel and link handle, in the plain shape that
 * clients send:
 *
 *     size (<= max_frame), doff 2, type 0, channel
 *     00 53 14  (descriptor: transfer)
 *     list8 or list32 of up to 11 fields:
 *       handle          uint (uint0, smalluint, uint)       the same in every frame
 *       delivery-id     uint                                present
 *       delivery-tag    vbin8 or null
 *       message-format  uint or null                        the same in every frame
 *       settled         true, false or null
 *       more            false or null
 *       rcv-settle-mode null
 *       state           null
 *       resume          false or null
 *       aborted         false or null
 *       batchable       true, false or null
 *     the payload: the rest of the frame
 *
 * Anything else ends the run, and the Python decoder takes the frame: it
 * checks everything and reports errors, so nothing here needs to. Each frame
 * of the run gets one row of QA_ROW_WORDS int64s: delivery-id, the tag's
 * offset and length (length -1: no tag), the payload's offset and length,
 * and the settled flag; offsets are from the buffer's start. */
#ifndef QFLOW_AMQP_TRANSFERS_H
#define QFLOW_AMQP_TRANSFERS_H

#include <stddef.h>
#include <stdint.h>

#define QA_ROW_WORDS 6

typedef struct qa_run {
    size_t count;            /* frames in the run */
    size_t end;              /* offset just past its last frame */
    unsigned channel;
    uint32_t handle;
    int64_t message_format;  /* -1: absent (0) */
} qa_run;

/* The queue entries of a run's deliveries (qflow/protocol/amqp/entries.py, store_entries): for delivery i
 * of rows (QA_ROW_WORDS each, offsets counted from base as blob[0]), the entry head (not redelivered,
 * sequence first_seq + i, the message's size), then prefix (the exchange and routing key, msgpack),
 * the properties (plain, or durable when the message's header says durable), and the payload as a
 * msgpack bin. Only payloads whose sections it can check itself are taken: each section a described
 * value with a 00 53 descriptor of a section code (0x70-0x78) and a value of a known format code that
 * fits; a header, if first, a list (list0, list8, list32) of null, boolean, uint or ubyte fields
 * that fills it exactly. It stops at the first payload it cannot take that way (the caller's
 * decoder then takes that one), at the first whose size would bring the run's total over max_bytes,
 * or when the entry buffer is full. out says how many, their total size and the entry bytes
 * written; ends[i] is where entry i ends and sizes[i] its size. */
typedef struct qa_stored {
    size_t count;
    uint64_t nbytes;
    size_t entry_bytes;
} qa_stored;

void qa_store_entries(const uint8_t *blob, size_t blob_len, int64_t base, const int64_t *rows, size_t count,
                      const uint8_t *prefix, size_t prefix_len, const uint8_t *plain, size_t plain_len,
                      const uint8_t *durable, size_t durable_len, uint64_t first_seq, uint64_t max_bytes,
                      uint8_t *entries, size_t cap, uint32_t *ends, uint64_t *sizes, qa_stored *out);

/* Transfer frames for queue entries back to back in buf (the deliveries of a 1.0 consumer): for entry
 * i, a frame on channel/handle with delivery-id first_delivery_id + i (mod 2^32), an 8-byte tag (the
 * big-endian first_tag + i), message-format 0, settled as given, carrying the entry's body. Only
 * entries of 1.0 messages as stored (not redelivered, properties exactly plain or durable) are taken:
 * it stops at the first other entry, at one whose frame would be over max_frame, or when out is
 * full. *consumed: the bytes of buf taken; returns how many entries, their frames in out[0, *written). */
size_t qa_write_transfers(const uint8_t *buf, size_t len, const uint8_t *plain, size_t plain_len,
                          const uint8_t *durable, size_t durable_len, unsigned channel, uint32_t handle,
                          uint32_t first_delivery_id, uint64_t first_tag, int settled, size_t max_frame,
                          uint8_t *out, size_t cap, size_t *written, size_t *consumed);

size_t qa_scan_transfers(const uint8_t *buf, size_t len, size_t pos, size_t max_frame, size_t max_count,
                         int64_t *rows, qa_run *run);

#endif
