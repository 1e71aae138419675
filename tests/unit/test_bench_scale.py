"""`tierq bench scale`'s pure parts: its seeded workload and its report (no services)."""

from __future__ import annotations

from benchmarks.scale import REPORT_KEYS, RUN_KEYS, ScaleConfig, make_workload, report
from tierq.core.messages import prefix_key
from tierq.workers.engine.simulated_engine import CostModel

CFG = ScaleConfig(duration_s=5.0, workers=2)


def _keys(cfg: ScaleConfig) -> set[str]:
    return {
        prefix_key([{"role": r, "content": c} for r, c in a.messages], None)
        for a in make_workload(cfg, CostModel())
    }


def test_the_workload_is_the_same_for_a_seed_and_another_for_another() -> None:
    first = make_workload(CFG, CostModel())
    assert first == make_workload(CFG, CostModel())
    assert first != make_workload(ScaleConfig(duration_s=5.0, workers=2, seed=2), CostModel())
    burst = [a for a in first if a.at == 0.0]
    assert len(burst) == CFG.workers * CFG.slots  # every slot's worth, queued at the start
    assert all(0 <= a.at < CFG.duration_s + 4 * CFG.lease_s for a in first)
    assert [a.at for a in first] == sorted(a.at for a in first)
    assert first[-1].at > CFG.duration_s  # arrivals go on past the window (the failover)


def test_jobs_share_prefixes_per_tenant_and_per_session() -> None:
    keys = _keys(CFG)
    # The tenants' system prompts, and the sessions' conversations (each some turns long).
    assert len(keys) > CFG.tenants
    assert len(keys) < len(make_workload(CFG, CostModel())) / 4


def test_the_report_has_the_figures_asked_for() -> None:
    run = {
        "prefix_hit_rate": 0.9,
        "cached_prompt_share": 0.7,
        "throughput_tokens_per_s": 2600.0,
        "offered_tokens_per_s": 5000.0,
        "idle_with_backlog": 0.01,
        "any_free_slot_with_backlog": 0.2,
        "desired_workers_at_peak": 7,
        "desired_workers_median": 6,
        "dispatches_per_s": 2500.0,
        "decision_us_p99": 80.0,
        "failover_s": 4.2,
        "preempted_tokens_wasted": 0,
    }
    free = {**run, "prefix_hit_rate": 0.2, "throughput_tokens_per_s": 1800.0}
    out = report({"affine": run, "free_slots": free}, CFG)
    assert all(k in out for k in REPORT_KEYS)
    assert set(out["affine"]) == set(RUN_KEYS) == set(out["free_slots"])
    assert out["needed_workers"] == 4  # 5000 / (2600 / 2 workers), rounded up
    assert out["desired_workers"] == 6  # the signal's median over the measured window
    assert out["targets"]["affine_1.3x_met"] and out["targets"]["failover_le_6s_met"]
