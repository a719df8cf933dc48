/* See amqp_transfers.h. */
#include "amqp_transfers.h"

#include <string.h>

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

/* The width of a value's length field (1 or 4) for the variable, compound and array format codes, the
 * fixed width (as -1 - width) for the fixed ones, 0 for codes not taken here. */
static int width_of(uint8_t code)
{
    switch (code) {
    case 0x40: case 0x41: case 0x42: case 0x43: case 0x44: case 0x45: return -1;
    case 0x50: case 0x51: case 0x52: case 0x53: case 0x54: case 0x55: case 0x56: return -2;
    case 0x60: case 0x61: return -3;
    case 0x70: case 0x71: case 0x72: case 0x73: case 0x74: return -5;
    case 0x80: case 0x81: case 0x82: case 0x83: case 0x84: return -9;
    case 0x94: case 0x98: return -17;
    case 0xa0: case 0xa1: case 0xa3: case 0xc0: case 0xc1: case 0xe0: return 1;
    case 0xb0: case 0xb1: case 0xb3: case 0xd0: case 0xd1: case 0xf0: return 4;
    default: return 0;
    }
}

/* Where the (not described) value at p ends, or NULL if it runs past end or its code is not taken. */
static const uint8_t *skip_value(const uint8_t *p, const uint8_t *end)
{
    int w;
    uint64_t n;
    if (p >= end)
        return NULL;
    w = width_of(*p);
    if (w == 0)
        return NULL;
    if (w < 0) {
        n = (uint64_t)(-w - 1);
        p += 1;
    } else {
        if ((size_t)(end - p) < 1 + (size_t)w)
            return NULL;
        n = w == 1 ? p[1] : be32(p + 1);
        p += 1 + w;
    }
    if (n > (uint64_t)(end - p))
        return NULL;
    return p + n;
}

/* 1 if the header list at p (ending at end) is durable, 0 if not, -1 if not in a shape taken here. */
static int header_durable(const uint8_t *p, const uint8_t *end)
{
    const uint8_t *list_end;
    uint32_t count;
    int durable = 0;
    if (*p == 0x45)
        return p + 1 == end ? 0 : -1;
    if (*p == 0xc0) {
        if (end - p < 3)
            return -1;
        list_end = p + 2 + p[1];
        count = p[2];
        p += 3;
    } else if (*p == 0xd0) {
        if (end - p < 9)
            return -1;
        list_end = p + 5 + be32(p + 1);
        count = be32(p + 5);
        p += 9;
    } else {
        return -1;
    }
    if (list_end != end || p > list_end)
        return -1;
    for (uint32_t i = 0; i < count; i++) {
        if (p >= list_end)
            return -1;
        switch (*p) {
        case 0x40: case 0x42: case 0x43: p += 1; break;
        case 0x41: if (i == 0) durable = 1; p += 1; break;
        case 0x50: case 0x52: p += 2; break;
        case 0x56:
            if (list_end - p < 2 || p[1] > 1)
                return -1;
            if (i == 0)
                durable = p[1];
            p += 2;
            break;
        case 0x70: p += 5; break;
        default: return -1;
        }
    }
    return p == list_end ? durable : -1;
}

/* 1 if the payload's sections are all taken here (durable set from its header), 0 if not. */
static int check_sections(const uint8_t *p, const uint8_t *end, int *durable)
{
    const uint8_t *start = p, *value_end;
    *durable = 0;
    while (p < end) {
        if (end - p < 4 || p[0] != 0x00 || p[1] != 0x53 || p[2] < 0x70 || p[2] > 0x78)
            return 0;
        value_end = skip_value(p + 3, end);
        if (value_end == NULL)
            return 0;
        if (p[2] == 0x70 && p == start) {
            int d = header_durable(p + 3, value_end);
            if (d < 0)
                return 0;
            *durable = d;
        }
        p = value_end;
    }
    return 1;
}

static void put_be(uint8_t *p, uint64_t v, int n)
{
    for (int i = n - 1; i >= 0; i--) {
        p[i] = (uint8_t)v;
        v >>= 8;
    }
}

