"""Issue 37 item 2: one text is one text at every door (runtime/text.py).

A leading byte-order mark is dropped; lines end at LF, CR LF and CR only (U+2028 and U+2029 are
text inside a line); control characters other than tab and line feed are refused naming the field;
bytes that are not UTF-8 are refused naming the field.  The rule is tested on its own, then walked
through every door: the Python API, a dialogue's turns and script, ``--batch`` lines, the CLI's
``--text``, ``--text-file``, stdin and script, the server's JSON fields, a voice upload's multipart
parts and the live WebSocket's ``input.text``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from live_server import LiveServer

from higgs_pack.errors import InputError
from higgs_pack.runtime import text as text_rule
from higgs_pack.runtime.batch import read_lines
from higgs_pack.runtime.loop.dialogue import as_turns, parse_script
from higgs_pack.runtime.request import SynthesisRequest, Voice

HIGGS = [sys.executable, "-m", "higgs_pack.runtime.cli"]
BOM = "\ufeff"
#: Characters no text may hold, with the name the message gives them.
REFUSED = [("\x00", "NUL"), ("\x01", "U+0001"), ("\x1b", "ESCAPE"), ("\x7f", "DELETE"), ("\x85", "NEXT LINE"),
           ("\x9f", "U+009F"), ("\x0b", "VERTICAL TAB"), ("\x0c", "FORM FEED")]


# the rule itself
def test_clean_drops_a_leading_bom_and_makes_every_line_end_lf():
    assert text_rule.clean(BOM + "a\r\nb\rc\nd") == "a\nb\nc\nd"
    assert text_rule.clean("a" + BOM + "b") == "a" + BOM + "b"  # only a leading one is a byte-order mark
    assert text_rule.clean(7) == 7  # not text: left for the check to name
    assert text_rule.lines("A: x\u2028y\u2029z\r\nB: w") == ["A: x\u2028y\u2029z", "B: w"]


@pytest.mark.parametrize(("char", "name"), REFUSED)
def test_control_characters_are_refused_naming_the_field_and_the_character(char, name):
    problem = text_rule.problem(f"Hello{char} there.", "input")
    assert problem is not None and problem.startswith("input holds a control character at character 6")
    assert name in problem


@pytest.mark.parametrize("value", ["tab\tinside.", "two\nlines.", "crlf\r\nlines.", BOM + "bom.", "a\u2028b.",
                                   "emoji \U0001f469\u200d\U0001f4bb."])
def test_tab_line_breaks_and_format_characters_are_text(value):
    assert text_rule.problem(value, "input") is None


def test_decode_refuses_bytes_that_are_not_utf8_naming_where_and_the_byte():
    assert text_rule.decode(b"\xef\xbb\xbfHi\r\n", "x") == "Hi\n"
    with pytest.raises(InputError, match=r"^the transcript part is not UTF-8 text \(byte 11 is 0xFF"):
        text_rule.decode(b"The quick \xff fox", "the transcript part")


# the Python doors
def test_a_request_holds_the_cleaned_text_and_refuses_nul_naming_its_field(cases_dir):
    request = SynthesisRequest.create(BOM + "Hello\r\nthere.")
    assert request.text == "Hello\nthere."
    with pytest.raises(InputError, match=r"^text holds a control character .*NUL.*set it with text=$"):
        SynthesisRequest.create("Hello\x00 there.")
    with pytest.raises(InputError, match=r"^ref_text holds a control character .*NUL.*set it with ref_text=$"):
        SynthesisRequest.create("Hi.", ref_audio=cases_dir / "ref_en_16k.wav", ref_text="Exact\x00 words.")
    assert Voice(cases_dir / "ref_en_16k.wav", BOM + "Her words.\r\n").transcript == "Her words.\n"


def test_a_script_and_turns_read_a_bom_line_separators_and_nul_one_way():
    turns = parse_script(BOM + "ANN: Hello\u2028there.\r\nBEN: Hi.\rANN: Bye.\n", "talk.txt")
    assert [(t.speaker, t.text) for t in turns] == [("ANN", "Hello\u2028there."), ("BEN", "Hi."), ("ANN", "Bye.")]
    with pytest.raises(InputError, match=r"the text of line 2 of talk.txt \('BEN'\) holds a control character at character 3 .*NUL"):
        parse_script("ANN: Hello.\nBEN: Hi\x00 there.\n", "talk.txt")
    (turn,) = as_turns([(BOM + "ANN", "Hello\r\nthere.")])
    assert (turn.speaker, turn.text) == ("ANN", "Hello\nthere.")


def test_batch_lines_end_at_lf_crlf_and_cr_only():
    lines, count = read_lines("one\u2028still one.\r\ntwo.\rthree.\n", None)
    assert [line.text for line in lines] == ["one\u2028still one.", "two.", "three."] and count == 3
    with pytest.raises(InputError, match=r"line 2 of the text file holds a control character .*ESCAPE"):
        read_lines("fine.\nnot \x1b fine.\n", None)


def test_batch_lines_read_a_bom_as_http_input_does():
    # each line is one text: a leading BOM dropped (as HTTP's input), then a line empty after it is
    # skipped as a whitespace-only line is (its number kept)
    lines, count = read_lines("First.\n" + BOM + "\n   \n" + BOM + "Fourth.\n", 7)
    assert [(line.number, line.text, line.seed) for line in lines] == [(1, "First.", 7), (4, "Fourth.", 10)]
    assert count == 4


# the command line
def _run(*args, input=None):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([*HIGGS, *map(str, args)], capture_output=True, input=input, env=env)


def test_cli_names_a_bad_byte_and_a_control_character_the_same_way_at_every_text_door(tmp_path, monkeypatch):
    from higgs_pack.runtime.cli import _read_text

    argv = os.fsdecode(b"Caf\xe9 au lait.")  # a Latin-1 argument, as Python hands it over (surrogateescape)
    with pytest.raises(InputError, match=r"^--text is not UTF-8 text \(byte 4 is 0xE9"):
        _read_text(argv, None)
    assert _read_text("Caf\u00e9 \U0001f600.", None) == "Caf\u00e9 \U0001f600."
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"Hello\x00 there.")
    with pytest.raises(InputError, match=rf"^--text-file {notes} holds a control character at character 6 .*NUL"):
        _read_text(None, notes)

    class Stdin:
        buffer = __import__("io").BytesIO(b"Hello\x1b there.")

        @staticmethod
        def isatty():
            return False

    monkeypatch.setattr(sys, "stdin", Stdin)
    with pytest.raises(InputError, match=r"^standard input holds a control character at character 6 .*ESCAPE"):
        _read_text("-", None)


@pytest.mark.parametrize(("content", "kind"), [(b"", "empty"), (b"\xef\xbb\xbf \r\n\t\n", "only whitespace")])
def test_an_empty_text_file_or_stdin_is_named_as_a_control_character_in_it_is(tmp_path, content, kind):
    """Issue 37: an empty --text-file said "text is empty ...; set it with --text or --text-file /
    text=", not naming the file; a control character in it names it."""
    empty = tmp_path / "empty.txt"
    empty.write_bytes(content)
    out = _run("synthesize", tmp_path / "no-bundle", "--text-file", empty, "-o", tmp_path / "a.wav")
    said = out.stderr.decode()
    assert out.returncode == 2 and f"--text-file {empty} is {kind}: there is nothing to speak; write the words" in said, said
    assert "set it with --text" not in said and not (tmp_path / "a.wav").exists()
    out = _run("synthesize", tmp_path / "no-bundle", "-o", tmp_path / "b.wav", input=content)
    said = out.stderr.decode()
    assert out.returncode == 2 and f"standard input is {kind}: there is nothing to speak; pipe the words in" in said, said


