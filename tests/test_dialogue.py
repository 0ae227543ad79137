"""Dialogue (issue 30 item 3): a script of turns spoken in one audio, a voice per speaker, the
speaker's own recent turns as context, one exact segment per turn; bad scripts refused before
anything is generated.  The oracle for the plan's prompts, the tiny bundles for the front doors."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf

from higgs_pack.errors import InputError
from higgs_pack.runtime.loop.dialogue import MAX_TURNS, DialogueRequest, Turn, parse_script
from higgs_pack.runtime.request import PreparedVoice

N = 8
SCRIPT = "ANN: Good morning, how are you?\nBEN: Very well, thank you. And you?\n\n# a comment\nANN: Fine."
HIGGS = [sys.executable, "-m", "higgs_pack.runtime.cli"]


@pytest.fixture(scope="module")
def oracle(tiny_ckpt):
    from higgs_pack.exporters.pytorch.reference import reference_pipeline

    return reference_pipeline(tiny_ckpt)


def test_a_script_is_one_turn_per_line():
    assert parse_script(SCRIPT) == [Turn("ANN", "Good morning, how are you?"),
                                    Turn("BEN", "Very well, thank you. And you?"), Turn("ANN", "Fine.")]


@pytest.mark.parametrize(("script", "message"), [
    ("ANN: Hello.\nno speaker on this line\n", "line 2 of s.txt has no speaker: write it as NAME: text"),
    ("ANN: Hello.\nBEN:   \n", "the text of line 2 of s.txt ('BEN') is empty: there is nothing to speak"),
    ("ANN: Hello.\n: Who?\n", "line 2 of s.txt has no speaker"),
    ("ANN: a\x00b", "the text of line 1 of s.txt ('ANN') holds a control character at character 2 (U+0000, NUL)"),
    ("\n# only a comment\n", "s.txt holds no turns"),
    ("ANN: hi\n" * 10_000, f"s.txt holds 10000 turns; at most {MAX_TURNS}"),
    ("A" * 65 + ": hi", "the speaker of line 1 of s.txt ('AAAA"),  # every problem names a line one way
    ("A" * 65 + ": hi", "must be a name of at most 64 characters"),
])
def test_a_bad_script_names_its_line(script, message):
    with pytest.raises(InputError) as caught:
        parse_script(script, "s.txt")
    assert message in str(caught.value), str(caught.value)


def test_bad_turns_and_voices_are_named_before_anything_runs():
    with pytest.raises(InputError, match=r"the text of turn 2 \('BEN'\) is only whitespace"):
        DialogueRequest.create([("ANN", "Hi."), ("BEN", "  ")])
    with pytest.raises(InputError, match="turns is empty"):
        DialogueRequest.create([])
    with pytest.raises(InputError, match=r"voices names 'CAT', who speaks no turn; the speakers are 'ANN', 'BEN'"):
        DialogueRequest.create([("ANN", "Hi."), ("BEN", "Yo.")], voices={"CAT": None})
    with pytest.raises(InputError, match="the voice of 'ANN' must be a prepared voice"):
        DialogueRequest.create([("ANN", "Hi.")], voices={"ANN": 3})
    with pytest.raises(InputError) as every:  # a turn, a voice and an option at once (a new user's finding)
        DialogueRequest.create([("ANN", "Hi."), ("BEN", " ")], voices={"ANN": 3}, temperature=-1)
    assert [p.field for p in every.value.problems] == ["turns[1].text", "voices", "temperature"], every.value.problems
    with pytest.raises(InputError, match=r"voices names 'CAT', who speaks no turn.*; set it with voices="):
        DialogueRequest.create([("ANN", "Hi.")], voices={"CAT": None}, temperature=-1)
    with pytest.raises(InputError, match="turn 1 must be a Turn"):
        DialogueRequest.create(["ANN: Hi."])
    with pytest.raises(InputError, match=r"turn 1 must be .* got 1 item \(\('ANN',\)\)"):  # it said "a list"
        DialogueRequest.create([("ANN",)])
    with pytest.raises(InputError, match=r"got a mapping with \['speaker'\] \(it needs exactly speaker and text\)"):
        DialogueRequest.create([{"speaker": "ANN"}])
    with pytest.raises(InputError, match="top_p"):
        DialogueRequest.create([("ANN", "Hi.")], top_p=2)
    # A speaker's name is stripped, as a script line's is (H-newuser 8).
    request = DialogueRequest.create([(" ANN ", "Hi.")], voices={"ANN": None})
    assert [t.speaker for t in request.turns] == ["ANN"]
    # A voice's problem names the voice and the path, not synthesize's flag (H-newuser 6).
    with pytest.raises(InputError, match=r"the voice of 'ANN': reference audio nosuch.wav does not exist") as found:
        DialogueRequest.create([("ANN", "Hi.")], voices={"ANN": ("nosuch.wav", "x")})
    assert "--ref-audio" not in str(found.value) and "set it with" not in str(found.value)
    # A speaker that is not text and voices that are not a mapping are named, not a TypeError
    # (a new user's findings, 2026-12-05).
    for speaker in (None, 5):
        with pytest.raises(InputError, match="the speaker of turn 1"):
            DialogueRequest.create([(speaker, "Hi.")])
    with pytest.raises(InputError, match="the speaker of turn 1"):
        DialogueRequest.create([{"speaker": None, "text": "Hi."}])
    for voices in (["ANN"], "ANN"):
        with pytest.raises(InputError, match="voices must be a mapping of speaker name to voice"):
            DialogueRequest.create([("ANN", "Hi.")], voices=voices)


def test_each_turn_opens_with_its_speakers_voice_and_own_last_turn(oracle):
    """ANN has no voice: her first turn is zero-shot and then her voice; BEN has a prepared voice;
    a turn's context is its own speaker's turns only; one exact segment per turn, back to back."""
    from higgs_pack.runtime.loop.prompt import build_prompt, prompt_of
    from higgs_pack.runtime.loop.streaming import stream_plan
    from higgs_pack.runtime.loop.synthesis import run_plan

    ben = PreparedVoice(np.random.default_rng(0).integers(0, 1024, size=(20, N)), "Ben's voice.")
    turns = [("ANN", "Good morning."), ("BEN", "Hello there."), ("ANN", "How are you?"), ("ANN", "Still here."),
             ("BEN", "Bye.")]
    plan = DialogueRequest.create(turns, {"BEN": ben}, seed=3, max_frames=10).plan(oracle)
    result = run_plan(oracle, plan)
    r, t = result.chunks, [text for _, text in turns]
    assert r[0].prompt_length == build_prompt(oracle, t[0]).shape[1]
    assert r[1].prompt_length == build_prompt(oracle, t[1], ben.codes, ben.transcript).shape[1]
    assert r[2].prompt_length == build_prompt(oracle, t[2], r[0].codes, t[0]).shape[1]  # not BEN's audio
    # The speaker's voice pair first (ANN's first turn), then her last turn as a pair of its own.
    assert r[3].prompt_length == prompt_of(oracle, t[3], r[0].codes, t[0], context=[(r[2].codes, t[2])]).length
    assert r[4].prompt_length == prompt_of(oracle, t[4], ben.codes, ben.transcript, context=[(r[1].codes, t[1])]).length
    segments = result.segments
    assert [(s.speaker, s.text, s.exact) for s in segments] == [(who, text, True) for who, text in turns]
    assert segments[0].start == 0 and segments[-1].end == len(result.samples) / result.sample_rate
    assert all(a.end == b.start for a, b in itertools.pairwise(segments))
    for segment, chunk in zip(segments, r, strict=True):
        assert round((segment.end - segment.start) * 25) == len(chunk.codes)
    speech = stream_plan(oracle, plan)
    pieces = list(speech)
    assert [s for p in pieces for s in p.segments] == segments
    assert float(np.abs(np.concatenate([p.samples for p in pieces]) - result.samples).max()) <= 1e-4


def test_tts_dialogue_on_the_cpu_bundle_clones_a_clip_and_streams_the_same(cpu_int4_bundle, cases_dir):
    import higgs_pack

    tts = higgs_pack.load(cpu_int4_bundle)
    clip = (cases_dir / "ref_en_16k.wav", (cases_dir / "ref_en_16k.txt").read_text().strip())
    turns = parse_script(SCRIPT)
    whole = tts.dialogue(turns, voices={"BEN": clip}, seed=5, max_frames=15)
    assert [s.speaker for s in whole.segments] == ["ANN", "BEN", "ANN"]
    assert whole.chunks[1].prompt_length > whole.chunks[0].prompt_length + 100  # BEN's clip opens his prompt
    stream = tts.stream_dialogue(turns, voices={"BEN": clip}, seed=5, max_frames=15)
    joined = np.concatenate([p.samples for p in stream])
    assert np.array_equal(stream.codes, whole.codes) and stream.segments == whole.segments
    assert float(np.abs(joined - whole.samples).max()) <= 1e-4
    with pytest.raises(InputError, match=r"turn 2 \('BEN'\): its text contains the prompt control token") as found:
        tts.dialogue([("ANN", "Hi."), ("BEN", "Say <|audio|> now.")])
    assert "--text" not in str(found.value) and "text=" not in str(found.value)
    with pytest.raises(InputError) as found:  # every bad turn at once, not the first alone
        tts.dialogue([("ANN", "Hi <|audio|>."), ("BEN", "Fine."), ("BEN", "Oh <|tts|> no.")])
    assert [p.field for p in found.value.problems] == ["turns[0].text", "turns[2].text"], found.value.problems
    with pytest.raises(InputError, match=r"turn 1 \('ANN'\): one sentence needs") as found:
        tts.dialogue([("ANN", "x" * 60000)])  # one word: no place to cut it
    assert "--text" not in str(found.value) and "text=" not in str(found.value)
    script = parse_script("# a talk\nANN: Hi.\n\nBEN: Say <|audio|> now.\n", "talk.txt")
    with pytest.raises(InputError, match=r"line 4 of talk.txt \('BEN'\): its text contains"):
        tts.dialogue(script)  # a script's turn is named by its line, as the script's own problems are
    assert script == [Turn("ANN", "Hi."), Turn("BEN", "Say <|audio|> now.")]  # where is not part of a turn's value


def test_tts_dialogue_on_the_openvino_bundle(ov_int4_bundle):
    import higgs_pack

    tts = higgs_pack.load(ov_int4_bundle)
    result = tts.dialogue(parse_script(SCRIPT), seed=5, max_frames=12)
    assert [s.speaker for s in result.segments] == ["ANN", "BEN", "ANN"]
    assert result.segments[-1].end == len(result.samples) / result.sample_rate > 0


def run(*args, input=None):
    return subprocess.run([*HIGGS, *map(str, args)], capture_output=True, text=True, input=input)


def test_the_dialogue_command_writes_audio_and_subtitles(cpu_int4_bundle, cases_dir, tmp_path):
    import srt

    script = tmp_path / "talk.txt"
    script.write_text(SCRIPT, encoding="utf-8")
    clip = cases_dir / "ref_en_16k.wav"
    words = (cases_dir / "ref_en_16k.txt").read_text().strip()
    out = run("dialogue", cpu_int4_bundle, script, "-o", tmp_path / "talk.wav", "--subtitles", tmp_path / "talk.srt",
              "--voice", f"BEN={clip}:{words}", "--max-frames", "15", "--no-progress")
    assert out.returncode == 0, out.stderr
    assert "3 turn(s)" in out.stdout
    cues = list(srt.parse((tmp_path / "talk.srt").read_text(encoding="utf-8")))
    assert [c.content for c in cues] == ["ANN: Good morning, how are you?", "BEN: Very well, thank you. And you?",
                                         "ANN: Fine."]
    assert cues[-1].end.total_seconds() == pytest.approx(sf.info(tmp_path / "talk.wav").frames / 24000, abs=1e-3)


@pytest.mark.parametrize(("make", "extra", "message"), [
    (lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe"), [], "is not UTF-8 text"),
    (lambda p: p.write_text("ANN: Hi.\nnobody\n"), [], "line 2 of"),
    (lambda p: p.write_text("ANN: Hi.\n"), ["--voice", "CAT={clip}:Words."], "--voice names 'CAT', who speaks no turn"),
    # the script's problems and a stray voice at once (issue 37 item 6)
    (lambda p: p.write_text("ANN: Hi.\nnobody\n"), ["--voice", "CAT={clip}:Words."],
     "2 problems with the request:\n  - line 2 of {script} has no speaker: write it as NAME: text (got 'nobody')\n"
     "  - --voice names 'CAT', who speaks no turn"),
    (lambda p: p.write_text("ANN: Hi.\n"), ["--voice", "ANN={clip}"], "needs the exact words said in its clip"),
    (lambda p: p.write_text("ANN: Hi.\n"), ["--voice", "ANN=missing.wav:Hi."], "no file missing.wav"),
    (lambda p: p.write_text("ANN: Hi.\n"), ["--subtitles", "{dir}/talk.txt"], "SubRip (.srt) or WebVTT (.vtt)"),
    (lambda p: p.write_text("ANN: hi\n" * 10_000), [], "holds 10000 turns"),
    # -o or --subtitles on a --voice clip would overwrite the user's recording (H-newuser 1).
    (lambda p: p.write_text("ANN: Hi.\n"), ["--voice", "ANN={clip}:Words.", "-o", "{clip}"],
     "is also an input of this command"),
    (lambda p: p.write_text("ANN: Hi.\n"), ["-o", "-"], "-o - (stdout) is not supported"),
    (lambda p: p.write_text("ANN: Hi.\n"), ["--context-frames", "0"], "--context-frames must be >= 1"),
    (lambda p: p.write_text("ANN: Hi.\n"), ["--voice", "ANN={dir}:Words."], "is a folder, not an audio file"),
    (lambda p: p.write_text("ANN: Hi.\n"), ["--voice", "ANN=:Words."], "the voice of 'ANN' names no clip"),
])
def test_the_dialogue_command_refuses_a_bad_script_before_loading(tmp_path, make, extra, message):
    from click.testing import CliRunner

    from higgs_pack.runtime.cli import main

    clip = tmp_path / "clip.wav"
    sf.write(clip, np.zeros(24000, np.float32), 24000)
    script = tmp_path / "s.txt"
    make(script)
    args = [a.format(clip=clip, dir=tmp_path, script=script) for a in extra]
    result = CliRunner().invoke(main, ["dialogue", str(tmp_path / "no-bundle"), str(script), "-o",
                                       str(tmp_path / "o.wav"), *args])
    message = message.format(script=script)
    assert result.exit_code == 2 and message in result.stderr and "no such bundle" not in result.stderr, \
        result.stderr
    assert not (tmp_path / "o.wav").exists()
    assert sf.info(clip).frames == 24000  # the clip is untouched


def test_dialogue_json_round_trip_of_segments():
    from higgs_pack.runtime.loop.synthesis import Segment
    from higgs_pack.runtime.loop.words import word_timings
    from higgs_pack.serve.formats import segment_json

    assert json.loads(json.dumps(segment_json(Segment("Hi.", 0.0, 0.48, 0, True, "ANN")))) == {
        "text": "Hi.", "start": 0.0, "end": 0.48, "chunk": 0, "exact": True, "words": [], "speaker": "ANN"}
    timed = Segment("Hi there.", 1.0, 1.9, 0, True, "ANN", word_timings("Hi there.", 1.0, 1.9))
    assert segment_json(timed)["words"] == [{"text": "Hi", "start": 1.0, "end": 1.225, "exact": False},
                                            {"text": "there.", "start": 1.225, "end": 1.9, "exact": False}]


# ------------------------------------------------ POST /v1/audio/dialogue on a live server


@pytest.fixture(scope="module")
def server(cpu_int4_bundle):
    from live_server import LiveServer

    with LiveServer(cpu_int4_bundle, "--max-input-chars", "2000") as live:
        yield live


def test_the_dialogue_route_answers_audio_segments_and_sse(server, cases_dir):
    import base64

    import httpx

    clip = base64.b64encode((cases_dir / "ref_en_16k.wav").read_bytes()).decode()
    words = (cases_dir / "ref_en_16k.txt").read_text().strip()
    body = {"model": "higgs-audio-v3-tiny", "seed": 2, "max_new_tokens": 15, "response_format": "pcm",
            "turns": [{"speaker": "ANN", "input": "Good morning."}, {"speaker": "BEN", "input": "Hello, Ann."},
                      {"speaker": "ANN", "input": "Shall we start?"}],
            "voices": {"BEN": {"audio": clip, "text": words}, "ANN": "default"}}
    url = server.url + "/v1/audio/dialogue"
    whole = httpx.post(url, json={**body, "segments": True}, timeout=120)
    assert whole.status_code == 200 and whole.headers["content-type"] == "application/json", whole.text
    answer = whole.json()
    assert [(s["speaker"], s["text"], s["exact"]) for s in answer["segments"]] == [
        ("ANN", "Good morning.", True), ("BEN", "Hello, Ann.", True), ("ANN", "Shall we start?", True)]
    pcm = base64.b64decode(answer["audio"])
    assert answer["segments"][-1]["end"] == pytest.approx(len(pcm) / 2 / 24000)
    # curl, as a user runs it: the bare audio, the same bytes.
    done = subprocess.run(["curl", "-sS", "--max-time", "120", "-H", "Content-Type: application/json", "-d", "@-",
                           url], input=json.dumps(body).encode(), capture_output=True)
    assert done.returncode == 0 and done.stdout == pcm, done.stderr
    with httpx.stream("POST", url, json={**body, "stream_format": "sse"}, timeout=120) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    timed = [{k: v for k, v in e.items() if k != "type"} for e in events if e["type"] == "speech.segment"]
    assert timed == answer["segments"] and events[-1]["type"] == "speech.audio.done"
    # Streamed audio is decoded piece by piece: the same samples within float rounding, so 16-bit
    # values may differ by one step where a sample sits on a rounding boundary.
    streamed = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert len(streamed) == len(pcm)
    assert np.abs(np.frombuffer(streamed, "<i2").astype(int) - np.frombuffer(pcm, "<i2")).max() <= 1
    # speed: the dialogue's audio and each turn's times, 1.5 times shorter, whole and streamed
    fast = httpx.post(url, json={**body, "segments": True, "speed": 1.5}, timeout=120).json()
    assert len(base64.b64decode(fast["audio"])) == round(len(pcm) / 2 / 1.5) * 2
    assert [s["end"] for s in fast["segments"]] == pytest.approx([s["end"] / 1.5 for s in answer["segments"]])
    assert [s["speaker"] for s in fast["segments"]] == ["ANN", "BEN", "ANN"]
    with httpx.stream("POST", url, json={**body, "speed": 1.5, "stream_format": "audio"}, timeout=120) as response:
        assert len(b"".join(response.iter_bytes())) == len(base64.b64decode(fast["audio"]))


@pytest.mark.parametrize(("change", "param", "words"), [
    ({"turns": []}, "turns", "got an empty list"),
    ({"turns": [{"speaker": "ANN", "input": "  "}]}, "turns[0].input", "input is only whitespace"),
    ({"turns": [{"speaker": "ANN"}]}, "turns[0]", "exactly speaker and input"),
    ({"turns": [{"speaker": "ANN", "input": "Hi."}] * 1001}, "turns", "1001 turns; at most 1000"),
    ({"voices": {"ANN": "nobody"}}, "voices.ANN", "voice 'nobody' is not known"),
    ({"voices": {"CAT": "default"}}, "voices.CAT", "who speaks no turn"),
    ({"voice": "default"}, "voice", "unknown field 'voice' (did you mean 'voices'?)"),
    ({"turns": [{"speaker": "ANN", "input": "Say <|audio|> now."}]}, "turns[0].input", "turns[0] ('ANN'): its text contains"),
    ({"turns": [{"speaker": "A:B", "input": "Hi."}]}, "turns[0].speaker", "without ':'"),  # H-newuser 6
    # a turn is named as param names it, turns[i] from 0, in every message (issue 37: one said "turn 1")
    ({"turns": [{"speaker": "ANN", "input": "Hi."}, {"speaker": "B:N", "input": "Yo."}]}, "turns[1].speaker",
     "the speaker of turns[1] ('B:N') must be"),
    ({"turns": [{"speaker": "ANN", "input": "Hi."}, {"speaker": "BEN", "input": "Say <|audio|> now."}]},
     "turns[1].input", "turns[1] ('BEN'): its text contains the prompt control token"),
    ({"segments": True, "stream_format": "audio"}, "segments", "segments true needs an answer with room"),
    ({"speed": 8}, "speed", "speed must be a number from 0.25 to 4.0"),
    # every bad turn at once, as a speech body's fields (a new user's finding: only the first was said)
    ({"turns": [{"speaker": "ANN", "input": ""}, {"speaker": 5, "input": "Hi."}, {"input": "Hi."}, "Hi."]},
     "turns[0].input", "4 problems with the request"),
])
def test_a_bad_dialogue_body_is_a_400_naming_the_field(server, change, param, words):
    import httpx

    body = {"model": "higgs-audio-v3-tiny", "turns": [{"speaker": "ANN", "input": "Hi."}], **change}
    answer = httpx.post(server.url + "/v1/audio/dialogue", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_the_dialogue_schema_describes_every_field_the_route_takes():
    from higgs_pack.serve.schema import DialogueBody
    from higgs_pack.serve.speech import DIALOGUE_FIELDS

    assert set(DialogueBody.model_fields) == set(DIALOGUE_FIELDS)
    assert all(f.description for f in DialogueBody.model_fields.values())
