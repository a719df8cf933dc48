/* Per-queue flow accounting and transfer completion (see accounting.h).
 *
 * This must stay observably identical to qflow.broker.accounting.PyAccounting: same
 * slot reuse order, same tokens, same output order, same errors at the same
 * op. Where the code below looks roundabout, that is usually why.
 *
 * Failure safety: an op either takes full effect or none. Everything an op
 * may need to allocate (output records, a pending entry, an outside hold, a
 * transfer slot) is reserved before the op changes any state, so running out
 * of memory is reported like any other bad op, with the earlier ops applied. */
#include "accounting.h"

#include <stdlib.h>
#include <string.h>

#define COUNT_MAX UINT32_MAX
#define GENERATION_MASK ((uint64_t)QFLOW_GENERATION_MASK) /* keeps tokens non-negative int64 */
#define TOKEN_INDEX_LIMIT ((size_t)1 << QFLOW_GENERATION_SHIFT)
/* A released pending list bigger than this is freed rather than kept: a
 * burst of holds should not pin its memory for the queue's whole life. */
#define PENDING_KEEP 1024

/* What a slot of the queue table is. An outside holder uses the table only
 * for its slot and its held count: it has no depth and no pending list. */
enum { SLOT_FREE = 0, SLOT_QUEUE = 1, SLOT_HOLDER = 2 };

struct queue {
    uint64_t nbytes;
    uint64_t stop_size;
    uint64_t resume_size;
    uint64_t held; /* live (non-tombstone) entries in pending */
    int32_t *pending; /* transfer slots, -1 where released */
    size_t npending;
    size_t cap_pending;
    uint32_t count;
    uint32_t stop_count;
    uint32_t resume_count;
    uint32_t stopped_count;
    uint32_t generation;
    uint8_t flow_on;
    uint8_t kind; /* SLOT_* */
};

struct transfer {
    int64_t session;
    int64_t command_id;
    uint64_t holds; /* 0 exactly when the slot is free */
    /* A separate flag rather than a session sentinel, so any int64 can be a
     * session: a dropped session's completions are never reported. */
    uint8_t dropped;
};

/* One hold by an outside holder; its token is generation << 32 | its index. */
struct outside_hold {
    int64_t holder;
    int32_t transfer; /* -1 while the entry is free */
    uint32_t generation; /* bumped each time the entry is freed */
};

struct acct_state {
    acct_output out;
    struct queue *queues;
    size_t nqueues;
    size_t cap_queues;
    int64_t *free_queues; /* a stack, capacity cap_queues */
    size_t nfree_queues;
    struct transfer *transfers;
    size_t ntransfers;
    size_t cap_transfers;
    int32_t *free_transfers; /* a stack, capacity cap_transfers */
    size_t nfree_transfers;
    struct outside_hold *outside; /* every holder's outside holds, one table */
    size_t noutside;
    size_t cap_outside;
    uint32_t *free_outside; /* a stack, capacity cap_outside */
    size_t nfree_outside;
};

/* -- growth -------------------------------------------------------------- */

static size_t grown(size_t cap, size_t need)
{
    size_t n = cap ? cap : 16;
    while (n < need) {
        if (n > SIZE_MAX / 2)
            return need;
        n *= 2;
    }
    return n;
}

/* Makes room for `need` records of `size` bytes in *buf; 0 or -1. */
static int reserve(void **buf, size_t *cap, size_t need, size_t size)
{
    if (need <= *cap)
        return 0;
    size_t n = grown(*cap, need);
    if (n > SIZE_MAX / size)
        return -1;
    void *p = realloc(*buf, n * size);
    if (!p)
        return -1;
    *buf = p;
    *cap = n;
    return 0;
}

static int reserve_completions(acct_output *out, size_t more)
{
    if (more > SIZE_MAX - out->ncompletions)
        return -1;
    void *p = out->completions;
    if (reserve(&p, &out->cap_completions, out->ncompletions + more, 3 * sizeof(int64_t)))
        return -1;
    out->completions = p;
    return 0;
}

static int reserve_holds(acct_output *out)
{
    void *p = out->holds;
    if (reserve(&p, &out->cap_holds, out->nholds + 1, 4 * sizeof(int64_t)))
        return -1;
    out->holds = p;
    return 0;
}

static int reserve_transitions(acct_output *out)
{
    void *p = out->transitions;
    if (reserve(&p, &out->cap_transitions, out->ntransitions + 1, 4 * sizeof(uint64_t)))
        return -1;
    out->transitions = p;
    return 0;
}

