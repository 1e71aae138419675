"""The message codec, the Redis names and the job state machine."""

from __future__ import annotations

import json

import pytest

from tierq.messages import Heartbeat, JobEvent, JobMessage
from tierq.queue import EventLog
from tierq.redis_names import RedisNames
from tierq.states import TERMINAL, JobStatus, can_transition, sources_for
from tierq.tiers import TIER_ORDER, Tier, vllm_priority


def test_job_message_round_trip() -> None:
    msg = JobMessage("job_1", "ten_1", Tier.BATCH, 12.5, cost=300, batch_id="batch_1")
    assert JobMessage.decode(msg.encode()) == msg
    assert JobMessage.decode({b"job": msg.encode()["job"].encode()}) == msg
    with pytest.raises(ValueError):
        JobMessage.decode({"other": "x"})


def test_a_stream_entry_carries_no_request_and_old_entries_still_decode() -> None:
    """The prompt stays in the database: an entry's size does not grow with it."""
    msg = JobMessage("job_1", "ten_1", Tier.STANDARD, 1.0, cost=50_000)
    assert len(msg.encode()["job"]) < 200
    old = json.loads(msg.encode()["job"])
    old.update(model="m", messages=[{"role": "user", "content": "x" * 1000}], prompt=None)
    assert JobMessage.decode({"job": json.dumps(old)}) == msg


def test_events_and_heartbeats_round_trip() -> None:
    ev = JobEvent("delta", {"text": "a|b"})
    assert JobEvent.decode(ev.encode()) == ev
    assert EventLog.decode_live("7|" + ev.encode()) == (7, ev)
    hb = Heartbeat("w", 8, 3, 1.5, draining=True)
    assert Heartbeat.decode(hb.encode()) == hb


def test_names_are_prefixed_and_job_keys_share_a_cluster_slot() -> None:
    names = RedisNames("p")
    assert names.tier_stream("batch", "ten_1") == "p:stream:batch:ten_1"
    assert names.preempted_stream("batch") == "p:preempted:batch"
    assert names.inbox("w1") == "p:inbox:w1"
    assert names.job_events("job_1") == "p:job:{job_1}:events"
    assert names.job_channel("job_1") == "p:job:{job_1}:live"
    with pytest.raises(ValueError):
        names.tier_stream("gold", "ten_1")


def test_tiers_map_to_vllm_priorities_in_serving_order() -> None:
    priorities = [vllm_priority(t) for t in TIER_ORDER]
    assert TIER_ORDER[0] == Tier.INTERACTIVE and priorities == sorted(priorities)


def test_state_machine() -> None:
    assert can_transition(JobStatus.QUEUED, JobStatus.RUNNING)
    assert can_transition(JobStatus.RUNNING, JobStatus.QUEUED)  # handed back
    assert not can_transition(JobStatus.SUCCEEDED, JobStatus.RUNNING)
    for final in TERMINAL:
        assert not any(can_transition(final, other) for other in JobStatus)
    assert set(sources_for(JobStatus.CANCELLED)) == {JobStatus.QUEUED, JobStatus.RUNNING}
