"""`tierq bench peers`: tierq against what a user would run instead of it — `vllm serve`
with FCFS and with `--scheduling-policy priority` — on the work tierq exists for:
interactive streamed chats arriving while a batch backlog fills the engine.

One seeded trace, the same for every server, sent by one client of this module (vLLM's
benchmark client cannot give each request its own priority or tier):

- a batch backlog of `overload` x the engine's capacity for the run's length, all of it
  submitted at the start;
- standard requests at a steady rate;
- interactive streamed chats arriving as a Poisson process.

Every request is greedy with `ignore_eos`, so each asks for a known number of tokens. The
servers run one after the other, each started fresh for each load, with the worker's engine
settings and the bundled model (only one engine runs at a time):

- `vllm-fcfs`: `vllm serve` (vLLM's stock scheduler, FCFS); requests carry no priority;
- `vllm-priority`: the same with `--scheduling-policy priority`; requests carry
  `priority` 0 (interactive), 10 (standard) and 100 (batch);
- `tierq`: `tierq run` on its embedded default; interactive chats with
  `service_tier: "priority"`, standard ones with `"flex"`, the batch backlog as native
  batch-tier jobs (`POST /v1/jobs`, the tier a Batches file runs in). The tenant has no
  bound on its queued jobs (`DEFAULT_MAX_QUEUED=0`): a backlog sent job by job would
  otherwise meet the default one, which a Batches file's jobs do not count against.

Calibration, once, on a `vllm serve` (FCFS) of its own before the runs: the idle TTFT
(sequential interactive chats on an idle engine, the median) and the engine's capacity
(output tokens per second of `max_num_seqs` batch-shaped requests at once). The SLO is
`--ttft-slo` ms, else twice the idle TTFT.

With `repeats` above 1 every load runs in rounds, each server once a round, in the given
order and then reversed (ABBA); a server's figures are then their medians over the rounds
(counts of what was lost are added up), and the comparison with vLLM's priority scheduling
is the median of each round's own comparison (two runs side by side), every round kept.

Each run lasts `duration_s` of arrivals (the window); interactive and standard requests
then have `drain_s` to finish; batch requests still running are abandoned (counted as
unfinished, not lost). Throughputs count the output tokens of requests that completed within
the window: a client's receive time for `vllm serve`; for tierq's batch jobs the job's
`finished_at`, whole seconds rounded down, taken as the end of that second (never earlier
than it ended). `lost` counts requests that failed or came back with the wrong number of
tokens, and interactive or standard ones unfinished after the drain; those count as missing
the SLO, and TTFT percentiles that fall on them are reported as None. Everything but the
JSON line goes to stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness import as_json, sse_events
from benchmarks.serve import ServeConfig, Server, start_tierq, start_vllm
from tierq.core.settings import Settings

SERVERS = ("vllm-fcfs", "vllm-priority", "tierq")
BASELINE = "vllm-priority"
VLLM_PRIORITY = {"interactive": 0, "standard": 10, "batch": 100}
TIERQ_SERVICE_TIER = {"interactive": "priority", "standard": "flex"}
REQUEST_TIMEOUT_S = 3600.0
PROBE_REQUESTS = 8  # sequential interactive chats of an idle-TTFT probe
TIERQ_SETTINGS = {"DEFAULT_MAX_QUEUED": "0"}
COLLECT_CONCURRENCY = 16  # tierq's batch jobs read at once after a run
LOOSER_SLOS = (2, 4)  # attainment is also reported at these multiples of the SLO
LAST_INSTANT = 0.999  # a whole second's last instant, for timestamps rounded down

# The words prompts are drawn from: plain text, which both servers take as it is.
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "bright",
    "stars",
    "turn",
    "above",
    "quiet",
    "rivers",
    "and",
    "old",
    "mountains",
    "under",
    "wide",
    "skies",
    "full",
    "of",
    "rain",
    "wind",
    "light",
    "and",
    "sound",
    "people",
    "write",
    "letters",
    "about",
    "markets",
    "music",
    "gardens",
    "trains",
    "cities",
    "books",
    "coffee",
    "bridges",
    "history",
    "science",
    "weather",
    "oceans",
    "islands",
    "forests",
    "machines",
    "stories",
    "questions",
    "answers",
]


@dataclass(frozen=True)
class PeersConfig:
    duration_s: float = 90.0  # seconds of arrivals: the window throughputs are counted in
    overloads: tuple[float, ...] = (1.5, 3.0)  # batch backlog x capacity x duration
    interactive_rate: float = 1.0  # Poisson arrivals per second
    standard_rate: float = 0.2  # steady arrivals per second
    interactive_tokens: int = 16
    standard_tokens: int = 64
    batch_tokens: int = 64
    prompt_words: tuple[int, int] = (20, 120)  # each prompt's length is drawn from this range
    seed: int = 0
    ttft_slo_ms: float | None = None  # None: twice the idle TTFT of the calibration
    capacity_tokens_per_s: float | None = None  # None: measured by the calibration
    drain_s: float = 120.0  # after the window: how long interactive and standard work may take
    servers: tuple[str, ...] = SERVERS
    # Rounds per load: each runs every server, in `servers`' order, then reversed, and so on
    # (ABBA: a drift of the machine over the rounds weighs on each server alike).
    repeats: int = 1
    # Targets against vLLM's priority scheduling in the same run.
    ttft_p95_target: float = 0.8  # at most this x vllm-priority's interactive TTFT p95
    slo_points_target: float = 20.0  # at least this many points above its SLO attainment
    throughput_target: float = 0.95  # total output tokens/s at least this x
    batch_target: float = 0.9  # batch output tokens/s at least this x


@dataclass(frozen=True)
class Request:
    kind: str  # interactive, standard or batch
    at: float  # seconds after the run's start
    prompt: str
    max_tokens: int


def _prompt(rng: random.Random, cfg: PeersConfig, i: int) -> str:
    n = rng.randint(*cfg.prompt_words)
    # A distinct opening per request: no two share a cached prefix beyond the template.
    return f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(n))


def batch_backlog(cfg: PeersConfig, overload: float, capacity_tokens_per_s: float) -> int:
    """Batch requests that hold `overload` x what the engine can generate in the window."""
    return max(1, math.ceil(overload * capacity_tokens_per_s * cfg.duration_s / cfg.batch_tokens))


def trace(cfg: PeersConfig, overload: float, capacity_tokens_per_s: float) -> list[Request]:
    """The seeded trace of one load, in arrival order: the backlog at 0, standard requests
    every 1/standard_rate s, interactive chats with exponential gaps; nothing arrives at or
    after duration_s. The same arguments give the same trace."""
    # One stream of draws per kind: the chats and standard requests are the same whatever
    # the backlog's size (a measured capacity moves only the backlog).
    rng = {kind: random.Random(f"{cfg.seed}:{overload}:{kind}") for kind in VLLM_PRIORITY}
    out: list[Request] = []
    for n in range(batch_backlog(cfg, overload, capacity_tokens_per_s)):
        out.append(Request("batch", 0.0, _prompt(rng["batch"], cfg, n), cfg.batch_tokens))
    n = 0
    if cfg.standard_rate > 0:
        at = 0.5 / cfg.standard_rate
        while at < cfg.duration_s:
            prompt = _prompt(rng["standard"], cfg, 1_000_000 + n)
            out.append(Request("standard", at, prompt, cfg.standard_tokens))
            n += 1
            at += 1.0 / cfg.standard_rate
    if cfg.interactive_rate > 0:
        draw = rng["interactive"]
        at = draw.expovariate(cfg.interactive_rate)
        while at < cfg.duration_s:
            prompt = _prompt(draw, cfg, 2_000_000 + n)
            out.append(Request("interactive", at, prompt, cfg.interactive_tokens))
            n += 1
            at += draw.expovariate(cfg.interactive_rate)
    out.sort(key=lambda r: r.at)
    return out


# --- one request's outcome --------------------------------------------------------------


@dataclass
class Outcome:
    kind: str
    expected: int  # tokens asked for
    sent: float  # wall clock (time.time())
    first: float | None = None  # first content token (streamed requests)
    done: float | None = None  # the response's end, wall clock
    tokens: int | None = None  # completion tokens, as the server counted them
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.done is not None and self.tokens == self.expected


def _chat_body(req: Request, model: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": req.prompt}],
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def _stream_chat(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], out: Outcome
) -> None:
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            out.error = f"{resp.status_code}: {(await resp.aread())[:200]!r}"
            return
        async for event in sse_events(resp):
            data = event.get("data", "")
            if data == "[DONE]":
                break
            chunk = as_json(data)
            if "error" in chunk:
                out.error = json.dumps(chunk["error"])[:200]
                return
            for choice in chunk.get("choices") or []:
                if out.first is None and (choice.get("delta") or {}).get("content"):
                    out.first = time.time()
            usage = chunk.get("usage")
            if usage:
                out.tokens = int(usage.get("completion_tokens", 0))
    out.done = time.time()
    if out.first is None:
        out.error = "no content streamed"


async def _plain_chat(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], out: Outcome
) -> None:
    resp = await client.post(url, json=body)
    out.done = time.time()
    if resp.status_code != 200:
        out.error = f"{resp.status_code}: {resp.text[:200]}"
        return
    out.tokens = int((resp.json().get("usage") or {}).get("completion_tokens", 0))


# --- the servers, as the client sees them -----------------------------------------------


class Target:
    """How the trace's requests reach one server: chats through its chat completions,
    interactive ones streamed, standard and batch ones plain."""

    batch_submits = False  # a batch request ends once submitted (its job is read later)

    def __init__(self, client: httpx.AsyncClient, name: str, base_url: str, model: str) -> None:
        self.client, self.name, self.base_url, self.model = client, name, base_url, model

    async def interactive(self, req: Request, out: Outcome) -> None:
        await _stream_chat(
            self.client, self.base_url + "/v1/chat/completions", self.body(req, stream=True), out
        )

    async def standard(self, req: Request, out: Outcome) -> None:
        await _plain_chat(
            self.client, self.base_url + "/v1/chat/completions", self.body(req, stream=False), out
        )

    async def batch(self, req: Request, out: Outcome) -> None:
        await self.standard(req, out)

    async def settle_batch(self, outcomes: list[Outcome], window_end: float) -> None:
        """After a run: what the batch requests' outcomes lack (tierq's are jobs)."""

    def body(self, req: Request, stream: bool) -> dict[str, Any]:
        return _chat_body(req, self.model, stream)


class VllmTarget(Target):
    def __init__(
        self, client: httpx.AsyncClient, name: str, base_url: str, model: str, priority: bool
    ) -> None:
        super().__init__(client, name, base_url, model)
        self.priority = priority

    def body(self, req: Request, stream: bool) -> dict[str, Any]:
        body = _chat_body(req, self.model, stream)
        if self.priority:  # FCFS refuses a non-zero priority
            body["priority"] = VLLM_PRIORITY[req.kind]
        return body


class TierqTarget(Target):
    """Interactive and standard through OpenAI's chat completions with `service_tier`;
    the batch backlog as native batch-tier jobs, read back once the run is over (their
    `finished_at` says whether they ended within the window)."""

    batch_submits = True

    def __init__(self, client: httpx.AsyncClient, name: str, base_url: str, model: str) -> None:
        super().__init__(client, name, base_url, model)  # the client carries the tenant's key
        self.job_ids: dict[int, str] = {}  # id(outcome) -> job id

    def body(self, req: Request, stream: bool) -> dict[str, Any]:
        body = _chat_body(req, self.model, stream)
        body["service_tier"] = TIERQ_SERVICE_TIER[req.kind]
        return body

    async def batch(self, req: Request, out: Outcome) -> None:
        body = {
            "tier": "batch",
            "messages": [{"role": "user", "content": req.prompt}],
            "max_tokens": req.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        resp = await self.client.post(self.base_url + "/v1/jobs", json=body)
        if resp.status_code != 202:
            out.error = f"{resp.status_code}: {resp.text[:200]}"
            out.done = time.time()
            return
        self.job_ids[id(out)] = resp.json()["id"]

    async def settle_batch(self, outcomes: list[Outcome], window_end: float) -> None:
        gate = asyncio.Semaphore(COLLECT_CONCURRENCY)

        async def read(out: Outcome) -> None:
            job_id = self.job_ids.get(id(out))
            if job_id is None:
                return
            try:
                async with gate:
                    resp = await self.client.get(f"{self.base_url}/v1/jobs/{job_id}")
                if resp.status_code != 200:
                    out.error = f"{resp.status_code}: {resp.text[:200]}"
                    return
                job = resp.json()
                if job["status"] == "succeeded":
                    # finished_at is whole seconds, rounded down: the job ended within
                    # that second, so it counts as ending at its last instant.
                    out.done = float(job["finished_at"]) + LAST_INSTANT
                    out.tokens = int(job["usage"]["completion_tokens"])
                elif job["status"] in ("failed", "cancelled"):
                    out.error = f"{job['status']}: {job.get('error')}"
                    out.done = float(job["finished_at"] or window_end)
            except Exception as exc:  # a reply not as expected is that request's failure
                out.error = f"{type(exc).__name__}: {exc}"[:200]

        await asyncio.gather(*(read(o) for o in outcomes if o.kind == "batch"))


# --- one run ----------------------------------------------------------------------------


async def _send(target: Target, req: Request, out: Outcome) -> None:
    call: Callable[[Request, Outcome], Awaitable[None]] = getattr(target, req.kind)
    try:
        await call(req, out)
    except Exception as exc:  # a transport error or a reply not as expected: a failure
        out.error = f"{type(exc).__name__}: {exc}"[:200]
        out.done = time.time()


async def idle_ttft(target: Target, cfg: PeersConfig, n: int = PROBE_REQUESTS) -> float:
    """The median TTFT (ms) of `n` interactive chats, one at a time, on an idle server."""
    rng = random.Random(f"{cfg.seed}:probe")
    ttfts: list[float] = []
    for i in range(n + 1):  # the first warms the server up and is not counted
        req = Request("interactive", 0.0, _prompt(rng, cfg, -1 - i), cfg.interactive_tokens)
        out = Outcome(req.kind, req.max_tokens, time.time())
        await _send(target, req, out)
        if out.error or out.first is None:
            raise RuntimeError(f"{target.name}: the idle probe failed: {out.error}")
        if i:
            ttfts.append((out.first - out.sent) * 1000)
    return statistics.median(ttfts)


async def capacity(target: Target, cfg: PeersConfig, max_num_seqs: int) -> float:
    """Output tokens per second of `max_num_seqs` batch-shaped requests sent at once."""
    rng = random.Random(f"{cfg.seed}:capacity")
    reqs = [
        Request("batch", 0.0, _prompt(rng, cfg, -100 - i), cfg.batch_tokens)
        for i in range(max_num_seqs)
    ]
    outs = [Outcome(r.kind, r.max_tokens, time.time()) for r in reqs]
    start = time.monotonic()
    await asyncio.gather(*(_send(target, r, o) for r, o in zip(reqs, outs, strict=True)))
    elapsed = time.monotonic() - start
    bad = [o.error for o in outs if not o.ok]
    if bad:
        raise RuntimeError(f"{target.name}: the capacity probe failed: {bad[0]}")
    return sum(o.tokens or 0 for o in outs) / elapsed


async def run_trace(
    target: Target, cfg: PeersConfig, requests: list[Request]
) -> tuple[list[Outcome], float, float]:
    """Sends the trace at its times; returns the outcomes, the window's start and end (wall
    clock; the end a whole second)."""
    now = time.time()
    start = math.ceil(now + 1.0)  # a whole second, so the window ends on one too
    window_end = start + cfg.duration_s
    await asyncio.sleep(start - now)
    outcomes: list[Outcome] = []
    tasks: dict[str, list[asyncio.Task[None]]] = {"interactive": [], "standard": [], "batch": []}
    try:
        for req in requests:
            delay = start + req.at - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            out = Outcome(req.kind, req.max_tokens, time.time())
            outcomes.append(out)
            tasks[req.kind].append(asyncio.create_task(_send(target, req, out)))
        await asyncio.sleep(max(0.0, window_end - time.time()))
        # Interactive and standard work must finish; the batch backlog need not — but where
        # a batch request is only its submission (tierq's jobs), the submission must.
        wanted = tasks["interactive"] + tasks["standard"]
        if target.batch_submits:
            wanted += tasks["batch"]
        if wanted:
            await asyncio.wait(wanted, timeout=cfg.drain_s)
    finally:
        every = [task for group in tasks.values() for task in group]
        for task in every:
            task.cancel()
        await asyncio.gather(*every, return_exceptions=True)
    await target.settle_batch(outcomes, window_end)
    return outcomes, float(start), float(window_end)


def _pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank), or None for no values or where it falls on an
    infinite one (a request never served)."""
    if not values:
        return None
    ranked = sorted(values)
    value = ranked[min(len(ranked) - 1, max(0, math.ceil(q / 100 * len(ranked)) - 1))]
    return None if math.isinf(value) else round(value, 1)


