"""The schedules' specification, written independently of the modules under test: the
actions each rank must run, their data dependencies and durations, a cycle check, and
what a simulated timeline must look like. Shared by `test_schedules.py` and
`test_schedule_simulator.py` (and `accepted` by the partition tests).

Backwards are either whole ("B") or, in zero-bubble schedules, split into "I" (input
gradient, which the previous stage waits for) and "W" (weight gradient, which nobody
waits for); each half takes half of the backward time."""

from __future__ import annotations

from collections import Counter

import pytest

from planaria.templates.schedules import Action, check_schedule_shape


def accepted(name, p, v, m):
    try:
        check_schedule_shape(name, p, v, m)
    except ValueError:
        return False
    return True


def virtual_stage_counts(name):
    return range(1, 5) if name == "interleaved" else (1,)


SPLIT_BACKWARD_SCHEDULES = ("zb1f1b",)


def action_kinds(name):
    """The kinds schedule `name` runs: forward plus whole or split backward."""
    return "FIW" if name in SPLIT_BACKWARD_SCHEDULES else "FB"


def expected_actions(p, v, m, kinds="FB"):
    """Per rank, every action it must run exactly once."""
    return {
        rank: Counter(
            Action(chunk * p + rank, kind, mb)
            for chunk in range(v)
            for kind in kinds
            for mb in range(m)
        )
        for rank in range(p)
    }


def dependencies(action, num_stages):
    """The spec's data dependencies, written independently of the module.

    A schedule never mixes B with I/W, so an action's own kind says which backward
    its downstream gradient comes from.
    """
    if action.kind == "F":
        return [Action(action.stage - 1, "F", action.microbatch)] if action.stage else []
    if action.kind == "W":
        return [Action(action.stage, "I", action.microbatch)]
    deps = [Action(action.stage, "F", action.microbatch)]
    if action.stage + 1 < num_stages:
        deps.append(Action(action.stage + 1, action.kind, action.microbatch))
    return deps


def duration(action, v, tf, tb):
    if action.kind == "F":
        return tf / v
    return (tb if action.kind == "B" else tb / 2) / v


def has_cycle(schedule, num_stages):
    """Kahn's algorithm over rank-order edges plus dependency edges."""
    edges = {a: [] for actions in schedule.values() for a in actions}
    indegree = Counter()
    for actions in schedule.values():
        for before, after in zip(actions, actions[1:]):
            edges[before].append(after)
            indegree[after] += 1
    for action in edges:
        for dep in dependencies(action, num_stages):
            edges[dep].append(action)
            indegree[action] += 1
    ready = [a for a in edges if indegree[a] == 0]
    done = 0
    while ready:
        action = ready.pop()
        done += 1
        for nxt in edges[action]:
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                ready.append(nxt)
    return done < len(edges)


def assert_timeline_obeys_spec(schedule, result, p, v, tf, tb):
    """Each rank runs its list in order, one at a time, each action as early as allowed."""
    ends = {action: end for events in result.timeline.values() for _, end, action in events}
    for rank, events in result.timeline.items():
        assert [action for _, _, action in events] == schedule[rank]
        previous_end = 0.0
        for start, end, action in events:
            assert end - start == pytest.approx(duration(action, v, tf, tb))
            earliest = max([previous_end] + [ends[d] for d in dependencies(action, p * v)])
            assert start == pytest.approx(earliest)
            previous_end = end
    assert result.makespan == pytest.approx(max(ends.values()))
