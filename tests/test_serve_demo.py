"""Issue 20 item 5: the demo page at ``/`` as a person uses it, in headless Chromium (Debian's
``chromium`` package, driven by Playwright; no browser is downloaded) against a live server on
127.0.0.1 serving the real tiny cpu int4 bundle.

The page streams ``/v1/audio/speech`` as raw 24 kHz s16le PCM and schedules each piece on a
Web Audio ``AudioContext`` as it arrives; it exposes what it did as ``window.higgsDemo``
(samples scheduled, time to first audio, the context, the peak level that went through it).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from live_server import LiveServer

try:
    from playwright import sync_api
except ImportError as exc:  # not installed, or broken
    pytest.skip(f"playwright (Python) cannot be imported ({exc}); it is in the dev extra: pip install -e '.[dev]'",
                allow_module_level=True)

#: Debian's chromium; the test never downloads a browser.
CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(not CHROMIUM.is_file(), reason=f"Debian's chromium is not installed at {CHROMIUM} "
                                "(apt-get install chromium); the demo page test drives it")

#: Flags for a machine with no network and no display; the autoplay flag lets the
#: AudioContext run without a real user gesture.
CHROMIUM_ARGS = ["--headless", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--autoplay-policy=no-user-gesture-required",
                 "--no-sandbox"]
MODEL = "higgs-audio-v3-tiny"
TEXT = "Hello there, this is a test of the speech server."
#: With seed 3 this runs about a minute of audio (seconds of generation): long enough to stop.
LONG_TEXT = " ".join(f"This is sentence number {i} of a long text to speak." for i in range(1, 18))
RATE = 24000
#: Where a person looks at the page: set HIGGS_PACK_DEMO_SCREENSHOT=path.png to keep a copy of
#: the screenshot taken while the audio plays (it is always written under the test's tmp_path).
SCREENSHOT = os.environ.get("HIGGS_PACK_DEMO_SCREENSHOT")
#: What Chromium itself logs for an answer with an error status (the page shows the error).
_STATUS_LINE = re.compile(r"^Failed to load resource: the server responded with a status of (\d+)")


@pytest.fixture(scope="module")
def server(cpu_int4_bundle, tmp_path_factory):
    with LiveServer(cpu_int4_bundle, "--voices-dir", str(tmp_path_factory.mktemp("voices"))) as live:
        yield live


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One Chromium for the module, on a fresh profile folder."""
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            tmp_path_factory.mktemp("chromium-profile"), executable_path=str(CHROMIUM), headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 900, "height": 1000})
        try:
            yield context
        finally:
            context.close()


class Watched:
    """A page and what it logged: console errors, uncaught exceptions, failed requests, answers
    with an error status, and every URL it asked for."""

    def __init__(self, page, url: str):
        self.page, self.url = page, url
        self.console_errors: list[str] = []
        self.failed: list[str] = []
        self.bad_answers: list[tuple[int, str]] = []
        self.urls: list[str] = []
        page.on("console", lambda m: m.type == "error" and self.console_errors.append(m.text))
        page.on("pageerror", lambda e: self.console_errors.append(f"uncaught: {e}"))
        page.on("requestfailed", lambda r: self.failed.append(f"{r.method} {r.url}: {r.failure}"))
        page.on("response", lambda r: r.status >= 400 and self.bad_answers.append((r.status, r.url)))
        page.on("request", lambda r: self.urls.append(r.url))
        page.goto(url + "/")

    def wait_connected(self) -> None:
        """Until the page knows the model and its voices (Play is enabled)."""
        self.page.wait_for_function("window.higgsDemo && higgsDemo.model !== null && "
                                    "!document.querySelector('#play').disabled", timeout=30_000)

    def status(self, where: str = "#status") -> str:
        return self.page.inner_text(where)

    def wait_status(self, pattern: str, where: str = "#status", timeout_s: float = 60) -> None:
        """Until the status line ``where`` matches the regular expression ``pattern``."""
        self.page.wait_for_function("([p, w]) => new RegExp(p).test(document.querySelector(w).textContent)",
                                    arg=[pattern, where], timeout=timeout_s * 1000)

    def state(self) -> dict:
        return self.page.evaluate("({samples: higgsDemo.samples, firstAudioMs: higgsDemo.firstAudioMs, "
                                  "peak: higgsDemo.peak, time: higgsDemo.context && higgsDemo.context.currentTime, "
                                  "state: higgsDemo.context && higgsDemo.context.state})")

    def play(self, text: str, seed: int | None = None, voice: str | None = None) -> None:
        self.page.fill("#text", text)
        self.page.fill("#seed", "" if seed is None else str(seed))
        if voice is not None:
            self.page.select_option("#voice", voice)
        self.page.click("#play")

    def shown_error(self, where: str = "#error") -> str:
        self.page.wait_for_selector(f"{where}:not([hidden])", timeout=30_000)
        return self.page.inner_text(where)

    def assert_clean(self, allowed_statuses: tuple[int, ...] = ()) -> None:
        """No console error but Chromium's own line for an expected error status, no uncaught
        exception, no failed request, and nothing fetched from anywhere but the server."""
        unexpected = [line for line in self.console_errors
                      if not ((m := _STATUS_LINE.match(line)) and int(m.group(1)) in allowed_statuses)]
        assert unexpected == [], f"console errors: {unexpected}"
        assert [s for s, _ in self.bad_answers if s not in allowed_statuses] == [], self.bad_answers
        assert self.failed == [], f"failed requests: {self.failed}"
        foreign = [u for u in self.urls if not u.startswith(self.url + "/") and not u.startswith(("data:", "blob:"))]
        assert foreign == [], f"the page fetched from outside the server: {foreign}"