def figures(
    outcomes: list[Outcome], start: float, window_end: float, slo_ms: float
) -> dict[str, Any]:
    """One run's figures (times in ms, throughputs in output tokens/s within the window)."""
    window = window_end - start
    inter = [o for o in outcomes if o.kind == "interactive"]
    served = [o for o in inter if o.ok and o.first is not None]
    # A chat never served (failed, unfinished) has an infinite TTFT: percentiles over the
    # served alone would flatter a server that refuses.
    ttfts = [(o.first - o.sent) * 1000 if o.ok and o.first is not None else math.inf for o in inter]
    tpots = [
        (o.done - o.first) * 1000 / (o.expected - 1)
        for o in served
        if o.done is not None and o.first is not None and o.expected > 1
    ]
    std = [o for o in outcomes if o.kind == "standard"]
    std_e2e = [(o.done - o.sent) * 1000 for o in std if o.ok and o.done is not None]
    batch = [o for o in outcomes if o.kind == "batch"]

    def in_window(o: Outcome) -> bool:
        return o.ok and o.done is not None and o.done <= window_end

    def tokens(group: list[Outcome]) -> int:
        return sum(o.tokens or 0 for o in group if in_window(o))

    def failed(o: Outcome) -> bool:
        return o.error is not None or (o.done is not None and o.tokens != o.expected)

    lost = [o for o in outcomes if failed(o)]
    unfinished_urgent = [o for o in inter + std if o.done is None and o.error is None]
    errors = [o.error for o in lost if o.error]
    met = sum(1 for t in ttfts if t <= slo_ms)
    return {
        "interactive": {
            "requests": len(inter),
            "ttft_p50_ms": _pct(ttfts, 50),
            "ttft_p95_ms": _pct(ttfts, 95),
            "ttft_p99_ms": _pct(ttfts, 99),
            # Failed and unfinished chats miss the SLO too.
            "slo_attainment": round(met / len(inter), 4) if inter else None,
            # The same at looser SLOs: where one step of a full batch is long (a CPU), the
            # SLO's multiple of an idle TTFT can be beyond every server.
            "slo_attainment_looser": {
                f"{m}x": round(sum(1 for t in ttfts if t <= m * slo_ms) / len(inter), 4)
                for m in LOOSER_SLOS
            }
            if inter
            else None,
            "tpot_p50_ms": _pct(tpots, 50),
            "e2e_p50_ms": _pct([(o.done - o.sent) * 1000 for o in served if o.done], 50),
        },
        "standard": {
            "requests": len(std),
            "e2e_p50_ms": _pct(std_e2e, 50),
            "e2e_p95_ms": _pct(std_e2e, 95),
        },
        "batch": {
            "requests": len(batch),
            "completed_in_window": sum(1 for o in batch if in_window(o)),
            "unfinished": sum(1 for o in batch if o.done is None and o.error is None),
            "tokens_per_s": round(tokens(batch) / window, 2),
        },
        "total_tokens_per_s": round(tokens(outcomes) / window, 2),
        "lost": len(lost) + len(unfinished_urgent),
        "failed": len(lost),
        "urgent_unfinished": len(unfinished_urgent),
        "first_error": errors[0] if errors else None,
    }