static int reserve_pending(struct queue *q)
{
    /* A token carries the index in 32 bits. */
    if (q->npending >= TOKEN_INDEX_LIMIT)
        return -1;
    void *p = q->pending;
    if (reserve(&p, &q->cap_pending, q->npending + 1, sizeof(int32_t)))
        return -1;
    q->pending = p;
    return 0;
}

/* Grows a table of `elem`-byte records and its stack of free indexes
 * (`free_elem` bytes each) together, to hold at least one more than `used`
 * and at most `limit`; 0 or -1. Both pointers are updated as each realloc
 * succeeds, so a failure leaves them valid. */
static int grow_table(void **table, size_t elem, void **free_stack, size_t free_elem, size_t *cap, size_t used,
                      size_t limit)
{
    if (used >= limit)
        return -1;
    size_t n = grown(*cap, used + 1);
    if (n > limit)
        n = limit;
    if (n > SIZE_MAX / elem || n > SIZE_MAX / free_elem)
        return -1;
    void *t = realloc(*table, n * elem);
    if (!t)
        return -1;
    *table = t;
    void *f = realloc(*free_stack, n * free_elem);
    if (!f)
        return -1; /* the bigger table is kept; cap still says the old size */
    *free_stack = f;
    *cap = n;
    return 0;
}

/* Ensures a transfer slot can be taken without allocating. */
static int reserve_transfer(acct_state *st)
{
    if (st->nfree_transfers || st->ntransfers < st->cap_transfers)
        return 0;
    /* Pending lists store slots as int32. */
    void *t = st->transfers, *f = st->free_transfers;
    int r = grow_table(&t, sizeof(struct transfer), &f, sizeof(int32_t), &st->cap_transfers, st->ntransfers,
                       (size_t)INT32_MAX);
    st->transfers = t;
    st->free_transfers = f;
    return r;
}

/* Ensures an outside hold entry can be taken without allocating. */
static int reserve_outside(acct_state *st)
{
    if (st->nfree_outside || st->noutside < st->cap_outside)
        return 0;
    /* A token carries the index in 32 bits. */
    void *o = st->outside, *f = st->free_outside;
    int r = grow_table(&o, sizeof(struct outside_hold), &f, sizeof(uint32_t), &st->cap_outside, st->noutside,
                       TOKEN_INDEX_LIMIT);
    st->outside = o;
    st->free_outside = f;
    return r;
}

/* -- outputs ------------------------------------------------------------- */

static void reset_output(acct_output *out)
{
    out->ncompletions = 0;
    out->floor = 0;
    out->nholds = 0;
    out->ntransitions = 0;
    out->err_op = -1;
    out->err_value = 0;
}

/* Space must have been reserved. Coalesces with the previous range exactly
 * like qflow.broker.accounting._add_completion. */
static void add_completion(acct_output *out, int64_t session, int64_t command_id)
{
    if (out->ncompletions > out->floor) {
        int64_t *last = out->completions + 3 * (out->ncompletions - 1);
        if (last[0] == session && last[2] != INT64_MAX && last[2] + 1 == command_id) {
            last[2] = command_id;
            return;
        }
    }
    int64_t *rec = out->completions + 3 * out->ncompletions++;
    rec[0] = session;
    rec[1] = command_id;
    rec[2] = command_id;
}

static void add_transition(acct_output *out, int64_t queue, const struct queue *q)
{
    uint64_t *rec = out->transitions + 4 * out->ntransitions++;
    rec[0] = (uint64_t)queue;
    rec[1] = q->flow_on;
    rec[2] = q->count;
    rec[3] = q->nbytes;
}

/* -- queues and transfers ------------------------------------------------- */

static struct queue *find_kind(const acct_state *st, int64_t slot, int kind)
{
    if (slot < 0 || (uint64_t)slot >= st->nqueues || st->queues[slot].kind != kind)
        return NULL;
    return &st->queues[slot];
}

static struct queue *find_queue(const acct_state *st, int64_t queue)
{
    return find_kind(st, queue, SLOT_QUEUE);
}

static struct queue *find_holder(const acct_state *st, int64_t holder)
{
    return find_kind(st, holder, SLOT_HOLDER);
}

