"""`tierq bench peers` (benchmarks/peers.py): the seeded trace, the figures of a run and
the verdicts against vLLM's priority scheduling, from made-up outcomes (no server)."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
from typer.testing import CliRunner

from benchmarks import peers
from benchmarks.peers import Outcome, PeersConfig, Request
from tierq.cli.main import app

CFG = PeersConfig(duration_s=60.0, interactive_rate=1.0, standard_rate=0.2)


def test_the_trace_is_seeded_bounded_and_holds_the_backlog_it_names() -> None:
    a = peers.trace(CFG, 3.0, 50.0)
    assert a == peers.trace(CFG, 3.0, 50.0)  # the same requests at the same times
    assert a != peers.trace(dataclasses.replace(CFG, seed=1), 3.0, 50.0)
    batch = [r for r in a if r.kind == "batch"]
    # 3 x 50 tokens/s x 60 s of 64-token requests, all at the start
    assert len(batch) == 141 and {r.at for r in batch} == {0.0}
    assert sum(r.max_tokens for r in batch) >= 3 * 50 * 60
    standard = [r.at for r in a if r.kind == "standard"]
    assert standard == [2.5 + 5 * i for i in range(12)]  # steady, every 1/rate s
    inter = [r for r in a if r.kind == "interactive"]
    assert 35 <= len(inter) <= 90 and all(0 < r.at < 60 for r in inter)
    assert [r.at for r in a] == sorted(r.at for r in a)
    assert len({r.prompt for r in a}) == len(a)  # no two share a prompt
    assert len(peers.trace(CFG, 1.5, 50.0)) < len(a)
    # The chats and standard requests do not move with a measured capacity (the backlog).
    slower = peers.trace(CFG, 3.0, 40.0)
    assert len(slower) < len(a)
    assert [r for r in slower if r.kind != "batch"] == [r for r in a if r.kind != "batch"]


def _out(kind: str, sent: float, ttft: float | None, end: float | None, **kw: object) -> Outcome:
    expected = {"interactive": 16, "standard": 64, "batch": 64}[kind]
    first = None if ttft is None else sent + ttft
    tokens = kw.pop("tokens", expected if end is not None else None)
    return Outcome(kind, expected, sent, first, end, tokens, **kw)  # type: ignore[arg-type]


def test_figures_count_the_window_the_slo_and_what_was_lost() -> None:
    start, end = 1000.0, 1060.0
    outcomes = [
        _out("interactive", 1001.0, 0.1, 1002.6),  # TTFT 100 ms, TPOT 100 ms
        _out("interactive", 1010.0, 0.3, 1012.0),
        _out("interactive", 1020.0, 1.0, 1023.0),  # misses a 500 ms SLO
        _out("interactive", 1030.0, None, 1031.0, error="503: busy"),  # lost, misses
        _out("standard", 1005.0, None, 1015.0),
        _out("standard", 1050.0, None, 1065.0),  # ends after the window: not counted
        _out("batch", 1000.0, None, 1040.0),
        _out("batch", 1000.0, None, 1059.0, tokens=10),  # the wrong length: lost
        _out("batch", 1000.0, None, None),  # still running when the run ended
    ]
    f = peers.figures(outcomes, start, end, slo_ms=500.0)
    assert f["interactive"]["requests"] == 4
    assert f["interactive"]["ttft_p50_ms"] == 300.0 and f["interactive"]["ttft_p95_ms"] is None
    assert f["interactive"]["slo_attainment"] == 0.5  # two of four, the failed one a miss
    assert f["interactive"]["slo_attainment_looser"] == {"2x": 0.75, "4x": 0.75}  # 1000 ms in
    assert f["interactive"]["tpot_p50_ms"] == pytest.approx(113.3, abs=0.1)
    assert f["standard"]["e2e_p95_ms"] == 15000.0
    assert f["batch"] == {
        "requests": 3,
        "completed_in_window": 1,
        "unfinished": 1,
        "tokens_per_s": round(64 / 60, 2),
    }
    # in the window: three chats, one standard, one batch
    assert f["total_tokens_per_s"] == round((3 * 16 + 64 + 64) / 60, 2)
    assert f["failed"] == 2 and f["lost"] == 2 and f["first_error"] == "503: busy"


def test_an_urgent_request_unfinished_after_the_drain_is_lost() -> None:
    f = peers.figures([_out("standard", 1001.0, None, None)], 1000.0, 1060.0, 500.0)
    assert f["lost"] == 1 and f["urgent_unfinished"] == 1 and f["failed"] == 0


def test_a_percentile_that_falls_on_an_unserved_chat_is_none() -> None:
    outcomes = [_out("interactive", 1001.0 + i, 0.2, 1003.0 + i) for i in range(19)]
    outcomes.append(_out("interactive", 1030.0, None, None))  # never served
    f = peers.figures(outcomes, 1000.0, 1060.0, 500.0)["interactive"]
    assert f["ttft_p50_ms"] == 200.0 and f["ttft_p95_ms"] == 200.0  # 19 of 20 served
    assert f["ttft_p99_ms"] is None and f["slo_attainment"] == 0.95


def test_the_window_counts_what_ended_by_its_last_instant() -> None:
    end = 1060.0
    on_time = _out("batch", 1000.0, None, end)  # a client's receive time at the edge
    late = _out("batch", 1000.0, None, end + 0.001)
    # tierq's finished_at of 1059 (rounded down) is read as 1059.999: inside
    tierq_1059 = _out("batch", 1000.0, None, 1059 + peers.LAST_INSTANT)
    tierq_1060 = _out("batch", 1000.0, None, 1060 + peers.LAST_INSTANT)  # ended in [1060, 1061)
    f = peers.figures([on_time, late, tierq_1059, tierq_1060], 1000.0, end, 500.0)
    assert f["batch"]["completed_in_window"] == 2


def _run(ttft_p95: float, slo: float, total: float, batch: float, lost: int = 0) -> dict:
    return {
        "interactive": {"ttft_p95_ms": ttft_p95, "slo_attainment": slo},
        "total_tokens_per_s": total,
        "batch": {"tokens_per_s": batch},
        "lost": lost,
    }


def test_the_verdicts_against_vllm_priority() -> None:
    peer = _run(2000.0, 0.5, 100.0, 80.0)
    good = peers.compare(_run(1500.0, 0.75, 96.0, 73.0), peer, CFG)
    assert good["ttft_p95_ratio"] == 0.75 and good["slo_points"] == 25.0
    assert good["throughput_ratio"] == 0.96 and good["batch_tokens_ratio"] == 0.912
    assert good["targets_met"]
    for bad in (
        _run(1700.0, 0.75, 96.0, 73.0),  # TTFT only 0.85x
        _run(1500.0, 0.65, 96.0, 73.0),  # 15 points
        _run(1500.0, 0.75, 94.0, 73.0),  # 0.94x throughput
        _run(1500.0, 0.75, 96.0, 70.0),  # 0.875x batch
        _run(1500.0, 0.75, 96.0, 73.0, lost=1),
    ):
        verdict = peers.compare(bad, peer, CFG)
        assert not verdict["targets_met"]
        assert sum(not v for v in verdict["targets"].values()) == 1


def test_rounds_are_their_medians_and_what_any_round_lost_counts() -> None:
    peer = _run(2000.0, 0.5, 100.0, 80.0)
    rounds = [
        peers.compare(_run(1500.0, 0.75, 96.0, 73.0), peer, CFG),
        peers.compare(_run(1900.0, 0.6, 90.0, 70.0), peer, CFG),  # a bad round
        peers.compare(_run(1400.0, 0.8, 97.0, 76.0, lost=1), peer, CFG),
    ]
    merged = peers.over_rounds([{k: v for k, v in r.items() if k != "targets"} for r in rounds])
    assert merged["ttft_p95_ratio"] == 0.75 and merged["slo_points"] == 25.0  # medians
    assert merged["throughput_ratio"] == 0.96 and merged["tierq_lost"] == 1  # summed
    verdict = peers._verdicts({k: v for k, v in merged.items() if k != "targets_met"}, CFG)
    assert verdict["targets"] == {
        "ttft_p95": True,
        "slo_points": True,
        "throughput": True,
        "batch_tokens": True,
        "nothing_lost": False,
    }
    # a server's figures: numbers by median, a percentile missing in a round stays missing
    a, b = _run(1500.0, 0.75, 96.0, 73.0), _run(1700.0, 0.7, 90.0, 71.0)
    c = _run(1600.0, 0.8, 99.0, 70.0)
    c["interactive"]["ttft_p95_ms"] = None
    figures = peers.over_rounds([a, b, c])
    assert figures["interactive"]["slo_attainment"] == 0.75
    assert figures["interactive"]["ttft_p95_ms"] is None
    assert figures["total_tokens_per_s"] == 96.0


def test_each_server_gets_the_tier_its_way() -> None:
    client = httpx.AsyncClient()
    req = Request("batch", 0.0, "hello", 64)
    fcfs = peers.VllmTarget(client, "v", "http://x", "m", priority=False).body(req, stream=False)
    prio = peers.VllmTarget(client, "v", "http://x", "m", priority=True).body(req, stream=False)
    assert "priority" not in fcfs and prio["priority"] == 100
    assert fcfs["ignore_eos"] and fcfs["temperature"] == 0 and fcfs["max_tokens"] == 64
    std = Request("standard", 0.0, "hello", 64)
    assert peers.VllmTarget(client, "v", "http://x", "m", True).body(std, False)["priority"] == 10
    tierq = peers.TierqTarget(client, "t", "http://x", "m")
    chat = tierq.body(Request("interactive", 0.0, "hi", 16), stream=True)
    assert chat["service_tier"] == "priority" and chat["stream_options"]["include_usage"]
    assert tierq.body(std, stream=False)["service_tier"] == "flex"  # tierq's standard tier
    assert tierq.batch_submits and not peers.VllmTarget.batch_submits


@pytest.mark.parametrize(
    "args",
    [["--overload", "0"], ["--overload", "x"], ["--servers", "vllm,tierq"]],
)
def test_the_command_refuses_bad_options(args: list[str]) -> None:
    result = CliRunner().invoke(app, ["bench", "peers", *args])
    assert result.exit_code == 2
