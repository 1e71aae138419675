"""What a job's earlier deliveries streamed, per choice, and what a new run still sends
(tierq.core.queue.streamed_so_far, tierq.workers.worker.unsent): text by characters, log
probabilities by tokens, kept through the replay buffer's placeholders."""

from __future__ import annotations

import json

from tierq.core.messages import JobEvent
from tierq.core.queue import streamed_so_far, truncated
from tierq.workers.worker import unsent


def entry(token: str) -> dict[str, object]:
    return {"token": token, "logprob": 0.0, "bytes": [], "top_logprobs": []}


def test_what_was_streamed_is_counted_per_choice_placeholders_included() -> None:
    kept = JobEvent("delta", {"text": "ab", "logprobs": [entry("a"), entry("b")]})
    dropped = JobEvent("delta", {"text": "cde", "logprobs": [entry("cde")], "index": 2})
    placeholder = JobEvent.decode(truncated(dropped))
    assert placeholder.data == {
        "text": "",
        "replay_truncated": True,
        "chars": 3,
        "scored": 1,
        "index": 2,
    }
    other = JobEvent("delta", {"text": "xy", "index": 1})
    done = JobEvent("done", {"id": "job_1"})
    got = streamed_so_far([kept, placeholder, other, done])
    assert got.chars == {0: 2, 2: 3, 1: 2}
    assert got.scored == {0: 2, 2: 1, 1: 0}
    assert json.loads(truncated(other))["data"]["index"] == 1


def test_a_rerun_sends_only_the_log_probabilities_followers_lack() -> None:
    entries = [entry("a"), entry("b"), entry("c")]
    assert unsent(entries, 2) == ([entries[2]], 0)
    assert unsent(entries, 5) == ([], 2)  # the rest is skipped from later chunks
    assert unsent(entries, 0) == (entries, 0)
