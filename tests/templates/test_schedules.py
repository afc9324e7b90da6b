"""Pipeline schedules as data: shapes, deadlock freedom, bubble and memory of the builders.
(The simulator's own behaviour: `test_schedule_simulator.py`; the spec both check
against: `schedule_spec.py`.)"""

from __future__ import annotations

from collections import Counter

import pytest

from planaria.templates.schedule_simulator import simulate
from planaria.templates.schedules import (
    SCHEDULES,
    Action,
    build_schedule,
    check_schedule_shape,
    format_schedule,
)
from tests.templates.schedule_spec import (
    accepted,
    action_kinds,
    assert_timeline_obeys_spec,
    expected_actions,
    has_cycle,
    virtual_stage_counts,
)


# --- 1. every accepted shape: complete and deadlock-free ---------------------


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p", range(1, 7))
def test_every_accepted_shape_is_complete_and_deadlock_free(name, p):
    simulated = 0
    for v in virtual_stage_counts(name):
        for m in range(1, 17):
            if not accepted(name, p, v, m):
                continue
            schedule = build_schedule(name, p, v, m)
            kinds = action_kinds(name)
            assert {r: Counter(a) for r, a in schedule.items()} == expected_actions(p, v, m, kinds)
            assert not has_cycle(schedule, p * v)
            result = simulate(schedule, p, v, m)  # raises ScheduleDeadlock on a hang
            assert_timeline_obeys_spec(schedule, result, p, v, 1.0, 2.0)
            assert sum(len(e) for e in result.timeline.values()) == len(kinds) * p * v * m
            # Every rank does the same work: m microbatches of forward and backward.
            assert result.busy_time == pytest.approx({r: 3.0 * m for r in range(p)})
            simulated += 1
    assert simulated > 0


def test_interleaved_accepts_few_microbatches_and_multiples_of_ranks():
    for p in range(1, 7):
        for m in list(range(1, p + 1)) + [2 * p, 3 * p]:
            check_schedule_shape("interleaved", p, 3, m)


# --- 2. bubble ---------------------------------------------------------------


@pytest.mark.parametrize("backward_time", [2.0, 1.0])
@pytest.mark.parametrize("p", range(2, 7))
def test_interleaved_bubble_is_ranks_minus_one_over_chunks_times_microbatches(p, backward_time):
    for v in range(1, 5):
        for m in (p, 2 * p, 3 * p, 4 * p):
            result = simulate(build_schedule("interleaved", p, v, m), p, v, m, 1.0, backward_time)
            assert abs(result.bubble_fraction - (p - 1) / (v * m)) < 1e-9, (v, m)
            # Megatron: the bubble is (p-1)(tf+tb)/v per rank.
            ideal = m * (1.0 + backward_time)
            assert result.makespan == pytest.approx(ideal + (p - 1) * (1.0 + backward_time) / v)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("backward_time", [2.0, 1.0])
def test_gpipe_and_1f1b_bubble_is_ranks_minus_one_over_microbatches(name, backward_time):
    for p in range(2, 7):
        for m in range(1, 17):
            result = simulate(build_schedule(name, p, 1, m), p, 1, m, 1.0, backward_time)
            assert abs(result.bubble_fraction - (p - 1) / m) < 1e-9, (p, m)


def test_busy_time_is_the_same_on_every_rank():
    result = simulate(build_schedule("interleaved", 4, 3, 8), 4, 3, 8, 1.0, 2.0)
    assert result.busy_time == pytest.approx({r: 8 * 3.0 for r in range(4)})


def test_single_rank_has_no_bubble():
    for name in SCHEDULES:
        for v in virtual_stage_counts(name):
            assert simulate(build_schedule(name, 1, v, 5), 1, v, 5).bubble_fraction == pytest.approx(0.0)


# --- 4. bad shapes -----------------------------------------------------------


