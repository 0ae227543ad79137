"""MkDocs hook: the list of error ``code`` values is rendered from their one declaration
(:data:`higgs_pack.errors.CODE_MEANINGS`, a request's problems, and
:data:`higgs_pack.serve.errors.TRANSPORT_CODES`, the transport's own), never typed by hand.

A page asks for it with a comment on a line of its own::

    <!-- error-codes -->
"""

from __future__ import annotations

import re
from typing import Any

MARKER = re.compile(r"^<!--[ \t]*error-codes[ \t]*-->[ \t]*$", re.MULTILINE)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table() -> str:
    """Every code as a Markdown table: a request's problems (no status: mostly 400, the page says
    which are not), then the transport's own with their HTTP status."""
    from higgs_pack.errors import CODE_MEANINGS
    from higgs_pack.serve.errors import TRANSPORT_CODES

    lines = ["| `code` | status | what it means |", "|---|---|---|"]
    lines += [f"| `{code}` | a request's problem | {_cell(meaning)} |" for code, meaning in CODE_MEANINGS.items()]
    lines += [f"| `{code}` | {status} | {_cell(meaning)} |" for code, (status, meaning) in TRANSPORT_CODES.items()]
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Replace a page's ``error-codes`` marker by the table (MkDocs event)."""
    return MARKER.sub(lambda _match: table(), markdown) if "error-codes" in markdown else markdown
