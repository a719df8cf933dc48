/* The journal's batch payload in one call: see journal.h. */
#include "journal.h"

#include <stdlib.h>
#include <string.h>

static inline uint8_t *put32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); p[2] = (uint8_t)(v >> 16); p[3] = (uint8_t)(v >> 24);
    return p + 4;
}

static inline uint8_t *put64(uint8_t *p, uint64_t v) {
    put32(p, (uint32_t)v);
    return put32(p + 4, (uint32_t)(v >> 32));
}

static inline uint64_t get_be64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = (v << 8) | p[i];
    return v;
}

int64_t qf_journal_encode(const qf_journal_batch *b, uint8_t *out, size_t cap) {
    /* Where each entry starts, checked against the total before anything is read. */
    size_t *starts = malloc((b->nenq + 1) * sizeof(size_t));
    if (starts == NULL)
        return -3;
    size_t pos = 0, tails = 0;
    for (size_t i = 0; i < b->nenq; i++) {
        if (b->entry_lens[i] < QF_JOURNAL_ENTRY_HEAD || b->entry_lens[i] > b->entries_len - pos) {
            free(starts);
            return -2;
        }
        starts[i] = pos;
        pos += b->entry_lens[i];
    }
    if (pos != b->entries_len) {
        free(starts);
        return -2;
    }
    for (size_t i = 0; i < b->nbodies; i++) {
        if (b->body_entries[i] >= b->nenq) {
            free(starts);
            return -2;
        }
        tails += b->entry_lens[b->body_entries[i]] - QF_JOURNAL_ENTRY_HEAD;
    }
    size_t need = 1 + 4 + b->names_len + 4 + 12 * b->nbodies + 4 + 5 * b->nsections
                  + 16 * b->nenq + 12 * b->ndeq + 4 * b->ndel + tails;
    if (need > cap) {
        free(starts);
        return -1;
    }
    uint8_t *p = out;
    *p++ = QF_JOURNAL_KIND_BATCH;
    p = put32(p, (uint32_t)b->nnames);
    if (b->names_len) {
        memcpy(p, b->names, b->names_len);
        p += b->names_len;
    }
    p = put32(p, (uint32_t)b->nbodies);
    for (size_t i = 0; i < b->nbodies; i++) {
        uint32_t e = b->body_entries[i];
        p = put64(p, get_be64(b->entries + starts[e] + 11));
        p = put32(p, b->entry_lens[e] - QF_JOURNAL_ENTRY_HEAD);
    }
    p = put32(p, (uint32_t)b->nsections);
    size_t enq = 0, deq = 0, del = 0;
    for (size_t s = 0; s < b->nsections; s++) {
        uint8_t op = b->section_ops[s];
        uint32_t n = b->section_counts[s];
        *p++ = op;
        p = put32(p, n);
        if (op == QF_JOURNAL_OP_ENQUEUE && n <= b->nenq - enq) {
            for (uint32_t k = 0; k < n; k++, enq++) {
                p = put32(p, b->enq_names[enq]);
                p = put64(p, get_be64(b->entries + starts[enq] + 2));
                p = put32(p, b->enq_bodies[enq]);
            }
        } else if (op == QF_JOURNAL_OP_DEQUEUE && n <= b->ndeq - deq) {
            for (uint32_t k = 0; k < n; k++, deq++) {
                p = put32(p, b->deq_names[deq]);
                p = put64(p, b->deq_seqs[deq]);
            }
        } else if (op == QF_JOURNAL_OP_DELETE && n <= b->ndel - del) {
            for (uint32_t k = 0; k < n; k++, del++)
                p = put32(p, b->del_names[del]);
        } else {
            free(starts);
            return -2;
        }
    }
    if (enq != b->nenq || deq != b->ndeq || del != b->ndel) {
        free(starts);
        return -2;
    }
    for (size_t i = 0; i < b->nbodies; i++) {
        uint32_t e = b->body_entries[i];
        size_t n = b->entry_lens[e] - QF_JOURNAL_ENTRY_HEAD;
        memcpy(p, b->entries + starts[e] + QF_JOURNAL_ENTRY_HEAD, n);
        p += n;
    }
    free(starts);
    return (int64_t)(p - out);
}
