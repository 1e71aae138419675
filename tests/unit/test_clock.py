"""The one clock's readings (tierq/core/clock.py): the fastest round trip of a measurement,
and a sloppy reading never taken over a precise recent one."""

from __future__ import annotations

import pytest

from tierq.core import clock


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("_offset", 0.0), ("_measured_at", None), ("_round_trip", 0.0)):
        monkeypatch.setattr(clock, name, value)
    monkeypatch.setattr(clock, "_tried_at", None)


def test_a_measurement_keeps_its_fastest_round_trip() -> None:
    # (sent, Redis' time, received): Redis 100 s ahead; the slow reading would say 99.5.
    readings = [(10.0, 111.0, 12.0), (20.0, 120.002, 20.004), (30.0, 130.5, 30.0)]
    offset, round_trip = clock._take(readings[:2])
    assert offset == pytest.approx(100.0) and round_trip == pytest.approx(0.004)


def test_a_sloppy_reading_is_not_taken_over_a_precise_recent_one() -> None:
    assert clock._keep((100.0, 0.002)) == 100.0
    assert clock._keep((90.0, 0.5)) == 100.0  # half a second of doubt: the old one stays
    assert clock.offset() == 100.0
    assert clock._keep((100.004, 0.003)) == pytest.approx(100.004)  # as precise: taken
    assert clock.now() == pytest.approx(clock.time.time() + 100.004, abs=0.01)
