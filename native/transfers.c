/* See transfers.h. */
#include "transfers.h"

#include <string.h>

static uint64_t be(const uint8_t *p, int width)
{
    uint64_t v = 0;
    for (int i = 0; i < width; i++)
        v = (v << 8) | p[i];
    return v;
}

/* A str at *p: sets its payload's offset and length and moves *p past it. */
static int take_str(const uint8_t **p, const uint8_t *end, const uint8_t *buf, size_t *off, size_t *n)
{
    const uint8_t *q = *p;
    int width;
    size_t len;
    if (q >= end)
        return 0;
    if (*q >= 0xa0 && *q <= 0xbf) {
        len = *q & 0x1f;
        width = 0;
    } else if (*q >= 0xd9 && *q <= 0xdb) {
        width = 1 << (*q - 0xd9);
        if (end - q < 1 + width)
            return 0;
        len = be(q + 1, width);
    } else {
        return 0;
    }
    q += 1 + width;
    if ((size_t)(end - q) < len)
        return 0;
    *off = (size_t)(q - buf);
    *n = len;
    *p = q + len;
    return 1;
}

/* The length of the msgpack object at p, 0 when it is incomplete or holds an
 * ext or the never-used 0xc1 (the Python decoder reports those). Iterative:
 * nesting costs no stack. */
static size_t skip_object(const uint8_t *p, const uint8_t *end)
{
    const uint8_t *start = p;
    uint64_t remaining = 1;
    while (remaining) {
        uint8_t b;
        uint64_t items = 0;
        size_t n = 0;
        int width = 0;
        if (p >= end)
            return 0;
        b = *p++;
        remaining--;
        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
            /* a value in its type byte */
        } else if (b <= 0x8f) {
            items = 2u * (b & 0x0f);
        } else if (b <= 0x9f) {
            items = b & 0x0f;
        } else if (b <= 0xbf) {
            n = b & 0x1f;
        } else {
            switch (b) {
            case 0xc4: case 0xd9: width = 1; break;
            case 0xc5: case 0xda: width = 2; break;
            case 0xc6: case 0xdb: width = 4; break;
            case 0xcc: case 0xd0: n = 1; break;
            case 0xcd: case 0xd1: n = 2; break;
            case 0xca: case 0xce: case 0xd2: n = 4; break;
            case 0xcb: case 0xcf: case 0xd3: n = 8; break;
            case 0xdc: case 0xdd: case 0xde: case 0xdf: {
                int w = (b == 0xdc || b == 0xde) ? 2 : 4;
                if (end - p < w)
                    return 0;
                items = be(p, w) * (b >= 0xde ? 2u : 1u);
                p += w;
                break;
            }
            default:
                return 0;
            }
            if (width) {
                if (end - p < width)
                    return 0;
                n = be(p, width);
                p += width;
            }
        }
        if ((size_t)(end - p) < n)
            return 0;
        p += n;
        remaining += items;
    }
    return (size_t)(p - start);
}

/* The body after a run's key at p: sets the body's length and returns the
 * frame's end, or NULL if no complete bin follows. */
static const uint8_t *take_body(const uint8_t *p, const uint8_t *end, uint64_t *size)
{
    int width;
    if (p >= end || *p < 0xc4 || *p > 0xc6)
        return NULL;
    width = 1 << (*p - 0xc4);
    if (end - p < 1 + width)
        return NULL;
    *size = be(p + 1, width);
    p += 1 + width;
    if ((uint64_t)(end - p) < *size)
        return NULL;
    return p + *size;
}

/* The "message_id" key as the client encodes it, first in a properties map. */
static const uint8_t ID_KEY[11] = {0xaa, 'm', 'e', 's', 's', 'a', 'g', 'e', '_', 'i', 'd'};

/* The length of the str at p if it is a fixstr or str8 of ASCII bytes only
 * (so valid UTF-8, as the Python decoder would require), else 0. */
static size_t ascii_str(const uint8_t *p, const uint8_t *end)
{
    size_t head, n;
    if (p >= end)
        return 0;
    if (*p >= 0xa0 && *p <= 0xbf) {
        head = 1;
        n = *p & 0x1f;
    } else if (*p == 0xd9 && end - p >= 2) {
        head = 2;
        n = p[1];
    } else {
        return 0;
    }
    if ((size_t)(end - p) < head + n)
        return 0;
    for (size_t i = head; i < head + n; i++)
        if (p[i] & 0x80)
            return 0;
    return head + n;
}

/* The key's length of a frame of the run whose key starts at key. */
static size_t key_len_at(const qf_run *run, const uint8_t *key)
{
    if (!run->varied)
        return run->key_len;
    {
        const uint8_t *v = key + run->id_at;
        size_t n = *v >= 0xa0 && *v <= 0xbf ? 1 + (*v & 0x1f) : 2 + (size_t)v[1];
        return run->id_at + n + run->rest_len;
    }
}

