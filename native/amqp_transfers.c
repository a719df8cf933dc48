/* See amqp_transfers.h. */
#include "amqp_transfers.h"

static uint32_t be32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

/* A uint at *p (uint0, smalluint, uint; null allowed when nullable, giving -1). */
static int take_uint(const uint8_t **p, const uint8_t *end, int nullable, int64_t *v)
{
    const uint8_t *q = *p;
    if (q >= end)
        return 0;
    switch (*q) {
    case 0x43: *v = 0; *p = q + 1; return 1;
    case 0x52: if (end - q < 2) return 0; *v = q[1]; *p = q + 2; return 1;
    case 0x70: if (end - q < 5) return 0; *v = be32(q + 1); *p = q + 5; return 1;
    case 0x40: if (!nullable) return 0; *v = -1; *p = q + 1; return 1;
    default: return 0;
    }
}

/* One frame's transfer at buf[pos], pos at the frame's start and the frame
 * complete; 1 if it is in the run's shape (fields set), 0 otherwise. */
static int parse(const uint8_t *buf, size_t pos, size_t size, uint32_t *handle, int64_t *format, int64_t *row)
{
    const uint8_t *p = buf + pos + 8, *end = buf + pos + size, *list_end;
    uint32_t count;
    int64_t v;
    if (end - p < 4 || p[0] != 0x00 || p[1] != 0x53 || p[2] != 0x14)
        return 0;
    p += 3;
    if (*p == 0xc0) {
        if (end - p < 3)
            return 0;
        list_end = p + 2 + p[1];
        count = p[2];
        p += 3;
    } else if (*p == 0xd0) {
        if (end - p < 9)
            return 0;
        list_end = p + 5 + be32(p + 1);
        count = be32(p + 5);
        p += 9;
    } else {
        return 0;
    }
    if (list_end > end || list_end < p || count < 2 || count > 11)
        return 0;
    row[1] = 0;
    row[2] = -1;
    row[5] = 0;
    *format = -1;
    for (uint32_t i = 0; i < count; i++) {
        if (p >= list_end)
            return 0;
        switch (i) {
        case 0:
            if (!take_uint(&p, list_end, 0, &v))
                return 0;
            *handle = (uint32_t)v;
            break;
        case 1:
            if (!take_uint(&p, list_end, 0, &row[0]))
                return 0;
            break;
        case 2:
            if (*p == 0x40) {
                p++;
            } else if (*p == 0xa0) {
                if (list_end - p < 2 || list_end - p - 2 < p[1])
                    return 0;
                row[1] = (int64_t)(p + 2 - buf);
                row[2] = p[1];
                p += 2 + p[1];
            } else {
                return 0;
            }
            break;
        case 3:
            if (!take_uint(&p, list_end, 1, format))
                return 0;
            break;
        case 4:
        case 10:
            if (*p == 0x41 || *p == 0x42 || *p == 0x40) {
                if (i == 4)
                    row[5] = *p == 0x41;
                p++;
            } else {
                return 0;
            }
            break;
        case 6:
        case 7:
            if (*p != 0x40)
                return 0;
            p++;
            break;
        default: /* more, resume, aborted: false or absent */
            if (*p == 0x42 || *p == 0x40)
                p++;
            else
                return 0;
        }
    }
    if (p != list_end)
        return 0;
    row[3] = (int64_t)(p - buf);
    row[4] = (int64_t)(end - p);
    return 1;
}

size_t qa_scan_transfers(const uint8_t *buf, size_t len, size_t pos, size_t max_frame, size_t max_count,
                         int64_t *rows, qa_run *run)
{
    size_t n = 0;
    run->count = 0;
    run->end = pos;
    while (n < max_count && len - pos >= 8) {
        uint32_t size = be32(buf + pos), handle = 0;
        unsigned channel = ((unsigned)buf[pos + 6] << 8) | buf[pos + 7];
        int64_t format;
        if (size > max_frame || size < 12 || buf[pos + 4] != 2 || buf[pos + 5] != 0 || size > len - pos)
            break;
        if (!parse(buf, pos, size, &handle, &format, rows + n * QA_ROW_WORDS))
            break;
        if (n == 0) {
            run->channel = channel;
            run->handle = handle;
            run->message_format = format;
        } else if (channel != run->channel || handle != run->handle || format != run->message_format) {
            break;
        }
        n++;
        pos += size;
    }
    run->count = n;
    run->end = pos;
    return n;
}
