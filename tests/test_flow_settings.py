"""Queue limits and flow thresholds (qflow.broker.flow.resolve, FlowDefaults), by the Qpid C++ manual's examples.

"Producer Flow Control": stop/resume thresholds by default 80%/70% of the queue's maximum; 0 for both
defaults disables default flow control; ring and ring-strict queues never get thresholds; a queue with
flow-stop-size and flow-stop-count set to zero has no flow control.
"""

from __future__ import annotations

import pytest

from qflow.broker.flow import (
    MAX_COUNT,
    MAX_SIZE,
    POLICY,
    RESUME_COUNT,
    RESUME_SIZE,
    STOP_COUNT,
    STOP_SIZE,
    FlowDefaults,
    QueueSettings,
    SettingsError,
    resolve,
)

pytestmark = pytest.mark.native_only  # no accounting here: nothing differs under QFLOW_ACCOUNTING=python

DEFAULTS = FlowDefaults()


def thresholds(s: QueueSettings) -> tuple[int, int, int, int]:
    return (s.stop_count, s.resume_count, s.stop_size, s.resume_size)


# -- defaults, as percentages of the queue's maximum ----------------------------------------------------------


def test_flow_defaults_are_qpidd_defaults() -> None:
    assert (DEFAULTS.stop_pct, DEFAULTS.resume_pct, DEFAULTS.queue_limit) == (80, 70, 104857600)


def test_manual_example_count_and_size() -> None:
    # "a queue with qpid.max_count=10000 and qpid.max_size=1000000 ... 8000 messages or 800000 bytes ...
    # resume at 7000 messages or 700000 bytes"
    s = resolve({MAX_COUNT: 10000, MAX_SIZE: 1000000}, DEFAULTS)
    assert thresholds(s) == (8000, 7000, 800000, 700000)
    assert (s.max_count, s.max_size, s.policy) == (10000, 1000000, "reject")
    assert s.flow_enabled
    assert not s.is_ring


def test_manual_example_rounding_80_70() -> None:
    s = resolve({MAX_SIZE: 2950001}, DEFAULTS)
    assert (s.stop_size, s.resume_size) == (2360001, 2065000)


def test_manual_example_rounding_97_73() -> None:
    s = resolve({MAX_SIZE: 2950001}, FlowDefaults(97, 73))
    assert (s.stop_size, s.resume_size) == (2861501, 2153500)


def test_default_queue_limit_applies_when_max_size_absent() -> None:
    s = resolve({}, DEFAULTS)
    assert s.max_size == 104857600
    assert thresholds(s) == (0, 0, 83886080, 73400320)
    s = resolve({MAX_COUNT: 100}, DEFAULTS)
    assert thresholds(s) == (80, 70, 83886080, 73400320)


def test_default_queue_limit_is_configurable() -> None:
    s = resolve({}, FlowDefaults(80, 70, 1000))
    assert (s.max_size, s.stop_size, s.resume_size) == (1000, 800, 700)
    s = resolve({}, FlowDefaults(80, 70, 0))  # no default size limit
    assert s.max_size == 0
    assert thresholds(s) == (0, 0, 0, 0)
    assert not s.flow_enabled


def test_max_size_zero_means_no_size_limit() -> None:
    s = resolve({MAX_SIZE: 0}, DEFAULTS)
    assert s.max_size == 0
    assert (s.stop_size, s.resume_size) == (0, 0)
    s = resolve({MAX_SIZE: 0, MAX_COUNT: 10000}, DEFAULTS)
    assert thresholds(s) == (8000, 7000, 0, 0)


def test_max_count_zero_or_absent_means_no_count_limit() -> None:
    for args in ({MAX_SIZE: 1000}, {MAX_SIZE: 1000, MAX_COUNT: 0}):
        s = resolve(args, DEFAULTS)
        assert s.max_count == 0
        assert (s.stop_count, s.resume_count) == (0, 0)


# -- explicit thresholds -------------------------------------------------------------------------------------