def compare(tierq: dict[str, Any], peer: dict[str, Any], cfg: PeersConfig) -> dict[str, Any]:
    """tierq against a peer's run of the same load, and the verdicts on the targets."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    ttft = ratio(tierq["interactive"]["ttft_p95_ms"], peer["interactive"]["ttft_p95_ms"])
    a, b = tierq["interactive"]["slo_attainment"], peer["interactive"]["slo_attainment"]
    points = round((a - b) * 100, 1) if a is not None and b is not None else None
    total = ratio(tierq["total_tokens_per_s"], peer["total_tokens_per_s"])
    batch = ratio(tierq["batch"]["tokens_per_s"], peer["batch"]["tokens_per_s"])
    return _verdicts(
        {
            "ttft_p95_ratio": ttft,
            "slo_points": points,
            "throughput_ratio": total,
            "batch_tokens_ratio": batch,
            "tierq_lost": tierq["lost"],
        },
        cfg,
    )


def _verdicts(vs: dict[str, Any], cfg: PeersConfig) -> dict[str, Any]:
    ttft, points = vs["ttft_p95_ratio"], vs["slo_points"]
    total, batch = vs["throughput_ratio"], vs["batch_tokens_ratio"]
    targets = {
        "ttft_p95": ttft is not None and ttft <= cfg.ttft_p95_target,
        "slo_points": points is not None and points >= cfg.slo_points_target,
        "throughput": total is not None and total >= cfg.throughput_target,
        "batch_tokens": batch is not None and batch >= cfg.batch_target,
        "nothing_lost": vs["tierq_lost"] == 0,
    }
    return {**vs, "targets": targets, "targets_met": all(targets.values())}


# Counts a server's rounds add up (what was lost in any round is lost); other figures of
# several rounds are their median.
SUMMED = frozenset({"lost", "failed", "urgent_unfinished", "tierq_lost"})


def over_rounds(rounds: list[Any], key: str = "") -> Any:
    """Several rounds' figures as one: the median of each number (None where any round has
    none: a percentile that fell on an unfinished request), the sum of each count in
    SUMMED, the first round's value of anything else; dicts key by key."""
    first = rounds[0]
    if isinstance(first, dict):
        return {k: over_rounds([r.get(k) for r in rounds], k) for k in first}
    numbers = [r for r in rounds if isinstance(r, int | float) and not isinstance(r, bool)]
    if not numbers or len(numbers) < len(rounds):
        return None if any(r is None for r in rounds) and numbers else first
    if key in SUMMED:
        return sum(numbers)
    median = statistics.median(numbers)
    return round(median, 4) if isinstance(median, float) else median