static int over_stop(uint32_t count, uint64_t nbytes, const struct queue *q)
{
    return (q->stop_count > 0 && count > q->stop_count) || (q->stop_size > 0 && nbytes > q->stop_size);
}

/* A unit whose *resume* threshold is zero takes no part in resuming, as in qpidd's
   QueueFlowLimit::dequeued: a unit with stop 0 and a resume left by qpidd's resolution
   must still drain below that resume. */
static int under_resume(uint32_t count, uint64_t nbytes, const struct queue *q)
{
    return (q->resume_count == 0 || count < q->resume_count) && (q->resume_size == 0 || nbytes < q->resume_size);
}

static int32_t new_transfer(acct_state *st, int64_t session, int64_t command_id)
{
    int32_t slot;
    if (st->nfree_transfers)
        slot = st->free_transfers[--st->nfree_transfers];
    else
        slot = (int32_t)st->ntransfers++;
    struct transfer *t = &st->transfers[slot];
    t->session = session;
    t->command_id = command_id;
    t->holds = 1;
    t->dropped = 0;
    return slot;
}

/* out == NULL drops the completion (a dropped session's transfer). */
static void unhold(acct_state *st, int32_t slot, acct_output *out)
{
    struct transfer *t = &st->transfers[slot];
    if (--t->holds)
        return;
    if (out && !t->dropped)
        add_completion(out, t->session, t->command_id);
    st->free_transfers[st->nfree_transfers++] = slot;
}

static int cmp_range(const void *a, const void *b)
{
    const int64_t *x = a, *y = b;
    /* (session, first, last): the order of PyAccounting's tuple sort, ties included */
    for (int k = 0; k < 3; k++)
        if (x[k] != y[k])
            return x[k] < y[k] ? -1 : 1;
    return 0;
}

/* Re-add one range, coalescing with the previous one like add_completion. */
static void add_range(acct_output *out, const int64_t *r)
{
    if (out->ncompletions) {
        int64_t *last = out->completions + 3 * (out->ncompletions - 1);
        if (last[0] == r[0] && last[2] != INT64_MAX && last[2] + 1 == r[1]) {
            last[2] = r[2];
            return;
        }
    }
    int64_t *rec = out->completions + 3 * out->ncompletions++;
    rec[0] = r[0];
    rec[1] = r[1];
    rec[2] = r[2];
}

/* A release interleaves the sessions whose transfers it completes, so its
 * completions arrive one id at a time. Order the ones from `start` on by
 * (session, first id) and coalesce them: a few ranges per session instead of
 * one per transfer. Within a session they are already ascending (enqueue order),
 * so a stable scatter over the distinct sessions equals a sort; qsort covers
 * the rare release with more sessions than the scatter tracks. */
static void group_by_session(acct_output *out, size_t start)
{
    enum { MAX_SESSIONS = 64 };
    size_t n = out->ncompletions - start;
    int64_t *seg = out->completions + 3 * start;
    if (n < 2) {
        if (n == 1) { /* it may still join the range before it */
            out->ncompletions = start;
            add_range(out, seg);
        }
        return;
    }
    int64_t sessions[MAX_SESSIONS];
    size_t counts[MAX_SESSIONS];
    size_t ns = 0;
    int scatter = 1;
    for (size_t i = 0; i < n && scatter; i++) {
        size_t k = 0;
        while (k < ns && sessions[k] != seg[3 * i])
            k++;
        if (k == ns) {
            if (ns == MAX_SESSIONS) {
                scatter = 0;
                break;
            }
            /* keep the distinct sessions sorted: the scatter then emits them in sort order */
            size_t j = ns++;
            while (j > 0 && sessions[j - 1] > seg[3 * i]) {
                sessions[j] = sessions[j - 1];
                counts[j] = counts[j - 1];
                j--;
            }
            sessions[j] = seg[3 * i];
            counts[j] = 0;
            k = j;
        }
        counts[k]++;
    }
    int64_t *scratch = scatter ? malloc(3 * n * sizeof *scratch) : NULL;
    if (!scratch) {
        qsort(seg, n, 3 * sizeof *seg, cmp_range);
        scratch = NULL;
    } else {
        size_t offsets[MAX_SESSIONS];
        size_t off = 0;
        for (size_t k = 0; k < ns; k++) {
            offsets[k] = off;
            off += counts[k];
        }
        for (size_t i = 0; i < n; i++) {
            size_t k = 0;
            while (sessions[k] != seg[3 * i])
                k++;
            memcpy(scratch + 3 * offsets[k]++, seg + 3 * i, 3 * sizeof *seg);
        }
        memcpy(seg, scratch, 3 * n * sizeof *seg);
        free(scratch);
        /* The broker's ids ascend within a session; anything else gets a real sort. */
        for (size_t i = 1; i < n; i++)
            if (seg[3 * i] == seg[3 * i - 3] && cmp_range(seg + 3 * i, seg + 3 * i - 3) < 0) {
                qsort(seg, n, 3 * sizeof *seg, cmp_range);
                break;
            }
    }
    out->ncompletions = start;
    for (size_t i = 0; i < n; i++)
        add_range(out, seg + 3 * i);
}

