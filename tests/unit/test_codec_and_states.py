"""The message codec, the Redis names and the job state machine."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tierq.core.messages import Heartbeat, JobEvent, JobMessage
from tierq.core.queue import EventLog
from tierq.core.redis_names import RedisNames
from tierq.core.states import TERMINAL, JobStatus, can_transition, sources_for
from tierq.core.tiers import TIER_ORDER, Tier, vllm_priority


def test_job_message_round_trip() -> None:
    msg = JobMessage("job_1", "ten_1", Tier.BATCH, 12.5, cost=300, batch_id="batch_1")
    assert JobMessage.decode(msg.encode()) == msg
    assert JobMessage.decode({b"job": msg.encode()["job"].encode()}) == msg
    with pytest.raises(ValueError):
        JobMessage.decode({"other": "x"})


def test_a_job_message_encodes_every_field() -> None:
    """The encoder names each field itself: one added to the message and not to it would
    be lost on the way through a stream."""
    full = JobMessage(
        "job_1",
        "ten_1",
        Tier.INTERACTIVE,
        enqueued_at=3.25,
        cost=7,
        preemptions=2,
        batch_id="batch_1",
        prefix="abc",
        trace="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        unsettled_charge=250,
    )
    defaults = JobMessage(full.job_id, full.tenant_id, full.tier)
    # Every field of `full` differs from its default, so each one has to travel.
    assert all(
        getattr(full, f.name) != getattr(defaults, f.name)
        for f in dataclasses.fields(JobMessage)
        if f.name not in ("job_id", "tenant_id", "tier")
    )
    assert JobMessage.decode(full.encode()) == full
    assert set(json.loads(full.encode()["job"])) == {f.name for f in dataclasses.fields(JobMessage)}
    # Untraced, the entry carries no trace field at all (entries stay as they were).
    assert "trace" not in json.loads(defaults.encode()["job"])


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