def test_batch_line_problems_name_the_file():
    with pytest.raises(InputError, match=r"^line 2 of notes.txt holds a control character .*ESCAPE"):
        read_lines("fine.\nnot \x1b fine.\n", None, "notes.txt")
    with pytest.raises(InputError, match=r"^standard input has no non-empty line"):
        read_lines("\n \n", None, "standard input")


def test_batch_refuses_every_lines_special_token_before_any_line_is_spoken(cpu_int4_bundle, tmp_path):
    """Issue 37: a special token in one line of --batch failed that line after the others were
    spoken, while a control character refuses the run first; now both refuse the run before
    anything is spoken, every line named."""
    lines = tmp_path / "lines.txt"
    lines.write_text("First line.\nSay <|endoftext|> now.\nThird line.\n<|im_start|> too.\n")
    out = _run("synthesize", cpu_int4_bundle, "--text-file", lines, "--batch", "2", "-o", tmp_path / "out",
               "--max-frames", "10", "--no-progress")
    said = out.stderr.decode()
    assert out.returncode == 2, said
    assert "2 problems with the request:" in said, said
    assert f"  - line 2 of {lines} contains the tokenizer's special token(s) <|endoftext|>" in said, said
    assert f"  - line 4 of {lines} contains the tokenizer's special token(s) <|im_start|>" in said, said
    assert said.count("fix or remove that line of --text-file") == 2 and "--text /" not in said, said
    assert not (tmp_path / "out").exists()  # nothing spoken, no folder made


def test_cli_text_files_stdin_and_scripts_drop_a_bom_and_refuse_other_bytes(cpu_int4_bundle, tmp_path):
    pytest.importorskip("srt", reason="--subtitles needs the [subtitles] extra")
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"\xef\xbb\xbfHello there.\r\nA second line.\r\n")  # Windows Notepad's UTF-8
    out = _run("synthesize", cpu_int4_bundle, "--text-file", notes, "-o", tmp_path / "a.wav", "--no-progress",
               "--max-frames", "10", "--subtitles", tmp_path / "a.srt")
    assert out.returncode == 0, out.stderr.decode()
    subtitles = (tmp_path / "a.srt").read_text(encoding="utf-8")
    assert BOM not in subtitles and "Hello there." in subtitles
    out = _run("synthesize", cpu_int4_bundle, "-o", tmp_path / "b.wav", "--no-progress", "--max-frames", "10",
               input=b"\xef\xbb\xbfFrom standard input.\n")
    assert out.returncode == 0, out.stderr.decode()
    latin = tmp_path / "latin.txt"
    latin.write_bytes("Caf\xe9 au lait.".encode("latin-1"))
    out = _run("synthesize", cpu_int4_bundle, "--text-file", latin, "-o", tmp_path / "c.wav", "--no-progress")
    assert out.returncode == 2 and f"--text-file {latin} is not UTF-8 text (byte 4 is 0xE9" in out.stderr.decode()
    assert not (tmp_path / "c.wav").exists()
    out = _run("synthesize", cpu_int4_bundle, "--text", "Hello\x1b there.", "-o", tmp_path / "d.wav")
    assert out.returncode == 2 and "text holds a control character" in out.stderr.decode()
    out = _run("dialogue", cpu_int4_bundle, "-", "-o", tmp_path / "e.wav", "--max-frames", "10",
               input=b"\xef\xbb\xbfANN: Hello.\nBEN: Hi there.\n")
    assert out.returncode == 0, out.stderr.decode()
    out = _run("dialogue", cpu_int4_bundle, "-", "-o", tmp_path / "f.wav", input=b"Hello.\n")
    assert out.returncode == 2 and "line 1 of standard input has no speaker" in out.stderr.decode()


# the server
@pytest.fixture(scope="module")
def server(cpu_int4_bundle):
    with LiveServer(cpu_int4_bundle, "--max-input-chars", "2000") as live:
        live.ws = live.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
        yield live


