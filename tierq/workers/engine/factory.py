"""The engine a worker hosts, chosen by Settings: vLLM (the default) or the simulated one,
wrapped in the fault injector when ENGINE_FAULT_RATE is set (tests, `bench chaos`)."""

from __future__ import annotations

import logging
from typing import Any

from tierq.core.settings import Settings
from tierq.workers.engine.base import Engine

log = logging.getLogger(__name__)


def make_engine(settings: Settings) -> Engine:
    """The engine Settings name (ENGINE), wrapped in the fault injector if ENGINE_FAULT_RATE."""
    engine: Any
    if settings.engine == "simulated":
        from tierq.core.token_count import for_settings
        from tierq.workers.engine.simulated_engine import CostModel, SimulatedEngine

        engine = SimulatedEngine(
            CostModel(slots=settings.max_num_seqs, max_model_len=settings.max_model_len),
            priority_steps=settings.engine_priority_steps,
            counter=for_settings(settings),
        )
    else:
        from tierq.workers.engine.vllm_engine import VllmEngine

        engine = VllmEngine(settings)
    if settings.engine_fault_rate > 0:
        from tierq.workers.engine.faulty_engine import FaultyEngine

        kinds = tuple(k.strip() for k in settings.engine_fault_kinds.split(",") if k.strip())
        log.warning(
            "injecting engine faults into %.1f%% of requests", 100 * settings.engine_fault_rate
        )
        engine = FaultyEngine(engine, settings.engine_fault_rate, settings.engine_fault_seed, kinds)
    return engine