void qa_store_entries(const uint8_t *blob, size_t blob_len, int64_t base, const int64_t *rows, size_t count,
                      const uint8_t *prefix, size_t prefix_len, const uint8_t *plain, size_t plain_len,
                      const uint8_t *durable, size_t durable_len, uint64_t first_seq, uint64_t max_bytes,
                      uint8_t *entries, size_t cap, uint32_t *ends, uint64_t *sizes, qa_stored *out)
{
    size_t e = 0, i;
    uint64_t total = 0;
    for (i = 0; i < count; i++) {
        const int64_t *row = rows + i * QA_ROW_WORDS;
        int64_t start = row[3] - base, n = row[4];
        const uint8_t *payload, *props;
        size_t props_len, bin_head, tail;
        uint64_t size;
        int is_durable;
        if (start < 0 || n < 0 || (uint64_t)start > blob_len || (uint64_t)n > blob_len - (uint64_t)start
            || (uint64_t)n > 0xffffffffu)
            break;
        payload = blob + start;
        if (!check_sections(payload, payload + n, &is_durable))
            break;
        props = is_durable ? durable : plain;
        props_len = is_durable ? durable_len : plain_len;
        bin_head = n < 0x100 ? 2 : n < 0x10000 ? 3 : 5;
        tail = prefix_len + props_len + bin_head + (size_t)n;
        size = (uint64_t)(tail - bin_head);  /* the message's size: msgpack's bin header left out */
        if (size > max_bytes - total || 19 + tail > cap - e)
            break;
        entries[e] = 0xc2;
        entries[e + 1] = 0xcf;
        put_be(entries + e + 2, first_seq + i, 8);
        entries[e + 10] = 0xcf;
        put_be(entries + e + 11, size, 8);
        e += 19;
        memcpy(entries + e, prefix, prefix_len);
        e += prefix_len;
        memcpy(entries + e, props, props_len);
        e += props_len;
        if (bin_head == 2) {
            entries[e] = 0xc4;
            entries[e + 1] = (uint8_t)n;
        } else if (bin_head == 3) {
            entries[e] = 0xc5;
            put_be(entries + e + 1, (uint64_t)n, 2);
        } else {
            entries[e] = 0xc6;
            put_be(entries + e + 1, (uint64_t)n, 4);
        }
        e += bin_head;
        memcpy(entries + e, payload, (size_t)n);
        e += (size_t)n;
        ends[i] = (uint32_t)e;
        sizes[i] = size;
        total += size;
    }
    out->count = i;
    out->nbytes = total;
    out->entry_bytes = e;
}

/* Where the msgpack str at p ends, or NULL. */
static const uint8_t *skip_str(const uint8_t *p, const uint8_t *end)
{
    size_t n;
    if (p >= end)
        return NULL;
    if (*p >= 0xa0 && *p <= 0xbf) {
        n = *p & 0x1f;
        p += 1;
    } else if (*p == 0xd9 && end - p >= 2) {
        n = p[1];
        p += 2;
    } else if (*p == 0xda && end - p >= 3) {
        n = ((size_t)p[1] << 8) | p[2];
        p += 3;
    } else if (*p == 0xdb && end - p >= 5) {
        n = be32(p + 1);
        p += 5;
    } else {
        return NULL;
    }
    return n <= (size_t)(end - p) ? p + n : NULL;
}

size_t qa_write_transfers(const uint8_t *buf, size_t len, const uint8_t *plain, size_t plain_len,
                          const uint8_t *durable, size_t durable_len, unsigned channel, uint32_t handle,
                          uint32_t first_delivery_id, uint64_t first_tag, int settled, size_t max_frame,
                          uint8_t *out, size_t cap, size_t *written, size_t *consumed)
{
    const uint8_t *p = buf, *end = buf + len;
    size_t o = 0, i = 0;
    for (;; i++) {
        const uint8_t *q;
        size_t n, frame;
        if (end - p < 19 || p[0] != 0xc2 || p[1] != 0xcf || p[10] != 0xcf)
            break;
        q = skip_str(p + 19, end);
        q = q ? skip_str(q, end) : NULL;
        if (q == NULL)
            break;
        if ((size_t)(end - q) > plain_len && memcmp(q, plain, plain_len) == 0)
            q += plain_len;
        else if ((size_t)(end - q) > durable_len && memcmp(q, durable, durable_len) == 0)
            q += durable_len;
        else
            break;
        if (*q == 0xc4 && end - q >= 2) {
            n = q[1];
            q += 2;
        } else if (*q == 0xc5 && end - q >= 3) {
            n = ((size_t)q[1] << 8) | q[2];
            q += 3;
        } else if (*q == 0xc6 && end - q >= 5) {
            n = be32(q + 1);
            q += 5;
        } else {
            break;
        }
        if (n > (size_t)(end - q))
            break;
        frame = 41 + n;
        if (frame > max_frame || frame > cap - o)
            break;
        put_be(out + o, frame, 4);
        out[o + 4] = 2;
        out[o + 5] = 0;
        put_be(out + o + 6, channel, 2);
        out[o + 8] = 0x00; out[o + 9] = 0x53; out[o + 10] = 0x14;
        out[o + 11] = 0xc0; out[o + 12] = 28; out[o + 13] = 6;
        out[o + 14] = 0x70;
        put_be(out + o + 15, handle, 4);
        out[o + 19] = 0x70;
        put_be(out + o + 20, (uint32_t)(first_delivery_id + (uint32_t)i), 4);
        out[o + 24] = 0xa0; out[o + 25] = 8;
        put_be(out + o + 26, first_tag + i, 8);
        out[o + 34] = 0x70;
        put_be(out + o + 35, 0, 4);
        out[o + 39] = settled ? 0x41 : 0x42;
        out[o + 40] = 0x42;
        memcpy(out + o + 41, q, n);
        o += frame;
        p = q + n;
    }
    *written = o;
    *consumed = (size_t)(p - buf);
    return i;
}
