"""Self-contained HTML reports: ``higgs-pack verify --report report.html`` (and the benchmark's
pages, written by ``bench/decoder/report.py`` of the checkout with :func:`page` and :func:`figure_png`).

One file, nothing fetched: every plot is a matplotlib figure embedded as a base64
PNG, every audio clip a base64 16-bit WAV in an ``<audio>`` element, the style
inline.  matplotlib comes with the ``report`` extra (``pip install
'higgs-pack[report]'``); the runtime works without it, and asking for a report
without it is an error naming the extra.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import platform
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from higgs_pack.errors import HiggsPackError, install_extra
from higgs_pack.runtime.verification.report import export_error

EXTRA_HINT = install_extra("report") + " (it adds matplotlib)"

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1100px;
     color:#1b1f24;line-height:1.45;padding:0 1rem}
h1{font-size:1.6rem;margin-bottom:.2rem} h2{margin-top:2.2rem;border-bottom:1px solid #d0d7de;padding-bottom:.3rem}
.meta{color:#57606a;font-size:.92rem} .explain{color:#57606a;font-size:.92rem;max-width:900px}
table{border-collapse:collapse;width:100%;font-size:.92rem} th,td{border:1px solid #d0d7de;padding:.35rem .55rem;
     text-align:left;vertical-align:top} th{background:#f6f8fa}
.ok{color:#1a7f37;font-weight:600} .FAIL{color:#cf222e;font-weight:700} .skipped{color:#6e7781;font-weight:600} .info{color:#0969da;font-weight:600}
.badge{display:inline-block;padding:.25rem .8rem;border-radius:1rem;font-weight:700;color:#fff;font-size:1.05rem}
.badge.pass{background:#1a7f37} .badge.fail{background:#cf222e}
.case{border:1px solid #d0d7de;border-radius:8px;padding:.8rem 1rem;margin:1rem 0}
img{max-width:100%} audio{width:100%;margin-top:.4rem} code{background:#f6f8fa;padding:0 .25rem;border-radius:4px}
"""


def require_matplotlib():
    """Import matplotlib with the file-only Agg backend.

    Raises:
        HiggsPackError: matplotlib is not installed (the message names the extra).
    """
    try:
        import matplotlib
    except ImportError as exc:
        raise HiggsPackError(f"an HTML report needs matplotlib, which is not installed; {EXTRA_HINT}") from exc
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def figure_png(fig) -> str:
    """A matplotlib figure as a ``data:image/png;base64,…`` URI (the figure is closed)."""
    plt = require_matplotlib()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def wav_uri(samples: np.ndarray, sample_rate: int) -> str:
    """float32 [samples] at ``sample_rate`` Hz as a ``data:audio/wav;base64,…`` URI (16-bit PCM, peak-safe)."""
    import soundfile as sf

    x = np.asarray(samples, dtype=np.float32)
    peak = float(np.abs(x).max()) if x.size else 0.0
    if peak > 1.0:
        x = x / peak
    buf = io.BytesIO()
    sf.write(buf, x, sample_rate, format="WAV", subtype="PCM_16")
    return "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _e(text: Any) -> str:
    return html.escape(str(text))


def page(title: str, subtitle: str, sections: Iterable[str]) -> str:
    """A whole HTML document with the inline style."""
    made = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body = "\n".join(sections)
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{_e(title)}</title>"
            f"<style>{_STYLE}</style></head><body><h1>{_e(title)}</h1><p class=\"meta\">{subtitle} · written "
            f"{made} on {_e(platform.node() or 'this machine')} ({_e(platform.machine())})</p>\n{body}\n"
            "</body></html>\n")


def _img(uri: str, alt: str) -> str:
    return f'<img src="{uri}" alt="{_e(alt)}">'


#: Errors below this are drawn at it on the parity chart's log axis (an exact match is 0).
_FLOOR = 1e-7