def _post(server, route, body):
    return httpx.post(server.url + route, json={"model": "higgs-audio-v3-tiny", **body}, timeout=120)


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/audio/speech", {"input": "Hello\u0000 there."}, "input"),
    ("/v1/audio/speech", {"input": "Hi.", "voice": "default\u0085"}, "voice"),
    ("/v1/audio/dialogue", {"turns": [{"speaker": "ANN", "input": "Hi\u0000."}]}, "turns[0].input"),
    ("/v1/audio/dialogue", {"turns": [{"speaker": "A\u001bNN", "input": "Hi."}]}, "turns[0].speaker"),
])
def test_http_fields_refuse_control_characters_naming_the_field(server, route, body, param):
    answer = _post(server, route, body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and "holds a control character" in error["message"]


def test_http_text_is_cleaned_as_at_every_other_door(server):
    assert _post(server, "/v1/audio/speech", {"input": BOM + "Hello\r\nthere.", "max_new_tokens": 10}
                 ).status_code == 200
    answer = _post(server, "/v1/audio/dialogue", {"turns": [{"speaker": BOM + "ANN", "input": "Hello\u2028there."}],
                                                  "max_new_tokens": 10, "stream_format": "sse"})
    assert answer.status_code == 200, answer.text
    events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
    segments = [e for e in events if e["type"] == "speech.segment"]
    assert [(e["speaker"], e["text"]) for e in segments] == [("ANN", "Hello\u2028there.")], segments


def _post_bytes(server, route, data):
    return httpx.post(server.url + route, content=data, headers={"Content-Type": "application/json"}, timeout=120)


@pytest.mark.parametrize(("route", "fields"), [("/v1/audio/speech", "model, input and voice"),
                                               ("/v1/audio/dialogue", "model, turns and voices")])
def test_a_body_that_is_not_json_is_told_the_routes_own_fields(server, route, fields):
    answer = _post_bytes(server, route, b"{bad")
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_json" and error["message"].endswith(f"; send a JSON object with {fields}")


@pytest.mark.parametrize(("words", "byte"), [(b"Caf\xe9 au lait.", "0xE9"),  # Latin-1
                                             (b"Cesu \xed\xa0\x80 bytes.", "0xED")])  # an encoded surrogate
def test_a_json_body_that_is_not_utf8_is_refused_naming_the_byte_as_every_door_does(server, words, byte):
    body = b'{"model": "higgs-audio-v3-tiny", "input": "' + words + b'"}'
    answer = _post_bytes(server, "/v1/audio/speech", body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_json" and error["param"] is None
    assert error["message"].startswith(f"the body is not UTF-8 text (byte {body.index(bytes.fromhex(byte[2:])) + 1} is {byte}")
    bom = b"\xef\xbb\xbf" + json.dumps({"model": "higgs-audio-v3-tiny", "input": "Hi.", "max_new_tokens": 10}).encode()
    assert _post_bytes(server, "/v1/audio/speech", bom).status_code == 200  # a BOM before the JSON is dropped


@pytest.mark.parametrize(("part", "value"), [("transcript", b"The quick \xff fox."), ("name", b"caf\xe9")])
def test_a_voice_upload_refuses_a_part_that_is_not_utf8_naming_the_part(server, cases_dir, part, value):
    parts = {"name": b"fine", "transcript": b"Exact words."}
    parts[part] = value
    answer = httpx.post(server.url + "/v1/audio/voices", timeout=60, data=None,
                        files={"audio": ("r.wav", (cases_dir / "ref_en_16k.wav").read_bytes(), "audio/wav"),
                               **{k: (None, v) for k, v in parts.items()}})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == part and f"the {part} part is not UTF-8 text" in error["message"]
    assert httpx.get(server.url + "/v1/audio/voices").json()["voices"][1:] == []  # nothing stored


def test_a_voice_upload_transcript_with_nul_is_refused(server, cases_dir):
    answer = httpx.post(server.url + "/v1/audio/voices", timeout=60,
                        files={"audio": ("r.wav", (cases_dir / "ref_en_16k.wav").read_bytes(), "audio/wav"),
                               "name": (None, b"fine"), "transcript": (None, b"Exact\x00 words.")})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "transcript"


def test_websocket_text_follows_the_rule_and_a_frame_that_is_not_utf8_is_closed_1007(server):
    websockets = pytest.importorskip("websockets", reason="the websockets client is a dev dependency")

    async def session() -> tuple[list[dict], int | None]:
        events = await _live_session(websockets, server, [{"type": "input.text", "text": piece} for piece in
                                                          ["Hello\x00", "bad \ud800 piece", BOM + "Hi there.\r\n"]])
        async with websockets.connect(server.ws) as ws:
            # a text frame whose payload is not UTF-8: the protocol's 1007 (RFC 6455 section 8.1)
            await ws.send(b"\xff\xfe", text=True)
            try:
                await asyncio.wait_for(ws.recv(), 30)
            except websockets.ConnectionClosed as closed:
                return events, closed.rcvd.code if closed.rcvd else None
        return events, None

    labels = 'route="/v1/audio/speech/stream",status="{}"'
    before = {status: server.metric("higgs_pack_requests_total", labels.format(status)) for status in ("400", "499")}
    events, code = asyncio.run(session())
    time.sleep(0.5)
    after = {status: server.metric("higgs_pack_requests_total", labels.format(status)) for status in ("400", "499")}
    assert after == {"400": before["400"] + 1, "499": before["499"]}  # refused, not a client that left
    log = "".join(server.log)
    assert "text frame that is not UTF-8" in log and "Traceback" not in log
    errors = [e for e in events if e["type"] == "error"]
    assert [e["param"] for e in errors] == ["text", "text"], errors
    assert "NUL" in errors[0]["message"] and errors[1]["message"].startswith("text is not valid Unicode")
    assert [e["sentence_text"] for e in events if e["type"] == "audio.start"] == ["Hi there."]
    assert code == 1007


def test_a_live_message_may_start_with_a_bom_before_its_json_as_an_http_body_may(server):
    events = _live(server, [BOM + json.dumps({"type": "input.text", "text": "Hi there."})],
                   done=BOM + json.dumps({"type": "input.done"}))
    assert [e for e in events if e["type"] == "error"] == []
    assert [e["sentence_text"] for e in events if e["type"] == "audio.start"] == ["Hi there."]


def test_a_voice_flags_transcript_that_is_not_utf8_is_refused_naming_the_byte_as_ref_text_is(cases_dir):
    from higgs_pack.runtime.cli import _voice_flag

    clip = cases_dir / "ref_en_16k.wav"
    latin = os.fsdecode(b"Caf\xe9.")  # as Python hands a Latin-1 argument over (surrogateescape)
    with pytest.raises(InputError, match=r"^the transcript in --voice 'ANN' is not UTF-8 text \(byte 4 is 0xE9"):
        _voice_flag(f"ANN={clip}:{latin}")
    assert _voice_flag(f"ANN={clip}:Caf\u00e9.") == ("ANN", (clip, "Caf\u00e9."))


def test_a_dialogue_voice_key_and_a_stored_voice_name_follow_the_rule_of_speechs_voice(server):
    turns = [{"speaker": "ANN", "input": "Hi."}]
    for voices in ({BOM + "ANN": "default"}, {"ANN": BOM + "default"}, {" ANN ": {"id": "default"}}):
        answer = _post(server, "/v1/audio/dialogue", {"turns": turns, "voices": voices, "max_new_tokens": 10})
        assert answer.status_code == 200, (voices, answer.text)
    for voices, param in (({"ANN": "bad\u0000name"}, "voices.ANN"), ({"A\u0000NN": "default"}, "voices")):
        answer = _post(server, "/v1/audio/dialogue", {"turns": turns, "voices": voices})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (error["param"], error["code"]) == (param, "invalid_value") and "control character" in error["message"]
    answer = _post(server, "/v1/audio/dialogue", {"turns": turns, "voices": {"ANN": "default", BOM + "ANN": "default"}})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "duplicate_field", answer.text


def test_a_voice_flags_name_and_a_python_voices_key_drop_a_bom_as_a_speaker_does(cases_dir):
    from higgs_pack.runtime.cli import _voice_flag
    from higgs_pack.runtime.loop.dialogue import DialogueRequest

    clip = cases_dir / "ref_en_16k.wav"
    assert _voice_flag(f"{BOM}ANN={clip}:Words.") == ("ANN", (clip, "Words."))
    request = DialogueRequest.create([("ANN", "Hi.")], {BOM + "ANN": None})
    assert list(request.voices) == ["ANN"]


def test_deleting_a_voice_reads_its_name_as_using_and_uploading_one_do(server, cases_dir):
    """Issue 37: DELETE /v1/audio/voices/<BOM>name kept the BOM (404), while an upload's name and
    speech's voice drop it; a control character in the name is refused naming ``name``."""
    answer = httpx.post(server.url + "/v1/audio/voices", timeout=60,
                        files={"audio": ("r.wav", (cases_dir / "ref_en_16k.wav").read_bytes(), "audio/wav"),
                               "name": (None, (BOM + "bomvoice").encode()), "transcript": (None, b"Exact words.")})
    assert answer.status_code == 201 and answer.json()["name"] == "bomvoice", answer.text
    assert _post(server, "/v1/audio/speech", {"input": "Hi.", "voice": BOM + "bomvoice", "max_new_tokens": 5}
                 ).status_code == 200
    bad = httpx.delete(server.url + "/v1/audio/voices/bom%00voice", timeout=30)
    assert bad.status_code == 400, bad.text
    error = bad.json()["error"]
    assert error["param"] == "name" and "holds a control character" in error["message"], error
    gone = httpx.delete(server.url + "/v1/audio/voices/%EF%BB%BFbomvoice", timeout=30)
    assert gone.status_code == 200 and gone.json() == {"name": "bomvoice", "deleted": True}, gone.text
    assert httpx.get(server.url + "/v1/audio/voices").json()["voices"][1:] == []


# issue 37, pass 3: what an error echoes back
def test_an_echoed_text_is_encodable_and_clipped_with_its_length():
    from higgs_pack.errors import clipped, encodable

    assert encodable("a\ud800b") == "a\\ud800b" and encodable("caf\u00e9") == "caf\u00e9"
    assert clipped("x" * 80) == "x" * 80
    assert clipped("x" * 49000) == "x" * 80 + "\u2026 (49000 characters)"


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/audio/speech", b'{"model":"higgs-audio-v3-tiny","input":"Hi.","\\ud800":1}'),
    ("/v1/audio/speech", b'{"model":"higgs-audio-v3-tiny","input":"Hi.","\\ud800":1,"\\ud800":2}'),
    ("/v1/audio/dialogue", b'{"model":"higgs-audio-v3-tiny","turns":[{"speaker":"A","input":"Hi."}],"\\ud800":1}'),
    ("/v1/audio/dialogue",
     b'{"model":"higgs-audio-v3-tiny","turns":[{"speaker":"A","input":"Hi.","\\ud800":1,"\\ud800":2}]}'),
])
def test_a_json_key_that_is_a_lone_surrogate_is_a_400_naming_it_escaped(server, route, body):
    """Pass 3 finding 1: the 400's param held the raw lone surrogate, which the answer could not
    encode: a 500 with a traceback, and the connection reset."""
    with httpx.Client(timeout=60) as client:  # one keep-alive connection: the next request must still work
        answer = client.post(server.url + route, content=body, headers={"Content-Type": "application/json"})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["code"] in ("unknown_field", "duplicate_field"), error
        assert error["param"] in ("\\ud800", "turns[0].\\ud800"), error  # a nested key named by its place
        assert "\\ud800" in error["message"]
        assert client.get(server.url + "/health").status_code == 200


