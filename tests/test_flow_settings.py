"""Queue limits and flow thresholds (qflow.broker.settings.resolve, FlowDefaults), resolved as qpidd resolves them.

The rules are the Qpid C++ broker's code (QueueFlowLimit::createLimit and validateFlowConfig), which
decides where the manual is silent; the manual's own examples are rows of the table below:

* createLimit: "if (settings.dropMessagesAtLimit) ... return" no limit -- ring queues get no flow limit.
* createLimit: "maxMsgCount(settings.maxDepth.hasCount() ? ... : 0)", "maxByteCount(settings.maxDepth.hasSize()
  ? ... : defaultMaxSize)" -- the maxima, by count and by size.
* createLimit: "// pre-fill by defaults, if exist": "if (defaultFlowStopRatio) ... (uint64_t)(maxByteCount *
  (defaultFlowStopRatio/100.0) + 0.5)" and "if (defaultFlowResumeRatio) ... (uint64_t)(maxByteCount *
  (defaultFlowResumeRatio/100.0))" -- IEEE double, truncated.
* createLimit: "// update by user-specified thresholds" -- each key replaces its own value only.
* createLimit: "if (flowStopCount || flowStopSize) { validateFlowConfig(...) ... }" else "no flow limit".
* validateFlowConfig: "if (stop) { if (resume > stop) throw ...; if (resume == 0) resume = stop;
  if (max != 0 && (max < stop)) throw ... }".
* createLimit: a resume key with no stop key logs "user-configured flow limits are ignored as no stop limits
  provided" and goes on: it is not refused.

Several answers here changed from qflow's earlier, non-qpidd rule ("any qpid.flow_* key makes the thresholds
explicit, defaults then apply to neither unit"); each such row says what the old rule answered.
"""

from __future__ import annotations

from typing import Any

import pytest

from qflow.broker.settings import (
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
    resume_of,
    resume_without_stop,
    stop_of,
)

pytestmark = pytest.mark.native_only  # no accounting here: nothing differs under QFLOW_ACCOUNTING=python

DEFAULTS = FlowDefaults()
# The default --default-queue-limit of 100 MB (104857600 bytes) at 80 % / 70 %:
# 104857600 x 0.8 + 0.5 = 83886080.5 -> 83886080; 104857600 x 0.7 = 73400320 (0.7 is a hair under 0.7 in
# double, but 104857600 is 100 x 2**20 and the product rounds back to the integer).
DSTOP, DRESUME = 83886080, 73400320
BASE = {MAX_COUNT: 10000, MAX_SIZE: 1000000}
SIZE_MAX = 2**64 - 1


def thresholds(s: QueueSettings) -> tuple[int, int, int, int]:
    return (s.stop_count, s.resume_count, s.stop_size, s.resume_size)


# -- the table ----------------------------------------------------------------------------------------------
# (id, arguments, broker defaults, (stop_count, resume_count, stop_size, resume_size))