def _parity_rows(parity: dict[str, dict[str, Any]], thresholds: dict[str, dict[str, Any]]
                 ) -> list[tuple[str, str, float, float | None, float | None]]:
    """``(sub-part, what decides, its error, its limit, quantization error or None)`` of each measured sub-part.

    The quantization error (rel L2 against the float oracle) is given where it is not
    what decides, i.e. where matched references (the bundle's own weights) decide.
    """
    rows = []
    for part, rule in thresholds.items():
        errors = parity.get(part, {})
        if errors.get("measured") is None:
            continue
        what, value, limit = export_error(rule, errors)
        quantization = errors.get("rel_l2") if "bundle's weights" in what else None
        rows.append((part, what, value, limit, quantization))
    return rows


def parity_chart(parity: dict[str, dict[str, Any]], thresholds: dict[str, dict[str, Any]],
                 results: dict[str, bool | None]) -> str:
    """Per sub-part, the error that decides its parity (:func:`~higgs_pack.runtime.verification.report.export_error`)
    as a bar with its limit marked, and the quantization error beside it (log axis).

    Args:
        parity: sub-part -> its errors (``VerifyReport.parity``).
        thresholds: sub-part -> its parity rule (``VerifyReport.thresholds``).
        results: sub-part -> the parity check's result (colours the bar: green passed).
    """
    plt = require_matplotlib()
    rows = _parity_rows(parity, thresholds)
    if not rows:
        return ""
    fig, ax = plt.subplots(figsize=(9, 0.8 * len(rows) + 1.5))
    y = np.arange(len(rows))
    export = [max(r[2], _FLOOR) for r in rows]
    ax.barh(y - 0.17, export, height=0.32, color=["#2da44e" if results.get(r[0]) else "#cf222e" for r in rows],
            label="export error (decides)")
    quant = [(i, max(r[4], _FLOOR)) for i, r in enumerate(rows) if r[4] is not None]
    if quant:
        ax.barh([i + 0.17 for i, _ in quant], [q for _, q in quant], height=0.32, color="#afb8c1",
                label="quantization error: rel L2 vs the float oracle (reported, not judged)")
    limits = [(i, max(r[3], _FLOOR)) for i, r in enumerate(rows) if r[3] is not None]
    ax.scatter([v for _, v in limits], [i - 0.17 for i, _ in limits], marker="|", s=500, color="#1b1f24",
               linewidths=2.5, label="limit (the export error must stay left)", zorder=3)
    ax.set_xscale("log")
    ax.set_yticks(y, [f"{part}\n{value:.3g}" + (f", limit {limit:.3g}" if limit is not None else "")
                      for part, _, value, limit, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"error (log scale; smaller is closer; below {_FLOOR:g} drawn at {_FLOOR:g})")
    ax.set_xlim(_FLOOR / 2, max(1.0, *export, *(q for _, q in quant)) * 1.5)
    ax.grid(axis="x", which="major", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08 - 0.4 / len(rows)), ncol=1, fontsize=8,
              frameon=False)
    ax.set_title("Parity per sub-part: the export error that decides, against its limit "
                 "(rel L2; 1 - agreement for codes)", fontsize=10)
    return _img(figure_png(fig), "parity chart")


def parity_table(parity: dict[str, dict[str, Any]], thresholds: dict[str, dict[str, Any]],
                 results: dict[str, bool | None]) -> str:
    """The numbers of :func:`parity_chart`, with the similarity and max |difference| to the float oracle."""
    def num(value: float | None, spec: str = ".3g") -> str:
        return "" if value is None else format(value, spec)

    body = ""
    for part, what, value, limit, quantization in _parity_rows(parity, thresholds):
        errors, rule = parity[part], thresholds[part]
        status = {True: "ok", False: "FAIL", None: "skipped"}[results.get(part)]
        body += (f"<tr><td>{_e(part)}</td><td>{_e(what)}</td><td>{num(value)}</td><td>{num(limit)}</td>"
                 f"<td>{num(quantization)}</td><td>{_e(rule['metric'])} {num(errors['measured'], '.6f')} "
                 f"(threshold {_e(rule['threshold'])}{'' if 'bundle' not in what else ', not judged'})</td>"
                 f"<td>{num(errors.get('measured_max_abs'))}</td><td class=\"{status}\">{status}</td></tr>")
    return ("<table><tr><th>sub-part</th><th>decided by</th><th>export error</th><th>limit</th>"
            "<th>quantization error (rel L2 vs float oracle)</th><th>similarity to the float oracle</th>"
            f"<th>max |difference|</th><th>result</th></tr>{body}</table>")


