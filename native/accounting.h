/* Per-queue flow accounting and transfer completion: the C twin of
 * qflow.broker.accounting.PyAccounting. The module docstring of qflow/broker/accounting.py
 * is the specification (op log format, outputs, hold tokens, drop_session);
 * this header only describes the C boundary.
 *
 * The boundary is batch-shaped: one call replays a whole op log, and the
 * results land in buffers owned by the state (acct_output), which the Python
 * wrapper reads after the call. Every function that produces results first
 * empties those buffers, so they only ever hold the last call's results. */
#ifndef QFLOW_ACCOUNTING_H
#define QFLOW_ACCOUNTING_H

#include <stddef.h>
#include <stdint.h>

#include "qflow_shared.h" /* written from qflow/broker/ops.py at build time */

#define ACCT_OP_WORDS QFLOW_OP_WORDS
#define ACCT_OP_TRANSFER QFLOW_OP_TRANSFER
#define ACCT_OP_ENQUEUE QFLOW_OP_ENQUEUE
#define ACCT_OP_END QFLOW_OP_END
#define ACCT_OP_TRANSFER1 QFLOW_OP_TRANSFER1
#define ACCT_OP_DEQUEUE QFLOW_OP_DEQUEUE
#define ACCT_OP_DEQUEUE_N QFLOW_OP_DEQUEUE_N
#define ACCT_OP_HOLD QFLOW_OP_HOLD
#define ACCT_OP_RELEASE QFLOW_OP_RELEASE

/* Status codes. acct_output.err_op is the failing op's index (-1 when the
 * error is not tied to one op) and err_value the number the message names:
 * the queue or holder slot, the op code or the log's word count. */
#define ACCT_OK QFLOW_ACCT_OK
#define ACCT_ERR_NOMEM QFLOW_ERR_NOMEM
#define ACCT_ERR_UNKNOWN_QUEUE QFLOW_ERR_UNKNOWN_QUEUE
#define ACCT_ERR_LOG_LENGTH QFLOW_ERR_LOG_LENGTH
#define ACCT_ERR_NESTED_TRANSFER QFLOW_ERR_NESTED_TRANSFER
#define ACCT_ERR_ENQUEUE_OVERFLOW QFLOW_ERR_ENQUEUE_OVERFLOW
#define ACCT_ERR_DEQUEUE_UNDERFLOW QFLOW_ERR_DEQUEUE_UNDERFLOW
#define ACCT_ERR_END_WITHOUT_TRANSFER QFLOW_ERR_END_WITHOUT_TRANSFER
#define ACCT_ERR_UNKNOWN_OP QFLOW_ERR_UNKNOWN_OP
#define ACCT_ERR_UNTERMINATED QFLOW_ERR_UNTERMINATED
#define ACCT_ERR_UNKNOWN_HOLDER QFLOW_ERR_UNKNOWN_HOLDER
#define ACCT_ERR_HOLD_OUTSIDE_TRANSFER QFLOW_ERR_HOLD_OUTSIDE_TRANSFER

typedef struct acct_output {
    int64_t *completions;   /* (session, first, last) per completed range */
    size_t ncompletions;
    int64_t *holds;         /* (op_index, token, session, queue or holder) per hold */
    size_t nholds;
    uint64_t *transitions;  /* (queue, flow_on, count, nbytes) per change */
    size_t ntransitions;
    int64_t err_op;
    int64_t err_value;
    /* Ranges below this index are closed to add_completion: a release groups
     * its own completions before they join the ones before it. */
    size_t floor;
    /* capacities, in records */
    size_t cap_completions;
    size_t cap_holds;
    size_t cap_transitions;
} acct_output;

typedef struct acct_state acct_state;

acct_state *acct_new(void);  /* NULL when out of memory */
void acct_free(acct_state *st);
acct_output *acct_output_of(acct_state *st);

/* The new queue's slot (freed slots are reused last-freed first), or -1 when
 * out of memory. */
int64_t acct_add_queue(acct_state *st);
int acct_check_queue(const acct_state *st, int64_t queue);
/* Releases the queue's held transfers into completions. */
int acct_remove_queue(acct_state *st, int64_t queue);
/* An outside holder: a slot from the queues' numbering (-1 when out of memory). */
int64_t acct_add_holder(acct_state *st);
/* Releases the holder's holds into completions. */
int acct_remove_holder(acct_state *st, int64_t holder);
/* The caller has validated resume <= stop for each unit whose stop is non-zero
 * (a unit with stop 0 may have a resume: it then takes part in resuming only).
 * Fills completions and transitions. */
int acct_set_thresholds(acct_state *st, int64_t queue, uint32_t stop_count, uint32_t resume_count,
                        uint64_t stop_size, uint64_t resume_size);
/* Replays nwords int64 words of op log. On error the ops before err_op have
 * taken effect and the outputs are meaningless. */
int acct_apply(acct_state *st, const int64_t *log, size_t nwords);
void acct_drop_session(acct_state *st, int64_t session);
/* out: count, bytes, flow_on, stopped_count, held; for a holder 0, 0, 0, 0, held. */
int acct_stats(const acct_state *st, int64_t queue, uint64_t out[5]);
/* The live holds of outside holder ``holder``, in index order: the first
 * ``cap`` of them into tokens[] and sessions[] (the session of the transfer
 * each holds); returns how many there are, or -ACCT_ERR_UNKNOWN_HOLDER. */
int64_t acct_holds_of(const acct_state *st, int64_t holder, int64_t *tokens, int64_t *sessions, size_t cap);
/* For tests only: the 32-bit count limit cannot be reached by enqueuing. */
int acct_force_depth(acct_state *st, int64_t queue, uint32_t count, uint64_t nbytes);

#endif
