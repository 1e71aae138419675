"""Invoices as CSV, as `GET /admin/invoices.csv` sends them: plain text from the invoices'
API shape (models.billing.invoice_to_api), no HTTP here.

One row per invoice line (tier and model), then the invoice's own row with the tier
"total" and no model. Amounts are written as the records hold them (decimal strings,
never through a float); fields with commas, quotes or line breaks are quoted (the csv
module's default dialect: "excel", CRLF line ends).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from typing import Any

INVOICE_COLUMNS = (
    "invoice_id",
    "tenant_id",
    "period",
    "tier",
    "model",
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "cost",
)


def invoices_to_csv(invoices: Iterable[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(INVOICE_COLUMNS)
    for inv in invoices:
        invoice = (inv["id"], inv["tenant_id"], inv["period"])
        for line in inv["lines"]:
            writer.writerow(
                (
                    *invoice,
                    line["tier"],
                    line["model"],
                    line["requests"],
                    line["prompt_tokens"],
                    line["completion_tokens"],
                    line["cost"],
                )
            )
        writer.writerow(
            (
                *invoice,
                "total",
                "",
                inv["requests"],
                inv["prompt_tokens"],
                inv["completion_tokens"],
                inv["cost"],
            )
        )
    return out.getvalue()
