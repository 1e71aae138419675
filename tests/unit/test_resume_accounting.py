"""What a resumed run is asked for, and how decode work done twice is counted (no services)."""

from __future__ import annotations

from benchmarks.decode_ledger import DecodeLedger
from models.records import Progress
from workers.engine.base import resumed_params
from workers.worker import Outcome, resumable


def test_a_resumed_run_is_asked_for_what_is_left_with_the_same_sampling() -> None:
    params = {"max_tokens": 100, "min_tokens": 30, "temperature": 0.7, "stop": ["\n"]}
    assert resumed_params(params, 0) is params
    assert resumed_params(params, 40) == {**params, "max_tokens": 60, "min_tokens": 0}
    assert resumed_params(params, 10)["min_tokens"] == 20
    assert resumed_params({"max_tokens": 5}, 2) == {"max_tokens": 3, "min_tokens": 0}


def test_penalties_that_count_a_runs_own_tokens_are_not_resumed() -> None:
    assert resumable({"temperature": 0.0, "presence_penalty": 0.0})
    assert not resumable({"presence_penalty": 0.5})
    assert not resumable({"frequency_penalty": -0.1})


def test_a_run_keeps_progress_only_when_the_engine_named_every_token() -> None:
    out = Outcome("preempted", text=" a b", prompt_tokens=9, completion_tokens=2)
    assert out.progress() is None  # no ids: nothing to resume after
    out.token_ids = [5, 6]
    assert out.progress() == Progress((5, 6), " a b", 9)
    out.completion_tokens = 3  # one token's id missing: resuming would skip it
    assert out.progress() is None
    kept = Progress((5, 6), " a b", 9)
    assert Progress.from_json(kept.to_json()) == kept and Progress.from_json(None) is None


def test_served_counts_this_runs_work_only() -> None:
    out = Outcome("succeeded", prompt_tokens=9, completion_tokens=10, resumed=4)
    assert out.served == 9 + 6


def test_the_ledger_counts_tokens_generated_beyond_the_finished_output() -> None:
    ledger = DecodeLedger()
    ledger.generate("kept", 40)  # preempted, its 40 tokens kept
    ledger.generate("kept", 60)  # resumed after them
    ledger.finish("kept", 100)
    ledger.generate("lost", 30)  # preempted, started again
    ledger.generate("lost", 100)
    ledger.finish("lost", 100)
    ledger.generate("unfinished", 7)  # may yet resume: left out
    assert ledger.wasted() == 30