ACCEPTED: list[tuple[str, dict[str, Any], FlowDefaults, tuple[int, int, int, int]]] = [
    # The consequences.
    ("issue: max_count 1000 + stop_count 900 resumes at 70 %, keeps the size thresholds",
     {MAX_COUNT: 1000, STOP_COUNT: 900}, DEFAULTS, (900, 700, DSTOP, DRESUME)),
    ("issue: max_count 100 + resume_size 0 still stops at 80 (resume size 0 becomes the stop size)",
     {MAX_COUNT: 100, RESUME_SIZE: 0}, DEFAULTS, (80, 70, DSTOP, DSTOP)),  # old rule: (0, 0, 0, 0)
    ("issue: resume_count 5 with the default stops is accepted",
     {RESUME_COUNT: 5}, DEFAULTS, (0, 5, DSTOP, DRESUME)),
    ("issue: resume_count 5 with a default count stop",
     {MAX_COUNT: 100, RESUME_COUNT: 5}, DEFAULTS, (80, 5, DSTOP, DRESUME)),
    # The manual's examples.
    ("manual: max 1000, stop 900, resume 500",
     {MAX_COUNT: 1000, STOP_COUNT: 900, RESUME_COUNT: 500}, DEFAULTS, (900, 500, DSTOP, DRESUME)),
    ("manual: 10K bytes and 5000 messages; stop 4000 or 8K, resume 3000 and 6K",
     {MAX_SIZE: 10240, MAX_COUNT: 5000, STOP_COUNT: 4000, STOP_SIZE: 8192, RESUME_COUNT: 3000, RESUME_SIZE: 6144},
     DEFAULTS, (4000, 3000, 8192, 6144)),
    ("manual: 90 % / 75 % of a default-queue-limit of 10000 bytes = 9000 / 7500",
     {}, FlowDefaults(90, 75, 10000), (0, 0, 9000, 7500)),
    ("manual: 'the same computation ... expressed as a message count'",
     {MAX_COUNT: 10000}, FlowDefaults(90, 75, 0), (9000, 7500, 0, 0)),
    ("manual: defaults 80 % / 70 % of max_count 10000 and max_size 1000000",
     BASE, DEFAULTS, (8000, 7000, 800000, 700000)),
    ("manual: 'disable flow control on a per queue basis by setting the flow-stop-size and flow-stop-count to "
     "zero'", {**BASE, STOP_COUNT: 0, STOP_SIZE: 0}, DEFAULTS, (0, 0, 0, 0)),
    ("manual: 'the value 0 for both' percentages disables default flow control",
     BASE, FlowDefaults(0, 0), (0, 0, 0, 0)),
    ("manual: '... flow control may still be applied manually on a per-queue basis in this case'",
     {**BASE, STOP_COUNT: 100, RESUME_COUNT: 50, STOP_SIZE: 2000}, FlowDefaults(0, 0), (100, 50, 2000, 2000)),
    # Pre-fill, then each key replaces its own value only.
    ("explicit count keys keep the pre-filled size thresholds",
     {**BASE, STOP_COUNT: 500, RESUME_COUNT: 400}, DEFAULTS, (500, 400, 800000, 700000)),  # old: (500, 400, 0, 0)
    ("explicit size keys keep the pre-filled count thresholds",
     {**BASE, STOP_SIZE: 5000, RESUME_SIZE: 4000}, DEFAULTS, (8000, 7000, 5000, 4000)),  # old: (0, 0, 5000, 4000)
    ("resume_size 0 alone replaces only the resume size, which then equals the stop size",
     {**BASE, RESUME_SIZE: 0}, DEFAULTS, (8000, 7000, 800000, 800000)),  # old: (0, 0, 0, 0)
    ("stop equal to the maximum; resume pre-filled at 70 %",
     {MAX_COUNT: 10, MAX_SIZE: 100, STOP_COUNT: 10, STOP_SIZE: 100}, DEFAULTS, (10, 7, 100, 70)),  # old: (10,10,100,100)
    ("resume 0 given for both units equals each stop",
     {STOP_COUNT: 500, STOP_SIZE: 5000, RESUME_COUNT: 0, RESUME_SIZE: 0}, DEFAULTS, (500, 500, 5000, 5000)),
    ("resume equal to stop",
     {STOP_COUNT: 5, RESUME_COUNT: 5, MAX_COUNT: 5}, DEFAULTS, (5, 5, DSTOP, DRESUME)),
    ("no count maximum: the count resume pre-fills to 0 and becomes the stop",
     {STOP_COUNT: 10}, DEFAULTS, (10, 10, DSTOP, DRESUME)),
    # A unit whose stop is 0 keeps its resume, unchecked (it takes part in resuming; see test_accounting.py).
    ("stop_size 0 with stop_count 10: the size unit keeps its pre-filled resume",
     {STOP_SIZE: 0, STOP_COUNT: 10}, DEFAULTS, (10, 10, 0, DRESUME)),
    ("stop_count 0 with resume_count 5 is accepted (the size unit stops)",
     {STOP_COUNT: 0, RESUME_COUNT: 5}, DEFAULTS, (0, 5, DSTOP, DRESUME)),  # old: refused, resume > stop
    ("stop_count 0 keeps the pre-filled count resume",
     {MAX_COUNT: 100, STOP_COUNT: 0}, DEFAULTS, (0, 70, DSTOP, DRESUME)),
    # Both stops 0: no flow limit, and nothing is kept of the resume values.
    ("max_size 0 and no count maximum: both stops pre-fill to 0, no flow limit",
     {MAX_SIZE: 0, RESUME_COUNT: 5}, DEFAULTS, (0, 0, 0, 0)),
    ("percentages 0: a resume key alone is no flow limit", {MAX_COUNT: 100, RESUME_COUNT: 5}, FlowDefaults(0, 0),
     (0, 0, 0, 0)),
    ("stop percentage alone: resumes are not pre-filled and become the stops",
     BASE, FlowDefaults(80, 0), (8000, 8000, 800000, 800000)),
    ("other percentages apply to both units", {MAX_COUNT: 200, MAX_SIZE: 3000}, FlowDefaults(50, 25),
     (100, 50, 1500, 750)),
    # Rounding, worked by hand from the double arithmetic (qpidd's, and Python's float).
    ("issue: max_count 90 at 70 % resumes at 62, not 63: 0.7 is 0.69999999999999995559 in double, and "
     "90 x that rounds to 62.999999999999992895, truncated to 62; the stop is 72.0 + 0.5 -> 72",
     {MAX_COUNT: 90}, DEFAULTS, (72, 62, DSTOP, DRESUME)),  # old (integer arithmetic): resume 63
    ("max_count 45 at 70 %: 45 x 0.69999999999999995559 rounds to 31.499999999999996447, + 0.5 is "
     "31.999999999999996447, truncated to 31 (exact arithmetic rounds 31.5 up to 32)",
     {MAX_COUNT: 45}, FlowDefaults(70, 70, 0), (31, 31, 0, 0)),
    ("manual: max_size 2950001 at 80/70: 2360000.8 + 0.5 -> 2360001; 2065000.7 -> 2065000",
     {MAX_SIZE: 2950001}, DEFAULTS, (0, 0, 2360001, 2065000)),
    ("manual: max_size 2950001 at 97/73: 2861500.97 + 0.5 -> 2861501; 2153500.73 -> 2153500",
     {MAX_SIZE: 2950001}, FlowDefaults(97, 73), (0, 0, 2861501, 2153500)),
    ("max_size 2**54 - 1 at 80 %: the double is 2**54 (a tie, to even); x 0.80000000000000004441 rounds to "
     "14411518807585588, + 0.5 ties to even, stays: stop 14411518807585588 (exact arithmetic: ...586)",
     {MAX_SIZE: 2**54 - 1}, DEFAULTS, (0, 0, 14411518807585588, 12610078956637388)),
    ("max_count 1 at 80/70: stop 0.8 + 0.5 -> 1, resume 0.7 -> 0, which becomes the stop",
     {MAX_COUNT: 1, MAX_SIZE: 1}, DEFAULTS, (1, 1, 1, 1)),
    ("max_size 2**64 - 1 at 100 %: the double 2**64 does not fit; qflow saturates at 2**64 - 1",
     {MAX_SIZE: SIZE_MAX}, FlowDefaults(100, 100), (0, 0, SIZE_MAX, SIZE_MAX)),
    ("max_count 2**32 - 1 at 100 %: 4294967295.5 truncates back to the maximum",
     {MAX_COUNT: 2**32 - 1, MAX_SIZE: 0}, FlowDefaults(100, 100), (2**32 - 1, 2**32 - 1, 0, 0)),
    # Other policies, and ring queues (their flow keys are ignored).
    ("policy reject gets thresholds", {**BASE, POLICY: "reject"}, DEFAULTS, (8000, 7000, 800000, 700000)),
    ("policy none gets thresholds", {**BASE, POLICY: "none"}, DEFAULTS, (8000, 7000, 800000, 700000)),
    ("manual: ring queues 'do NOT have queue flow thresholds'", {**BASE, POLICY: "ring"}, DEFAULTS, (0, 0, 0, 0)),
    ("ring-strict: none either, even with flow keys",
     {POLICY: "ring-strict", MAX_COUNT: 100, STOP_COUNT: 50, RESUME_COUNT: 40, STOP_SIZE: 500}, DEFAULTS,
     (0, 0, 0, 0)),
    ("ring: a flow key that would be refused elsewhere is ignored",
     {POLICY: "ring", MAX_COUNT: 100, STOP_SIZE: 5000}, DEFAULTS, (0, 0, 0, 0)),
]