async def _live_session(websockets, server, messages, done: str = '{"type": "input.done"}') -> list[dict]:
    """The live route's JSON events for ``messages`` (a str is sent as it is, else as JSON) and
    ``done``, up to ``session.done``."""
    events = []
    async with websockets.connect(server.ws) as ws:
        for message in messages:
            await ws.send(message if isinstance(message, str) else json.dumps(message))
        await ws.send(done)
        while True:
            message = await asyncio.wait_for(ws.recv(), 120)
            if isinstance(message, str):
                events.append(json.loads(message))
                if events[-1]["type"] == "session.done":
                    return events


def _live(server, messages, **done):
    websockets = pytest.importorskip("websockets", reason="the websockets client is a dev dependency")
    return asyncio.run(_live_session(websockets, server, messages, **done))


def test_a_live_error_escapes_a_lone_surrogate_key_and_clips_a_long_sentence(server):
    long = "Say <|im_start|> " + "word " * 100 + "end."
    (error,) = [e for e in _live(server, ['{"type":"session.config","\\ud800":1}']) if e["type"] == "error"]
    assert error["param"] == "\\ud800" and "\\ud800" in error["message"], error
    events = _live(server, [{"type": "input.text", "text": long}])
    (sentence,) = [e for e in events if e["type"] == "error"]
    assert sentence["sentence_text"] == long[:80] + f"\u2026 ({len(long)} characters)"


