"""The documentation's tables made from a declaration of the code, kept in the Markdown itself.

Each table is written between a pair of comments in a page, so the page read on GitHub holds it
as the built site does, and no copy is kept by hand::

    <!-- request-fields -->
    | ... the table ... |
    <!-- /request-fields -->

``python -m docs.hooks.generated --write`` (from the repository's root) renders every table into
the pages that ask for one; without ``--write`` it checks they are current and exits 1 naming the
stale pages (tests/test_request_fields.py and tests/test_errors.py hold the committed pages to
it).  As an MkDocs hook it fills the same blocks when the site is built.

The tables:

- ``request-fields``: a synthesis request's fields, from their one declaration
  (:class:`higgs_pack.runtime.options.RequestFields`): the Python keyword, the CLI flag, the speech
  body's field (``/v1/audio/speech``, a live session's ``session.config`` where marked), the
  default, what is allowed (the declared limits) and the meaning (the declared description): the
  words ``--help``, the OpenAPI schema (``/docs``) and the error messages use;
- ``error-codes``: every error ``code``, from :data:`higgs_pack.errors.CODE_MEANINGS` (a
  request's problems) and :data:`higgs_pack.serve.errors.TRANSPORT_CODES` (the transport's own).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
REQUEST_COLUMNS = (("keyword", "keyword"), ("flag", "CLI flag"), ("http", "HTTP field"), ("live", "live"),
                   ("default", "default"), ("allowed", "allowed"), ("meaning", "meaning"))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def request_fields() -> str:
    """The request's fields as a Markdown table (one row per field, in declaration order)."""
    from higgs_pack.runtime.options import field_rows

    def cell(key: str, text: str) -> str:
        code = key in ("keyword", "flag", "http", "default")
        return f"`{_cell(text)}`" if code and text else _cell(text)

    lines = ["| " + " | ".join(title for _key, title in REQUEST_COLUMNS) + " |", "|" + "---|" * len(REQUEST_COLUMNS)]
    lines += ["| " + " | ".join(cell(key, row[key]) for key, _title in REQUEST_COLUMNS) + " |" for row in field_rows()]
    return "\n".join(lines)


def error_codes() -> str:
    """Every code as a Markdown table: a request's problems (no status: mostly 400, the page says
    which are not), then the transport's own with their HTTP status."""
    from higgs_pack.errors import CODE_MEANINGS
    from higgs_pack.serve.errors import TRANSPORT_CODES

    lines = ["| `code` | status | what it means |", "|---|---|---|"]
    lines += [f"| `{code}` | a request's problem | {_cell(meaning)} |" for code, meaning in CODE_MEANINGS.items()]
    lines += [f"| `{code}` | {status} | {_cell(meaning)} |" for code, (status, meaning) in TRANSPORT_CODES.items()]
    return "\n".join(lines)


#: Each table's name (its comments') -> what renders it.
TABLES: dict[str, Callable[[], str]] = {"request-fields": request_fields, "error-codes": error_codes}


def _block(name: str) -> re.Pattern[str]:
    return re.compile(rf"^<!--[ \t]*{name}[ \t]*-->[ \t]*\n(?:.*?\n)??<!--[ \t]*/{name}[ \t]*-->[ \t]*$",
                      re.MULTILINE | re.DOTALL)


def fill(markdown: str) -> str:
    """``markdown`` with every table's block (its opening and closing comments) holding the table
    as rendered now."""
    for name, render in TABLES.items():
        if name in markdown:
            markdown = _block(name).sub(lambda _m, name=name, render=render:
                                        f"<!-- {name} -->\n{render()}\n<!-- /{name} -->", markdown)
    return markdown


def pages(docs: Path = DOCS) -> dict[Path, tuple[str, str]]:
    """Every page that holds a table's block: path -> (its text, its text filled)."""
    found = {}
    for page in sorted(docs.rglob("*.md")):
        text = page.read_text(encoding="utf-8")
        if any(_block(name).search(text) for name in TABLES):
            found[page] = (text, fill(text))
    return found


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Fill a page's tables when the site is built (MkDocs event)."""
    return fill(markdown)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m docs.hooks.generated", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the tables into the pages (default: check them)")
    args = parser.parse_args(argv)
    stale = [page for page, (text, filled) in pages().items() if text != filled]
    if args.write:
        for page in stale:
            page.write_text(pages()[page][1], encoding="utf-8")
        print(f"wrote {len(stale)} page(s)" + "".join(f"\n  {p.relative_to(ROOT)}" for p in stale))
        return 0
    for page in stale:
        print(f"{page.relative_to(ROOT)}: a generated table is stale; run python -m docs.hooks.generated --write",
              file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
