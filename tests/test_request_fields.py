"""A request field is declared once (runtime/options.py) and every door agrees with it.

For each field of :class:`~higgs_pack.runtime.options.RequestFields`: the CLI's ``--help`` and
its click option, the speech and dialogue bodies' OpenAPI schema, the speech body's parser (the
HTTP door and a live session's ``session.config``), the Python API's checks and the docs table
give the same name, default and limits.  A field added to the declaration appears at every door
without touching them (the declaration is extended for one test with pydantic's own
``create_model`` and restored).  The live server's ``/openapi.json`` is checked in
tests/test_serve.py.
"""

from __future__ import annotations

import math

import pytest
from click.testing import CliRunner
from pydantic import Field, create_model

from higgs_pack.errors import InputError
from higgs_pack.runtime import options
from higgs_pack.runtime.cli import main
from higgs_pack.runtime.options import FIELDS, RequestFields, allowed, door_of, http_keywords
from higgs_pack.runtime.request import SynthesisRequest
from higgs_pack.serve.config import ServeConfig
from higgs_pack.serve.errors import ApiError
from higgs_pack.serve.schema import (
    NOT_IN_CONFIG,
    DialogueBody,
    SessionFields,
    SpeechBody,
    config_fields,
)
from higgs_pack.serve.speech import parse_speech

VALUED = [name for name, info in RequestFields.model_fields.items() if not door_of(info).shaped]
MODELS = ("tiny",)


class _NoVoices:
    def get(self, name):
        return None

    def names(self):
        return []


def _bad_value(name: str):
    """A value just outside field ``name``'s declared limits."""
    limits = options._limits(RequestFields.model_fields[name])
    if "gt" in limits:
        return limits["gt"]
    if "ge" in limits:
        return limits["ge"] - 1
    return limits["le"] + 1


def _command(name: str):
    return main.commands[name]


@pytest.mark.parametrize("name", VALUED)
def test_the_cli_option_is_the_declaration(name):
    info = RequestFields.model_fields[name]
    flag = door_of(info).flag
    option = next(p for p in _command("synthesize").params if flag in p.opts)
    assert option.name == name and option.default == info.default
    help_text = CliRunner().invoke(main, ["synthesize", "--help"], terminal_width=400).output
    line = next(text for text in help_text.splitlines() if text.strip().startswith(flag))
    assert allowed(name) in line
    assert (f"[default: {info.default}]" in line) == (info.default is not None)


@pytest.mark.parametrize("name", VALUED)
def test_the_python_api_refuses_a_value_outside_the_declared_limits(name):
    bad = _bad_value(name)
    with pytest.raises(InputError) as caught:
        SynthesisRequest.create("Hello.", **{name: bad})
    said = str(caught.value)
    # the Python door names the keyword, never the CLI's flag (issue 37: one door's terms each)
    assert said == f"{name} must be {allowed(name)}, got {bad}; set it with {name}="
    assert door_of(RequestFields.model_fields[name]).flag not in said


@pytest.mark.parametrize("name", [n for n in VALUED if FIELDS[n].http])
def test_the_openapi_schema_and_the_http_door_are_the_declaration(name):
    info = RequestFields.model_fields[name]
    door = door_of(info)
    limits = options._limits(info)
    for body in (SpeechBody, DialogueBody):
        schema = body.model_json_schema()["properties"]
        for http in (door.http, *door.aliases):
            number = next(part for part in schema[http]["anyOf"] if part["type"] != "null")
            assert number["type"] == ("integer" if options.is_whole(name) else "number")
            assert number.get("minimum") == limits.get("ge") and number.get("exclusiveMinimum") == limits.get("gt")
            assert number.get("maximum") == limits.get("le")
        assert schema[door.http]["default"] == info.default
        assert schema[door.http]["description"] == info.description
    # the HTTP door (and a live session's config, which is parsed by it) refuses by the same limits
    bad = _bad_value(name)
    with pytest.raises(ApiError) as caught:
        parse_speech({"model": "tiny", "input": "Hello.", door.http: bad}, models=MODELS, voices=_NoVoices(),
                     config=ServeConfig())
    assert caught.value.param == door.http and f"{door.http} must be {allowed(name)}" in caught.value.message
    good = info.default if info.default is not None else (limits.get("ge", 0) + 1 if "ge" in limits else limits["le"])
    job = parse_speech({"model": "tiny", "input": "Hello.", door.http: good}, models=MODELS, voices=_NoVoices(),
                       config=ServeConfig())
    held = job.request.schedule if name in ("first_chunk_frames",) else job.request
    assert getattr(held, name) == good
    assert (door.http in NOT_IN_CONFIG) == (not door.live)


def test_every_body_field_of_the_declaration_and_only_those_are_generated():
    assert set(http_keywords()) <= set(SpeechBody.model_fields)
    assert set(http_keywords()) <= set(DialogueBody.model_fields)
    assert http_keywords()["max_new_tokens"] == "max_frames"
    assert http_keywords()["initial_codec_chunk_frames"] == "first_chunk_frames"