@pytest.fixture
def page(browser, server):
    page = browser.new_page()
    try:
        watched = Watched(page, server.url)
        watched.wait_connected()
        yield watched
    finally:
        page.close()


def _whole_pcm(server, **body) -> np.ndarray:
    answer = httpx.post(server.url + "/v1/audio/speech", timeout=120,
                        json={"model": MODEL, "response_format": "pcm", **body})
    assert answer.status_code == 200, answer.text
    return np.frombuffer(answer.content, "<i2")


def _seconds(shown: str) -> float:
    match = re.fullmatch(r"(\d+\.\d+) s", shown.strip())
    assert match, f"not a number of seconds: {shown!r}"
    return float(match.group(1))


def test_play_streams_the_audio_into_the_audio_context_as_it_arrives(page, server, tmp_path):
    assert page.page.is_hidden("#key-form")  # no --api-key: no key field
    assert page.page.inner_text("#about").startswith("higgs-audio-v3-tiny-cpu-int4")
    assert page.page.eval_on_selector_all("#voice option", "os => os.map(o => o.value)") == ["default"]
    page.play(TEXT, seed=5)
    page.wait_status("playing")  # every piece is scheduled: the rest plays out in real time
    playing = tmp_path / "playing.png"
    page.page.screenshot(path=str(playing), full_page=True)
    if SCREENSHOT:
        shutil.copyfile(playing, SCREENSHOT)
    page.wait_status("^Done\\.$")
    state = page.state()
    whole = _whole_pcm(server, input=TEXT, seed=5)
    assert state["samples"] == whole.size > RATE  # every sample of the answer was scheduled
    first = _seconds(page.page.inner_text("#ttfa"))
    assert first > 0 and first == pytest.approx(state["firstAudioMs"] / 1000, abs=0.001)
    assert _seconds(page.page.inner_text("#received")) == pytest.approx(whole.size / RATE, abs=0.005)
    # it played: the context ran past the end of the audio, and the signal went through its graph
    assert state["state"] == "running" and state["time"] >= whole.size / RATE
    assert state["peak"] > 0.01
    saved = page.page.evaluate("fetch(document.querySelector('#save').href).then(r => r.arrayBuffer())"
                               ".then(b => Array.from(new Uint8Array(b)))")
    kept = np.frombuffer(bytes(saved[44:]), "<i2").astype(int)
    assert bytes(saved[:4]) == b"RIFF" and kept.size == whole.size
    assert np.abs(kept - whole).max() <= 2  # streamed and whole differ by codec-window rounding at most
    assert page.page.is_disabled("#stop") and not page.page.is_disabled("#play")
    page.assert_clean()


def test_pieces_that_split_a_sample_decode_as_one_piece(page):
    """The body's pieces may end inside a sample (odd byte counts): the split byte is joined to
    the next piece, so any split gives the samples of the whole."""
    samples = np.array([0, 1, -1, 32767, -32768, 12345, -23456, 258, -2, 7], dtype="<i2")
    cuts = [0, 1, 2, 5, 6, 9, 13, 14, 17, 20]  # pieces of 1, 1, 3, 1, 3, 4, 1, 3, 3 bytes
    decoded = page.page.evaluate("""([bytes, cuts]) => {
        const pcm = new higgsDemo.Pcm16(), all = Uint8Array.from(bytes), out = [];
        for (let i = 1; i < cuts.length; i++) out.push(...pcm.samples(all.subarray(cuts[i - 1], cuts[i])));
        return out;
    }""", [list(samples.tobytes()), cuts])
    assert decoded == (samples / 32768).tolist()