@pytest.mark.parametrize(
    "args, fragments",
    [
        (("zb", 2, 1, 4), ["unknown schedule 'zb'", "gpipe, 1f1b, interleaved, zb1f1b"]),
        (("zb1f1b", 2, 2, 4), ["use schedule 'interleaved' for virtual_stages > 1"]),
        (("zb1f1b", 2, 1, 0), ["num_microbatches must be a positive integer"]),
        (("1f1b", 0, 1, 4), ["num_ranks must be a positive integer", "got 0"]),
        (("gpipe", 2, -1, 4), ["virtual_stages must be a positive integer"]),
        (("interleaved", 2, 2, 0), ["num_microbatches must be a positive integer"]),
        (("1f1b", 2, 1, True), ["num_microbatches must be a positive integer"]),
        (("gpipe", 2, 2, 4), ["use schedule 'interleaved' for virtual_stages > 1"]),
        (("1f1b", 4, 3, 8), ["use schedule 'interleaved' for virtual_stages > 1"]),
        (("interleaved", 4, 2, 9), ["num_microbatches=9", "use num_microbatches=8 or 10"]),
        (("interleaved", 4, 2, 13), ["use num_microbatches=12 or 15", "multiple of num_ranks"]),
        (("interleaved", 2, 3, 5), ["use num_microbatches=4 or 6"]),
    ],
)
def test_bad_shapes_name_the_fix(args, fragments):
    for call in (check_schedule_shape, build_schedule):
        with pytest.raises(ValueError) as info:
            call(*args)
        for fragment in fragments:
            assert fragment in str(info.value)


def test_suggested_microbatch_counts_are_accepted():
    for p in range(2, 7):
        for m in range(1, 40):
            if accepted("interleaved", p, 2, m):
                continue
            with pytest.raises(ValueError) as info:
                check_schedule_shape("interleaved", p, 2, m)
            below, above = str(info.value).split("use num_microbatches=")[1].split(" (")[0].split(" or ")
            assert int(below) < m < int(above)
            assert accepted("interleaved", p, 2, int(below))
            assert accepted("interleaved", p, 2, int(above))
            assert all(not accepted("interleaved", p, 2, k) for k in range(int(below) + 1, int(above)))


# --- 5. memory -----------------------------------------------------------------


def max_in_flight(actions):
    """Most microbatches a rank holds activations for: forwarded, and whose backward (for
    split backwards, whose W: the weight gradient still needs the layer inputs) is not
    yet done. I frees nothing."""
    in_flight = peak = 0
    for action in actions:
        in_flight += {"F": 1, "B": -1, "I": 0, "W": -1}[action.kind]
        peak = max(peak, in_flight)
    return peak


def test_1f1b_keeps_at_most_ranks_to_go_microbatches_in_flight():
    for p in range(1, 7):
        for m in range(1, 17):
            schedule = build_schedule("1f1b", p, 1, m)
            for rank, actions in schedule.items():
                assert max_in_flight(actions) == min(p - rank, m), (p, m, rank)


def test_interleaved_holds_megatron_warmup_plus_one_chunk_microbatches():
    # Same footprint as Megatron's and torch's interleaved 1F1B: the last rank holds one
    # round of every chunk but the last, and each rank upstream two more.
    for p in range(1, 7):
        for v in range(1, 5):
            for m in (1, p, 2 * p, 3 * p):
                per_round = m // max(1, m // p)
                schedule = build_schedule("interleaved", p, v, m)
                for rank, actions in schedule.items():
                    warmup = (v - 1) * per_round + 2 * (p - 1 - rank)
                    assert max_in_flight(actions) == min(warmup + 1, m * v), (p, v, m, rank)


def test_gpipe_holds_every_microbatch():
    schedule = build_schedule("gpipe", 3, 1, 5)
    assert [max_in_flight(a) for a in schedule.values()] == [5, 5, 5]


# --- formatting ----------------------------------------------------------------


def test_action_prints_compactly_and_schedule_prints_one_line_per_rank():
    assert str(Action(1, "F", 0)) == "1F0"
    text = format_schedule(build_schedule("interleaved", 3, 2, 3))
    lines = text.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("rank 0: 0F0 0F1 0F2 3F0")
    assert all(f"{r}B2" in line and f"{r + 3}B2" in line for r, line in enumerate(lines))


# --- 6. zb1f1b: 1F1B with split backward ----------------------------------------


def zb1f1b_shapes():
    """p in 2..6 with m a multiple of p up to 4p, and every m < p."""
    for p in range(2, 7):
        for m in list(range(1, p)) + [p, 2 * p, 3 * p, 4 * p]:
            yield p, m