def test_explicit_flow_args_win_and_turn_defaults_off_for_both_units() -> None:
    base = {MAX_COUNT: 10000, MAX_SIZE: 1000000}
    s = resolve({**base, STOP_COUNT: 500, RESUME_COUNT: 400}, DEFAULTS)
    assert thresholds(s) == (500, 400, 0, 0)  # no default size thresholds
    s = resolve({**base, STOP_SIZE: 5000, RESUME_SIZE: 4000}, DEFAULTS)
    assert thresholds(s) == (0, 0, 5000, 4000)  # no default count thresholds
    s = resolve({**base, RESUME_SIZE: 0}, DEFAULTS)  # any flow key makes the thresholds explicit
    assert thresholds(s) == (0, 0, 0, 0)
    s = resolve({STOP_COUNT: 9, STOP_SIZE: 99}, DEFAULTS)
    assert thresholds(s) == (9, 9, 99, 99)


@pytest.mark.parametrize("resume", [0, None])
def test_resume_zero_or_absent_equals_stop(resume: int | None) -> None:
    args = {STOP_COUNT: 500, STOP_SIZE: 5000}
    if resume is not None:
        args |= {RESUME_COUNT: resume, RESUME_SIZE: resume}
    s = resolve(args, DEFAULTS)
    assert thresholds(s) == (500, 500, 5000, 5000)


def test_resume_equal_to_stop_allowed() -> None:
    s = resolve({STOP_COUNT: 5, RESUME_COUNT: 5, MAX_COUNT: 5}, DEFAULTS)
    assert (s.stop_count, s.resume_count) == (5, 5)


def test_explicit_zero_stop_thresholds_disable_flow_control() -> None:
    s = resolve({MAX_COUNT: 10000, MAX_SIZE: 1000000, STOP_COUNT: 0, STOP_SIZE: 0}, DEFAULTS)
    assert thresholds(s) == (0, 0, 0, 0)
    assert not s.flow_enabled
    assert (s.max_count, s.max_size) == (10000, 1000000)  # the limits themselves stay


def test_stop_equal_to_max_allowed() -> None:
    s = resolve({MAX_COUNT: 10, MAX_SIZE: 100, STOP_COUNT: 10, STOP_SIZE: 100}, DEFAULTS)
    assert thresholds(s) == (10, 10, 100, 100)


# -- refusals ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "keys"), [
    ({STOP_COUNT: 100, RESUME_COUNT: 101}, (RESUME_COUNT, STOP_COUNT)),
    ({STOP_SIZE: 1000, RESUME_SIZE: 1001}, (RESUME_SIZE, STOP_SIZE)),
    ({STOP_COUNT: 0, RESUME_COUNT: 5}, (RESUME_COUNT, STOP_COUNT)),
    ({MAX_COUNT: 100, STOP_COUNT: 101}, (STOP_COUNT, MAX_COUNT)),
    ({MAX_SIZE: 1000, STOP_SIZE: 1001}, (STOP_SIZE, MAX_SIZE)),
])
def test_inconsistent_thresholds_refused_naming_both_keys(args: dict, keys: tuple[str, str]) -> None:
    with pytest.raises(SettingsError) as info:
        resolve(args, DEFAULTS)
    for key in keys:
        assert key in str(info.value)


def test_stop_size_above_default_queue_limit_refused() -> None:
    with pytest.raises(SettingsError, match="--default-queue-limit") as info:
        resolve({STOP_SIZE: 104857601}, DEFAULTS)
    assert STOP_SIZE in str(info.value)
    assert resolve({STOP_SIZE: 104857600}, DEFAULTS).stop_size == 104857600


@pytest.mark.parametrize("key", [MAX_COUNT, MAX_SIZE, STOP_COUNT, RESUME_COUNT, STOP_SIZE, RESUME_SIZE])
@pytest.mark.parametrize("value", [10.0, "10", True, False, None, [10], -1, -10000])
def test_non_integers_and_negatives_refused(key: str, value: object) -> None:
    with pytest.raises(SettingsError) as info:
        resolve({key: value}, DEFAULTS)
    assert key in str(info.value)


@pytest.mark.parametrize("key", [MAX_COUNT, STOP_COUNT, RESUME_COUNT])
def test_counts_above_32_bits_refused(key: str) -> None:
    with pytest.raises(SettingsError, match=key.replace(".", r"\.")):
        resolve({key: 2**32}, DEFAULTS)
    assert resolve({MAX_COUNT: 2**32 - 1}, DEFAULTS).max_count == 2**32 - 1
    assert resolve({STOP_COUNT: 2**32 - 1}, DEFAULTS).stop_count == 2**32 - 1


@pytest.mark.parametrize("key", [MAX_SIZE, STOP_SIZE, RESUME_SIZE])
def test_sizes_above_64_bits_refused(key: str) -> None:
    with pytest.raises(SettingsError):
        resolve({key: 2**64}, DEFAULTS)