# issue 37, pass 3: whitespace and format characters are nothing to speak
ZWSP, ZWJ = "\u200b", "\u200d"


def test_a_sentence_of_only_format_characters_is_dropped_as_a_blank_one_is():
    from higgs_pack.runtime.loop.sentences import TextCommits, split_sentences

    assert text_rule.blank(ZWSP + " " + ZWJ + BOM) and not text_rule.blank(ZWSP + "a")
    for tail in (ZWSP, ZWJ, BOM, f"{ZWSP} {ZWJ}"):
        assert split_sentences(f"Hello. {tail}") == ["Hello."], tail
        assert split_sentences(f"Hello. {tail}. Bye.") == ["Hello.", f"{tail}.", "Bye."]  # a stop is text
        commits = TextCommits()
        assert commits.feed(f"Hello. {tail}") + commits.flush() == ["Hello."]
    assert split_sentences(ZWSP) == [] and text_rule.problem(ZWSP, "input").startswith("input is only whitespace and format")


def test_a_batch_line_of_only_format_characters_is_skipped_as_a_whitespace_only_line_is():
    lines, count = read_lines(f"Hello.\nSecond.\n{ZWSP}\n{BOM}{ZWJ} \n", None, "zb.txt")
    assert [(line.number, line.text) for line in lines] == [(1, "Hello."), (2, "Second.")] and count == 4
    with pytest.raises(InputError, match=r"^zb.txt has no non-empty line"):
        read_lines(f"{ZWSP}\n", None, "zb.txt")


def test_http_segments_never_hold_only_a_format_character(server):
    for tail in (ZWSP, BOM):
        answer = _post(server, "/v1/audio/speech", {"input": f"Hello. {tail}", "stream_format": "sse",
                                                    "max_new_tokens": 5})
        assert answer.status_code == 200, answer.text
        events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
        assert [e["text"] for e in events if e["type"] == "speech.segment"] == ["Hello."], events


def _spoken(events):
    return [e["sentence_text"] for e in events if e["type"] == "audio.start"]


def test_live_format_characters_are_nothing_to_speak_and_no_error(server):
    config = {"type": "session.config", "max_new_tokens": 5}
    events = _live(server, [config, {"type": "input.text", "text": f"Hello. {ZWSP}"}])
    assert [e for e in events if e["type"] == "error"] == [] and _spoken(events) == ["Hello."], events
    events = _live(server, [config, {"type": "input.text", "text": ZWSP}, {"type": "input.text", "text": ZWJ}])
    assert [e for e in events if e["type"] in ("error", "audio.start")] == [], events


def test_live_a_bom_is_dropped_only_where_the_sessions_text_starts(server):
    config = {"type": "session.config", "max_new_tokens": 5}
    events = _live(server, [config, {"type": "input.text", "text": BOM + "Hello"},
                            {"type": "input.text", "text": BOM + " there."}])
    assert [e for e in events if e["type"] == "error"] == [] and _spoken(events) == ["Hello" + BOM + " there."], events


# issue 37, pass 3: each door names the field as its request named it
def _clip_b64(cases_dir):
    import base64

    return base64.b64encode((cases_dir / "ref_en_16k.wav").read_bytes()).decode()


def test_http_references_problems_name_references_fields(server, cases_dir):
    clip = _clip_b64(cases_dir)
    for reference, param, start in (
            ({"audio": clip, "text": "Hi <|im_start|>."}, "references[0].text", "references[0].text contains"),
            ({"audio": "!!notb64", "text": "Hi."}, "references[0].audio", "references[0].audio"),
            ({"text": "Hi."}, "references[0].text", "references[0].text needs references[0].audio"),
            ({"audio": "AAAA"}, "references[0].text", "references[0].audio needs references[0].text")):
        answer = _post(server, "/v1/audio/speech", {"input": "Hi.", "references": [reference], "max_new_tokens": 5})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == param and error["message"].startswith(start), error
        assert "ref_text" not in error["message"] and "ref_audio" not in error["message"], error


def test_http_dialogue_voice_transcript_special_token_names_voices_ann_text(server, cases_dir):
    answer = _post(server, "/v1/audio/dialogue", {
        "turns": [{"speaker": "ANN", "input": "Hi."}], "max_new_tokens": 5,
        "voices": {"ANN": {"audio": _clip_b64(cases_dir), "text": "Hello <|im_start|> there."}}})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "voices.ANN.text" and error["message"].startswith("voices.ANN.text contains"), error