# (id, arguments, broker defaults, texts the refusal must contain: the key, the value and the rule)
REFUSED: list[tuple[str, dict[str, Any], FlowDefaults, tuple[str, ...]]] = [
    ("issue: stop_size 5000 alone: the pre-filled resume size is larger",
     {STOP_SIZE: 5000}, DEFAULTS,
     (f"{RESUME_SIZE}={DRESUME} (the default: 70 % of {MAX_SIZE}=104857600 from --default-queue-limit)",
      "must be less than or equal to", f"{STOP_SIZE}=5000")),
    ("stop_count below the pre-filled resume count",
     {MAX_COUNT: 100, STOP_COUNT: 50}, DEFAULTS,  # old rule: accepted as (50, 50, 0, 0)
     (f"{RESUME_COUNT}=70 (the default: 70 % of {MAX_COUNT}=100)", f"{STOP_COUNT}=50")),
    ("both stops without resumes, under the 100 MB default limit",
     {STOP_COUNT: 500, STOP_SIZE: 5000}, DEFAULTS,  # old rule: (500, 500, 5000, 5000)
     (f"{RESUME_SIZE}={DRESUME}", f"{STOP_SIZE}=5000")),
    ("small stops for both units",
     {STOP_COUNT: 9, STOP_SIZE: 99}, DEFAULTS,  # old rule: (9, 9, 99, 99)
     (f"{RESUME_SIZE}={DRESUME}", f"{STOP_SIZE}=99")),
    ("resume count above stop count",
     {STOP_COUNT: 100, RESUME_COUNT: 101}, DEFAULTS,
     (f"{RESUME_COUNT}=101 must be less than or equal to {STOP_COUNT}=100",)),
    ("resume size above stop size",
     {STOP_SIZE: 1000, RESUME_SIZE: 1001}, DEFAULTS,
     (f"{RESUME_SIZE}=1001 must be less than or equal to {STOP_SIZE}=1000",)),
    ("stop count above max count",
     {MAX_COUNT: 100, STOP_COUNT: 101, RESUME_COUNT: 50}, DEFAULTS,
     (f"{STOP_COUNT}=101 must be less than or equal to {MAX_COUNT}=100",)),
    ("stop size above max size",
     {MAX_SIZE: 1000, STOP_SIZE: 1001, RESUME_SIZE: 1}, DEFAULTS,
     (f"{STOP_SIZE}=1001 must be less than or equal to {MAX_SIZE}=1000",)),
    ("stop size above the default queue limit",
     {STOP_SIZE: 104857601}, DEFAULTS,
     (f"{STOP_SIZE}=104857601 must be less than or equal to {MAX_SIZE}=104857600 from --default-queue-limit",)),
    ("the count unit is checked first, as qpidd does",
     {MAX_COUNT: 100, STOP_COUNT: 101, STOP_SIZE: 1}, DEFAULTS, (f"{STOP_COUNT}=101",)),
    ("max_size 2**54 - 1 at 100 %: the double pre-fill 2**54 is above the maximum, as in qpidd",
     {MAX_SIZE: 2**54 - 1}, FlowDefaults(100, 70),
     (f"{STOP_SIZE}=18014398509481984 (the default: 100 % of {MAX_SIZE}=18014398509481983)",
      f"must be less than or equal to {MAX_SIZE}=18014398509481983")),
]