# --- the processes ----------------------------------------------------------------------


def _log(message: str) -> None:
    print(f"[bench peers] {message}", file=sys.stderr, flush=True)


@contextlib.asynccontextmanager
async def _server(which: str, workdir: Path, settings: Settings) -> Any:
    """A fresh server and the target that reaches it; stopped (its whole group) on exit."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0)
    model = settings.served_model_name
    headers: dict[str, str] = {}
    server: Server
    reach: Callable[[httpx.AsyncClient], Target]
    # Started in this thread (nothing else runs meanwhile): an interrupt while it starts
    # reaches the start, which then stops what it began.
    if which == "tierq":
        server, key = start_tierq(workdir / f"state-{time.time_ns()}", TIERQ_SETTINGS)
        headers["Authorization"] = f"Bearer {key}"
        reach = functools.partial(TierqTarget, name=which, base_url=server.base_url, model=model)
    else:
        priority = which == "vllm-priority"
        server = start_vllm(ServeConfig(), "priority" if priority else "fcfs")
        reach = functools.partial(
            VllmTarget, name=which, base_url=server.base_url, model=model, priority=priority
        )
    try:
        async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
            yield reach(client)
    finally:
        server.stop()


@dataclass
class Calibration:
    idle_ttft_ms: float | None = None
    capacity_tokens_per_s: float | None = None
    ttft_slo_ms: float | None = None
    measured: list[str] = field(default_factory=list)


async def calibrate(cfg: PeersConfig, settings: Settings, workdir: Path) -> Calibration:
    cal = Calibration(capacity_tokens_per_s=cfg.capacity_tokens_per_s, ttft_slo_ms=cfg.ttft_slo_ms)
    if cal.capacity_tokens_per_s is not None and cal.ttft_slo_ms is not None:
        return cal
    async with _server("vllm-fcfs", workdir, settings) as target:
        cal.idle_ttft_ms = round(await idle_ttft(target, cfg), 1)
        cal.measured.append("idle_ttft_ms")
        if cal.capacity_tokens_per_s is None:
            cal.capacity_tokens_per_s = round(await capacity(target, cfg, settings.max_num_seqs), 2)
            cal.measured.append("capacity_tokens_per_s")
    if cal.ttft_slo_ms is None:
        cal.ttft_slo_ms = round(2 * cal.idle_ttft_ms, 1)
    _log(f"calibration: {json.dumps(asdict(cal))}")
    return cal


async def run_one(
    which: str,
    cfg: PeersConfig,
    requests: list[Request],
    slo_ms: float,
    settings: Settings,
    workdir: Path,
) -> dict[str, Any]:
    async with _server(which, workdir, settings) as target:
        idle = await idle_ttft(target, cfg)
        _log(f"{which}: idle TTFT {idle:.1f} ms; {len(requests)} requests")
        outcomes, start, end = await run_trace(target, cfg, requests)
    out = figures(outcomes, start, end, slo_ms)
    out["idle_ttft_ms"] = round(idle, 1)
    _log(f"{which}: {json.dumps(out)}")
    return out


async def run_peers(settings: Settings, cfg: PeersConfig) -> dict[str, Any]:
    from tierq.workers.engine.bundled_model import resolve_model_path

    resolve_model_path(settings)  # prepared once, before anything is timed
    with tempfile.TemporaryDirectory(prefix="tierq-peers-") as tmp:
        workdir = Path(tmp)
        cal = await calibrate(cfg, settings, workdir)
        assert cal.capacity_tokens_per_s is not None and cal.ttft_slo_ms is not None
        loads: dict[str, Any] = {}
        for overload in cfg.overloads:
            requests = trace(cfg, overload, cal.capacity_tokens_per_s)
            kinds = {k: sum(1 for r in requests if r.kind == k) for k in VLLM_PRIORITY}
            _log(f"overload {overload:g}: {json.dumps(kinds)}")
            rounds: list[dict[str, Any]] = []
            for n in range(cfg.repeats):
                order = cfg.servers if n % 2 == 0 else tuple(reversed(cfg.servers))
                runs = {
                    which: await run_one(which, cfg, requests, cal.ttft_slo_ms, settings, workdir)
                    for which in order
                }
                one: dict[str, Any] = {"order": list(order), "servers": runs}
                if "tierq" in runs and BASELINE in runs:
                    one["vs_vllm_priority"] = compare(runs["tierq"], runs[BASELINE], cfg)
                rounds.append(one)
            servers = {
                which: over_rounds([r["servers"][which] for r in rounds]) for which in cfg.servers
            }
            load: dict[str, Any] = {"requests": kinds, "servers": servers}
            if "tierq" in servers and BASELINE in servers:
                # Each round's comparison is of two runs side by side; the verdicts read
                # their medians.
                each = [r["vs_vllm_priority"] for r in rounds]
                merged = over_rounds(
                    [
                        {k: v for k, v in c.items() if k not in ("targets", "targets_met")}
                        for c in each
                    ]
                )
                load["vs_vllm_priority"] = _verdicts(merged, cfg)
            if cfg.repeats > 1:
                load["rounds"] = rounds
            loads[f"{overload:g}"] = load
    verdicts = [
        load["vs_vllm_priority"]["targets_met"]
        for load in loads.values()
        if "vs_vllm_priority" in load
    ]
    return {
        "calibration": asdict(cal),
        "loads": loads,
        "targets_met": bool(verdicts) and all(verdicts),
        "config": asdict(cfg),
    }