def test_an_uploaded_voice_joins_the_picker_and_speaks(page, server, cases_dir, tmp_path):
    transcript = (cases_dir / "ref_en_16k.txt").read_text().strip()
    page.page.fill("#up-name", "fox-reader")
    page.page.set_input_files("#up-audio", str(cases_dir / "ref_en_16k.txt"))  # not audio: the server says so
    page.page.fill("#up-text", transcript)
    page.page.click("#up-send")
    assert "audio" in page.shown_error("#up-error")
    assert page.page.eval_on_selector_all("#voice option", "os => os.map(o => o.value)") == ["default"]
    page.page.set_input_files("#up-audio", str(cases_dir / "ref_en_16k.wav"))
    page.page.click("#up-send")
    page.wait_status("^Voice fox-reader added", "#up-status")
    assert page.page.is_hidden("#up-error")
    options = page.page.eval_on_selector_all("#voice option", "os => os.map(o => o.value)")
    assert options == ["default", "fox-reader"]
    assert page.page.input_value("#voice") == "fox-reader"  # selected
    listed = httpx.get(server.url + "/v1/audio/voices", timeout=10).json()["voices"]
    assert [v["transcript"] for v in listed if v["name"] == "fox-reader"] == [transcript]
    assert page.page.input_value("#up-name") == ""  # the form is ready for the next one
    page.play(TEXT, seed=2)
    page.wait_status("^Done\\.$")
    assert page.state()["samples"] == _whole_pcm(server, input=TEXT, seed=2, voice="fox-reader").size
    # the voice is deleted behind the page's back: playing it shows the server's error
    assert httpx.delete(server.url + "/v1/audio/voices/fox-reader", timeout=10).status_code == 200
    page.play(TEXT, voice="fox-reader")
    message = page.shown_error()
    assert "voice 'fox-reader' is not known" in message and "POST /v1/audio/voices" in message
    assert page.status() == "" and not page.page.is_disabled("#play")
    page.page.wait_for_function("document.querySelector('#voice').options.length === 1")  # the list is refreshed
    assert page.page.input_value("#voice") == "default"
    page.page.screenshot(path=str(tmp_path / "unknown-voice.png"), full_page=True)
    page.assert_clean(allowed_statuses=(400,))


def test_the_servers_error_for_empty_text_is_shown(page):
    page.play("   ")
    assert page.shown_error().startswith("input is only whitespace: there is nothing to speak")
    assert page.page.inner_text("#ttfa") == "–" and page.state()["samples"] == 0
    assert not page.page.is_disabled("#play") and page.page.is_disabled("#stop")
    page.play(TEXT, seed=1)  # the next request clears it
    page.wait_status("playing|^Done")
    assert page.page.is_hidden("#error")
    page.assert_clean(allowed_statuses=(400,))


def test_stop_aborts_the_fetch_and_the_server_cancels_the_request(page, server):
    frames_before = server.metric("higgs_pack_engine_frames_total")
    page.play(LONG_TEXT, seed=3)
    page.page.wait_for_function("higgsDemo.firstAudioMs !== null", timeout=60_000)
    assert server.metric("higgs_pack_in_flight") == 1
    page.page.click("#stop")
    assert page.status() == "Stopped."
    deadline = time.monotonic() + 10
    while server.metric("higgs_pack_in_flight") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("higgs_pack_in_flight") == 0 and server.metric("higgs_pack_active_batch") == 0
    made = server.metric("higgs_pack_engine_frames_total") - frames_before
    time.sleep(0.5)
    assert server.metric("higgs_pack_engine_frames_total") - frames_before == made  # nothing runs on
    assert made < 60 * 25 / 2  # the whole answer is about a minute of audio at 25 frames/s
    page.page.wait_for_timeout(200)  # let the browser report the aborted request
    assert [f for f in page.failed if "/v1/audio/speech" in f and "ERR_ABORTED" in f], page.failed
    page.failed.clear()  # the one failed request is the aborted one
    assert page.page.is_disabled("#stop") and not page.page.is_disabled("#play")
    page.assert_clean()


def test_the_api_key_field_appears_when_the_server_wants_a_key(browser, cpu_int4_bundle):
    with LiveServer(cpu_int4_bundle, "--api-key", "s3cret-key") as live:
        page = browser.new_page()
        try:
            watched = Watched(page, live.url)
            page.wait_for_selector("#key-form:not([hidden])", timeout=30_000)
            assert page.is_disabled("#play")
            assert watched.shown_error("#key-error").startswith("missing or wrong API key")
            page.fill("#key", "wrong-key")
            with page.expect_response("**/v1/models") as refused:
                page.click("#key-form button")
            assert refused.value.status == 401 and page.is_visible("#key-error") and page.is_disabled("#play")
            page.fill("#key", "s3cret-key")
            page.click("#key-form button")
            watched.wait_connected()
            assert page.is_hidden("#key-error") and page.is_visible("#key-form")  # kept, to change the key
            assert page.eval_on_selector_all("#voice option", "os => os.map(o => o.value)") == ["default"]
            watched.play(TEXT, seed=5, voice="default")
            watched.wait_status("playing|^Done")
            assert watched.state()["samples"] > 0
            watched.assert_clean(allowed_statuses=(401,))
        finally:
            page.close()