def test_python_names_the_keyword_and_the_cli_the_flag_or_source(tmp_path, cases_dir, cpu_int4_bundle):
    with pytest.raises(InputError) as found:
        SynthesisRequest.create("")
    assert str(found.value) == "text is empty: there is nothing to speak; set it with text=", found.value
    script = tmp_path / "dl.txt"
    script.write_text("ANN: Hi.\n")
    clip = cases_dir / "ref_en_16k.wav"
    for transcript, said in (("", "is empty"), (BOM, "is empty"), ("Hi <|im_start|>.", "contains the tokenizer")):
        out = _run("dialogue", cpu_int4_bundle, script, "-o", tmp_path / "d.wav", "--max-frames", "5",
                   "--voice", f"ANN={clip}:{transcript}")
        err = out.stderr.decode()
        assert out.returncode == 2 and f"error: the transcript of --voice ANN {said}" in err, err
        assert "ref_text" not in err and "voices=" not in err and "Usage" not in err, err
    notes = tmp_path / "notes.txt"
    notes.write_text("Say <|endoftext|> now.")
    out = _run("synthesize", cpu_int4_bundle, "--text-file", notes, "-o", tmp_path / "a.wav")
    err = out.stderr.decode()
    assert out.returncode == 2 and f"\nerror: --text-file {notes} contains the tokenizer's" in err, err
    out = _run("synthesize", cpu_int4_bundle, "-o", tmp_path / "b.wav", input=b"Say <|endoftext|> now.")
    err = out.stderr.decode()
    assert out.returncode == 2 and "\nerror: standard input contains the tokenizer's" in err, err


# issue 37, pass 3 item 7: every name-like choice reads a leading BOM as voice does
@pytest.mark.parametrize("field", [{"model": BOM + "higgs-audio-v3-tiny"}, {"response_format": BOM + "wav"},
                                   {"stream_format": BOM + "sse"}, {"voice": BOM + "default"}])
def test_a_bom_led_model_or_format_is_read_as_a_bom_led_voice_is(server, field):
    answer = _post(server, "/v1/audio/speech", {"input": "Hi.", "max_new_tokens": 5, **field})
    assert answer.status_code == 200, answer.text
    turns = [{"speaker": "ANN", "input": "Hi."}]
    if "voice" not in field:
        answer = _post(server, "/v1/audio/dialogue", {"turns": turns, "max_new_tokens": 5, **field})
        assert answer.status_code == 200, answer.text


def test_a_live_config_reads_a_bom_led_format_or_commit_rule_as_a_bom_led_voice(server):
    config = {"type": "session.config", "max_new_tokens": 5, "model": BOM + "higgs-audio-v3-tiny",
              "response_format": BOM + "pcm", "split_granularity": BOM + "sentence", "voice": BOM + "default"}
    events = _live(server, [config, {"type": "input.text", "text": "Hello."}])
    assert [e for e in events if e["type"] == "error"] == [] and _spoken(events) == ["Hello."], events


# issue 37, pass 3 item 8: DELETE's NAME is checked by the upload's name check
@pytest.mark.parametrize(("path", "said"), [("%FF", "the NAME of DELETE /v1/audio/voices/NAME is not UTF-8 text "
                                                    "(byte 1 is 0xFF"),
                                            ("%00x", "name holds a control character at character 1 (U+0000, NUL)")])
