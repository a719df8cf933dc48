"""The C allocator's thresholds, set once per process for qflow's read buffers.

A read asks for up to READ_SIZE (256 KiB): CPython's ``socket.recv``
allocates that much before it knows how much arrived, then shrinks it. glibc
serves a request above its mmap threshold (128 KiB until the program frees
such a block) with a fresh mapping, so every read maps, faults in and unmaps
its pages. Measured on qflowd with one producer and one consumer of 300,000
64-byte messages (``perf stat``): about 4,300 page faults against 1,900 with
the threshold raised, and 5 % more broker CPU.

glibc raises the threshold by itself once the program frees a large block,
so left alone it depends on which buffers happen to be freed. This sets
it on purpose, to a size glibc's own rule reaches (it allows up to 32 MiB):
4 MiB, so reads and joined writes stay in the heap, and a trim threshold of
twice that, as glibc's rule pairs them. Nothing is done off glibc, or when
the environment already sets glibc's malloc options.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 4 << 20
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
_ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")

_set: bool | None = None  # once per process: None until tried


def keep_read_buffers_in_heap() -> bool:
    """Raise glibc's mmap and trim thresholds (once per process); returns
    whether they are set by this call or an earlier one."""
    global _set
    if _set is None:
        _set = False
        if not any(name in os.environ for name in _ENVIRONMENT):  # the operator's choice wins
            try:
                mallopt = ctypes.CDLL(None).mallopt
            except (OSError, AttributeError):  # not glibc
                return False
            mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            _set = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _set