size_t qf_scan_transfers(const uint8_t *buf, size_t len, size_t pos, size_t max_frame, size_t max_count,
                         qf_run *run)
{
    const uint8_t *end = buf + len;
    const uint8_t *p = buf + pos;
    const uint8_t *key, *q, *frame_end;
    uint64_t size;
    size_t n = 0, id_len = 0;
    if (pos >= len || len - pos < 3 || p[0] != 0x96 || p[1] != 0x1e || p[2] > 0x7f || max_count == 0)
        return 0;
    key = p + 2;
    q = key + 1;
    if (!take_str(&q, end, buf, &run->exchange, &run->exchange_len)
        || !take_str(&q, end, buf, &run->routing_key, &run->routing_key_len))
        return 0;
    run->properties = (size_t)(q - buf);
    run->id_at = 0;
    run->rest_len = 0;
    if (q < end && *q == 0xc0) {
        q += 1;
    } else {
        size_t m;
        if (q >= end || !((*q >= 0x80 && *q <= 0x8f) || *q == 0xde || *q == 0xdf))
            return 0;
        m = skip_object(q, end);
        if (m == 0)
            return 0;
        /* A fixmap whose first key is "message_id" with an ASCII str value:
         * the run may go on through frames that differ from this one only in
         * that value (each message its own id, as a Spark writer sends them). */
        if (*q >= 0x81 && *q <= 0x8f && m >= 1 + sizeof ID_KEY && memcmp(q + 1, ID_KEY, sizeof ID_KEY) == 0) {
            const uint8_t *v = q + 1 + sizeof ID_KEY;
            id_len = ascii_str(v, q + m);
            if (id_len) {
                run->id_at = (size_t)(v - key);
                run->rest_len = (size_t)(q + m - (v + id_len));
            }
        }
        q += m;
    }
    run->properties_len = (size_t)(q - buf) - run->properties;
    run->key_len = (size_t)(q - key);
    run->channel = key[0];
    run->varied = 0;
    while (n < max_count) {
        size_t klen = run->key_len;
        if (end - p < 2 || p[0] != 0x96 || p[1] != 0x1e)
            break;
        if (n && ((size_t)(end - (p + 2)) < klen || memcmp(p + 2, key, klen) != 0)) {
            /* Not the same key: the same but for the message id? */
            const uint8_t *v = p + 2 + run->id_at;
            if (run->id_at == 0 || (size_t)(end - (p + 2)) < run->id_at || memcmp(p + 2, key, run->id_at) != 0)
                break;
            id_len = ascii_str(v, end);
            if (id_len == 0 || (size_t)(end - (v + id_len)) < run->rest_len
                || memcmp(v + id_len, key + run->key_len - run->rest_len, run->rest_len) != 0)
                break;
            klen = run->id_at + id_len + run->rest_len;
            run->varied = 1;
        } else if ((size_t)(end - (p + 2)) < klen) {
            break;
        }
        frame_end = take_body(p + 2 + klen, end, &size);
        if (frame_end == NULL || (size_t)(frame_end - p) > max_frame)
            break;
        p = frame_end;
        n++;
    }
    run->count = n;
    run->end = (size_t)(p - buf);
    return n;
}

/* A message's size (transfers.h) from the length of its fields as stored
 * (exchange through body) and its body's length. The bin header msgpack needs
 * is what is left out, not the one the sender wrote: then the frame-by-frame
 * path need not look at the header's bytes, only at the two lengths. */
static uint64_t message_size(uint64_t tail_len, uint64_t body_len)
{
    return tail_len - (body_len < 0x100 ? 2 : body_len < 0x10000 ? 3 : 5);
}

static void put_be64(uint8_t *p, uint64_t v)
{
    for (int i = 7; i >= 0; i--) {
        p[i] = (uint8_t)v;
        v >>= 8;
    }
}

void qf_store_transfers(const uint8_t *buf, size_t len, size_t pos, const qf_run *run, size_t count, uint64_t max_bytes,
                        uint64_t first_seq, int64_t session, int64_t first_command, int64_t queue,
                        uint8_t *entries, size_t entries_cap, uint32_t *entry_ends, int64_t *ops,
                        qf_stored *out)
{
    const uint8_t *end = buf + len;
    const uint8_t *p = buf + pos;
    uint64_t bytes = 0, body, size;
    size_t e = 0, i;
    for (i = 0; i < count; i++) {
        const uint8_t *frame_end = take_body(p + 2 + key_len_at(run, p + 2), end, &body);
        size_t tail;
        if (frame_end == NULL)  /* not a scanned run */
            break;
        tail = (size_t)(frame_end - p) - 3;
        size = message_size(tail, body);
        if (size > max_bytes - bytes || QF_ENTRY_HEAD + tail > entries_cap - e)
            break;
        entries[e] = 0xc2;
        entries[e + 1] = 0xcf;
        put_be64(entries + e + 2, first_seq + i);
        entries[e + 10] = 0xcf;
        put_be64(entries + e + 11, size);
        memcpy(entries + e + QF_ENTRY_HEAD, p + 3, tail);
        e += QF_ENTRY_HEAD + tail;
        entry_ends[i] = (uint32_t)e;
        ops[0] = QF_OP_TRANSFER1;
        ops[1] = session;
        ops[2] = first_command + (int64_t)i;
        ops[3] = queue;
        ops[4] = (int64_t)size;
        ops += QF_OP_WORDS;
        bytes += size;
        p = frame_end;
    }
    out->count = i;
    out->consumed = (size_t)(p - (buf + pos));
    out->nbytes = bytes;
    out->entry_bytes = e;
}

