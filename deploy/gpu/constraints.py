"""Write deploy/gpu/constraints.txt: every package `pip install .[gpu,otel]` takes, pinned to
the version pip resolves now from PyPI alone, for this interpreter and platform (Python 3.11
on Linux x86_64, as the image's), this host's local wheels and pip configuration left out,
so that torch is PyPI's CUDA build.

`make gpu-constraints` runs it; run it after moving the vLLM pin (pyproject.toml's `gpu`
extra) and commit the file with the pin. The image (Dockerfile, ENGINE=gpu) installs with it.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "deploy" / "gpu" / "constraints.txt"


def resolve() -> list[tuple[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no local indexes, links or caps
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--dry-run",
                "--ignore-installed",
                "--quiet",
                "--index-url",
                "https://pypi.org/simple",
                "--report",
                str(report),
                f"{ROOT}[gpu,otel]",
            ],
            env=env,
            check=True,
        )
        items = json.loads(report.read_text())["install"]
    pins = {
        (i["metadata"]["name"].lower(), i["metadata"]["version"])
        for i in items
        if i["metadata"]["name"].lower() != "tierq"
    }
    return sorted(pins)


def main() -> None:
    if sys.version_info[:2] != (3, 11) or platform.machine() != "x86_64" or os.name != "posix":
        sys.exit(
            "resolve the GPU image's constraints with Python 3.11 on Linux x86_64, as the image"
        )
    pins = resolve()
    lines = [
        "# The GPU image's packages, as `python deploy/gpu/constraints.py` resolved them from",
        "# PyPI for Python 3.11 on Linux x86_64 (pip install -c deploy/gpu/constraints.txt",
        "# '.[gpu,otel]'). Regenerate with `make gpu-constraints` after moving the vLLM pin.",
        *(f"{name}=={version}" for name, version in pins),
    ]
    OUT.write_text("\n".join(lines) + "\n")
    print(f"{len(pins)} pins written to {OUT.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
