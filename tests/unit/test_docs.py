"""The README and the documentation site: the README is short and starts with the two
commands CI and the Makefile use; every page is reachable (the strict build, `make docs`,
checks links and navigation)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_is_short_and_starts_with_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    first_block = readme.split("```sh\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in first_block.splitlines()]
    assert commands == ["make run", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^run: ", makefile, re.M) and re.search(r"^test: ", makefile, re.M)
    ci = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line.strip()]
    assert ci[-1] == "make test"  # CI runs exactly the README's second command
    # `make test` builds the docs (strictly) before the suite.
    assert "docs" in re.search(r"^test: (.*)$", makefile, re.M).group(1).split()  # type: ignore[union-attr]


def test_every_docs_page_is_in_the_navigation_and_every_readme_link_resolves() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["strict"] is True

    def pages(nav: object) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        if isinstance(nav, dict):
            return [p for v in nav.values() for p in pages(v)]
        if isinstance(nav, list):
            return [p for v in nav for p in pages(v)]
        return []

    listed = set(pages(config["nav"]))
    written = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert listed == written
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)\)", readme):
        assert (ROOT / target).exists(), target


def test_the_settings_reference_is_rendered_from_the_settings() -> None:
    """Each setting says what it is for in its field's description, and the reference page
    is exactly what `make reference` renders from them (no hand edits that drift)."""
    from tierq.cli import reference

    assert reference.undocumented() == []
    assert (ROOT / reference.PAGE).read_text() == reference.render(), "run `make reference`"


def test_the_api_reference_is_rendered_from_the_openapi_document() -> None:
    """Every route of the app is on the page, as `make reference` renders it."""
    from tierq.cli import reference

    document = reference.api_document()
    page = (ROOT / reference.API_PAGE).read_text()
    assert page == reference.render_api(document), "run `make reference`"
    for path, operations in document["paths"].items():
        for method in operations:
            assert f"| `{method.upper()} {path}` |" in page
