"""The wheel: one import name (`tierq`), no benchmarks in it, and everything the code reads
at run time beside the modules (Redis scripts, the migrations' template, the console's
files, the simulated engine's calibration). Built from a copy of the package's sources, the
way pip builds it, and imported from the unpacked wheel, not from this checkout; and the
`tierq` command loads a distribution's commands (`tierq bench`) only through its entry point,
leaving out one that fails to load."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _build(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "tierq", src / "tierq", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps"),
            *("--no-build-isolation", "--no-index", "-w", str(tmp / "dist"), str(src)),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp / "dist").glob("tierq-*.whl")
    return wheel


def test_the_wheel_installs_one_name_and_runs_from_what_it_ships(tmp_path: Path) -> None:
    wheel = _build(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"tierq", "tierq-0.1.0.dist-info"}
    assert not [n for n in names if "benchmarks" in n]
    entry_points = zipfile.ZipFile(wheel).read("tierq-0.1.0.dist-info/entry_points.txt")
    assert b"tierq = tierq.cli.main:main" in entry_points

    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    # Every module imports from the unpacked wheel (not from the checkout, which is not on
    # the path), and each file the code reads beside its modules is there.
    probe = textwrap.dedent(
        f"""
        import importlib, importlib.metadata, json, pkgutil, sys
        from pathlib import Path
        # As where only the wheel is installed: no distribution adds commands (this
        # environment has the benchmarks' entry point, from the checkout).
        importlib.metadata.entry_points = lambda **_: []
        import tierq
        for module in pkgutil.walk_packages(tierq.__path__, "tierq."):
            # __main__ runs the command; Alembic runs the migrations' env and versions.
            if module.name != "tierq.__main__" and ".migrations." not in module.name:
                importlib.import_module(module.name)
        mine = [m for name, m in sys.modules.items() if name.split(".")[0] == "tierq"]
        assert all(Path(m.__file__).is_relative_to({str(unpacked)!r}) for m in mine)
        assert "benchmarks" not in sys.modules
        from tierq.cli.main import app
        assert "bench" not in {{g.name for g in app.registered_groups}}
        from tierq.core import scripts
        assert len(scripts.names()) >= 20 and all(scripts.source(n) for n in scripts.names())
        from tierq import migrations
        assert (migrations.MIGRATIONS_DIR / "script.py.mako").is_file()
        assert list((migrations.MIGRATIONS_DIR / "versions").glob("0001_*.py"))
        sql = {{p.name for p in (migrations.MIGRATIONS_DIR / "sql").glob("*.sql")}}
        assert sql >= {{"0016_tierq_admit.sql", "0017_tierq_admit.sql",
                       "0017_held_reservations.postgresql.sql",
                       "0017_held_reservations.sqlite.sql"}}
        from tierq.api import console
        assert (Path(console.__file__).parent / "static" / "console.js").is_file()
        from tierq.workers.engine import simulated_engine
        json.loads((Path(simulated_engine.__file__).parent / "calibration.json").read_text())
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env={"PYTHONPATH": str(unpacked), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_command_group_that_fails_to_load_is_left_out_and_the_rest_works(tmp_path: Path) -> None:
    """An installed `tierq.commands` entry point whose module cannot be imported costs only
    its own command: `tierq --help` (and every process `tierq run` starts) still works."""
    probe = textwrap.dedent(
        """
        import importlib.metadata
        broken = importlib.metadata.EntryPoint("bench", "no_such_module.cli:app", "tierq.commands")
        found = importlib.metadata.entry_points
        importlib.metadata.entry_points = (
            lambda **kw: [broken] if kw.get("group") == "tierq.commands" else found(**kw)
        )
        from typer.testing import CliRunner
        from tierq.cli.main import app
        assert "bench" not in {g.name for g in app.registered_groups}
        result = CliRunner().invoke(app, ["--help"])
        assert result.exit_code == 0 and "migrate" in result.output, result.output
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    assert "leaving out `tierq bench`" in done.stderr


def test_the_designs_folders_stand_at_the_top_as_links_into_the_package() -> None:
    """DESIGN.md's folders are where a reader looks first; the code lives once, in `tierq`."""
    for name in ("api", "workers", "dispatcher", "models", "migrations"):
        top = ROOT / name
        assert top.is_symlink(), f"{name}/ is not a link"
        assert top.resolve() == (ROOT / "tierq" / name).resolve(), top.resolve()
        assert (top / "__init__.py").is_file()