@pytest.mark.parametrize(("arguments", "defaults", "expected"),
                         [pytest.param(a, d, e, id=i) for i, a, d, e in ACCEPTED])
def test_resolution(arguments: dict[str, Any], defaults: FlowDefaults, expected: tuple[int, int, int, int]) -> None:
    s = resolve(arguments, defaults)
    assert thresholds(s) == expected
    assert s.flow_enabled == bool(expected[0] or expected[2])


@pytest.mark.parametrize(("arguments", "defaults", "texts"), [pytest.param(a, d, t, id=i) for i, a, d, t in REFUSED])
def test_refusal(arguments: dict[str, Any], defaults: FlowDefaults, texts: tuple[str, ...]) -> None:
    with pytest.raises(SettingsError) as info:
        resolve(arguments, defaults)
    for text in texts:
        assert text in str(info.value)


def test_prefill_is_qpidds_double_arithmetic() -> None:
    # Where exact and double arithmetic part, the double wins (rows above); elsewhere they agree.
    assert (stop_of(45, 70), resume_of(90, 70)) == (31, 62)
    assert (stop_of(10000, 80), resume_of(10000, 70)) == (8000, 7000)
    for maximum in range(0, 400):
        for pct in (0, 1, 33, 50, 70, 75, 80, 90, 97, 100):
            assert stop_of(maximum, pct) == int(float(maximum) * (pct / 100.0) + 0.5)
            assert resume_of(maximum, pct) == int(float(maximum) * (pct / 100.0))


