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

size_t qa_scan_transfers(const uint8_t *buf, size_t len, size_t pos, size_t max_frame, size_t max_count,
                         int64_t *rows, qa_run *run);

#endif