def test_the_docs_table_is_the_declaration():
    from docs.hooks.generated import on_page_markdown

    page = on_page_markdown("before\n<!-- request-fields -->\n<!-- /request-fields -->\nafter", page=None)
    assert page.startswith("before\n<!-- request-fields -->\n| keyword |") and page.endswith("<!-- /request-fields -->\nafter")
    for name, info in RequestFields.model_fields.items():
        row = next(line for line in page.splitlines() if line.startswith(f"| `{name}` |"))
        door = door_of(info)
        if door.flag:
            assert door.flag in row
        if not door.shaped:
            assert allowed(name) in row
            if info.default is not None:
                assert f"`{info.default:g}`" in row if isinstance(info.default, float) else f"`{info.default}`" in row


def test_the_docs_page_asks_for_the_table_and_the_hook_is_installed():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    assert "<!-- request-fields -->" in (root / "docs/using/python.md").read_text()
    assert "docs/hooks/generated.py" in (root / "mkdocs.yml").read_text()


def test_the_markdown_holds_the_generated_tables_as_the_declarations_make_them():
    """Issue 37: the table was on the built site only (a hook filled a marker), not in the Markdown
    read on GitHub; now the pages hold it, and a page that differs from what the declarations
    render fails here (python -m docs.hooks.generated --write renders them)."""
    from docs.hooks.generated import TABLES, main, pages

    found = pages()
    assert {page.name for page in found} >= {"python.md", "index.md"}, found
    named = "".join(text for text, _filled in found.values())
    for name in TABLES:
        assert f"<!-- {name} -->\n| " in named and f"|\n<!-- /{name} -->" in named, name
    stale = [str(page) for page, (text, filled) in found.items() if text != filled]
    assert not stale, f"{stale}: run python -m docs.hooks.generated --write"
    assert main([]) == 0


def test_a_field_added_to_the_declaration_appears_at_every_door(monkeypatch):
    from typing import Annotated

    extended = create_model(
        "RequestFields", __base__=RequestFields,
        repetition_penalty=(Annotated[float | None, options.Door("--repetition-penalty", "repetition_penalty",
                                                                 meaning="1 = off")],
                            Field(None, ge=1, allow_inf_nan=False, description="Penalty of codes already said.")))
    monkeypatch.setattr(options, "RequestFields", extended)
    options._adapter.cache_clear()
    try:
        assert "repetition_penalty" in options.http_fields() and "repetition_penalty" in options.http_fields(True)
        assert options.http_keywords()["repetition_penalty"] == "repetition_penalty"
        assert options.allowed("repetition_penalty") == "a finite number >= 1 (1 = off)"
        problems = options.value_problems({"repetition_penalty": math.inf})
        assert [(p.field, p.allowed) for p in problems] == [("repetition_penalty", "a finite number >= 1 (1 = off)")]
        assert any(row["flag"] == "--repetition-penalty" for row in options.field_rows())

        import click

        @click.command()
        @options.click_options("repetition_penalty")
        def command(repetition_penalty):
            click.echo(repr(repetition_penalty))

        assert CliRunner().invoke(command, ["--repetition-penalty", "1.5"]).output.strip() == "1.5"
        assert "(1 = off)" in CliRunner().invoke(command, ["--help"]).output
    finally:
        options._adapter.cache_clear()


def test_a_number_type_refusal_names_the_kind():
    assert [(p.field, p.allowed) for p in options.value_problems({"top_k": 2.5, "temperature": "hot",
                                                                   "seed": True})] == [
        ("seed", "a whole number"), ("temperature", "a number"), ("top_k", "a whole number")]


def test_a_session_config_takes_the_speech_body_less_the_stream_switches_and_the_session_fields():
    fields = config_fields()
    assert "input" not in fields and "stream" not in fields and "stream_format" not in fields
    assert {"seed", "context_frames", "initial_chunk_frames"} <= set(fields)
    assert set(SessionFields.model_fields) <= set(fields)
    # the default rule, from the agent benchmark (docs/benchmarks/agent.md): clause ends and a first commit of 3 words
    assert SessionFields().split_granularity == "clause" and SessionFields().first_commit_words == 3


def test_a_missing_reference_clip_is_refused_by_the_request_with_the_flag(tmp_path):
    result = CliRunner().invoke(main, ["synthesize", str(tmp_path / "no-bundle"), "--text", "Hi.", "-o",
                                       str(tmp_path / "out.wav"), "--ref-audio", str(tmp_path / "missing.wav"),
                                       "--ref-text", "Hi."])
    assert result.exit_code == 2, result.output
    assert "missing.wav does not exist" in result.output and "--ref-audio" in result.output
    assert not (tmp_path / "out.wav").exists()


def test_a_clip_that_is_not_audio_or_too_short_is_refused_before_the_bundle_loads(tmp_path):
    import numpy as np
    import soundfile as sf

    (tmp_path / "notes.wav").write_text("not audio")
    sf.write(tmp_path / "short.wav", np.zeros(2400, np.float32), 24000)  # 0.1 s
    for clip, words in (("notes.wav", "is not a readable audio file"), ("short.wav", "is 0.10 s long")):
        with pytest.raises(InputError, match=words):
            SynthesisRequest.create("Hi.", ref_audio=tmp_path / clip, ref_text="Hi.")
        result = CliRunner().invoke(main, ["synthesize", str(tmp_path / "no-bundle"), "--text", "Hi.", "-o",
                                           str(tmp_path / "out.wav"), "--ref-audio", str(tmp_path / clip),
                                           "--ref-text", "Hi."])
        assert result.exit_code == 2 and words in result.output and "no such bundle" not in result.output