# -- the warning for a resume key without a stop key ---------------------------------------------------------


@pytest.mark.parametrize(("arguments", "warned"), [
    ({RESUME_COUNT: 5}, (RESUME_COUNT,)),
    ({MAX_COUNT: 100, RESUME_SIZE: 0, RESUME_COUNT: 5}, (RESUME_COUNT, RESUME_SIZE)),
    ({RESUME_COUNT: 5, STOP_SIZE: 0}, ()),  # a stop key was given, even a 0
    ({RESUME_COUNT: 5, STOP_COUNT: 10}, ()),
    ({MAX_COUNT: 100}, ()),
    ({POLICY: "ring", MAX_COUNT: 100, RESUME_COUNT: 5}, ()),  # qpidd returns for ring queues before warning
])
def test_resume_without_stop_is_warned_not_refused(arguments: dict[str, Any], warned: tuple[str, ...]) -> None:
    # createLimit: a resume key with no stop key logs a warning; the queue is still created.
    text = resume_without_stop(arguments)
    resolve(arguments, DEFAULTS)  # accepted
    if not warned:
        assert text is None
    else:
        assert text is not None
        for key in warned:
            assert key in text


# -- limits --------------------------------------------------------------------------------------------------


def test_flow_defaults_are_qpidd_defaults() -> None:
    assert (DEFAULTS.stop_pct, DEFAULTS.resume_pct, DEFAULTS.queue_limit) == (80, 70, 104857600)


def test_manual_example_limits_kept() -> None:
    s = resolve(BASE, DEFAULTS)
    assert (s.max_count, s.max_size, s.policy) == (10000, 1000000, "reject")
    assert s.flow_enabled
    assert not s.is_ring


def test_default_queue_limit_applies_when_max_size_absent() -> None:
    s = resolve({}, DEFAULTS)
    assert s.max_size == 104857600
    assert thresholds(s) == (0, 0, DSTOP, DRESUME)


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


def test_explicit_zero_stop_thresholds_keep_the_limits() -> None:
    s = resolve({**BASE, STOP_COUNT: 0, STOP_SIZE: 0}, DEFAULTS)
    assert not s.flow_enabled
    assert (s.max_count, s.max_size) == (10000, 1000000)


# -- bad values ----------------------------------------------------------------------------------------------


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


@pytest.mark.parametrize("policy", ["ring", "ring-strict"])
def test_ring_flow_keys_are_still_type_checked(policy: str) -> None:
    with pytest.raises(SettingsError, match=STOP_COUNT):
        resolve({POLICY: policy, MAX_COUNT: 10, STOP_COUNT: "5"}, DEFAULTS)


def test_unknown_policy_refused() -> None:
    with pytest.raises(SettingsError, match=POLICY):
        resolve({POLICY: "flow_to_disk"}, DEFAULTS)


def test_ring_queue_needs_a_limit() -> None:
    with pytest.raises(SettingsError, match=MAX_COUNT):
        resolve({POLICY: "ring", MAX_SIZE: 0}, DEFAULTS)
    assert resolve({POLICY: "ring"}, DEFAULTS).max_size == 104857600  # the default limit is a limit


# -- FlowDefaults --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("stop", "resume"), [(101, 70), (80, -1), (-1, -1), (80, 101), (80.0, 70), (80, "70"),
                                              (True, 0)])
def test_flow_defaults_refuse_bad_percentages(stop: object, resume: object) -> None:
    # qpidd's setDefaults: "Default queue flow ratios must be between 0 and 100, inclusive"
    with pytest.raises(SettingsError, match="percentage"):
        FlowDefaults(stop, resume)


def test_flow_defaults_refuse_resume_above_stop() -> None:
    # qpidd's setDefaults: "Default queue flow stop ratio must be >= flow resume ratio"
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
