"""`tierq bench overhead`: the whole platform against the raw engine, same prompts, same machine.

N chat jobs go through the running platform (REST in, polling for results, from the
database); the same prompts go straight to vLLM's `LLM.chat` in this process with the same
engine settings. Engine start-up is excluded on both sides: the platform's engine is
already running, and the in-process engine is timed only around `chat()`. Tokens per
second count generated tokens. The jobs are identical, or with `mixed` of seeded mixed
lengths (prompts of 1 to 12 sentences, max_tokens from a quarter to twice the given one),
the same on both sides.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from typing import Any

import httpx

from tierq.core.settings import Settings
from tierq.workers.engine.vllm_args import engine_kwargs, set_engine_environment

PROMPT = "Write a short story about a robot who learns to paint."
SENTENCE = "Add one more detail about the colours, the brushes and the light. "
POLL_S = 0.1

# One job: its chat prompt and max_tokens.
Job = tuple[str, int]


def workload(n: int, max_tokens: int, mixed: bool, seed: int = 0) -> list[Job]:
    if not mixed:
        return [(PROMPT, max_tokens)] * n
    rng = random.Random(seed)
    return [
        (PROMPT + " " + SENTENCE * rng.randint(0, 11), rng.randint(max_tokens // 4, 2 * max_tokens))
        for _ in range(n)
    ]


async def _platform(url: str, key: str, jobs: list[Job], tier: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"}

    def body(prompt: str, max_tokens: int) -> dict[str, Any]:
        return {
            "tier": tier,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
        # One warm-up job so that connection set-up is not measured.
        warm = (await client.post("/v1/jobs", json=body(PROMPT, 1))).json()
        await _wait(client, [warm["id"]])
        started = time.perf_counter()
        responses = await asyncio.gather(
            *(client.post("/v1/jobs", json=body(p, m)) for p, m in jobs)
        )
        ids = [r.json()["id"] for r in responses]
        finished = await _wait(client, ids)
        elapsed = time.perf_counter() - started
    failed = [j for j in finished if j["status"] != "succeeded"]
    if failed:
        raise RuntimeError(f"{len(failed)} jobs did not succeed, e.g. {failed[0]}")
    tokens = sum(j["usage"]["completion_tokens"] for j in finished)
    return {"tokens": tokens, "seconds": elapsed}


async def _wait(client: httpx.AsyncClient, ids: list[str]) -> list[dict[str, Any]]:
    """Poll as a considerate client does: one list request per tick, not one per job, and
    no further pages once every job of the run has been seen (older jobs are not read)."""
    wanted = set(ids)
    done: dict[str, dict[str, Any]] = {}
    while len(done) < len(ids):
        await asyncio.sleep(POLL_S)
        after: str | None = None
        seen: set[str] = set()
        while True:
            params: dict[str, Any] = {"limit": 100}
            if after:
                params["after"] = after
            page = (await client.get("/v1/jobs", params=params)).json()
            for job in page["data"]:
                if job["id"] not in wanted:
                    continue
                seen.add(job["id"])
                if job["status"] in ("succeeded", "failed", "cancelled"):
                    done[job["id"]] = job
            if not page["has_more"] or seen == wanted:
                break
            after = page["last_id"]
    return [done[i] for i in ids]


class _RawEngine:
    """vLLM's offline `LLM` in this process, with the worker's engine settings."""

    def __init__(self, settings: Settings) -> None:
        set_engine_environment(settings)
        from vllm import LLM

        self.llm = LLM(**engine_kwargs(settings))

    def run(self, jobs: list[Job]) -> dict[str, Any]:
        from vllm import SamplingParams

        conversations = [[{"role": "user", "content": p}] for p, _ in jobs]
        sampling = [SamplingParams(max_tokens=m, temperature=0.0) for _, m in jobs]
        warm = SamplingParams(max_tokens=1, temperature=0.0)
        self.llm.chat([conversations[0]], warm, use_tqdm=False)  # warm-up, as on the platform
        started = time.perf_counter()
        outputs = self.llm.chat(conversations, sampling, use_tqdm=False)
        elapsed = time.perf_counter() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        return {"tokens": tokens, "seconds": elapsed}


def run_overhead(
    settings: Settings,
    url: str,
    key: str,
    n: int,
    max_tokens: int,
    tier: str,
    rounds: int = 3,
    mixed: bool = False,
) -> dict[str, Any]:
    """Alternate platform and engine rounds (times drift here); compare the medians."""
    engine = _RawEngine(settings)  # its start-up is not measured
    jobs = workload(n, max_tokens, mixed)
    platform_rates: list[float] = []
    engine_rates: list[float] = []
    for i in range(rounds):
        p = asyncio.run(_platform(url, key, jobs, tier))
        e = engine.run(jobs)
        platform_rates.append(p["tokens"] / p["seconds"])
        engine_rates.append(e["tokens"] / e["seconds"])
        print(
            f"round {i + 1}: platform {p['tokens']} tokens in {p['seconds']:.2f} s, "
            f"engine {e['tokens']} tokens in {e['seconds']:.2f} s",
            file=sys.stderr,
            flush=True,
        )
    p_rate = statistics.median(platform_rates)
    e_rate = statistics.median(engine_rates)
    return {
        "platform_tokens_per_s": round(p_rate, 2),
        "engine_tokens_per_s": round(e_rate, 2),
        "ratio": round(p_rate / e_rate, 3),
        "n": n,
        "max_tokens": max_tokens,
        "mixed_lengths": mixed,
        "tier": tier,
        "rounds": rounds,
    }