void qf_fanout_ops(const uint8_t *buf, size_t len, size_t pos, const qf_run *run, size_t count, int64_t session,
                   int64_t first_command, const int64_t *queues, size_t nq, const int64_t *holders, size_t nh,
                   int64_t *ops)
{
    const uint8_t *end = buf + len;
    const uint8_t *p = buf + pos;
    uint64_t body, size;
    for (size_t i = 0; i < count; i++) {
        const uint8_t *frame_end = take_body(p + 2 + key_len_at(run, p + 2), end, &body);
        if (frame_end == NULL)  /* not a scanned run: the caller stored fewer */
            return;
        size = message_size((uint64_t)(frame_end - p) - 3, body);
        ops[0] = QF_OP_TRANSFER;
        ops[1] = session;
        ops[2] = first_command + (int64_t)i;
        ops[3] = ops[4] = 0;
        ops += QF_OP_WORDS;
        for (size_t j = 0; j < nq; j++) {
            ops[0] = QF_OP_ENQUEUE;
            ops[1] = queues[j];
            ops[2] = (int64_t)size;
            ops[3] = ops[4] = 0;
            ops += QF_OP_WORDS;
        }
        for (size_t j = 0; j < nh; j++) {
            ops[0] = QF_OP_HOLD;
            ops[1] = holders[j];
            ops[2] = ops[3] = ops[4] = 0;
            ops += QF_OP_WORDS;
        }
        ops[0] = QF_OP_END;
        ops[1] = ops[2] = ops[3] = ops[4] = 0;
        ops += QF_OP_WORDS;
        p = frame_end;
    }
}

void qf_transfer1_ops(const uint64_t *sizes, size_t count, int64_t session, int64_t first_command, int64_t queue,
                      int64_t *ops)
{
    for (size_t i = 0; i < count; i++) {
        ops[0] = QF_OP_TRANSFER1;
        ops[1] = session;
        ops[2] = first_command + (int64_t)i;
        ops[3] = queue;
        ops[4] = (int64_t)sizes[i];
        ops += QF_OP_WORDS;
    }
}

/* The end of the stored entry at p (see qf_scan_entries), setting its body's
 * length and its size (the head's, checked), or NULL when it is malformed or
 * runs past end. */
static const uint8_t *entry_end(const uint8_t *p, const uint8_t *end, const uint8_t *buf, uint64_t *body_len,
                                uint64_t *size)
{
    const uint8_t *q, *body_end;
    size_t off, n;
    if (end - p < QF_ENTRY_HEAD || (p[0] != 0xc2 && p[0] != 0xc3) || p[1] != 0xcf || p[10] != 0xcf)
        return NULL;
    *size = be(p + 11, 8);
    q = p + QF_ENTRY_HEAD;
    if (!take_str(&q, end, buf, &off, &n) || !take_str(&q, end, buf, &off, &n))
        return NULL;
    if (q < end && *q == 0xc0) {
        q += 1;
    } else {
        size_t m;
        if (q >= end || !((*q >= 0x80 && *q <= 0x8f) || *q == 0xde || *q == 0xdf))
            return NULL;
        m = skip_object(q, end);
        if (m == 0)
            return NULL;
        q += m;
    }
    body_end = take_body(q, end, body_len);
    if (body_end == NULL || message_size((uint64_t)(body_end - (p + QF_ENTRY_HEAD)), *body_len) != *size)
        return NULL;
    return body_end;
}

int64_t qf_scan_entries(const uint8_t *buf, size_t len, size_t count, int64_t *offsets)
{
    const uint8_t *end = buf + len;
    const uint8_t *p = buf;
    size_t i;
    for (i = 0; i < count; i++) {
        uint64_t body_len, size;
        const uint8_t *next = entry_end(p, end, buf, &body_len, &size);
        if (next == NULL)
            return -(int64_t)(i + 1);
        offsets[2 * i] = (int64_t)(p - buf);
        offsets[2 * i + 1] = (int64_t)(next - body_len - buf);
        p = next;
    }
    if (p != end)
        return -(int64_t)(count + 1);
    offsets[2 * count] = (int64_t)len;
    return (int64_t)count;
}

int64_t qf_entries_size(const uint8_t *buf, size_t len)
{
    const uint8_t *end = buf + len;
    const uint8_t *p = buf;
    uint64_t total = 0;
    while (p < end) {
        uint64_t body_len, size;
        p = entry_end(p, end, buf, &body_len, &size);
        if (p == NULL)
            return -1;
        total += size;
    }
    return (int64_t)total;
}
