"""The settings reference (docs/reference/settings.md), rendered from tierq/core/settings.py: each
field's description is the one source of what it means, its default is the field's own
(or, where the value says little, such as unset or made at run time, the `shown_default`
the field states), and the sections are the settings module's own (`# --- name ---`).

`tierq reference settings` prints it; `make reference` writes it; a test fails when the
committed page differs from what this renders, or when a field has no description.
"""

from __future__ import annotations

import inspect
import re
from decimal import Decimal
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo

from tierq.core import settings as settings_module
from tierq.core.settings import OTHER_VARIABLES, Settings

PAGE = Path("docs/reference/settings.md")
_SECTION = re.compile(r"^    # --- (.+?) -+$")
_FIELD = re.compile(r"^    ([a-z_][a-z0-9_]*): ")
_UNITS = ((1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB"))

INTRO = """\
# Settings

One `Settings` object (`tierq/core/settings.py`) reads the environment (and `.env`); the
variable is the field name in capitals. This page is rendered from that module (`make
reference`): each setting's meaning is its field's description there.
"""


def sections() -> list[tuple[str, list[str]]]:
    """The settings module's sections, in order, each with its fields in order."""
    out: list[tuple[str, list[str]]] = []
    for line in inspect.getsource(settings_module.Settings).splitlines():
        heading = _SECTION.match(line)
        if heading:
            out.append((_title(heading.group(1)), []))
            continue
        field = _FIELD.match(line)
        if field and field.group(1) in Settings.model_fields:
            if not out:
                out.append(("Settings", []))
            out[-1][1].append(field.group(1))
    return out


def _title(text: str) -> str:
    text = re.sub(r"\s*\(.*\)\s*$", "", text).strip()
    return text[:1].upper() + text[1:]


def shown_default(name: str, info: FieldInfo) -> str:
    extra = info.json_schema_extra
    if isinstance(extra, dict) and "shown_default" in extra:
        return str(extra["shown_default"])
    value: Any = info.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, int) and name.endswith("_bytes"):
        for size, unit in _UNITS:
            if value >= size and value % size == 0:
                return f"{value // size:,} {unit}"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, float):
        return f"{value:,.6g}" if abs(value) >= 10_000 else f"{value:g}"
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, str | Path):
        return f"`{value}`" if str(value) else '`""`'
    if isinstance(value, list | tuple | set | frozenset):
        return ", ".join(str(v) for v in value) or "none"
    return str(value)


def render() -> str:
    """The page, as committed."""
    fields = Settings.model_fields
    parts = [INTRO]
    for title, names in sections():
        parts.append(f"\n## {title}\n\n| variable | default | meaning |\n|---|---|---|\n")
        # Fields side by side with one description share a row.
        rows: list[tuple[list[str], list[str], str]] = []
        for name in names:
            info = fields[name]
            description = " ".join((info.description or "").split())
            default = shown_default(name, info)
            if rows and rows[-1][2] == description:
                rows[-1][0].append(name)
                rows[-1][1].append(default)
            else:
                rows.append(([name], [default], description))
        for row_names, defaults, description in rows:
            variables = ", ".join(f"`{n.upper()}`" for n in row_names)
            shown = ", ".join(defaults) if len(set(defaults)) > 1 else defaults[0]
            parts.append(f"| {variables} | {shown} | {description} |\n")
    parts.append(
        "\n## Other environment variables\n\n| variable | default | meaning |\n|---|---|---|\n"
    )
    for variable, (default, meaning) in OTHER_VARIABLES.items():
        parts.append(f"| `{variable}` | {default} | {meaning} |\n")
    return "".join(parts)


def undocumented() -> list[str]:
    """Settings fields without a description (each must say what it is for)."""
    return [name for name, info in Settings.model_fields.items() if not info.description]


# --- the HTTP API -------------------------------------------------------------------------

API_PAGE = Path("docs/reference/api.md")

API_INTRO = """\
# The HTTP API

Every route the API serves, rendered from its OpenAPI document (`make reference`). A
running API serves that document at `/openapi.json`, with Swagger UI over it at `/docs`
and ReDoc at `/redoc` (their scripts are served by the API itself: nothing is fetched from
a CDN), where each route's request schema, parameters and errors can be read and tried.
Tenant routes take a tenant's key (`Authorization: Bearer sk-...`), `/admin` routes the
operator's `ADMIN_API_KEY`; every error has OpenAI's shape ([the errors](../tenants/errors.md)).
"""


def _first_sentence(text: str) -> str:
    flat = " ".join(text.split())
    cut = re.search(r"(?<=[.:])\s", flat)
    return (flat[: cut.start()] if cut else flat).rstrip(":").replace("|", "\\|")


def api_document() -> dict[str, Any]:
    """The app's OpenAPI document, every route included, whatever the environment sets."""
    from tierq.api.app import build_app

    return build_app(Settings(_env_file=None, admin_api_key=None)).openapi()  # type: ignore[call-arg]


def render_api(document: dict[str, Any] | None = None) -> str:
    """The HTTP API page from the OpenAPI document (the app's own by default)."""
    if document is None:
        document = api_document()
    groups: dict[str, list[str]] = {}
    for path, operations in document["paths"].items():
        for method, op in operations.items():
            tag = (op.get("tags") or ["other"])[0]
            what = _first_sentence(op.get("description") or "") or op.get("summary", "")
            errors = sorted(
                code for code in op.get("responses", {}) if code.isdigit() and int(code) >= 400
            )
            shown = ", ".join(f"`{code}`" for code in errors if code != "422") or "—"
            groups.setdefault(tag, []).append(f"| `{method.upper()} {path}` | {what} | {shown} |")
    parts = [API_INTRO]
    for tag, rows in groups.items():
        parts.append(f"\n## {tag}\n\n| route | what it does | errors |\n|---|---|---|\n")
        parts.append("\n".join(rows) + "\n")
    return "".join(parts)
