"""A job's run on a worker (tierq/workers/worker.py `Run`): why the engine stopped it early, and
each reason acted on once."""

from __future__ import annotations

from tierq.core.messages import JobMessage
from tierq.core.tiers import Tier
from tierq.workers.worker import _GONE, _NOT_OURS, Ending, Run


def _run(entry: str = "1-0") -> Run:
    return Run(JobMessage("j1", "t1", Tier.STANDARD, enqueued_at=1.0, cost=10), entry)


def test_a_run_stopped_for_several_reasons_ends_as_the_first_of_them() -> None:
    run = _run()
    assert run.why_stopped() == Ending.RETRY  # stopped by the engine's own doing
    assert run.stop(Ending.CANCELLED)
    assert not run.stop(Ending.CANCELLED)  # each reason acts once (one abort, one count)
    assert run.why_stopped() == Ending.CANCELLED
    run.stop(Ending.PREEMPTED)
    assert run.why_stopped() == Ending.PREEMPTED  # its tokens go back with it
    run.stop(Ending.HANDED_BACK)
    assert run.why_stopped() == Ending.HANDED_BACK  # a drain or a dead engine: back to queue


def test_each_ending_is_reported_as_the_dispatcher_reads_it() -> None:
    assert {str(e) for e in Ending} == {
        "succeeded",
        "failed",
        "cancelled",
        "handed_back",
        "preempted",
        "retry",
        "skipped",
        "superseded",
        "duplicate",
        "abandoned",
    }
    assert not _GONE & _NOT_OURS
    assert Ending.SUCCEEDED == "succeeded"  # the dispatcher compares reports with text
