"""Benchmark results as data (benchmarks/results.py): a kept run carries what its figures
depend on, and the report renders the latest of each bench into the docs' table."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from typer.testing import CliRunner

from benchmarks import results
from cli.main import app

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
    out = CliRunner().invoke(
        app, ["bench", "report", "--results", str(tmp_path), "--page", str(page), "--write"]
    )
    assert out.exit_code == 0, out.output
    text = page.read_text()
    assert text.startswith("# B\n\nbefore\n") and text.endswith("\nafter\n")
    assert table in text and "old" not in text


def test_the_docs_table_is_the_report_of_the_kept_results() -> None:
    """The page shows what the kept results say (run `tierq bench report --write` after
    keeping one)."""
    page = (ROOT / "docs/benchmarks.md").read_text()
    shown = page.split(results.START + "\n", 1)[1].split(results.END, 1)[0]
    assert shown == results.render(results.load(ROOT / results.RESULTS))
