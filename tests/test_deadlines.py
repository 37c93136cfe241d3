import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sloweave.core.deadlines import DeadlineTracker


def test_earliest_deadline_and_budget():
    tracker = DeadlineTracker(default_tpot_ms=25.0)
    assert tracker.budget_ms(0.0) == math.inf
    tracker.add("a", last_token_ms=100.0)
    tracker.add("b", last_token_ms=90.0, tpot_ms=50.0)
    assert tracker.earliest_deadline_ms() == 125.0
    assert tracker.budget_ms(110.0) == 15.0
    tracker.on_token("a", 130.0)
    assert tracker.earliest_deadline_ms() == 140.0  # b: 90 + 50
    tracker.remove("b")
    assert tracker.earliest_deadline_ms() == 155.0
    assert tracker.budget_ms(200.0) == 0.0  # already late: budget clamps at zero
    tracker.remove("a")
    assert tracker.earliest_deadline_ms() == math.inf and len(tracker) == 0


def test_bad_targets_and_ids():
    with pytest.raises(ValueError, match="default_tpot_ms"):
        DeadlineTracker(0)
    tracker = DeadlineTracker(25.0)
    with pytest.raises(ValueError, match="tpot_ms"):
        tracker.add("x", 0.0, tpot_ms=-3)
    tracker.add("x", 0.0)
    with pytest.raises(ValueError, match="already tracked"):
        tracker.add("x", 0.0)
    with pytest.raises(KeyError):
        tracker.on_token("missing", 1.0)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(st.sampled_from(["add", "token", "remove"]), st.integers(0, 9), st.floats(0, 1e4), st.floats(1, 100)),
        max_size=300,
    )
)
def test_heap_matches_brute_force_minimum(operations):
    tracker = DeadlineTracker(25.0)
    reference: dict[int, tuple[float, float]] = {}  # id -> (last token, target)
    for op, rid, t, target in operations:
        if op == "add" and rid not in reference:
            tracker.add(rid, t, target)
            reference[rid] = (t, target)
        elif op == "token" and rid in reference:
            tracker.on_token(rid, t)
            reference[rid] = (t, reference[rid][1])
        elif op == "remove":
            tracker.remove(rid)
            reference.pop(rid, None)
        expected = min((last + d for last, d in reference.values()), default=math.inf)
        assert tracker.earliest_deadline_ms() == expected
        assert len(tracker._heap) <= 4 * len(reference) + 65  # lazy deletion stays bounded


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["emit", "remove"]),
            st.lists(st.integers(0, 9), max_size=6),
            st.floats(0, 1e4),
        ),
        max_size=200,
    ),
    st.dictionaries(st.integers(0, 9), st.sampled_from([10.0, 25.0, 40.0])),
)
def test_batched_emits_match_brute_force_minimum(operations, own_targets):
    """An engine step's tokens come as one batch (one heap entry per target): the earliest
    deadline is still the minimum over requests, whatever order batches and removals come in."""
    tracker = DeadlineTracker(25.0)
    reference: dict[int, float] = {}  # id -> deadline
    for op, ids, t in operations:
        if op == "emit":
            tracker.emit(ids, t, own_targets.get)
            for rid in ids:
                reference[rid] = t + own_targets.get(rid, 25.0)
        else:
            for rid in ids:
                tracker.remove(rid)
                reference.pop(rid, None)
        assert tracker.earliest_deadline_ms() == min(reference.values(), default=math.inf)
        assert all(tracker.deadline_of(rid) == d for rid, d in reference.items())
        assert len(tracker._heap) <= 4 * len(reference) + 65


def test_a_bad_target_in_a_batch_changes_nothing():
    tracker = DeadlineTracker(25.0)
    tracker.emit(["a"], 0.0)
    with pytest.raises(ValueError, match="tpot_ms of request 'b'"):
        tracker.emit(["a", "b"], 10.0, {"b": -1.0}.get)
    assert "b" not in tracker and tracker.earliest_deadline_ms() == 25.0