/* Frees outside hold idx (reused last freed first); returns the transfer it held. */
static int32_t free_outside_hold(acct_state *st, size_t idx)
{
    struct outside_hold *o = &st->outside[idx];
    int32_t slot = o->transfer;
    o->transfer = -1;
    o->generation = (o->generation + 1) & GENERATION_MASK;
    st->free_outside[st->nfree_outside++] = (uint32_t)idx;
    return slot;
}

/* Room for q->held completions must have been reserved. */
static void release_all(acct_state *st, struct queue *q, acct_output *out)
{
    size_t start = out ? out->ncompletions : 0;
    size_t n = q->npending;
    q->npending = 0;
    q->generation = (q->generation + 1) & GENERATION_MASK;
    q->held = 0;
    /* Its completions are grouped among themselves, then joined to the earlier
     * ones (PyAccounting._release_all): none may first extend an earlier range. */
    if (out)
        out->floor = start;
    for (size_t i = 0; i < n; i++)
        if (q->pending[i] >= 0)
            unhold(st, q->pending[i], out);
    if (out) {
        out->floor = 0;
        group_by_session(out, start);
    }
    if (q->cap_pending > PENDING_KEEP) {
        free(q->pending);
        q->pending = NULL;
        q->cap_pending = 0;
    }
}

acct_state *acct_new(void)
{
    acct_state *st = calloc(1, sizeof *st);
    if (st)
        reset_output(&st->out);
    return st;
}

void acct_free(acct_state *st)
{
    if (!st)
        return;
    for (size_t i = 0; i < st->nqueues; i++)
        free(st->queues[i].pending);
    free(st->queues);
    free(st->free_queues);
    free(st->transfers);
    free(st->free_transfers);
    free(st->outside);
    free(st->free_outside);
    free(st->out.completions);
    free(st->out.holds);
    free(st->out.transitions);
    free(st);
}

acct_output *acct_output_of(acct_state *st)
{
    return &st->out;
}

/* A slot for a queue or a holder: one numbering, one free list. */
static int64_t add_slot(acct_state *st, uint8_t kind)
{
    int64_t slot;
    if (st->nfree_queues) {
        slot = st->free_queues[--st->nfree_queues];
    } else {
        if (st->nqueues == st->cap_queues) {
            size_t n = grown(st->cap_queues, st->nqueues + 1);
            if (n > SIZE_MAX / sizeof(struct queue))
                return -1;
            struct queue *q = realloc(st->queues, n * sizeof *q);
            if (!q)
                return -1;
            st->queues = q;
            int64_t *f = realloc(st->free_queues, n * sizeof *f);
            if (!f)
                return -1;
            st->free_queues = f;
            st->cap_queues = n;
        }
        slot = (int64_t)st->nqueues++;
    }
    memset(&st->queues[slot], 0, sizeof(struct queue));
    st->queues[slot].kind = kind;
    return slot;
}

int64_t acct_add_queue(acct_state *st)
{
    return add_slot(st, SLOT_QUEUE);
}

int64_t acct_add_holder(acct_state *st)
{
    return add_slot(st, SLOT_HOLDER);
}

int acct_check_queue(const acct_state *st, int64_t queue)
{
    return find_queue(st, queue) ? ACCT_OK : ACCT_ERR_UNKNOWN_QUEUE;
}

static int unknown_queue(acct_output *out, int64_t queue)
{
    out->err_value = queue;
    return ACCT_ERR_UNKNOWN_QUEUE;
}

