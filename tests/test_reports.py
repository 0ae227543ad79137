"""HTML reports: one self-contained file each (verify --report x.html, dist/bench.html)."""

from __future__ import annotations

import base64
import subprocess
import sys
from html.parser import HTMLParser

import pytest
from conftest import write_voice_clip


class Page(HTMLParser):
    """Collects every tag with its attributes, and the visible text."""

    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []

        self._in_style = False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_style = tag == "style"

    def handle_endtag(self, tag):
        self._in_style = False

    def handle_data(self, data):
        if not self._in_style:  # the visible text only
            self.text.append(data)


def parse(html: str) -> Page:
    page = Page()
    page.feed(html)
    page.close()
    return page


def assert_self_contained(html: str) -> Page:
    page = parse(html)
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    for tag, attrs in page.tags:
        assert tag not in ("script", "link", "iframe", "object", "embed"), tag
        for key in ("src", "href", "srcset", "data", "poster"):
            value = attrs.get(key)
            if value is not None:
                assert value.startswith("data:"), f"<{tag} {key}={value[:60]!r}> references something outside"
    assert "http://" not in html and "https://" not in html and "url(" not in html
    return page


def decoded(page: Page, tag: str, prefix: str) -> list[bytes]:
    out = []
    for t, attrs in page.tags:
        if t == tag:
            assert attrs["src"].startswith(prefix), attrs["src"][:40]
            out.append(base64.b64decode(attrs["src"][len(prefix):], validate=True))
    return out


