"""The op codes and record layouts that C and Python share are defined once,
in qflow/broker/ops.py and qflow/protocol/entries.py; the C headers repeat
them, and this compares the compiled values with the Python ones."""

from __future__ import annotations

import pytest
from qflow._accounting_native import lib as accounting  # built by make install
from qflow._transfers_native import lib as transfers

from qflow.broker import ops
from qflow.broker._native_accounting import NativeAccounting
from qflow.protocol.entries import ENTRY_HEAD_SIZE

pytestmark = pytest.mark.native_only


@pytest.mark.parametrize("name", ["OP_WORDS", "OP_TRANSFER", "OP_ENQUEUE", "OP_END", "OP_TRANSFER1", "OP_DEQUEUE",
                                  "OP_DEQUEUE_N", "OP_HOLD", "OP_RELEASE"])
def test_the_c_accounting_uses_the_python_op_codes(name):
    assert getattr(accounting, "ACCT_" + name) == getattr(ops, name)


def test_every_op_code_is_compared():
    # A new op in ops.py must join the list above (and the C header).
    codes = {name for name in vars(ops) if name.startswith("OP_") and name != "OP_WORDS"}
    assert codes == {"OP_TRANSFER", "OP_ENQUEUE", "OP_END", "OP_TRANSFER1", "OP_DEQUEUE", "OP_DEQUEUE_N",
                     "OP_HOLD", "OP_RELEASE"}


@pytest.mark.parametrize("name", sorted(n for n in dir(accounting) if n.startswith("ACCT_ERR_") and n != "ACCT_ERR_NOMEM"))
def test_every_c_accounting_error_has_its_own_message(name):
    # NativeAccounting must raise PyAccounting's text for each status, never the catch-all.
    with pytest.raises(ops.AccountingError) as raised:
        NativeAccounting()._check(getattr(accounting, name))
    assert not str(raised.value).startswith("accounting status")


@pytest.mark.parametrize("name", ["OP_WORDS", "OP_TRANSFER", "OP_ENQUEUE", "OP_END", "OP_TRANSFER1", "OP_HOLD"])
def test_the_c_transfer_scanner_writes_the_python_op_codes(name):
    assert getattr(transfers, "QF_" + name) == getattr(ops, name)


def test_the_c_transfer_scanner_writes_the_python_entry_head():
    assert transfers.QF_ENTRY_HEAD == ENTRY_HEAD_SIZE