int acct_remove_queue(acct_state *st, int64_t queue)
{
    acct_output *out = &st->out;
    reset_output(out);
    struct queue *q = find_queue(st, queue);
    if (!q)
        return unknown_queue(out, queue);
    if (reserve_completions(out, q->held))
        return ACCT_ERR_NOMEM;
    release_all(st, q, out);
    free(q->pending);
    q->pending = NULL;
    q->cap_pending = 0;
    q->kind = SLOT_FREE;
    st->free_queues[st->nfree_queues++] = queue;
    return ACCT_OK;
}

int acct_remove_holder(acct_state *st, int64_t holder)
{
    acct_output *out = &st->out;
    reset_output(out);
    struct queue *h = find_holder(st, holder);
    if (!h) {
        out->err_value = holder;
        return ACCT_ERR_UNKNOWN_HOLDER;
    }
    if (reserve_completions(out, h->held))
        return ACCT_ERR_NOMEM;
    /* In index order, as PyAccounting frees them: the free list's order shows in later tokens. */
    for (size_t i = 0; i < st->noutside; i++)
        if (st->outside[i].transfer >= 0 && st->outside[i].holder == holder)
            unhold(st, free_outside_hold(st, i), out);
    group_by_session(out, 0);
    h->held = 0;
    h->kind = SLOT_FREE;
    st->free_queues[st->nfree_queues++] = holder;
    return ACCT_OK;
}

int acct_set_thresholds(acct_state *st, int64_t queue, uint32_t stop_count, uint32_t resume_count,
                        uint64_t stop_size, uint64_t resume_size)
{
    acct_output *out = &st->out;
    reset_output(out);
    struct queue *q = find_queue(st, queue);
    if (!q)
        return unknown_queue(out, queue);
    if (reserve_transitions(out) || reserve_completions(out, q->held))
        return ACCT_ERR_NOMEM;
    q->stop_count = stop_count;
    q->resume_count = resume_count;
    q->stop_size = stop_size;
    q->resume_size = resume_size;
    if (!q->flow_on && over_stop(q->count, q->nbytes, q)) {
        q->flow_on = 1;
        q->stopped_count++;
        add_transition(out, queue, q);
    } else if (q->flow_on && under_resume(q->count, q->nbytes, q)) {
        q->flow_on = 0;
        add_transition(out, queue, q);
        release_all(st, q, out);
    }
    return ACCT_OK;
}

void acct_drop_session(acct_state *st, int64_t session)
{
    for (size_t i = 0; i < st->nqueues; i++) {
        struct queue *q = &st->queues[i];
        if (q->kind != SLOT_QUEUE)
            continue;
        for (size_t j = 0; j < q->npending; j++) {
            int32_t slot = q->pending[j];
            if (slot < 0)
                continue;
            const struct transfer *t = &st->transfers[slot];
            if (!t->dropped && t->session == session) {
                q->pending[j] = -1;
                q->held--;
                unhold(st, slot, NULL);
            }
        }
    }
    for (size_t i = 0; i < st->noutside; i++) {
        int32_t slot = st->outside[i].transfer;
        if (slot < 0)
            continue;
        const struct transfer *t = &st->transfers[slot];
        if (!t->dropped && t->session == session) {
            st->queues[st->outside[i].holder].held--;
            unhold(st, free_outside_hold(st, i), NULL);
        }
    }
    /* What is left of the session (a transfer still counting a routing hold
     * after a failed apply) must never report either. */
    for (size_t i = 0; i < st->ntransfers; i++) {
        struct transfer *t = &st->transfers[i];
        if (t->holds && t->session == session)
            t->dropped = 1;
    }
}

int acct_stats(const acct_state *st, int64_t queue, uint64_t out[5])
{
    /* A holder's depth fields are all zero: add_slot cleared them and nothing sets them. */
    const struct queue *q = find_queue(st, queue);
    if (!q)
        q = find_holder(st, queue);
    if (!q)
        return ACCT_ERR_UNKNOWN_QUEUE;
    out[0] = q->count;
    out[1] = q->nbytes;
    out[2] = q->flow_on;
    out[3] = q->stopped_count;
    out[4] = q->held;
    return ACCT_OK;
}

int64_t acct_holds_of(const acct_state *st, int64_t holder, int64_t *tokens, int64_t *sessions, size_t cap)
{
    if (!find_holder(st, holder))
        return -ACCT_ERR_UNKNOWN_HOLDER;
    size_t n = 0;
    for (size_t i = 0; i < st->noutside; i++) {
        const struct outside_hold *o = &st->outside[i];
        if (o->transfer < 0 || o->holder != holder)
            continue;
        const struct transfer *t = &st->transfers[o->transfer];
        if (t->dropped)
            continue;
        if (n < cap) {
            tokens[n] = (int64_t)(((uint64_t)o->generation << QFLOW_GENERATION_SHIFT) | i);
            sessions[n] = t->session;
        }
        n++;
    }
    return (int64_t)n;
}

