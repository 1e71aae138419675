"""`tierq bench batch`: the platform's batches against vLLM's own batch runner, one file.

The same JSONL file (N chat requests, max_tokens each) runs
- through the running platform: upload to /v1/files, POST /v1/batches, poll until it
  completes (upload, validation, expansion into batch-tier jobs, the dispatcher, the
  worker's engine, finalisation into the output file: everything a user waits for);
- through vLLM's `run_batch` (what `python -m vllm.entrypoints.openai.run_batch` runs):
  in a child process that builds the engine exactly as that command does with the
  worker's engine settings, then times only its `run_batch()` (read, run, write).
Engine start-up is excluded on both sides. Rounds alternate (times drift on this
machine) and the medians are compared. Tokens per second count generated tokens, summed
from each side's output file.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tierq.client.batches import BatchClient
from tierq.core.settings import Settings
from tierq.workers.engine.vllm_args import command_line, engine_environment, engine_kwargs

SUBJECTS = (
    "a robot who learns to paint",
    "a lighthouse keeper and a storm",
    "a cat that runs a bakery",
    "the last tree on a distant planet",
    "a detective who cannot remember faces",
    "a river that flows uphill",
    "two rival chess players",
    "a map that redraws itself",
)


def make_requests(n: int, max_tokens: int, model: str) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [
                    {
                        "role": "user",
                        "content": f"Write a short story (#{i}) about {subject}.",
                    }
                ],
                "max_tokens": max_tokens,
                "temperature": 0.0,
            },
        }
        for i, subject in ((i, SUBJECTS[i % len(SUBJECTS)]) for i in range(n))
    ]


def completion_tokens(path: Path) -> int:
    total = 0
    with path.open() as f:
        for raw in f:
            if raw.strip():
                body = json.loads(raw)["response"]["body"]
                total += int(body["usage"]["completion_tokens"])
    return total


def _platform_round(client: BatchClient, input_path: Path, workdir: Path, n: int) -> dict[str, Any]:
    started = time.perf_counter()
    uploaded = client.upload(input_path)
    batch = client.create(uploaded["id"], "/v1/chat/completions", {"bench": "batch"})
    done = client.wait(batch["id"], poll_s=0.1)
    elapsed = time.perf_counter() - started
    counts = done["request_counts"]
    if done["status"] != "completed" or counts["completed"] != n:
        raise RuntimeError(f"the platform's batch did not complete: {done}")
    out = workdir / f"{batch['id']}.jsonl"
    client.download(done["output_file_id"], out)
    return {"tokens": completion_tokens(out), "seconds": elapsed}


class RunBatchChild:
    """vLLM's run_batch in a child process: the engine starts once, then one run per round."""

    def __init__(self, settings: Settings, input_path: Path, output_path: Path) -> None:
        env = {**os.environ, **engine_environment(settings)}
        engine = command_line(engine_kwargs(settings))
        argv = ["-i", str(input_path), "-o", str(output_path), *engine]
        self.output_path = output_path
        self.log_path = output_path.with_suffix(".log")
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.batch", *argv],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            if raw.startswith(prefix):
                return raw[len(prefix) :].strip()
        tail = self.log_path.read_text()[-3000:]
        raise RuntimeError(f"run_batch exited (rc={self.proc.wait()}) before {prefix}:\n{tail}")

    def round(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        seconds = float(self._expect("RESULT"))
        return {"tokens": completion_tokens(self.output_path), "seconds": seconds}

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_bench(
    settings: Settings, url: str, key: str, n: int, max_tokens: int, rounds: int
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tierq-bench-batch-") as tmp:
        workdir = Path(tmp)
        input_path = workdir / "input.jsonl"
        with input_path.open("w") as f:
            for item in make_requests(n, max_tokens, settings.served_model_name):
                f.write(json.dumps(item) + "\n")
        client = BatchClient(url, key)
        child = RunBatchChild(settings, input_path, workdir / "run_batch_output.jsonl")
        tierq_rates: list[float] = []
        vllm_rates: list[float] = []
        try:
            for i in range(rounds):
                p = _platform_round(client, input_path, workdir, n)
                v = child.round()
                tierq_rates.append(p["tokens"] / p["seconds"])
                vllm_rates.append(v["tokens"] / v["seconds"])
                print(
                    f"round {i + 1}: tierq batch {p['tokens']} tokens in {p['seconds']:.2f} s, "
                    f"run_batch {v['tokens']} tokens in {v['seconds']:.2f} s",
                    flush=True,
                )
        finally:
            child.close()
            client.close()
    t_rate = statistics.median(tierq_rates)
    v_rate = statistics.median(vllm_rates)
    return {
        "tierq_tokens_per_s": round(t_rate, 2),
        "run_batch_tokens_per_s": round(v_rate, 2),
        "ratio": round(t_rate / v_rate, 3),
        "n": n,
        "max_tokens": max_tokens,
        "rounds": rounds,
    }


async def _child(argv: list[str]) -> None:
    """The run_batch side: vLLM's own argument parsing, engine client and run_batch()."""
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.run_batch import (
        parse_args,
        run_batch,
        validate_run_batch_args,
    )
    from vllm.usage.usage_lib import UsageContext

    sys.argv = ["run_batch", *argv]
    args = parse_args()
    validate_run_batch_args(args)
    async with build_async_engine_client(
        args, usage_context=UsageContext.OPENAI_BATCH_RUNNER
    ) as engine_client:
        print("READY", flush=True)
        while (await asyncio.to_thread(sys.stdin.readline)).strip() == "go":
            started = time.perf_counter()
            await run_batch(engine_client, args)
            print(f"RESULT {time.perf_counter() - started:.6f}", flush=True)


if __name__ == "__main__":
    asyncio.run(_child(sys.argv[1:]))
