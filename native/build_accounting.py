"""cffi build script for ``qflow._accounting_native`` (out-of-line API mode).

Referenced from setup.py as ``native/build_accounting.py:ffibuilder``; can
also be run directly (``python native/build_accounting.py``) to compile into
the current directory.
"""

import os
import sys

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import shared_header  # noqa: E402

shared_header.write()  # the numbers the C code shares with Python, written from the Python definitions

# Mirrors native/accounting.h (cdef cannot read headers); in API mode cffi
# checks these declarations against the real header when it compiles.
CDEF = """
#define ACCT_OP_WORDS ...
#define ACCT_OP_TRANSFER ...
#define ACCT_OP_ENQUEUE ...
#define ACCT_OP_END ...
#define ACCT_OP_TRANSFER1 ...
#define ACCT_OP_DEQUEUE ...
#define ACCT_OP_DEQUEUE_N ...
#define ACCT_OP_HOLD ...
#define ACCT_OP_RELEASE ...
#define ACCT_OK ...
#define ACCT_ERR_NOMEM ...
#define ACCT_ERR_UNKNOWN_QUEUE ...
#define ACCT_ERR_LOG_LENGTH ...
#define ACCT_ERR_NESTED_TRANSFER ...
#define ACCT_ERR_ENQUEUE_OVERFLOW ...
#define ACCT_ERR_DEQUEUE_UNDERFLOW ...
#define ACCT_ERR_END_WITHOUT_TRANSFER ...
#define ACCT_ERR_UNKNOWN_OP ...
#define ACCT_ERR_UNTERMINATED ...
#define ACCT_ERR_UNKNOWN_HOLDER ...
#define ACCT_ERR_HOLD_OUTSIDE_TRANSFER ...

typedef struct acct_output {
    int64_t *completions;
    size_t ncompletions;
    int64_t *holds;
    size_t nholds;
    uint64_t *transitions;
    size_t ntransitions;
    int64_t err_op;
    int64_t err_value;
    ...;
} acct_output;

typedef struct acct_state acct_state;

acct_state *acct_new(void);
void acct_free(acct_state *st);
acct_output *acct_output_of(acct_state *st);
int64_t acct_add_queue(acct_state *st);
int acct_check_queue(const acct_state *st, int64_t queue);
int acct_remove_queue(acct_state *st, int64_t queue);
int64_t acct_add_holder(acct_state *st);
int acct_remove_holder(acct_state *st, int64_t holder);
int acct_set_thresholds(acct_state *st, int64_t queue, uint32_t stop_count, uint32_t resume_count,
                        uint64_t stop_size, uint64_t resume_size);
int acct_apply(acct_state *st, const int64_t *log, size_t nwords);
void acct_drop_session(acct_state *st, int64_t session);
int acct_stats(const acct_state *st, int64_t queue, uint64_t out[5]);
int64_t acct_holds_of(const acct_state *st, int64_t holder, int64_t *tokens, int64_t *sessions, size_t cap);
int acct_force_depth(acct_state *st, int64_t queue, uint32_t count, uint64_t nbytes);
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "qflow._accounting_native",
    '#include "accounting.h"',
    # Relative to the working directory (the repo root under pip), so that
    # setuptools keeps its object files inside build/.
    sources=[os.path.relpath(os.path.join(_HERE, "accounting.c"))],
    include_dirs=[_HERE],
    extra_compile_args=["-O2"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