int acct_force_depth(acct_state *st, int64_t queue, uint32_t count, uint64_t nbytes)
{
    struct queue *q = find_queue(st, queue);
    if (!q)
        return ACCT_ERR_UNKNOWN_QUEUE;
    q->count = count;
    q->nbytes = nbytes;
    return ACCT_OK;
}

/* -- the batch ------------------------------------------------------------ */

#define FAIL(code, value)           \
    do {                            \
        out->err_op = (int64_t)i;   \
        out->err_value = (value);   \
        return (code);              \
    } while (0)

/* A dequeue lowered the queue's depth to (count, nbytes): if that ends its flow
 * control, record the transition and release every held transfer. Returns 1
 * if it did, 0 if not, -1 when out of memory (the queue is then unchanged). */
static int lower_depth(acct_state *st, struct queue *q, int64_t queue, uint32_t count, uint64_t nbytes,
                       acct_output *out)
{
    int resumes = q->flow_on && under_resume(count, nbytes, q);
    if (resumes && reserve_completions(out, q->held))
        return -1;
    q->count = count;
    q->nbytes = nbytes;
    if (resumes) {
        q->flow_on = 0;
        add_transition(out, queue, q);
        release_all(st, q, out);
    }
    return resumes;
}

int acct_apply(acct_state *st, const int64_t *log, size_t nwords)
{
    acct_output *out = &st->out;
    reset_output(out);
    if (nwords % ACCT_OP_WORDS) {
        out->err_value = (int64_t)nwords;
        return ACCT_ERR_LOG_LENGTH;
    }
    size_t nops = nwords / ACCT_OP_WORDS;
    int opened = 0;
    int32_t current = -1; /* slot of the open transfer, -1 until it is held */
    int64_t session = 0, command_id = 0;

    for (size_t i = 0; i < nops; i++) {
        const int64_t *w = log + i * ACCT_OP_WORDS;
        int64_t op = w[0], a = w[1], b = w[2];

        /* Every op adds at most one record of each kind, except a release
         * of a whole pending list, which reserves for itself. */
        if (reserve_completions(out, 1) || reserve_holds(out) || reserve_transitions(out))
            FAIL(ACCT_ERR_NOMEM, 0);

        if (op == ACCT_OP_TRANSFER || op == ACCT_OP_TRANSFER1) {
            if (opened)
                FAIL(ACCT_ERR_NESTED_TRANSFER, 0);
            /* Locals only: a failure below abandons the whole call. */
            session = a;
            command_id = b;
            current = -1;
            if (op == ACCT_OP_TRANSFER) {
                opened = 1;
                continue;
            }
            a = w[3];
            b = w[4];
        }

        if (op == ACCT_OP_ENQUEUE || op == ACCT_OP_TRANSFER1) {
            int in_transfer = opened || op == ACCT_OP_TRANSFER1;
            struct queue *q = find_queue(st, a);
            if (!q)
                FAIL(ACCT_ERR_UNKNOWN_QUEUE, a);
            if (b < 0 || (uint64_t)b > UINT64_MAX - q->nbytes || q->count >= COUNT_MAX)
                FAIL(ACCT_ERR_ENQUEUE_OVERFLOW, a);
            uint32_t count = q->count + 1;
            uint64_t nbytes = q->nbytes + (uint64_t)b;
            int turns_on = !q->flow_on && over_stop(count, nbytes, q);
            int hold = (q->flow_on || turns_on) && in_transfer;
            if (hold && (reserve_pending(q) || (current < 0 && reserve_transfer(st))))
                FAIL(ACCT_ERR_NOMEM, 0);

            q->count = count;
            q->nbytes = nbytes;
            if (turns_on) {
                q->flow_on = 1;
                q->stopped_count++;
                add_transition(out, a, q);
            }
            if (hold) {
                if (current < 0)
                    current = new_transfer(st, session, command_id);
                st->transfers[current].holds++;
                int64_t token = (int64_t)(((uint64_t)q->generation << QFLOW_GENERATION_SHIFT) | q->npending);
                q->pending[q->npending++] = current;
                q->held++;
                int64_t *rec = out->holds + 4 * out->nholds++;
                rec[0] = (int64_t)i;
                rec[1] = token;
                rec[2] = session;
                rec[3] = a;
            }
            if (op == ACCT_OP_ENQUEUE)
                continue;
        }

        if (op == ACCT_OP_END || op == ACCT_OP_TRANSFER1) {
            if (op == ACCT_OP_END && !opened)
                FAIL(ACCT_ERR_END_WITHOUT_TRANSFER, 0);
            opened = 0;
            if (current < 0)
                add_completion(out, session, command_id);
            else
                unhold(st, current, out);
        } else if (op == ACCT_OP_DEQUEUE) {
            struct queue *q = find_queue(st, a);
            if (!q)
                FAIL(ACCT_ERR_UNKNOWN_QUEUE, a);
            if (q->count == 0 || b < 0 || (uint64_t)b > q->nbytes)
                FAIL(ACCT_ERR_DEQUEUE_UNDERFLOW, a);
            int resumed = lower_depth(st, q, a, q->count - 1, q->nbytes - (uint64_t)b, out);
            if (resumed < 0)
                FAIL(ACCT_ERR_NOMEM, 0);
            if (!resumed) {
                int64_t token = w[3];
                if (token >= 0 && (uint64_t)(token >> QFLOW_GENERATION_SHIFT) == q->generation) {
                    size_t idx = (size_t)(token & 0xFFFFFFFF);
                    if (idx < q->npending && q->pending[idx] >= 0) {
                        int32_t slot = q->pending[idx];
                        q->pending[idx] = -1;
                        q->held--;
                        unhold(st, slot, out);
                    }
                }
            }
        } else if (op == ACCT_OP_DEQUEUE_N) {
            struct queue *q = find_queue(st, a);
            if (!q)
                FAIL(ACCT_ERR_UNKNOWN_QUEUE, a);
            int64_t n = w[3];
            if (n < 0 || (uint64_t)n > q->count || b < 0 || (uint64_t)b > q->nbytes)
                FAIL(ACCT_ERR_DEQUEUE_UNDERFLOW, a);
            if (lower_depth(st, q, a, q->count - (uint32_t)n, q->nbytes - (uint64_t)b, out) < 0)
                FAIL(ACCT_ERR_NOMEM, 0);
        } else if (op == ACCT_OP_HOLD) {
            if (!opened)
                FAIL(ACCT_ERR_HOLD_OUTSIDE_TRANSFER, 0);
            struct queue *h = find_holder(st, a);
            if (!h)
                FAIL(ACCT_ERR_UNKNOWN_HOLDER, a);
            if (reserve_outside(st) || (current < 0 && reserve_transfer(st)))
                FAIL(ACCT_ERR_NOMEM, 0);
            if (current < 0)
                current = new_transfer(st, session, command_id);
            st->transfers[current].holds++;
            size_t idx;
            if (st->nfree_outside) {
                idx = st->free_outside[--st->nfree_outside];
            } else {
                idx = st->noutside++;
                st->outside[idx].generation = 0;
            }
            struct outside_hold *o = &st->outside[idx];
            o->holder = a;
            o->transfer = current;
            h->held++;
            int64_t *rec = out->holds + 4 * out->nholds++;
            rec[0] = (int64_t)i;
            rec[1] = (int64_t)(((uint64_t)o->generation << QFLOW_GENERATION_SHIFT) | idx);
            rec[2] = session;
            rec[3] = a;
        } else if (op == ACCT_OP_RELEASE) {
            struct queue *h = find_holder(st, a);
            if (!h)
                FAIL(ACCT_ERR_UNKNOWN_HOLDER, a);
            /* A token naming no live hold of this holder is ignored, like a stale dequeue token. */
            size_t idx = (size_t)((uint64_t)b & 0xFFFFFFFF);
            if (b >= 0 && idx < st->noutside) {
                const struct outside_hold *o = &st->outside[idx];
                if (o->transfer >= 0 && o->holder == a && (uint64_t)(b >> QFLOW_GENERATION_SHIFT) == o->generation) {
                    h->held--;
                    unhold(st, free_outside_hold(st, idx), out);
                }
            }
        } else {
            FAIL(ACCT_ERR_UNKNOWN_OP, op);
        }
    }
    if (opened) {
        out->err_op = -1;
        return ACCT_ERR_UNTERMINATED;
    }
    return ACCT_OK;
}