def greedy_chart(greedy: dict[str, int | None]) -> str:
    """One bar: greedy steps identical to the reference out of all, with the required count marked."""
    plt = require_matplotlib()
    if not greedy:
        return ""
    same, steps, needed = greedy["identical"], greedy["steps"], greedy.get("needed")
    fig, ax = plt.subplots(figsize=(9, 1.5))
    ax.barh([0], [steps], color="#d0d7de", height=0.5, label="steps compared")
    ok = needed is None or same >= needed
    ax.barh([0], [same], color="#2da44e" if ok else "#cf222e", height=0.5, label="identical to the reference")
    if needed is not None:
        ax.axvline(needed, color="#1b1f24", linewidth=2.5, label=f"needed: {needed}")
    ax.set_yticks([])
    ax.set_xlim(0, max(steps, needed or 0) * 1.02 or 1)
    ax.set_xlabel("decoding steps (greedy, from the first)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.55), ncol=3, fontsize=8, frameon=False)
    ax.set_title(f"Greedy codes: {same} of {steps} steps identical to the PyTorch reference")
    return _img(figure_png(fig), "greedy code agreement")


def audio_figures(samples: np.ndarray, sample_rate: int, name: str) -> str:
    """Waveform and spectrogram (dB) of one clip, stacked, with a time axis in seconds."""
    plt = require_matplotlib()
    x = np.asarray(samples, dtype=np.float32)
    t = np.arange(x.size) / sample_rate
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 4.6), sharex=True, gridspec_kw={"height_ratios": [1, 1.4]})
    a.plot(t, x, linewidth=0.5, color="#0969da")
    peak = float(np.abs(x).max()) if x.size else 0.0
    a.axhline(1.0, color="#cf222e", linewidth=0.8, linestyle="--", label="full scale (±1)")
    a.axhline(-1.0, color="#cf222e", linewidth=0.8, linestyle="--")
    a.legend(loc="upper right", fontsize=7)
    a.set_ylabel("amplitude")
    a.set_ylim(-max(1.0, peak) * 1.08, max(1.0, peak) * 1.08)
    a.set_title(f"{name}: waveform and spectrogram ({x.size / sample_rate:.2f} s at {sample_rate} Hz)")
    a.grid(alpha=0.25)
    if x.size >= 512:
        _, _, _, image = b.specgram(x, NFFT=512, Fs=sample_rate, noverlap=384, cmap="magma", scale="dB",
                                    vmin=-120)
        fig.colorbar(image, ax=[a, b], location="right", shrink=0.6, label="power (dB)")
    b.set_ylabel("frequency (Hz)")
    b.set_xlabel("time (s)")
    return _img(figure_png(fig), f"{name} waveform and spectrogram")


def checks_table(checks: Sequence[Any]) -> str:
    rows = "".join(f"<tr><td class=\"{_e(c.status)}\">{_e(c.status)}</td><td>{_e(c.name)}</td>"
                   f"<td>{_e(c.detail)}</td></tr>" for c in checks)
    return f"<table><tr><th>status</th><th>check</th><th>detail</th></tr>{rows}</table>"


