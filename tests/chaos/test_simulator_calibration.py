"""The simulator's scale curves (`planaria.chaos.simulator.calibration`): the control
plane's cost by nodes and the communicators' by GPUs go through their tables' points and
never fall as the job grows, a number makes them flat, and `planaria simulate` charges a
larger job's reconfigurations more."""
from __future__ import annotations

import json

import pytest

from planaria.chaos.simulator.calibration import (AXES, COMMUNICATOR_POINTS, CONTROL_PLANE_POINTS, Calibration,
                                                  ScaleCurve)
from planaria.cli import main

SIZES = [2 ** (k / 4) for k in range(4 * 21)]  # 1 to a million, four a doubling


def _non_decreasing(curve: ScaleCurve) -> bool:
    values = [curve(size) for size in SIZES]
    return all(b >= a for a, b in zip(values, values[1:]))


def test_the_models_go_through_their_points_and_never_fall_as_the_job_grows():
    cal = Calibration()
    for curve, table in ((cal.control_s, CONTROL_PLANE_POINTS), (cal.regroup_s, COMMUNICATOR_POINTS)):
        for point in table:
            assert curve(point.size) == pytest.approx(point.seconds), point.source
        assert _non_decreasing(curve)
    # The communicators' cost grows with the GPUs; below the smallest published size it
    # is that size's figure, not less.
    assert cal.regroup_s(1) == cal.regroup_s(8) == pytest.approx(2.46)
    assert cal.regroup_s(64) < cal.regroup_s(1024) < cal.regroup_s(16384) < cal.regroup_s(200_000)


@pytest.mark.parametrize("axis, between", [("log2", 2.0), ("linear", 1 + 2 * 4 / 12)])
def test_a_curve_is_linear_on_its_axis_flat_below_and_follows_its_last_slope_beyond(axis, between):
    curve = ScaleCurve(((4, 1.0), (16, 3.0), (64, 4.0)), axis=axis)
    assert curve(8) == pytest.approx(between)
    assert curve(2) == curve(4) == 1.0
    # Beyond 64 the slope of the 16-64 segment: one more second per doubling (log2), or
    # per 48 more (linear).
    assert curve(256 if axis == "log2" else 112) == pytest.approx(5.0)
    assert _non_decreasing(curve)


@pytest.mark.parametrize("points", [((64, 1.0), (4, 2.0)), ((4, 2.0), (64, 1.0)), ((4, 1.0), (4, 2.0)),
                                    ((0, 1.0),), ((4, -1.0),), ()])
def test_a_table_that_would_make_a_curve_fall_or_go_negative_is_refused(points):
    for axis in AXES:
        with pytest.raises(ValueError):
            ScaleCurve(points, axis=axis)


def test_a_number_makes_a_curve_flat():
    for cal in (Calibration(control_s=0.5, regroup_s=2), Calibration().with_overrides(["control_s=0.5",
                                                                                         "regroup_s=2"])):
        assert {cal.control_s(n) for n in SIZES} == {0.5}
        assert {cal.regroup_s(w) for w in SIZES} == {2.0}
    points = Calibration().with_overrides(["control_s=4:0.75,1024:3"]).control_s
    assert points(4) == 0.75 and points(32) == pytest.approx(0.75 + 2.25 * 3 / 8) and points(1024) == 3.0


def test_the_cli_takes_a_flat_value_or_points_and_reports_them(capsys):
    args = ["simulate", "--trace", "synthetic:1h", "--model", "gpt3-2.7b", "--hardware", "v100",
            "--policy", "planaria", "--json"]
    assert main([*args, "--set", "regroup_s=2", "--set", "control_s=4:0.75,1024:3"]) == 0
    calibration = json.loads(capsys.readouterr().out)["calibration"]
    assert calibration["regroup_s"] == 2.0
    assert calibration["control_s"] == {"per": "nodes", "axis": "log2", "points": [[4.0, 0.75], [1024.0, 3.0]]}
    assert main([*args, "--set", "control_s=64:1,4:2"]) == 2
    assert "must rise" in capsys.readouterr().err
    assert main([*args, "--set", "regroup_s=-1"]) == 2
    assert "regroup_s" in capsys.readouterr().err


def _downtime_per_change(nodes: int, capsys, *sets: str) -> float:
    args = ["simulate", "--trace", "synthetic:1h", "--nodes", str(nodes), "--model", "gpt3-2.7b",
            "--hardware", "a100", "--policy", "planaria", "--json"]
    assert main([*args, *(f"--set={s}" for s in sets)]) == 0
    planaria = json.loads(capsys.readouterr().out)["policies"]["planaria"]
    return planaria["downtime_s"] / planaria["reconfigurations"]


def test_a_larger_job_pays_more_for_each_reconfiguration(capsys):
    """The same market (a node lost every hour) on 16 and on 256 eight-GPU nodes: each loss
    costs the larger job more, by its communicators' creation across 16 times the GPUs. With
    the curves made flat the two pay the same, within the planner's measured time."""
    small, large = _downtime_per_change(16, capsys), _downtime_per_change(256, capsys)
    assert large > small + 1.0
    flat = ("control_s=0.75", "regroup_s=2.46")
    assert _downtime_per_change(256, capsys, *flat) == pytest.approx(_downtime_per_change(16, capsys, *flat),
                                                                     abs=0.3)