def test_unknown_policy_refused() -> None:
    with pytest.raises(SettingsError, match=POLICY):
        resolve({POLICY: "flow_to_disk"}, DEFAULTS)


# -- ring queues ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["ring", "ring-strict"])
def test_ring_queues_get_no_thresholds(policy: str) -> None:
    s = resolve({POLICY: policy, MAX_COUNT: 10000, MAX_SIZE: 1000000}, DEFAULTS)
    assert thresholds(s) == (0, 0, 0, 0)
    assert s.is_ring and not s.flow_enabled
    s = resolve({POLICY: policy, MAX_COUNT: 100, STOP_COUNT: 50, RESUME_COUNT: 40, STOP_SIZE: 500}, DEFAULTS)
    assert thresholds(s) == (0, 0, 0, 0)
    assert (s.max_count, s.policy) == (100, policy)


def test_ring_queue_needs_a_limit() -> None:
    with pytest.raises(SettingsError, match=MAX_COUNT):
        resolve({POLICY: "ring", MAX_SIZE: 0}, DEFAULTS)
    assert resolve({POLICY: "ring"}, DEFAULTS).max_size == 104857600  # the default limit is a limit


@pytest.mark.parametrize("policy", ["reject", "none"])
def test_other_policies_get_thresholds(policy: str) -> None:
    s = resolve({POLICY: policy, MAX_COUNT: 10000, MAX_SIZE: 1000000}, DEFAULTS)
    assert thresholds(s) == (8000, 7000, 800000, 700000)


# -- FlowDefaults --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("stop", "resume"), [(101, 70), (80, -1), (-1, -1), (80, 101), (80.0, 70), (80, "70"),
                                              (True, 0)])
def test_flow_defaults_refuse_bad_percentages(stop: object, resume: object) -> None:
    with pytest.raises(SettingsError, match="percentage"):
        FlowDefaults(stop, resume)


def test_flow_defaults_refuse_resume_above_stop() -> None:
    with pytest.raises(SettingsError) as info:
        FlowDefaults(60, 70)
    assert "--default-flow-resume-threshold" in str(info.value)
    assert "--default-flow-stop-threshold" in str(info.value)


@pytest.mark.parametrize("limit", [-1, 2**64, 1.5, "100"])
def test_flow_defaults_refuse_bad_queue_limit(limit: object) -> None:
    with pytest.raises(SettingsError, match="--default-queue-limit"):
        FlowDefaults(80, 70, limit)


def test_flow_defaults_edges_accepted() -> None:
    assert FlowDefaults(100, 100).stop_pct == 100
    assert FlowDefaults(100, 0).resume_pct == 0
    assert FlowDefaults(0, 0).stop_pct == 0


def test_both_percentages_zero_turn_default_flow_control_off() -> None:
    off = FlowDefaults(0, 0)
    s = resolve({MAX_COUNT: 10000, MAX_SIZE: 1000000}, off)
    assert thresholds(s) == (0, 0, 0, 0)
    assert not s.flow_enabled
    assert (s.max_count, s.max_size) == (10000, 1000000)
    s = resolve({}, off)
    assert thresholds(s) == (0, 0, 0, 0)
    # explicit per-queue settings still work
    s = resolve({MAX_COUNT: 10000, STOP_COUNT: 100, RESUME_COUNT: 50, STOP_SIZE: 2000}, off)
    assert thresholds(s) == (100, 50, 2000, 2000)
    assert s.flow_enabled


def test_other_percentages_apply_to_both_units() -> None:
    s = resolve({MAX_COUNT: 200, MAX_SIZE: 3000}, FlowDefaults(50, 25))
    assert thresholds(s) == (100, 50, 1500, 750)


def test_default_resume_rounding_to_zero_equals_stop() -> None:
    # qpid.max_count=1 at 80/70: stop round(0.8) = 1, resume floor(0.7) = 0. A literal resume of 0 could
    # never be undercut (flow would stay ON for good); like an explicit 0 it means "equal to stop".
    s = resolve({MAX_COUNT: 1, MAX_SIZE: 1}, DEFAULTS)
    assert thresholds(s) == (1, 1, 1, 1)
    s = resolve({MAX_COUNT: 10000, MAX_SIZE: 1000000}, FlowDefaults(80, 0))
    assert thresholds(s) == (8000, 8000, 800000, 800000)
