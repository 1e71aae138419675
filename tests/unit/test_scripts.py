"""Redis's scripts are files (tierq/core/lua/), each used, none written inline in Python."""

from __future__ import annotations

import re
from pathlib import Path

from tierq.core import scripts
from tierq.core.queue import ERROR_MARK

ROOT = Path(__file__).resolve().parents[2]
CODE = ["tierq"]


def _python() -> dict[Path, str]:
    return {p: p.read_text() for d in CODE for p in (ROOT / d).rglob("*.py")}


def test_every_script_is_a_file_that_some_module_runs_and_none_is_inline() -> None:
    code = _python()
    names = scripts.names()
    assert len(names) >= 20
    for name in names:
        users = [p for p, text in code.items() if f'scripts.source("{name}")' in text]
        assert users, f"tierq/core/lua/{name}.lua is run by no module"
        text = scripts.source(name)
        assert text.startswith("--"), f"{name}.lua does not say what it does first"
        assert "redis.call" in text
    inline = [p for p, text in code.items() if re.search(r"redis\.call\(", text)]
    assert inline == [], inline


def test_the_enqueue_script_marks_a_failed_job_as_the_queue_reads_it() -> None:
    assert f"'{ERROR_MARK}'" in scripts.source("enqueue")
