"""vLLM's engine-core process waits for its model worker without spinning (the CPU build).

vLLM's multiprocess executor hands each step to its worker process and reads the result
back through a shared-memory ring (`shm_broadcast.MessageQueue`). A reader that read
within the last second (`SpinCondition.busy_loop_s`, 1 s, not configurable) waits by
calling `sched_yield()` in a loop, so while the engine is busy its engine-core process
spins through every step the worker computes (py-spy finds its main thread in that loop
most of the time under a burst, and the process takes half a core). On a GPU host that
buys a few microseconds a step with a core nobody else wants. On a CPU host the engine's
compute threads are bound to their cores and the spinner, bound to none, lands either
beside them (slowing every step) or on the core that the API, the dispatcher and the
worker's own loop share (slowing admission of a burst on the embedded default). With the
spin off, the reader blocks on the ring's notification socket, which the writer signals
after every write — the path vLLM itself takes once the engine has been idle for a second.

That signal can be lost: the writer's socket keeps one message (`SNDHWM` 1) and drops the
rest, and the reader keeps the last (`CONFLATE`). vLLM's reader then sleeps until its
recheck (`SHM_READER_RECHECK_INTERVAL_MS`, 5 s): the first job after a burst then waits
seconds for a step that takes a fraction of one. So a quiet wait blocks for at most
`RECHECK_MS` before it looks at the ring again: a lost signal costs at most that (a small
part of one CPU step), and the rechecks cost a few hundred cheap wake-ups a second while
the engine works, not a spinning core.

`quiet_waits()` runs in the engine-core process (tierq's scheduler classes are built
there; `vllm_scheduler.py`). It replaces `SpinCondition.wait` on the class, so it reaches
the rings the executor created before the scheduler was built. Only readers call `wait`.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("vllm.tierq.quiet_waits")

CONFIG_KEY = "tierq_quiet_waits"
# The longest a quiet wait blocks before it looks at the ring again (see above).
RECHECK_MS = 2


def quiet_waits() -> bool:
    """Make every shared-memory ring reader in this process block instead of spinning.
    True if it did (now or before); False where this vLLM has no such ring."""
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return False
    condition: Any = getattr(shm_broadcast, "SpinCondition", None)
    if condition is None or not hasattr(condition, "wait"):
        log.warning("vLLM's SpinCondition is not there: its readers may spin")
        return False
    if getattr(condition, "_tierq_quiet", False):
        return True
    spinning_wait = condition.wait

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        self.busy_loop_s = 0  # past the busy loop's window: block on the notify socket
        spinning_wait(self, RECHECK_MS if timeout_ms is None else min(timeout_ms, RECHECK_MS))

    condition.wait = wait
    condition._tierq_quiet = True
    return True


def wanted(additional_config: Any) -> bool:
    """Whether the worker asked for quiet waits (vLLM's `additional_config`)."""
    return isinstance(additional_config, dict) and bool(additional_config.get(CONFIG_KEY))
