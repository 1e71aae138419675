"""api.admin.reports: invoices as the CSV `GET /admin/invoices.csv` sends, exactly."""

from __future__ import annotations

import csv
import io
from decimal import Decimal
from typing import Any

from tierq.api.admin.reports import invoices_to_csv

HEADER = "invoice_id,tenant_id,period,tier,model,requests,prompt_tokens,completion_tokens,cost\r\n"


def line(tier: str, model: str, requests: int, cost: Any) -> dict[str, Any]:
    return {
        "tier": tier,
        "model": model,
        "requests": requests,
        "prompt_tokens": 10 * requests,
        "completion_tokens": 20 * requests,
        "total_tokens": 30 * requests,
        "cost": cost,
    }


def invoice(lines: list[dict[str, Any]], cost: Any, **fields: Any) -> dict[str, Any]:
    """An invoice in the shape models.billing.invoice_to_api gives it."""
    requests = sum(x["requests"] for x in lines)
    return {
        "id": "inv_1",
        "object": "invoice",
        "tenant_id": "ten_1",
        "period": "2026-11",
        "requests": requests,
        "prompt_tokens": 10 * requests,
        "completion_tokens": 20 * requests,
        "cost": cost,
        "lines": lines,
        "updated_at": 1_790_000_000,
        **fields,
    }


def test_no_invoices_is_the_header_alone() -> None:
    assert invoices_to_csv([]) == HEADER


def test_a_row_per_line_then_the_invoices_total_row() -> None:
    first = invoice(
        [line("interactive", "m", 1, "0.000040"), line("standard", "m", 2, "0.000080")],
        "0.000120",
    )
    second = invoice([line("batch", "m", 3, "0")], "0", id="inv_2", tenant_id="ten_2")
    assert invoices_to_csv([first, second]) == HEADER + (
        "inv_1,ten_1,2026-11,interactive,m,1,10,20,0.000040\r\n"
        "inv_1,ten_1,2026-11,standard,m,2,20,40,0.000080\r\n"
        "inv_1,ten_1,2026-11,total,,3,30,60,0.000120\r\n"
        "inv_2,ten_2,2026-11,batch,m,3,30,60,0\r\n"
        "inv_2,ten_2,2026-11,total,,3,30,60,0\r\n"
    )


def test_an_invoice_without_lines_has_its_total_row_only() -> None:
    assert invoices_to_csv([invoice([], "0")]) == HEADER + "inv_1,ten_1,2026-11,total,,0,0,0,0\r\n"


def test_commas_quotes_and_line_breaks_are_quoted_and_read_back_as_they_were() -> None:
    model = 'org/model, "v2"\nbeta'
    rendered = invoices_to_csv([invoice([line("standard", model, 1, "1.5")], "1.5")])
    assert rendered == HEADER + (
        'inv_1,ten_1,2026-11,standard,"org/model, ""v2""\nbeta",1,10,20,1.5\r\n'
        "inv_1,ten_1,2026-11,total,,1,10,20,1.5\r\n"
    )
    rows = list(csv.DictReader(io.StringIO(rendered, newline="")))
    assert [r["model"] for r in rows] == [model, ""]


def test_money_is_written_as_held_never_through_a_float() -> None:
    # Decimal strings keep their digits and trailing zeros; a Decimal is written as str()
    # writes it (its exponent too), not rounded the way a float would be.
    exact = "0.100000000000000000000000001"
    lines = [line("standard", "a", 1, exact), line("standard", "b", 1, Decimal("1E-7"))]
    rendered = invoices_to_csv([invoice(lines, Decimal("0.10"))])
    assert rendered == HEADER + (
        f"inv_1,ten_1,2026-11,standard,a,1,10,20,{exact}\r\n"
        "inv_1,ten_1,2026-11,standard,b,1,10,20,1E-7\r\n"
        "inv_1,ten_1,2026-11,total,,2,20,40,0.10\r\n"
    )
