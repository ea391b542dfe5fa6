"""The decisions of a trial, as pure functions: the split, the guard's judgement, the shadow comparison."""

from __future__ import annotations

import numpy as np
import pytest
from click.exceptions import BadParameter

from inferd.cli.common import Duration
from inferd.config import CanaryGuard
from inferd.ipc.messages import TensorRef
from inferd.supervisor.dispatch.shadow import compare
from inferd.supervisor.shared.candidates import Candidate, Mode, Split
from inferd.supervisor.shared.stats import Series
from inferd.supervisor.versions.canary import P99_MIN_OK, judge


@pytest.mark.parametrize("weight", [0, 3, 10, 50, 97, 100])
def test_the_split_keeps_the_candidates_share_of_samples_at_its_weight(weight):
    split = Split(Candidate("v2", Mode.CANARY, weight, False, None, 0.0))
    sizes = np.random.default_rng(weight).integers(1, 9, 2000)
    taken = sum(int(size) for size in sizes if split.take(int(size)))
    assert abs(taken / sizes.sum() - weight / 100) <= 8 / sizes.sum() + 1e-9, "within one batch of the weight"
    assert split.share() == taken / sizes.sum()


def series(ok: int, internal: int = 0, latency_s: float = 0.01) -> Series:
    made = Series()
    made.replies["ok"], made.replies["internal"] = ok, internal
    made.total.add(latency_s, ok)
    return made


def test_the_guard_waits_for_enough_replies_then_judges_errors_against_the_live_versions():
    guard = CanaryGuard(min_requests=20, max_error_increase=0.05)
    assert judge(guard, series(10, 9), series(1000)).verdict == "waiting"
    failing = judge(guard, series(15, 5), series(1000, 10))
    assert failing.verdict == "failing" and "25.0%, exceeds the live version's 1.0%" in failing.reason
    slow = series(15)
    slow.replies["timeout"] = 5
    assert judge(guard, slow, series(1000)).verdict == "failing", "a timeout is a failure too"
    assert judge(guard, series(190, 10), series(1000, 10)).verdict == "clean", "5 % against 1 %: within the margin"
    assert judge(guard, series(150, 50), series(100, 30)).verdict == "clean", "the live version fails as often"
    waiting = judge(guard, series(19, 1), series(1000, 10))
    assert waiting.verdict == "waiting" and "p99s are compared once" in waiting.reason, "no promotion unjudged"


def test_the_guard_compares_p99_only_once_each_side_has_enough_ok_replies():
    guard = CanaryGuard(min_requests=20, max_p99_increase=0.5)
    slow, fast = series(P99_MIN_OK, latency_s=0.1), series(P99_MIN_OK, latency_s=0.01)
    failing = judge(guard, slow, fast)
    assert failing.verdict == "failing" and "p99 latency" in failing.reason
    assert judge(guard, series(P99_MIN_OK - 1, latency_s=0.1), fast).verdict == "waiting"
    assert judge(guard, series(P99_MIN_OK, latency_s=0.014), fast).verdict == "clean", "40 % slower is within 50 %"
    quick, quicker = series(P99_MIN_OK, latency_s=0.002), series(P99_MIN_OK, latency_s=0.001)
    assert judge(guard, quick, quicker).verdict == "clean", "twice as slow, but by 1 ms: under the 5 ms floor"
    assert judge(CanaryGuard(min_p99_increase_ms=0.5), quick, quicker).verdict == "failing"


def refs_and_bytes(array: np.ndarray) -> list:
    return [(TensorRef("float32", array.shape, 0), array.tobytes())]


def test_the_comparison_counts_requests_whose_outputs_all_agree_and_the_largest_differences():
    live = np.arange(12, dtype=np.float32).reshape(6, 2) + 1
    same = live.copy()
    assert compare(refs_and_bytes(live), [(r, memoryview(b)) for r, b in refs_and_bytes(same)], (1, 3, 2)) \
        .allclose == 3
    other = live.copy()
    other[2, 1] += 0.5  # in the second request (rows 1 to 3)
    comparison = compare(refs_and_bytes(live), [(r, memoryview(b)) for r, b in refs_and_bytes(other)], (1, 3, 2))
    assert comparison.allclose == 2 and comparison.max_abs == pytest.approx(0.5)
    assert comparison.max_rel == pytest.approx(0.5 / live[2, 1])
    wide = np.zeros((6, 3), dtype=np.float32)
    mismatch = compare(refs_and_bytes(live), [(r, memoryview(b)) for r, b in refs_and_bytes(wide)], (1, 3, 2))
    assert not mismatch.comparable and mismatch.allclose == 0


def test_a_candidate_survives_its_trip_through_the_state_file_and_a_bad_one_says_why():
    candidate = Candidate("v3", Mode.SHADOW, 5.0, False, None, 1234.5)
    assert Candidate.from_json(candidate.to_json()) == candidate
    with pytest.raises(ValueError, match="weight is a percentage from 0 to 100, not 150"):
        Candidate.from_json({**candidate.to_json(), "weight": 150})
    with pytest.raises(ValueError, match="unreadable"):
        Candidate.from_json({"version": "v3"})


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("10m", 600), ("1h30m", 5400), ("1.5h", 5400)])
def test_durations_read_as_people_write_them(text, seconds):
    assert Duration().convert(text, None, None) == seconds


@pytest.mark.parametrize("text", ["soon", "", "0", "-5m", "m"])
def test_a_duration_that_is_not_one_is_refused(text):
    with pytest.raises(BadParameter):
        Duration().convert(text, None, None)
