"""What a resumed run is asked for, and how decode work done twice is counted (no services)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from benchmarks.decode_ledger import DecodeLedger
from tierq.models.records import Progress
from tierq.workers.engine.base import Chunk, resumed_params
from tierq.workers.worker import Ending, Outcome, resumable


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


def test_structured_outputs_start_again() -> None:
    """The engine's grammar starts at the first token a run generates: a continuation would
    open a second JSON document after the first one's start."""
    assert not resumable({"temperature": 0.0, "response_format": {"json_object": True}})
    assert not resumable({"temperature": 0.0, "response_format": {"json": {"type": "object"}}})


def test_a_run_keeps_progress_only_when_the_engine_named_every_token() -> None:
    out = Outcome(Ending.PREEMPTED, text=" a b", prompt_tokens=9, completion_tokens=2)
    assert out.progress("vllm:m") is None  # no ids: nothing to resume after
    out.token_ids = [5, 6]
    assert out.progress("vllm:m") == Progress((5, 6), " a b", 9, "vllm:m")
    out.completion_tokens = 3  # one token's id missing: resuming would skip it
    assert out.progress("vllm:m") is None
    kept = Progress((5, 6), " a b", 9, "vllm:m")
    assert Progress.from_json(kept.to_json()) == kept and Progress.from_json(None) is None


def test_served_counts_this_runs_work_only() -> None:
    out = Outcome(Ending.SUCCEEDED, prompt_tokens=9, completion_tokens=10, resumed=4)
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


def test_stop_strings_penalties_and_a_tenants_seed_with_sampling_start_again() -> None:
    assert resumable({"temperature": 0.7})  # the platform's own replay seed: resumed
    assert resumable({"temperature": 0.0, "seed": 7})  # greedy: the seed draws nothing
    assert not resumable({"temperature": 0.7, "seed": 7})
    assert not resumable({"seed": 7})  # temperature 1 by default
    assert not resumable({"stop": ["END"]})
    assert resumable({"stop": []})


def test_a_run_that_resumed_and_generated_nothing_served_nothing() -> None:
    assert Outcome(Ending.HANDED_BACK, prompt_tokens=9, completion_tokens=4, resumed=4).served == 0
    assert Outcome(Ending.HANDED_BACK, prompt_tokens=9, completion_tokens=0).served == 9


async def _chunks(*finishes: str | None) -> AsyncIterator[Chunk]:
    for finish in finishes:
        yield Chunk("x", 1, 5, finish)


async def test_an_aborted_run_is_no_finished_output() -> None:
    ledger = DecodeLedger()
    async for _ in ledger.counted("a", (), _chunks(None, "abort")):
        pass
    async for _ in ledger.counted("b", (1, 2), _chunks(None, "length")):
        pass
    assert ledger.final == {"b": 4} and ledger.generated == {"a": 2, "b": 2}
    assert ledger.resumed == 2
