"""The schedule simulator's own behaviour: hand-computed timelines, deadlock detection
exactly when orders and dependencies form a cycle, and broken schedules refused with
every blocked action or the missing one named."""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from planaria.templates.schedule_simulator import ScheduleDeadlock, simulate
from planaria.templates.schedules import SCHEDULES, Action, build_schedule, format_schedule
from tests.templates.schedule_spec import (
    accepted,
    action_kinds,
    assert_timeline_obeys_spec,
    dependencies,
    expected_actions,
    has_cycle,
    virtual_stage_counts,
)


# --- the simulator itself ----------------------------------------------------


def test_simulated_1f1b_on_two_ranks_matches_hand_computed_timeline():
    schedule = build_schedule("1f1b", 2, 1, 2)
    assert format_schedule(schedule).splitlines() == [
        "rank 0: 0F0 0F1 0B0 0B1",
        "rank 1: 1F0 1B0 1F1 1B1",
    ]
    result = simulate(schedule, 2, 1, 2, forward_time=1.0, backward_time=2.0)
    spans = {r: [(s, e, str(a)) for s, e, a in events] for r, events in result.timeline.items()}
    assert spans == {
        0: [(0, 1, "0F0"), (1, 2, "0F1"), (4, 6, "0B0"), (7, 9, "0B1")],
        1: [(1, 2, "1F0"), (2, 4, "1B0"), (4, 5, "1F1"), (5, 7, "1B1")],
    }
    assert result.makespan == 9
    assert result.busy_time == {0: 6, 1: 6}
    assert result.bubble_fraction == pytest.approx(0.5)


def test_chunk_times_are_a_fraction_of_the_rank_times():
    result = simulate(build_schedule("interleaved", 1, 4, 1), 1, 4, 1, 2.0, 4.0)
    durations = {str(a): e - s for s, e, a in result.timeline[0]}
    assert durations["0F0"] == pytest.approx(0.5)
    assert durations["3B0"] == pytest.approx(1.0)


@st.composite
def shapes(draw):
    name = draw(st.sampled_from(SCHEDULES))
    p = draw(st.integers(1, 4))
    v = draw(st.sampled_from(list(virtual_stage_counts(name))))
    m = draw(st.integers(1, 5).filter(lambda m: accepted(name, p, v, m)))
    return name, p, v, m


@st.composite
def shuffled_schedules(draw):
    """Each rank's actions in a random order: mostly deadlocking."""
    name, p, v, m = draw(shapes())
    schedule = {r: draw(st.permutations(a)) for r, a in build_schedule(name, p, v, m).items()}
    return schedule, p, v, m


@st.composite
def topologically_ordered_schedules(draw):
    """A random order that respects every dependency, split per rank: never deadlocks."""
    name, p, v, m = draw(shapes())
    pending = [a for actions in expected_actions(p, v, m, action_kinds(name)).values()
               for a in actions]
    done, order = set(), []
    while pending:
        ready = [a for a in pending if all(d in done for d in dependencies(a, p * v))]
        action = ready[draw(st.integers(0, len(ready) - 1))]
        pending.remove(action)
        done.add(action)
        order.append(action)
    schedule = {r: [a for a in order if a.stage % p == r] for r in range(p)}
    return schedule, p, v, m


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.one_of(shuffled_schedules(), topologically_ordered_schedules()),
       st.sampled_from([1.0, 2.0, 3.0]))
def test_simulator_deadlocks_exactly_when_orders_and_dependencies_form_a_cycle(case, tb):
    schedule, p, v, m = case
    if has_cycle(schedule, p * v):
        event("deadlock")
        with pytest.raises(ScheduleDeadlock):
            simulate(schedule, p, v, m, 1.0, tb)
    else:
        event("runs")
        result = simulate(schedule, p, v, m, 1.0, tb)
        assert_timeline_obeys_spec(schedule, result, p, v, 1.0, tb)
        assert result.makespan >= max(result.busy_time.values()) - 1e-9


# --- 3. broken schedules -----------------------------------------------------


