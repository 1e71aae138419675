"""`tierq bench curves` (benchmarks/curves.py): the fitted growth of a cost against size,
and the command's refusals."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from benchmarks.curves import curve, growth
from tierq.cli.main import app

SIZES = [10**3, 10**4, 10**5, 10**6, 10**7]


def test_a_flat_cost_is_flat_and_a_linear_one_linear() -> None:
    flat = growth([(x, 5.0) for x in SIZES])
    assert flat["exponent"] == 0 and flat["verdict"] == "flat"
    assert flat["last_step"] == {"size_x": 10.0, "cost_x": 1.0}
    linear = growth([(x, x / 1000) for x in SIZES])
    assert linear["exponent"] == pytest.approx(1.0) and linear["verdict"] == "linear or worse"
    root = growth([(x, math.sqrt(x)) for x in SIZES])
    assert root["exponent"] == pytest.approx(0.5) and root["verdict"] == "grows as size^0.50"


def test_a_logarithmic_cost_reads_as_slow_growth_shrinking_at_the_end() -> None:
    fitted = growth([(x, math.log(x)) for x in SIZES])
    assert growth([(x, math.log(x)) for x in (10, 100, 1000, 10**4, 10**5)])["verdict"] == (
        "logarithmic or slower"
    )
    assert 0.05 <= fitted["exponent"] < 0.25 and fitted["verdict"] == "logarithmic or slower"
    assert fitted["last_step"]["cost_x"] == pytest.approx(7 / 6, abs=1e-3)


def test_points_without_a_cost_are_left_out() -> None:
    assert growth([(1000, 1.0)])["exponent"] is None
    rows = [
        {"n": 1000, "ms": 2.0},
        {"n": 10_000, "ms": None},
        {"n": 100_000, "ms": 2.0},
        {"n": 1_000_000, "ms": 0.0},
    ]
    got = curve(rows, "n", "ms")
    assert got["points"] == [[1000.0, 2.0], [100000.0, 2.0], [1000000.0, 0.0]]
    assert got["exponent"] == 0 and got["last_step"]["size_x"] == 100.0


@pytest.mark.parametrize(
    "args",
    [
        ["--parts", "ledger,nope"],
        ["--ledger-sizes", "1e4,1e3"],
        ["--queue-lengths", "0,10"],
        ["--tenant-counts", "ten"],
        ["--streams", "1000"],
    ],
)
def test_the_command_refuses_bad_options(args: list[str]) -> None:
    assert CliRunner().invoke(app, ["bench", "curves", *args]).exit_code == 2