def test_deleting_a_name_that_is_not_utf8_or_holds_nul_is_refused_as_an_upload_is(server, path, said):
    answer = httpx.delete(server.url + "/v1/audio/voices/" + path, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == ("name", "invalid_name") and error["message"].startswith(said), error
    assert "\ufffd" not in error["message"], error


# issue 37, pass 3 item 9: a part's name that is not UTF-8 is named by its bytes, never read as Latin-1
@pytest.mark.parametrize(("name", "escaped", "byte"), [(b"\xff", "\\xff", "byte 1 is 0xFF"),
                                                        (b"\xed\xa0\x80", "\\xed\\xa0\\x80", "byte 1 is 0xED")])
def test_a_part_name_that_is_not_utf8_is_named_by_its_bytes(server, cases_dir, name, escaped, byte):
    boundary = b"b0undary"
    parts = [(b"audio", b'; filename="r.wav"', (cases_dir / "ref_en_16k.wav").read_bytes()),
             (b"transcript", b"", b"Exact words."), (b"name", b"", b"fine"), (name, b"", b"x")]
    body = b"".join(b"--" + boundary + b'\r\nContent-Disposition: form-data; name="' + key + b'"' + extra
                    + b"\r\n\r\n" + value + b"\r\n" for key, extra, value in parts) + b"--" + boundary + b"--\r\n"
    answer = httpx.post(server.url + "/v1/audio/voices", content=body, timeout=60,
                        headers={"Content-Type": "multipart/form-data; boundary=b0undary"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == escaped and error["code"] == "unknown_field", error
    assert error["message"].startswith(f"the name of the part '{escaped}' is not UTF-8 text ({byte}"), error
    assert "\u00ff" not in error["message"] and "\u00ed" not in error["message"], error
    assert httpx.get(server.url + "/v1/audio/voices").json()["voices"][1:] == []


# issue 37, pass 3 item 12: the voice-name rule says the letters it means
def test_the_voice_name_rule_says_ascii_letters_in_its_message_and_the_api_docs():
    from higgs_pack.serve.schema import VoiceUpload
    from higgs_pack.serve.voices import name_problem

    problem = name_problem("n\u00e4me")
    assert problem is not None and "1 to 64 ASCII letters (a-z, A-Z), digits (0-9)" in problem, problem
    assert name_problem("Name-2.v") is None and name_problem(None).startswith("a voice needs a name (1 to 64 ASCII")
    assert VoiceUpload.model_fields["name"].description.startswith("1 to 64 ASCII letters (a-z, A-Z)")


# issue 37, pass 3 item 13: /docs says the text rule as the field's one declaration states it
def test_the_api_docs_input_states_the_text_rule_from_the_fields_declaration():
    from higgs_pack.runtime.options import RequestFields
    from higgs_pack.serve.schema import SpeechBody

    declared = RequestFields.model_fields["text"].description
    shown = SpeechBody.model_json_schema()["properties"]["input"]["description"]
    assert shown.startswith(declared), shown
    for said in ("anywhere, a control character other than tab and line breaks", "special tokens",
                 "empty, or only whitespace and format characters"):
        assert said in shown, said
    assert "not only whitespace or control characters" not in shown


# issue 37, pass 3 item 11: what synthesize_many yields for a failed or blank text, said where it is documented
def test_synthesize_many_yields_a_blank_texts_error_in_its_place_as_the_readme_and_engine_page_say(cpu_int4_bundle):
    from pathlib import Path

    import higgs_pack

    tts = higgs_pack.load(cpu_int4_bundle)
    results = dict(tts.synthesize_many(["Hi.", "", ZWSP, "Ho."], max_frames=3))
    assert sorted(results) == [0, 1, 2, 3]
    assert isinstance(results[1], InputError) and isinstance(results[2], InputError), results
    assert not isinstance(results[0], Exception) and not isinstance(results[3], Exception), results
    root = Path(__file__).resolve().parents[1]
    readme = " ".join((root / "README.md").read_text().split())
    assert "(a failed text's result is its exception: [details](docs/using/engine.md#many-texts-synthesize_many))" in readme
    engine = " ".join((root / "docs/using/engine.md").read_text().split())
    assert "so is an empty text, or one of only whitespace and format characters" in engine
    assert "It skips a blank line (nothing to speak: a file's layout) before handing the others to `synthesize_many`" in engine


# issue 37, pass 4
@pytest.mark.parametrize("name", ["p8\n", "q1\n", "default\n"])
def test_a_voice_name_ending_in_a_line_feed_breaks_the_name_rule(name):
    """Pass 4 finding 2: ``$`` matched before a final LF, so ``p8\\n`` was stored as a voice."""
    from higgs_pack.runtime.backends.openvino.devices import _PLAIN_RE
    from higgs_pack.runtime.sources.hub import parse_ref
    from higgs_pack.serve.voices import name_problem

    assert "is not allowed" in (name_problem(name) or "") and name_problem(name.rstrip()) in (None, name_problem("default"))
    with pytest.raises(Exception, match="is not a hub reference"):
        parse_ref("my-org/bundles\n")
    assert _PLAIN_RE.fullmatch("CPU\n") is None


def test_an_upload_name_or_voice_ending_in_a_line_feed_is_invalid_name(server, cases_dir):
    answer = httpx.post(server.url + "/v1/audio/voices", timeout=60,
                        files={"audio": ("r.wav", (cases_dir / "ref_en_16k.wav").read_bytes(), "audio/wav"),
                               "name": (None, b"p8\r\n"), "transcript": (None, b"Hi.")})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_name", answer.text
    answer = _post(server, "/v1/audio/speech", {"input": "Hi.", "voice": "nosuch\n"})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_name", answer.text
    assert httpx.get(server.url + "/v1/audio/voices").json()["voices"][1:] == []


def test_audio_at_a_path_that_is_not_utf8_is_written_and_read(tmp_path, cases_dir):
    """Pass 4 finding 1: soundfile encodes a path as strict UTF-8, so ``-o`` at such a path was a
    UnicodeEncodeError traceback after all the audio was made, and a clip there "not a readable
    audio file"; Linux takes those bytes (``--subtitles`` and ``--text-file`` did)."""
    import numpy as np

    from higgs_pack import write_wav
    from higgs_pack.runtime.audio import AudioSink, WavFileWriter, check_audio_file, load_audio

    clip = tmp_path / os.fsdecode(b"c\xff.wav")
    clip.write_bytes((cases_dir / "ref_en_16k.wav").read_bytes())
    assert check_audio_file(clip) == clip
    samples, rate = load_audio(clip)
    assert np.array_equal(samples, load_audio(cases_dir / "ref_en_16k.wav")[0])
    out = tmp_path / os.fsdecode(b"w\xff.wav")
    assert write_wav(out, samples * 2, rate).scaled and load_audio(out)[1] == rate
    with WavFileWriter(tmp_path / os.fsdecode(b"d\xe9.wav"), rate) as writer:  # 16-bit deferred: converted at the end
        writer.write(samples)
    with AudioSink(tmp_path / os.fsdecode(b"k\xe9.wav"), rate) as sink:
        sink.write(samples)
    assert len(load_audio(tmp_path / os.fsdecode(b"d\xe9.wav"))[0]) == len(samples)
    assert len(load_audio(tmp_path / os.fsdecode(b"k\xe9.wav"))[0]) == len(samples)
    assert sorted(os.listdir(os.fsencode(tmp_path))) == [b"c\xff.wav", b"d\xe9.wav", b"k\xe9.wav", b"w\xff.wav"]


def test_cli_writes_and_reads_audio_at_a_path_that_is_not_utf8(tmp_path, cases_dir, cpu_int4_bundle):
    clip = tmp_path / os.fsdecode(b"c\xff.wav")
    clip.write_bytes((cases_dir / "ref_en_16k.wav").read_bytes())
    out = _run("synthesize", cpu_int4_bundle, "--text", "Hi.", "-o", tmp_path / os.fsdecode(b"o\xff.wav"),
               "--max-frames", "5", "--ref-audio", clip, "--ref-text", "Hello there.")
    assert out.returncode == 0, out.stderr.decode()
    assert (tmp_path / os.fsdecode(b"o\xff.wav")).stat().st_size > 44
    lines = tmp_path / "two.txt"
    lines.write_text("One.\nTwo.\n")
    folder = tmp_path / os.fsdecode(b"b\xff")
    out = _run("synthesize", cpu_int4_bundle, "--text-file", lines, "--batch", "2", "-o", folder, "--max-frames", "5")
    assert out.returncode == 0, out.stderr.decode()
    assert len([p for p in folder.iterdir() if p.suffix == ".wav"]) == 2


@pytest.mark.parametrize(("key", "said"), [("ANN\x00", "holds a control character at character 4 (U+0000"),
                                           ("AN\x85N", "holds a control character at character 3 (U+0085"),
                                           ("AN\ud800", "is not valid Unicode: character 3 is a lone surrogate")])
def test_a_python_voices_key_follows_the_text_rule_as_https_does(cases_dir, key, said):
    """Pass 4 finding 3: such a key was refused as a name "who speaks no turn" from Python."""
    from higgs_pack.runtime.loop.dialogue import DialogueRequest

    with pytest.raises(InputError) as found:
        DialogueRequest.create([("ANN", "Hi.")], {key: (cases_dir / "ref_en_16k.wav", "Hello.")})
    message = str(found.value)
    assert message.startswith(f"voices[{key!r}] {said}") and "speaks no turn" not in message, message
    assert f"; voices[{key!r}] is the name of a speaker of the turns; set it with voices=" in message, message


@pytest.mark.parametrize(("name", "said"), [(os.fsdecode(b"AN\xc9"), "is not UTF-8 text (byte 3 is 0xC9"),
                                            ("AN\x1bN", "holds a control character at character 3 (U+001B"),
                                            ("AN\x85N", "holds a control character at character 3 (U+0085")])
def test_a_voice_flags_name_follows_the_text_rule_as_a_scripts_speaker_does(cases_dir, name, said):
    from higgs_pack.runtime.cli import _voice_flag

    with pytest.raises(InputError) as found:
        _voice_flag(f"{name}={cases_dir / 'ref_en_16k.wav'}:Hello.")
    message = str(found.value)
    assert message.startswith(f"the NAME of --voice {said}") and "\\udc" not in message, message


def test_a_dialogue_voice_without_room_names_its_transcript_at_every_door(server, cases_dir, cpu_int4_bundle):
    """Pass 4 finding 4: a voice transcript too long for the context was said of turns[0].input,
    and Python named a voice transcript's special tokens with HTTP's field (voices.ANN.text)."""
    import higgs_pack

    answer = _post(server, "/v1/audio/dialogue", {
        "turns": [{"speaker": "A", "input": "Hi."}], "max_new_tokens": 5,
        "voices": {"A": {"audio": _clip_b64(cases_dir), "text": "Long " + "b" * 20000}}})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "voices.A.text" and "positions of the decoder's context" in error["message"], error
    tts = higgs_pack.load(cpu_int4_bundle)
    clip = cases_dir / "ref_en_16k.wav"
    with pytest.raises(InputError, match=r"^the transcript of voices\['ANN'\] contains the tokenizer's special"):
        tts.dialogue([("ANN", "Hi.")], voices={"ANN": (clip, "Hi <|endoftext|>.")}, max_frames=5)
    with pytest.raises(InputError, match=r"^the voice of 'ANN': the voice takes \d+ positions") as found:
        tts.dialogue([("ANN", "Hi.")], voices={"ANN": (clip, "Long " + "b" * 20000)}, max_frames=5)
    assert [problem.field for problem in found.value.problems] == ["voices.ANN.text"]


def test_a_live_messages_type_drops_a_leading_bom_as_every_other_name_like_field(server):
    """Pass 4 finding 5: ``"\\ufeffinput.text"`` was unknown_type while a BOM is dropped on
    model, voice, response_format and the JSON itself."""
    events = _live(server, [{"type": BOM + "session.config", "max_new_tokens": 5},
                            {"type": BOM + "input.text", "text": "Hi there."}])
    assert [e for e in events if e["type"] == "error"] == [], events
    assert _spoken(events) == ["Hi there."], events


def test_one_speaker_given_two_voices_by_keys_read_alike_is_refused_at_every_door(server, tmp_path):
    """"A", " A " and "A\\n" are one speaker's name (speaker_name): HTTP refused two such keys as
    duplicate_field (naming only one of them) and --voice as given more than once, while Python's
    voices= took them and kept one voice silently (a fifth new-user pass)."""
    from higgs_pack.runtime.loop.dialogue import DialogueRequest, named_twice

    assert named_twice(["A", "B", " A ", "A\n", BOM + "B"]) == {"A": ["A", " A ", "A\n"], "B": ["B", BOM + "B"]}
    assert named_twice(["A", "B"]) == {}
    with pytest.raises(InputError, match=r"voices gives 'A' more than once \(the keys 'A', 'A\\n' are one"):
        DialogueRequest.create([("A", "Hi.")], {"A": None, "A\n": None})
    answer = _post(server, "/v1/audio/dialogue", {"turns": [{"speaker": "A", "input": "Hi."}],
                                                  "voices": {"A\n": "default", "A": "default"}})
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["code"] == "duplicate_field", answer.text
    assert "the keys 'A\\n', 'A' are one speaker's name" in error["message"], error["message"]


@pytest.mark.parametrize(("route", "body", "place"), [
    ("/v1/audio/speech", '"input": "a", "input": "b"', "input"),
    ("/v1/audio/dialogue", '"turns": [{"speaker": "A", "speaker": "B", "input": "Hi."}]', "turns[0].speaker"),
    ("/v1/audio/dialogue", '"turns": [{"speaker": "A", "input": "Hi."}], "voices": {"A": "default", "A": "x"}',
     "voices.A"),
    ("/v1/audio/speech", '"input": "Hi.", "references": [{"audio": "", "text": "a", "text": "b"}]',
     "references[0].text"),
])
def test_a_key_given_twice_is_named_by_its_place_in_the_body(server, route, body, place):
    """A fifth new-user pass: a nested key given twice was named bare ('speaker', 'A', 'text'), where
    every other problem names its field's place in the body (turns[0].speaker)."""
    answer = httpx.post(server.url + route, content=f'{{"model": "higgs-audio-v3-tiny", {body}}}'.encode(),
                        headers={"Content-Type": "application/json"}, timeout=60)
    error = answer.json()["error"]
    assert answer.status_code == 400 and (error["code"], error["param"]) == ("duplicate_field", place), error
    key = place.rsplit(".", 1)[-1]
    assert f"gives {key!r} twice" in error["message"], error["message"]