def test_swapped_warmups_deadlock_and_name_every_blocked_action():
    # Rank 0 takes rank 1's warmup (none) and rank 1 takes rank 0's (one forward):
    # rank 0 waits for a backward rank 1 only sends after a forward rank 0 never sends.
    schedule = {
        0: [Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "B", 1)],
        1: [Action(1, "F", 0), Action(1, "F", 1), Action(1, "B", 0), Action(1, "B", 1)],
    }
    with pytest.raises(ScheduleDeadlock) as info:
        simulate(schedule, 2, 1, 2)
    message = str(info.value)
    assert "rank 0: blocked at 0B0" in message and "waiting for 1B0" in message
    assert "rank 1: blocked at 1F1" in message and "waiting for 0F1" in message
    assert info.value.blocked == {0: Action(0, "B", 0), 1: Action(1, "F", 1)}


def test_backward_before_its_own_forward_deadlocks():
    schedule = {0: [Action(0, "B", 0), Action(0, "F", 0)], 1: [Action(1, "F", 0), Action(1, "B", 0)]}
    with pytest.raises(ScheduleDeadlock) as info:
        simulate(schedule, 2, 1, 1)
    message = str(info.value)
    assert "rank 0: blocked at 0B0" in message and "0F0" in message
    assert "rank 1: blocked at 1F0" in message
    assert isinstance(info.value, RuntimeError)


def test_missing_action_is_reported_as_incomplete():
    schedule = build_schedule("1f1b", 2, 1, 3)
    schedule[1].remove(Action(1, "B", 2))
    with pytest.raises(ValueError, match=r"incomplete.*1B2"):
        simulate(schedule, 2, 1, 3)


def test_duplicate_action_is_rejected():
    schedule = build_schedule("gpipe", 2, 1, 2)
    schedule[0].append(Action(0, "F", 1))
    with pytest.raises(ValueError, match="more than once"):
        simulate(schedule, 2, 1, 2)


def test_action_on_wrong_rank_is_rejected():
    schedule = build_schedule("1f1b", 2, 1, 2)
    schedule[0], schedule[1] = schedule[1], schedule[0]
    with pytest.raises(ValueError, match="belongs on rank 1"):
        simulate(schedule, 2, 1, 2)


def test_missing_rank_and_out_of_range_and_unknown_kind_are_rejected():
    schedule = build_schedule("1f1b", 2, 1, 2)
    with pytest.raises(ValueError, match="one action list per rank"):
        simulate({0: schedule[0]}, 2, 1, 2)
    with pytest.raises(ValueError, match="out of range"):
        simulate({0: schedule[0] + [Action(0, "F", 2)], 1: schedule[1]}, 2, 1, 2)
    with pytest.raises(ValueError, match="has kind 'X'"):
        simulate({0: schedule[0] + [Action(0, "X", 0)], 1: schedule[1]}, 2, 1, 2)


def test_mixing_whole_and_split_backwards_is_rejected():
    # 1B1 split into I and W while 0B0, 0B1, 1B0 stay whole: every action is accounted
    # for once, but the schedule mixes the two kinds of backward.
    schedule = build_schedule("1f1b", 2, 1, 2)
    i = schedule[1].index(Action(1, "B", 1))
    schedule[1][i:i + 1] = [Action(1, "I", 1), Action(1, "W", 1)]
    with pytest.raises(ValueError, match=r"mixes full backwards \(B\) with split ones"):
        simulate(schedule, 2, 1, 2)
    # The other way round: a split schedule with one whole backward added.
    schedule = build_schedule("zb1f1b", 2, 1, 2)
    schedule[0].append(Action(0, "B", 0))
    with pytest.raises(ValueError, match="mixes"):
        simulate(schedule, 2, 1, 2)


def test_split_backward_missing_its_weight_gradient_is_incomplete():
    schedule = build_schedule("zb1f1b", 2, 1, 3)
    schedule[0].remove(Action(0, "W", 2))
    with pytest.raises(ValueError, match=r"incomplete.*0W2"):
        simulate(schedule, 2, 1, 3)


def test_weight_gradient_before_its_input_gradient_deadlocks():
    schedule = {0: [Action(0, "F", 0), Action(0, "W", 0), Action(0, "I", 0)]}
    with pytest.raises(ScheduleDeadlock) as info:
        simulate(schedule, 1, 1, 1)
    assert "rank 0: blocked at 0W0" in str(info.value) and "waiting for 0I0" in str(info.value)
