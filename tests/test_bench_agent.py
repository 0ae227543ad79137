"""The agent benchmark (bench/serving/agent.py, issue 41 item 1): text cut as an LLM emits it, the
figures of a session from what was sent and received, and its table in the docs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bench.serving.agent import RATE, agent_table, commit_rule, main, session_record, token_pieces
from bench.tables import TableError, render

ROOT = Path(__file__).resolve().parents[1]


def test_token_pieces_are_the_tokenizers_pieces_with_their_whitespace(tiny_checkpoint):
    text = "The sun rises in the east, and sets  in the west."
    pieces = token_pieces(text, tiny_checkpoint / "tokenizer.json")
    assert "".join(pieces) == text and len(pieces) >= len(text.split())
    assert pieces[:3] == ["The", " sun", " rises"]  # Qwen3's BPE: a word with the space before it


def _audio(at: float, part: int, seconds: float) -> tuple[float, int, int]:
    return at, part, round(seconds * RATE)


def test_a_session_record_finds_the_first_commit_gaps_and_underruns():
    text = "Hello there, friend. And more."
    sent = [(5, 0.0), (12, 0.05), (20, 0.10), (30, 0.15)]  # characters sent so far, seconds
    parts = ["Hello there,", "friend.", "And more."]
    # part 0: 0.5 s of audio at 0.3 s, a late second piece (an underrun of 0.2 s); part 1 arrives in time,
    # part 2 0.4 s after the player ran dry
    messages = [_audio(0.3, 0, 0.25), _audio(0.75, 0, 0.25), _audio(0.9, 1, 0.5), _audio(1.9, 2, 1.0)]
    record = session_record(text, parts, sent, messages, [])
    assert record["first_token_to_speech_s"] == 0.3
    assert record["first_commit_text_s"] == 0.05  # "Hello there," is whole once 12 characters are sent
    assert record["server_added_s"] == pytest.approx(0.25)
    assert record["sentence_gaps_s"] == [0.0, pytest.approx(0.4)]
    assert record["underruns"] == 2 and record["underrun_s"] == pytest.approx(0.6)
    assert record["audio_s"] == pytest.approx(2.0)
    nothing = session_record(text, [], sent, [], ["an error"])
    assert nothing["first_token_to_speech_s"] is None and nothing["server_added_s"] is None
def test_the_kept_run_renders_and_a_wrong_file_is_refused(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_tables", ROOT / "docs" / "hooks" / "bench_tables.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    runs = sorted(hook.RUNS.glob("agent-*.json"))
    assert runs, "no agent benchmark run kept in docs/benchmarks/runs/"
    record = json.loads(runs[-1].read_text())
    headers, rows, facts = agent_table(record)
    assert len(rows) == len(record["levels"]) and all(len(r) == len(headers) for r in rows)
    assert any("floor of the first commit" in f for f in facts) and "machine" in facts[-1]
    assert "| sentence |" in hook.render(runs[-1].name, "agent")
    (tmp_path / "x.json").write_text(json.dumps([{"kind": "serve-bench"}]))
    with pytest.raises(TableError, match=r"not a python -m bench\.serving\.agent run"):
        render(tmp_path / "x.json", "agent")


def test_a_commit_rule_is_a_known_name_or_granularity_plus_first_words():
    assert commit_rule("clause+first4") == {"split_granularity": "clause", "first_commit_words": 4}
    assert commit_rule("clause+first3") == {"split_granularity": "clause", "first_commit_words": 3}
    assert commit_rule("sentence+first2") == {"split_granularity": "sentence", "first_commit_words": 2}
    for bad in ("clause+first0", "clause+firstx", "word+first3", "clauses"):
        with pytest.raises(ValueError, match="--rules"):
            commit_rule(bad)


def test_an_unknown_rule_is_refused_before_a_bundle_is_built_or_a_server_started(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--rules", "sentence,clause+firstx", "--bundle", str(tmp_path / "none"), "--out", str(tmp_path / "a.json")])
    assert "clause+firstx" in capsys.readouterr().err and not (tmp_path / "a.json").exists()
