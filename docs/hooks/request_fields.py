"""MkDocs hook: the table of a synthesis request's fields is rendered from the request's one
declaration (:class:`higgs_pack.runtime.options.RequestFields`), never typed by hand.

A page asks for it with a comment on a line of its own::

    <!-- request-fields -->

Each row gives the Python keyword, the CLI flag, the speech body's field (``/v1/audio/speech``,
a live session's ``session.config`` where marked), the default, what is allowed (from the
declared limits) and the meaning (the declared description): the same words ``--help``, the
OpenAPI schema (``/docs``) and the error messages use.
"""

from __future__ import annotations

import re
from typing import Any

MARKER = re.compile(r"^<!--[ \t]*request-fields[ \t]*-->[ \t]*$", re.MULTILINE)
COLUMNS = (("keyword", "keyword"), ("flag", "CLI flag"), ("http", "HTTP field"), ("live", "live"),
           ("default", "default"), ("allowed", "allowed"), ("meaning", "meaning"))


def _cell(text: str, code: bool) -> str:
    text = text.replace("|", "\\|")
    return f"`{text}`" if code and text else text


def table() -> str:
    """The fields as a Markdown table (one row per field, in declaration order)."""
    from higgs_pack.runtime.options import field_rows

    lines = ["| " + " | ".join(title for _key, title in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in field_rows():
        lines.append("| " + " | ".join(_cell(row[key], key in ("keyword", "flag", "http", "default"))
                                       for key, _title in COLUMNS) + " |")
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Replace a page's ``request-fields`` marker by the table (MkDocs event)."""
    return MARKER.sub(lambda _match: table(), markdown) if "request-fields" in markdown else markdown