def test_the_api_docs_render_offline_with_the_speech_body(browser, server, tmp_path):
    """Issue 29 item 10: ``/docs`` draws Swagger UI from the server's own files (this browser
    reaches nothing else) and shows the speech route's request body, field by field."""
    page = browser.new_page()
    try:
        watched = Watched(page, server.url)
        watched.wait_connected()  # the demo page's own requests done before it is left
        page.goto(server.url + "/docs")
        operation = "#operations-default-speech_v1_audio_speech_post"
        page.wait_for_selector(operation, timeout=30_000)
        page.click(f"{operation} .opblock-summary")
        page.wait_for_selector(f"{operation} .opblock-section-request-body", timeout=30_000)
        shown = page.inner_text(operation)
        assert "Request body" in shown and "application/json" in shown, shown[:2000]
        assert "higgs-audio-v3-tiny" in shown and "Hello from the server." in shown  # the body's example
        page.click(f"{operation} .opblock-section-request-body button[data-name='model']")
        page.wait_for_selector(f"{operation} .model-box", timeout=30_000)
        described = page.inner_text(f"{operation} .opblock-section-request-body")
        for field in ("input", "voice", "stream_format", "ref_audio", "max_new_tokens"):
            assert field in described, described[:3000]
        page.screenshot(path=str(tmp_path / "docs.png"), full_page=True)
        watched.assert_clean()
    finally:
        page.close()


def test_type_while_it_speaks_plays_the_first_sentence_and_cancel_stops_it(page, server):
    """Issue 31 item 4: the live box sends text over the WebSocket as it is typed; the first
    finished sentence plays through the page's AudioContext; Cancel stops the sentence being
    spoken (the server frees its row) and what was scheduled, and typing on speaks again."""
    page.play(TEXT, seed=1)  # a first request makes the AudioContext (as a person's click would)
    page.wait_status("^Done\\.$")
    page.page.type("#live-text", "Hello there. ", delay=20)  # typed, key by key
    page.page.wait_for_function("higgsDemo.live.firstAudioMs !== null", timeout=60_000)
    page.page.wait_for_function("higgsDemo.live.sentences.length === 1 && higgsDemo.live.sentences[0].done",
                                timeout=60_000)
    first = page.page.evaluate("({s: higgsDemo.live.sentences[0], samples: higgsDemo.live.samples, "
                               "ms: higgsDemo.live.firstAudioMs})")
    assert first["s"]["text"] == "Hello there." and first["s"]["start"] == 0
    assert first["samples"] == round(first["s"]["end"] * RATE) > 0 and first["ms"] > 0
    assert page.status("#live-status").startswith("Speaking sentence 1: Hello there.")
    t0 = page.page.evaluate("higgsDemo.context.currentTime")
    page.page.wait_for_timeout(300)
    assert page.page.evaluate("higgsDemo.context.currentTime") > t0  # it plays
    # a long sentence (a cap of about 80 s of audio), cancelled as soon as it speaks
    long = "This one sentence goes on and on and " * 24 + "until it ends. "  # no clause end: one part
    page.page.fill("#live-text", "Hello there. " + long)
    page.page.dispatch_event("#live-text", "input")
    page.page.wait_for_function("higgsDemo.live.sentences.length === 2 && higgsDemo.live.sources.size > 0",
                                timeout=60_000)
    assert server.metric("higgs_pack_active_batch") == 1
    page.page.click("#live-cancel")
    page.wait_status("^Cancelled", "#live-status", timeout_s=10)
    assert page.page.evaluate("higgsDemo.live.sources.size") == 0  # nothing left playing
    deadline = time.monotonic() + 10
    while server.metric("higgs_pack_active_batch") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("higgs_pack_active_batch") == 0
    samples = page.page.evaluate("higgsDemo.live.samples")
    page.page.wait_for_timeout(500)
    assert page.page.evaluate("higgsDemo.live.samples") == samples  # no audio of it came after the cancel
    assert not page.page.evaluate("higgsDemo.live.sentences[1].done")
    page.page.type("#live-text", "Back again. ", delay=20)
    page.page.wait_for_function("higgsDemo.live.sentences.length === 3 && higgsDemo.live.sentences[2].done",
                                timeout=60_000)
    assert page.page.evaluate("higgsDemo.live.sentences[2].text") == "Back again."
    assert page.page.evaluate("higgsDemo.live.samples") > samples
    page.assert_clean()