@pytest.mark.parametrize("backward_time", [2.0, 1.0, 3.0])
def test_zb1f1b_never_deadlocks(backward_time):
    for p, m in zb1f1b_shapes():
        schedule = build_schedule("zb1f1b", p, 1, m)
        assert {r: Counter(a) for r, a in schedule.items()} == expected_actions(p, 1, m, "FIW")
        assert not has_cycle(schedule, p), (p, m)
        result = simulate(schedule, p, 1, m, 1.0, backward_time)  # raises on a hang
        assert_timeline_obeys_spec(schedule, result, p, 1, 1.0, backward_time)


def test_zb1f1b_bubble_is_two_thirds_of_1f1b():
    # forward 1, backward 2 makes F = I = W = 1: the bubble is 2(p-1) units in 3m.
    for p in range(2, 7):
        for m in range(p, 4 * p + 1):
            result = simulate(build_schedule("zb1f1b", p, 1, m), p, 1, m, 1.0, 2.0)
            assert result.bubble_fraction == pytest.approx(2 * (p - 1) / (3 * m), abs=1e-12), (p, m)
            assert result.makespan == pytest.approx(3 * m + 2 * (p - 1)), (p, m)


def test_zb1f1b_bubble_is_smaller_than_1f1b():
    for p in range(2, 7):
        for m in range(1, 17):
            zb = simulate(build_schedule("zb1f1b", p, 1, m), p, 1, m, 1.0, 2.0)
            plain = simulate(build_schedule("1f1b", p, 1, m), p, 1, m, 1.0, 2.0)
            assert zb.bubble_fraction < plain.bubble_fraction - 1e-9, (p, m)


def test_zb1f1b_keeps_1f1b_activation_bound():
    # On rank r, microbatches forwarded whose W is not done never exceed p - r.
    for p in range(1, 7):
        for m in range(1, 17):
            schedule = build_schedule("zb1f1b", p, 1, m)
            for rank, actions in schedule.items():
                assert max_in_flight(actions) <= p - rank, (p, m, rank)


def test_zb1f1b_runs_each_weight_gradient_after_its_input_gradient():
    for p in range(1, 7):
        for m in range(1, 17):
            for rank, actions in build_schedule("zb1f1b", p, 1, m).items():
                position = {a: i for i, a in enumerate(actions)}
                for mb in range(m):
                    f, i, w = (position[Action(rank, kind, mb)] for kind in "FIW")
                    assert f < i < w, (p, m, rank, mb)


def test_zb1f1b_on_one_rank_has_no_bubble():
    for m in range(1, 9):
        for backward_time in (1.0, 2.0, 3.0):
            result = simulate(build_schedule("zb1f1b", 1, 1, m), 1, 1, m, 1.0, backward_time)
            assert result.bubble_fraction == pytest.approx(0.0)
            assert result.makespan == pytest.approx(m * (1.0 + backward_time))


def test_simulated_zb1f1b_on_two_ranks_matches_hand_computed_timeline():
    # I and W take half the backward each; 0I0 waits for 1I0 (not 1W0), and rank 1 fills
    # what would be 1F1B's wait with its W.
    schedule = build_schedule("zb1f1b", 2, 1, 2)
    assert format_schedule(schedule).splitlines() == [
        "rank 0: 0F0 0F1 0I0 0W0 0I1 0W1",
        "rank 1: 1F0 1I0 1W0 1F1 1I1 1W1",
    ]
    result = simulate(schedule, 2, 1, 2, forward_time=1.0, backward_time=2.0)
    spans = {r: [(s, e, str(a)) for s, e, a in events] for r, events in result.timeline.items()}
    assert spans == {
        0: [(0, 1, "0F0"), (1, 2, "0F1"), (3, 4, "0I0"), (4, 5, "0W0"), (6, 7, "0I1"), (7, 8, "0W1")],
        1: [(1, 2, "1F0"), (2, 3, "1I0"), (3, 4, "1W0"), (4, 5, "1F1"), (5, 6, "1I1"), (6, 7, "1W1")],
    }
    assert result.makespan == 8
    assert result.bubble_fraction == pytest.approx(1 / 3)