@pytest.mark.slow
def test_verify_report_html(cpu_fp32_bundle, tmp_path):
    cases = tmp_path / "cases"
    cases.mkdir()
    (cases / "text_en_basic.txt").write_text("Hello there.", encoding="utf-8")
    (cases / "text_zh.txt").write_text("你好。", encoding="utf-8")
    write_voice_clip(cases / "ref_en_16k.wav")
    (cases / "ref_en_16k.txt").write_text("Hello.", encoding="utf-8")
    report = tmp_path / "report.html"
    out = subprocess.run([sys.executable, "-m", "higgs_pack.runtime.cli", "verify", str(cpu_fp32_bundle),
                          "--cases", str(cases), "--report", str(report)], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    html = report.read_text(encoding="utf-8")
    page = assert_self_contained(html)
    pngs = decoded(page, "img", "data:image/png;base64,")
    wavs = decoded(page, "audio", "data:audio/wav;base64,")
    assert all(p.startswith(b"\x89PNG\r\n\x1a\n") for p in pngs)
    assert all(w[:4] == b"RIFF" and w[8:12] == b"WAVE" for w in wavs)
    assert len(wavs) == 3 and len(pngs) == 2 + 3  # parity, greedy, one waveform+spectrogram per case
    text = " ".join(page.text)
    assert "PASS" in text and "Parity per sub-part" in text and "Greedy code agreement" in text
    for part in ("llm_decoder", "audio_tokenizer", "text_embed"):
        assert part in text
    for case in ("text_en_basic", "text_zh", "clone ref_en_16k"):
        assert case in text
    assert text.count("FAIL") == 0


def test_report_without_matplotlib_names_the_extra(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None\n"  # as if it were not installed
            "from higgs_pack.runtime.cli import main\n"
            f"main(['verify', {str(tmp_path)!r}, '--report', {str(tmp_path / 'r.html')!r}])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "needs matplotlib" in out.stderr and "install the [report] extra" in out.stderr
    assert not (tmp_path / "r.html").exists()


def test_bench_html_from_records(tmp_path):
    import json

    from bench.decoder import records as bench_records
    from bench.decoder import report

    records = [
        {"label": "pytorch", "system": "pytorch", "precision": "fp32", "preset": "bench", "frames_per_s": 10.0,
         "first_frame_ms": 90.0, "rtf": 2.5, "outside_decoder_frac": 0.2, "peak_rss_mb": 500.0, "bundle_mb": 80.0},
        {"label": "cpu-int4", "system": "cpu", "precision": "int4", "preset": "bench", "device": "cpu",
         "frames_per_s": 30.0, "first_frame_ms": 30.0, "rtf": 0.8, "outside_decoder_frac": 0.1,
         "roofline_frac": 0.4, "peak_rss_mb": 200.0, "bundle_mb": 20.0},
        {"label": "openvino-int4", "system": "openvino", "precision": "int4", "preset": "bench", "device": "CPU",
         "frames_per_s": 36.0, "first_frame_ms": 25.0, "rtf": 0.7, "outside_decoder_frac": 0.08,
         "roofline_frac": 0.5, "peak_rss_mb": 210.0, "bundle_mb": 18.0},
    ]
    bench_records.add_ratios(records)
    out = tmp_path / "bench.json"
    bench_records.write_records(records, out)
    path = report.write_html(out)
    assert path == tmp_path / "bench.html"
    page = assert_self_contained(path.read_text(encoding="utf-8"))
    pngs = decoded(page, "img", "data:image/png;base64,")
    assert len(pngs) == 4 and all(p.startswith(b"\x89PNG") for p in pngs)
    alts = [a["alt"] for t, a in page.tags if t == "img"]
    assert any("frames per second" in a for a in alts) and any("roofline" in a for a in alts)
    assert any("outside the decoder" in a for a in alts) and any("first audio frame" in a for a in alts)
    text = " ".join(page.text)
    assert "Goals" in text and "openvino int4 >= cpu int4 frames/s" in text
    assert "not measured" in text  # the full-size goals: no full-preset records
    assert json.loads(out.read_text())[0]["label"] == "pytorch"


def test_self_contained_check_catches_external_references():
    with pytest.raises(AssertionError):
        assert_self_contained('<!DOCTYPE html><html><body><img src="https://example.com/x.png"></body></html>')
    with pytest.raises(AssertionError):
        assert_self_contained('<!DOCTYPE html><html><head><script src="x.js"></script></head></html>')
    inline = '<!DOCTYPE html><html><body><img src="data:image/png;base64,iVBORw0K"></body></html>'
    assert assert_self_contained(inline).tags[-1] == ("img", {"src": "data:image/png;base64,iVBORw0K"})


def test_verify_header_without_a_loaded_backend_has_no_empty_parentheses():
    from higgs_pack.runtime.verification.report import VerifyReport

    report = VerifyReport(bundle="b")
    report.add("files", False, "missing: x.onnx")
    assert report.render().splitlines()[0] == "verify b"
    report.backend = "CPUExecutionProvider"
    assert report.render().splitlines()[0] == "verify b (CPUExecutionProvider)"


def test_parity_section_shows_what_decides():
    """The chart and table show the export error against its limit (what the check decides by), and the
    quantization error beside it; the cosine to the float oracle is 'not judged' under matched references."""
    pytest.importorskip("matplotlib")
    from higgs_pack.runtime.verification.html_report import verify_html
    from higgs_pack.runtime.verification.report import VerifyReport, judge_parity

    report = VerifyReport(bundle="b", backend="CPUExecutionProvider")
    report.thresholds = {
        "llm_decoder": {"metric": "cosine", "threshold": 0.85, "max_rel_l2": 0.03, "reference": "matched"},
        "audio_tokenizer": {"metric": "cosine", "threshold": 0.9999, "max_rel_l2": 0.001, "reference": "float"},
    }
    report.parity = {  # a decoder whose cosine to the float oracle is below the old 0.85, export error fine
        "llm_decoder": {"measured": 0.80, "measured_max_abs": 0.7, "rel_l2": 0.6, "matched_rel_l2": 0.008,
                        "matched_cosine": 0.99997},
        "audio_tokenizer": {"measured": 0.99999, "measured_max_abs": 1e-6, "rel_l2": 0.004},  # x1.004: fails
    }
    for part, rule in report.thresholds.items():
        ok, detail = judge_parity(rule, report.parity[part])
        report.add(f"parity {part}", ok, detail)
    assert [c.ok for c in report.checks] == [True, False]
    page = assert_self_contained(verify_html(report))
    text = " ".join(t.strip() for t in page.text if t.strip())
    assert len(decoded(page, "img", "data:image/png;base64,")) == 1  # the parity chart
    assert ("llm_decoder rel L2 vs the oracle with the bundle's weights 0.008 0.03 0.6 "
            "cosine 0.800000 (threshold 0.85, not judged) 0.7 ok") in text, text
    assert "audio_tokenizer rel L2 vs the float oracle 0.004 0.001 cosine 0.999990 (threshold 0.9999) 1e-06 FAIL" \
        in text, text


def test_a_check_shown_but_not_judged_reads_info_not_ok():
    from higgs_pack.runtime.verification.report import VerifyReport

    report = VerifyReport(bundle="b")
    report.add("parity llm_decoder", True, "cos 0.999")
    report.add("greedy codes", True, "not judged at int4: 0/32 steps identical", 0, informational=True)
    lines = report.render().splitlines()
    assert lines[2].split()[:3] == ["info", "greedy", "codes"] and "ok" not in lines[2].split()[:1]
    assert report.ok and report.to_dict()["checks"][1]["status"] == "info"
    report.add("synthesize text_zh", False, "boom")
    assert not report.ok and report.render().endswith("result: FAIL")