def verify_html(report: Any) -> str:
    """The HTML page of a :class:`~higgs_pack.runtime.verification.report.VerifyReport`.

    Raises:
        HiggsPackError: matplotlib is missing (names the ``report`` extra).
    """
    require_matplotlib()
    s = report.summary
    failed = [c for c in report.checks if c.ok is False]
    skipped = [c for c in report.checks if c.ok is None and not c.informational]
    shown = [c for c in report.checks if c.informational]
    verdict = ("<span class=\"badge pass\">PASS</span>" if report.ok else "<span class=\"badge fail\">FAIL</span>")
    where = s.get("execution_provider") or s.get("device")
    built = (f"target <b>{_e(s.get('target'))}</b>, precision <b>{_e(s.get('precision'))}</b>"
             + (f", variant {_e(s['variant'])}" if s.get("variant") else "")
             + f", built for {_e(s.get('backend'))} on {_e(where)}") if s else "manifest unreadable"
    sections = [
        f"<p>{verdict} &nbsp; {len(report.checks)} checks: "
        f"{len(report.checks) - len(failed) - len(skipped) - len(shown)} passed, {len(failed)} failed, "
        f"{len(skipped)} skipped, {len(shown)} shown and not judged. {built}. Verified on "
        f"<b>{_e(report.backend or 'no backend')}</b>.</p>",
        "<p class=\"explain\">Verification uses only the bundle: its manifest and every file's sha256, each "
        "sub-part's inputs and outputs, each sub-part's output against golden outputs captured from the PyTorch "
        "model at build time, greedy decoding against the reference, and speech synthesis of the test cases. "
        "A skipped check says why it could not run here.</p>",
    ]
    if failed:
        sections.append("<h2>Failed checks</h2>" + checks_table(failed))
    sections.append("<h2>Every check</h2>" + checks_table(report.checks))
    results = {c.name[len("parity "):]: c.ok for c in report.checks if c.name.startswith("parity ")}
    chart = parity_chart(report.parity, report.thresholds, results)
    if chart:
        sections.append(
            "<h2>Parity per sub-part</h2><p class=\"explain\">Each sub-part ran on the golden inputs. What decides "
            "is the export error: the relative L2 distance of its output from the PyTorch oracle run with the "
            "bundle's own (quantized or cast) weights, or from the float oracle where the weights are the "
            "checkpoint's; the codec encoder is judged by the fraction of equal codes. For a quantized sub-part "
            "the distance from the float oracle is the quantization error, drawn in grey beside it: reported, "
            "not judged. A green bar left of its black mark passes (without matched references the cosine must "
            "also reach its threshold, in the table).</p>" + chart + parity_table(report.parity, report.thresholds,
                                                                                 results))
    if report.greedy:
        needed = report.greedy.get("needed")
        sections.append(
            "<h2>Greedy code agreement</h2><p class=\"explain\">The golden prompt decoded greedily (temperature "
            "0) with the bundle, step by step against the codes the PyTorch reference produced. "
            + (f"An fp32 bundle must match at least the first {needed} steps exactly."
               if needed is not None else "Informational at this precision: quantized weights may pick another "
               "code after a few steps.") + "</p>" + greedy_chart(report.greedy))
    if report.audio:
        cases = []
        for name, case in report.audio.items():
            samples, rate = case["samples"], case["sample_rate"]
            check = next((c for c in report.checks if c.name == f"synthesize {name}"), None)
            detail = (f"<p class=\"meta\"><span class=\"{_e(check.status)}\">{_e(check.status)}</span> "
                      f"{_e(check.detail)}</p>") if check else ""
            said = f"<p><b>Text:</b> {_e(case['text'])}</p>"
            if case.get("ref_text"):
                said += f"<p><b>Voice cloned from a reference clip whose transcript is:</b> {_e(case['ref_text'])}</p>"
            peak = float(np.abs(samples).max()) if len(samples) else 0.0
            loud = (f"<p class=\"meta\">Peak {peak:.2f} is above full scale: the player's copy is scaled down "
                    "to fit 16-bit audio.</p>") if peak > 1.0 else ""
            cases.append(f"<div class=\"case\"><h3>{_e(name)}</h3>{detail}{said}{audio_figures(samples, rate, name)}"
                         f"{loud}<audio controls preload=\"metadata\" src=\"{wav_uri(samples, rate)}\"></audio></div>")
        sections.append("<h2>Synthesized cases</h2><p class=\"explain\">Each case text spoken with seed 0 by this "
                        "bundle. A bundle of a random test checkpoint (the tiny preset) speaks noise, not words: "
                        "there the check is that audio of the expected length comes out, finite and "
                        "deterministic.</p>" + "".join(cases))
    return page(f"higgs-pack verify: {report.bundle}", "Bundle verification report", sections)
