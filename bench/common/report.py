"""What every tool's report shares: the goals' states (``met``, ``MISSED``, ``not measured``,
``not judged``), the JSON file written whole, and the pieces of an HTML page."""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from higgs_pack.runtime.verification.html_report import figure_png

#: Ends the ``measured`` text of a goal computed where it is not judged.
NOT_JUDGED = "judged at full size only"
#: ``(goal, met, measured)``; ``met`` None: not measured (``measured`` says why) or not judged.
Goal = tuple[str, bool | None, str]


def goal_state(met: bool | None, measured: str = "") -> str:
    """``met``, ``MISSED``, ``not measured`` or ``not judged``."""
    if met is None:
        return "not judged" if measured.endswith(NOT_JUDGED) else "not measured"
    return "met" if met else "MISSED"


def write_json(data: Any, out: Path) -> None:
    """Write ``data`` as indented JSON through a temporary file (never half a file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(out)


def esc(text: Any) -> str:
    return html.escape(str(text))


def img(fig: Any, alt: str) -> str:
    """A matplotlib figure as an inline PNG (the figure is closed)."""
    return f'<img src="{figure_png(fig)}" alt="{esc(alt)}">'


def html_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    return "<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in headers) + f"</tr>{body}</table>"


def facts_list(lines: Sequence[str]) -> str:
    return '<ul class="explain">' + "".join(f"<li>{esc(line)}</li>" for line in lines) + "</ul>"


def goals_table(goals: Sequence[Goal]) -> str:
    """The goals met, missed, not measured or not judged, first on a page."""
    css = {"met": "ok", "MISSED": "FAIL"}
    rows = "".join(f"<tr><td class=\"{css.get(goal_state(met, m), 'skipped')}\">{goal_state(met, m)}</td>"
                   f"<td>{esc(goal)}</td><td>{esc(m)}</td></tr>" for goal, met, m in goals)
    return f"<h2>Goals</h2><table><tr><th>result</th><th>goal</th><th>measured</th></tr>{rows}</table>"


def axes(plt: Any, size: tuple[float, float], title: str, xlabel: str = "", ylabel: str = "") -> tuple[Any, Any]:
    fig, ax = plt.subplots(figsize=size)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.25)
    return fig, ax
