"""Benchmark results as data (benchmarks/results.py): a kept run carries what its figures
depend on, and the report renders the latest of each bench into the docs' table."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path

from typer.testing import CliRunner

from benchmarks import results
from tierq.cli.main import app

ROOT = Path(__file__).resolve().parents[2]


def keep(folder: Path, bench: str, day: int, result: dict[str, object]) -> Path:
    return results.record(
        bench, result, ["bench", bench], folder, dt.datetime(2026, 12, day, 12, tzinfo=dt.UTC)
    )


def test_a_kept_run_carries_its_commit_machine_date_and_engine(tmp_path: Path) -> None:
    path = keep(tmp_path, "admission", 3, {"jobs_per_s": 1090.4, "p99_ms": 49.6})
    body = json.loads(path.read_text())
    assert path.parent.name == "admission" and path.name.startswith("20261203T120000Z-")
    assert body["date"] == "2026-12-03T12:00:00+00:00"
    assert body["result"] == {"jobs_per_s": 1090.4, "p99_ms": 49.6}
    assert body["machine"]["cores"] and body["machine"]["cpu"]
    assert len(body["commit"]) == 40 and isinstance(body["dirty"], bool)  # this checkout
    assert set(body["engine"]) == {"vllm", "build"}


def test_the_report_shows_the_latest_run_of_each_bench(tmp_path: Path) -> None:
    keep(tmp_path, "admission", 2, {"jobs_per_s": 900.0, "p99_ms": 60.0})
    keep(tmp_path, "admission", 4, {"jobs_per_s": 1090.4, "p99_ms": 49.6, "_detail": 1})
    keep(tmp_path, "overhead", 3, {"ratio": 1.009, "rounds": [1, 2], "mixed": False})
    table = results.render(results.load(tmp_path))
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [r.split("|")[1].strip() for r in rows] == ["`admission`", "`overhead`"]
    assert "`jobs_per_s` 1,090" in rows[0] and "2026-12-04" in rows[0] and "900" not in rows[0]
    assert "_detail" not in rows[0]
    assert "`ratio` 1.009" in rows[1] and "`mixed` no" in rows[1] and "rounds" not in rows[1]

    page = tmp_path / "page.md"
    page.write_text(f"# B\n\nbefore\n\n{results.START}\nold\n{results.END}\n\nafter\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"# R\n\n{results.HEADLINE_START}\nold\n{results.HEADLINE_END}\n\nend\n")
    argv = ["--results", str(tmp_path), "--page", str(page), "--readme", str(readme)]
    out = CliRunner().invoke(app, ["bench", "report", *argv, "--write"])
    assert out.exit_code == 0, out.output
    text = page.read_text()
    assert text.startswith("# B\n\nbefore\n") and text.endswith("\nafter\n")
    assert table in text and "old" not in text
    head = readme.read_text()
    assert head.startswith("# R\n") and head.endswith("\nend\n") and "old" not in head
    assert "| `bench overhead`: tokens/s through the platform" in head
    assert "| 1.009 | ≥ 0.95 | yes |" in head
    # admission's row reads a run of 32 clients: these kept runs name none
    assert "bench admission" not in head


def test_the_docs_and_readme_tables_are_the_report_of_the_kept_results() -> None:
    """The page and the README show what the kept results say (run `tierq bench report
    --write` after keeping one)."""
    kept = results.load(ROOT / results.RESULTS)
    page = (ROOT / "docs/benchmarks.md").read_text()
    shown = page.split(results.START + "\n", 1)[1].split(results.END, 1)[0]
    assert shown.startswith(results.render(kept))
    readme = (ROOT / "README.md").read_text()
    head = readme.split(results.HEADLINE_START + "\n", 1)[1].split(results.HEADLINE_END, 1)[0]
    assert head == results.render_headline(kept)
    for image in re.findall(r"\]\(([^)]+\.png)\)", shown):
        assert (ROOT / "docs" / image).is_file(), image


def test_the_report_draws_the_plots_the_results_allow(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    for clients, p99 in ((8, 12.0), (32, 27.4), (64, 48.0)):
        keep(folder, "admission", 3, {"clients": clients, "p50_ms": p99 / 2, "p99_ms": p99})
    policy = {
        "interactive_ttft_p95_s": 0.8,
        "interactive_ttft_p95_idle_s": 0.5,
        "throughput_tokens_per_s": 300.0,
        "tier_share": {"interactive": 0.2, "standard": 0.6, "batch": 0.2},
        "tier_min_share": {"standard": 0.2, "batch": 0.1},
    }
    shares = {"t_s": [10.0, 20.0], "shares": {"big": [0.5, 0.52], "small": [0.5, 0.48]}}
    tierq = {**policy, "batch_tenant_shares": shares}
    keep(folder, "qos", 4, {"tierq": tierq, "fcfs": {**policy, "interactive_ttft_p95_s": 200.0}})
    keep(folder, "overhead", 4, {"ratio": 1.009})
    run = {"interactive": {"ttft_p95_ms": 900.0}, "total_tokens_per_s": 150.0}
    servers = {"vllm-fcfs": run, "vllm-priority": run, "tierq": run}
    loads = {
        load: {"servers": servers, "vs_vllm_priority": {"throughput_ratio": 0.97}}
        for load in ("1.5", "3")
    }
    keep(folder, "peers", 4, {"loads": loads})
    fitted = {"points": [[1000, 2.0], [10000, 2.1], [100000, 2.2]], "exponent": 0.02}
    keep(
        folder,
        "curves",
        4,
        {
            "ledger": {"curves": {"usage_whole_ms": fitted, "admission_p99_ms": fitted}},
            "dispatch": {"by_tenants": {"curves": {"read_round_ms": fitted}}},
        },
    )
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text(f"# B\n\n{results.START}\n{results.END}\n")
    text = results.write_report(page, results.load(folder))
    drawn = sorted(p.name for p in (page.parent / results.PLOTS).iterdir())
    assert drawn == [
        "admission-latency.png",
        "baseline-ratios.png",
        "curves-by-tenants.png",
        "curves-ledger.png",
        "peers-throughput.png",
        "peers-ttft.png",
        "qos-shares.png",
        "qos-tenant-shares.png",
        "qos-throughput.png",
        "qos-ttft.png",
    ]
    for name in drawn:
        png = (page.parent / results.PLOTS / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 2000
        assert f"]({results.PLOTS}/{name})" in text
    # Nothing kept: no plot, and the table says so.
    empty = tmp_path / "empty" / "page.md"
    empty.parent.mkdir()
    empty.write_text(f"{results.START}\n{results.END}\n")
    assert "No result is kept yet" in results.write_report(empty, [])
    assert not (empty.parent / results.PLOTS).exists() or not any(
        (empty.parent / results.PLOTS).iterdir()
    )


def test_the_headline_rows_and_their_verdicts(tmp_path: Path) -> None:
    keep(tmp_path, "admission", 2, {"clients": 32, "jobs_per_s": 1889.2, "p99_ms": 27.4})
    keep(tmp_path, "admission", 3, {"clients": 64, "jobs_per_s": 2063.0, "p99_ms": 46.4})
    keep(tmp_path, "batch", 3, {"ratio": 0.894})
    vs = {
        "ttft_p95_ratio": 0.5,
        "slo_points": 31.8,
        "throughput_ratio": 0.97,
        "batch_tokens_ratio": 0.93,
        "targets_met": True,
    }
    loads = {"1.5": {"vs_vllm_priority": vs}, "3": {"vs_vllm_priority": {**vs, "targets_met": 0}}}
    keep(tmp_path, "peers", 3, {"loads": loads})
    keep(
        tmp_path,
        "soak",
        3,
        {
            "failed_by_platform": 0,
            "accepted": 4399,
            "billed_tokens": 9,
            "served_tokens": 9,
            "lost": 0,
            "double_billed": 0,
        },
    )
    keep(tmp_path, "isolation", 3, {"ttft_ratio_vs_neighbour": 1.31})
    burst = {"completed": 127, "requests": 128, "refused_unstorable": 1}
    serve = {"tpot_ratio": 0.917, "servers": {"tierq": {"burst": burst}}, "burst_lost": 0}
    keep(tmp_path, "serve", 3, {**serve, "burst_all_complete": False})
    flat = {"exponent": 0.01, "verdict": "flat"}
    linear = {"exponent": 0.97, "verdict": "linear or worse"}
    ledger = {"curves": {"usage_whole_ms": flat}, "usage_within_1s_at_largest": True}
    dispatch = {"by_tenants": {"curves": {"decision_p99_ms": linear}}}
    keep(tmp_path, "curves", 3, {"ledger": ledger, "dispatch": dispatch})
    rows = {
        line.split("`")[1]: line
        for line in results.render_headline(results.load(tmp_path)).splitlines()
        if line.startswith("| `bench")
    }
    assert list(rows) == [
        "bench admission",
        "bench serve",
        "bench batch",
        "bench peers",
        "bench curves",
        "bench soak",
        "bench isolation",
    ]
    assert (
        "| 1 of 2 flat or logarithmic; growing: tenants: decision_p99_ms (k=0.97); usage"
        in (rows["bench curves"])
    )
    assert rows["bench curves"].endswith("| **no** |")
    # a prompt refused by contract is not a stream lost
    assert (
        "| 0.92x; 127 of 128 burst streams complete, 1 refused by contract" in rows["bench serve"]
    )
    assert rows["bench serve"].endswith("| yes |")
    # the 32-client run, not the newer 64-client one
    assert "| 1,889 jobs/s, p99 27.4 ms | ≥ 1,000, p99 ≤ 50 ms | yes |" in rows["bench admission"]
    assert rows["bench batch"].endswith("| 0.894 | ≥ 0.95 | **no** |")
    assert "at 1.5x: 0.5x; +31.8 points; 0.97x; 0.93x<br>at 3x:" in rows["bench peers"]
    assert rows["bench peers"].endswith("| **no** |")  # one load fell short
    assert "| 0 of 4,399; 1.000 | 0; 1 | yes |" in rows["bench soak"]
    assert rows["bench isolation"].endswith("| 1.31 (the simulated engine) | ≤ 1.25 | **no** |")
    assert "No result is kept yet" in results.render_headline([])


def test_the_isolation_row_shows_the_control_where_it_ran(tmp_path: Path) -> None:
    control = {"ttft_ratio_vs_neighbour": 0.91}
    run = {"engine": "vllm", "ttft_ratio_vs_neighbour": 1.58, "control": control}
    keep(tmp_path, "isolation", 1, {**run, "ttft_ratio_vs_neighbour_accounted": 1.735})
    row = next(
        line
        for line in results.render_headline(results.load(tmp_path)).splitlines()
        if line.startswith("| `bench isolation")
    )
    assert row.endswith(
        "| 1.58 (the real engine); the noisy client's CPU alone: 0.91; accounted for it: 1.74 "
        "| ≤ 1.25 | **no** |"
    ), row


def test_kept_results_do_not_make_the_tree_a_changed_one(tmp_path: Path) -> None:
    import subprocess

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "code.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    (tmp_path / results.RESULTS / "qos").mkdir(parents=True)
    (tmp_path / results.RESULTS / "qos" / "run.json").write_text("{}")
    assert results.commit(tmp_path)["dirty"] is False  # an earlier run's kept result
    (tmp_path / "code.py").write_text("x = 2\n")
    assert results.commit(tmp_path)["dirty"] is True


def test_a_run_of_some_parts_keeps_the_others_from_the_newest_run_that_measured_them(
    tmp_path: Path,
) -> None:
    flat = {"exponent": 0.01, "verdict": "flat"}
    linear = {"exponent": 0.97, "verdict": "linear"}
    full = {
        "ledger": {"curves": {"admission_p99_ms": flat}, "usage_within_1s_at_largest": True},
        "dispatch": {"by_tenants": {"curves": {"decision_p99_ms": linear}}},
        "streams": {"api_bytes_per_stream": 60_000},
    }
    keep(tmp_path, "curves", 2, full)
    recovery = {**linear, "by_nature": "once per recovery"}
    curves = {"decision_p99_ms": flat, "first_read_ms": recovery}
    keep(tmp_path, "curves", 4, {"dispatch": {"by_tenants": {"curves": curves}}})
    kept = results.load(tmp_path)
    newest = results.latest(kept)["curves"]["result"]
    assert newest["ledger"] == full["ledger"] and newest["streams"] == full["streams"]
    assert newest["dispatch"]["by_tenants"]["curves"]["decision_p99_ms"] == flat
    commit = kept[-1]["commit"]
    assert newest["parts_from"] == {"ledger": commit, "dispatch": commit, "streams": commit}
    row = [r for r in results.render_headline(kept).splitlines() if "bench curves" in r]
    assert "2 of 2 flat or logarithmic" in row[0] and "within 1 s" in row[0] and "yes" in row[0]
    # a cost that grows by nature is shown, not judged
    assert "growing by nature (not judged): tenants: first_read_ms (k=0.97)" in row[0]
