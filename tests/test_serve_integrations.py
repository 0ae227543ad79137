"""Issue 31 item 3: the Pipecat TTS service and the LiveKit Agents TTS plugin against a live
``higgs-pack serve`` (a real subprocess on 127.0.0.1 serving the real tiny cpu int4 bundle),
driven through each framework's own classes: Pipecat's ``run_test`` pipeline harness with its
frames, LiveKit's ``SynthesizeStream`` and ``AudioEmitter``.  Issue 41 item 3: after an
interruption, the conversation keeps only the words played, in Pipecat's ``LLMContext`` (its output
transport's clock and ``LLMContextAggregatorPair``) and in a LiveKit ``AgentSession``'s history
(``use_tts_aligned_transcript`` with its ``TranscriptSynchronizer``).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from live_server import LiveServer

#: One sentence of about 200 tokens: its frame cap (10 per token) is some 80 s of audio, which the
#: tiny model, speaking to its cap, takes seconds to generate: long enough to interrupt.
LONG = "This one sentence goes on and on, " * 24 + "until it ends."
#: LONG's frame cap: 196 text tokens x 10 frames per token (generate.FRAMES_PER_TEXT_TOKEN).
LONG_CAP_FRAMES = 1960
#: A turn the interruption tests cut in its first sentence, which the tiny model speaks to its cap
#: (``max_new_tokens`` 100: :data:`CUT_SENTENCE_S`).
CUT_TURN = "One two three four five six seven eight nine ten. Eleven twelve thirteen fourteen fifteen."
CUT_SENTENCE_S = 4.0
#: The commit rule of the tests that time words within whole sentences (the server's default also
#: commits a response's first words alone and cuts at clauses: docs/serving/live.md).
BY_SENTENCE = {"split_granularity": "sentence", "first_commit_words": 0}


def _words_started(played_s: float) -> int:
    """How many words of CUT_TURN's first sentence had begun after ``played_s`` seconds of its audio,
    by the server's estimate (its span shared by the words' characters: runtime/loop/words.py)."""
    words = CUT_TURN.split(".")[0].split()
    total, seen, count = sum(map(len, words)) + 1, 0, 0  # the sentence's "." counts with "ten."
    for word in words:
        count += seen / total * CUT_SENTENCE_S <= played_s
        seen += len(word)
    return count


@pytest.fixture(scope="module")
def server(cpu_int4_bundle):
    with LiveServer(cpu_int4_bundle) as live:
        yield live


def _wait_idle(server, rows: int = 0, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.metric("higgs_pack_active_batch") > rows:
        time.sleep(0.05)
    assert server.metric("higgs_pack_active_batch") == rows


def _pipecat_speaker():
    """Pipecat's own output transport writing to a speaker that plays in real time (as its WebSocket
    transports pace their writes): its clock releases each word's TTSTextFrame at its pts, and an
    interruption drops the words not yet released.  ``played``: seconds of audio handed to the speaker."""
    from pipecat.transports.base_output import BaseOutputTransport
    from pipecat.transports.base_transport import TransportParams

    class Speaker(BaseOutputTransport):
        played = 0.0

        async def start(self, frame):
            await super().start(frame)
            await self.set_transport_ready(frame)

        async def write_audio_frame(self, frame) -> bool:
            self.played += len(frame.audio) / 2 / frame.sample_rate
            await asyncio.sleep(len(frame.audio) / 2 / frame.sample_rate)
            return True

    return Speaker(TransportParams(audio_out_enabled=True, audio_out_sample_rate=16000, audio_out_end_silence_secs=0))


class TestPipecat:
    pipecat = pytest.importorskip("pipecat", reason="the [pipecat] extra (pipecat-ai) is not installed: `nox -s integrations` runs these tests in a venv with it")

    def _run(self, server, frames, rate=16000, **options):
        from pipecat.pipeline.task import PipelineParams
        from pipecat.tests.utils import run_test

        from higgs_pack.serve.integrations.pipecat_tts import HiggsTTSService

        tts = HiggsTTSService(base_url=server.url, sample_rate=rate, options={"seed": 3, **BY_SENTENCE, **options})
        down, _ = asyncio.run(run_test(tts, frames_to_send=frames,
                                       pipeline_params=PipelineParams(audio_out_sample_rate=rate)))
        return down

    def test_sentences_come_as_audio_frames_at_the_rate_asked_with_their_timings(self, server):
        from pipecat.frames.frames import (
            TTSAudioRawFrame,
            TTSSpeakFrame,
            TTSStartedFrame,
            TTSStoppedFrame,
            TTSTextFrame,
        )
        from pipecat.tests.utils import SleepFrame

        down = self._run(server, [TTSSpeakFrame("Hello there. How are you today?"), SleepFrame(sleep=4)])
        audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
        assert audio and {f.sample_rate for f in audio} == {16000} and {f.num_channels for f in audio} == {1}
        seconds = sum(len(f.audio) for f in audio) / 2 / 16000
        # two sentences of at least 50 frames (2 s) each and the 0.2 s pause between them
        assert seconds >= 4.0
        texts = [f for f in down if isinstance(f, TTSTextFrame)]
        # word by word (supports_word_timestamps), each at its estimated time in the turn's audio
        assert [f.text for f in texts] == ["Hello", "there.", "How", "are", "you", "today?"]
        assert [f.pts for f in texts] == sorted(f.pts for f in texts)
        # the second sentence's first word is timed where its speech starts: after the first one and the pause
        assert (texts[2].pts - texts[0].pts) / 1e9 == pytest.approx(2.2, abs=0.5)
        kinds = [type(f) for f in down]
        assert kinds.index(TTSStartedFrame) < kinds.index(TTSAudioRawFrame)
        assert TTSStoppedFrame in kinds[kinds.index(TTSAudioRawFrame):]

    def test_token_mode_streams_tokens_and_the_server_finds_the_sentences(self, server):
        from pipecat.frames.frames import (
            LLMFullResponseEndFrame,
            LLMFullResponseStartFrame,
            LLMTextFrame,
            TTSAudioRawFrame,
            TTSTextFrame,
        )
        from pipecat.services.tts_service import TextAggregationMode
        from pipecat.tests.utils import SleepFrame, run_test

        from higgs_pack.serve.integrations.pipecat_tts import HiggsTTSService

        tts = HiggsTTSService(base_url=server.url, sample_rate=24000, options={"seed": 1},
                              text_aggregation_mode=TextAggregationMode.TOKEN)
        tokens = ["One", " sentence", " here.", " And", " the", " rest"]
        frames = [LLMFullResponseStartFrame(), *(LLMTextFrame(t) for t in tokens), LLMFullResponseEndFrame(),
                  SleepFrame(sleep=4)]
        from pipecat.pipeline.task import PipelineParams

        down, _ = asyncio.run(run_test(tts, frames_to_send=frames,
                                       pipeline_params=PipelineParams(audio_out_sample_rate=24000)))
        audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
        assert audio and {f.sample_rate for f in audio} == {24000}
        assert sum(len(f.audio) for f in audio) / 2 / 24000 >= 4.0  # two sentences of >= 2 s
        assert "".join(f.text for f in down if isinstance(f, TTSTextFrame)).replace(" ", "") == \
            "Onesentencehere.Andtherest"

    def test_each_word_frame_is_timed_at_its_word_in_the_audio(self, server):
        """Pipecat's output transport plays audio and TTSTextFrames by their pts and drops what an
        interruption cuts off, so the assistant's context keeps the words played: each word's pts
        is its (estimated) start in the turn's audio, back to back over the sentence's speech."""
        from pipecat.frames.frames import TTSAudioRawFrame, TTSSpeakFrame, TTSTextFrame
        from pipecat.tests.utils import SleepFrame

        text = "One two three four five six seven eight nine ten eleven twelve."
        down = self._run(server, [TTSSpeakFrame(text), SleepFrame(sleep=2.0)], max_new_tokens=150)
        words = [f for f in down if isinstance(f, TTSTextFrame)]
        seconds = sum(len(f.audio) for f in down if isinstance(f, TTSAudioRawFrame)) / 2 / 16000
        assert [f.text for f in words] == text.split()
        times = [(f.pts - words[0].pts) / 1e9 for f in words]
        assert times == sorted(times) and 0 < times[-1] < seconds
        # by characters: "twelve." (7 of 52) starts 45/52 of the way through the speech (the resampler
        # holds back a few ms of the end)
        assert times[-1] == pytest.approx(seconds * 45 / 52, abs=0.1)

    def test_an_interruption_stops_the_sentence_on_the_server_and_the_next_turn_speaks(self, server):
        """The tiny model makes audio far faster than real time: the interruption comes 0.5 s in,
        while its sentence (a cap of about 2000 frames, 80 s) is still being generated."""
        from pipecat.frames.frames import InterruptionFrame, TTSAudioRawFrame, TTSSpeakFrame
        from pipecat.tests.utils import SleepFrame

        frames = [TTSSpeakFrame(LONG), SleepFrame(sleep=0.5), InterruptionFrame(), SleepFrame(sleep=1.0),
                  TTSSpeakFrame("After the cut."), SleepFrame(sleep=3)]
        generated = server.metric("higgs_pack_engine_frames_total")
        down = self._run(server, frames)
        generated = server.metric("higgs_pack_engine_frames_total") - generated
        cut = next(i for i, f in enumerate(down) if isinstance(f, InterruptionFrame))
        before = sum(len(f.audio) for f in down[:cut] if isinstance(f, TTSAudioRawFrame)) / 2 / 16000
        after = sum(len(f.audio) for f in down[cut:] if isinstance(f, TTSAudioRawFrame)) / 2 / 16000
        assert before > 0
        # Run to its cap, LONG alone makes LONG_CAP_FRAMES frames (plus the next turn's): fewer means the
        # server stopped it (a fixed count would depend on how fast this machine generates).
        assert generated < LONG_CAP_FRAMES
        assert 2.0 <= after < 10  # then the next turn alone: no audio of the stopped sentence after the cut
        _wait_idle(server)
        assert server.metric("higgs_pack_in_flight") == 0  # the pipeline's end closed the session

    def test_after_an_interruption_the_context_holds_only_the_words_played(self, server):
        """A Pipecat pipeline as an agent's: the service, Pipecat's own output transport (its clock
        releases each word's TTSTextFrame at its pts, and an interruption drops the words not yet
        released; the speaker it writes to plays in real time) and the assistant half of
        LLMContextAggregatorPair.  Interrupted about 2 s into a turn of some 8 s, the context's
        assistant message is the turn's first words, up to about where playback stopped."""
        from pipecat.frames.frames import InterruptionFrame, TTSSpeakFrame
        from pipecat.pipeline.pipeline import Pipeline
        from pipecat.pipeline.task import PipelineParams
        from pipecat.processors.aggregators.llm_context import LLMContext
        from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
        from pipecat.tests.utils import SleepFrame, run_test

        from higgs_pack.serve.integrations.pipecat_tts import HiggsTTSService

        text = CUT_TURN
        context = LLMContext()
        pair = LLMContextAggregatorPair(context)
        tts = HiggsTTSService(base_url=server.url, sample_rate=16000, options={"seed": 3, "max_new_tokens": 100,
                                                                                     **BY_SENTENCE})
        speaker = _pipecat_speaker()
        pipeline = Pipeline([tts, speaker, pair.assistant()])
        frames = [TTSSpeakFrame(text), SleepFrame(sleep=2.5), InterruptionFrame(), SleepFrame(sleep=1.0)]
        asyncio.run(run_test(pipeline, frames_to_send=frames,
                             pipeline_params=PipelineParams(audio_out_sample_rate=16000)))
        said = [m["content"] for m in context.get_messages() if m["role"] == "assistant"]
        assert len(said) == 1, context.get_messages()
        words = said[0].split()
        # a prefix of the turn cut inside its first sentence, where playback stopped (Pipecat releases a
        # word's frame at its start), within a word; every word would be there if not held to their times
        assert words == text.split()[:len(words)], said
        assert 1.0 < speaker.played < CUT_SENTENCE_S - 0.5
        assert abs(len(words) - _words_started(speaker.played)) <= 1, (said, speaker.played)

    def test_an_interruption_before_the_sentences_end_keeps_the_words_heard_of_it(self, server):
        """Interrupted about 2 s into LONG, a sentence still being generated (its audio.done, which
        times its words, never comes): the context's assistant message is the words the server's
        audio.cancelled says were heard (a prefix of the sentence), added with their times; without
        them the context would hold nothing of what the user heard."""
        from pipecat.frames.frames import InterruptionFrame, TTSSpeakFrame, TTSTextFrame
        from pipecat.pipeline.pipeline import Pipeline
        from pipecat.pipeline.task import PipelineParams
        from pipecat.processors.aggregators.llm_context import LLMContext
        from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
        from pipecat.processors.frame_processor import FrameProcessor
        from pipecat.tests.utils import SleepFrame, run_test

        from higgs_pack.serve.integrations.pipecat_tts import HiggsTTSService

        class Words(FrameProcessor):
            """The word frames on their way from the output transport to the aggregator."""

            def __init__(self):
                super().__init__()
                self.seen = []

            async def process_frame(self, frame, direction):
                await super().process_frame(frame, direction)
                if isinstance(frame, TTSTextFrame):
                    self.seen.append(frame)
                await self.push_frame(frame, direction)

        context = LLMContext()
        pair = LLMContextAggregatorPair(context)
        tts = HiggsTTSService(base_url=server.url, sample_rate=16000, options={"seed": 3, **BY_SENTENCE})
        speaker, words_seen = _pipecat_speaker(), Words()
        pipeline = Pipeline([tts, speaker, words_seen, pair.assistant()])
        frames = [TTSSpeakFrame(LONG), SleepFrame(sleep=2.0), InterruptionFrame(), SleepFrame(sleep=1.0)]
        generated = server.metric("higgs_pack_engine_frames_total")
        asyncio.run(run_test(pipeline, frames_to_send=frames,
                             pipeline_params=PipelineParams(audio_out_sample_rate=16000)))
        assert server.metric("higgs_pack_engine_frames_total") - generated < LONG_CAP_FRAMES  # cut mid-sentence
        said = [m["content"] for m in context.get_messages() if m["role"] == "assistant"]
        assert len(said) == 1, context.get_messages()
        words = said[0].split()
        assert 1 <= len(words) < 20 and words == LONG.split()[:len(words)], (said, speaker.played)
        # the server's estimate (12.5 characters a second, the rate of a session with no finished sentence,
        # or slower) at the service's guess of the point played (2 s after the text went out, at most), no
        # less than what the speaker (which lags the wall clock a little) had played, within a word
        chars = sum(map(len, words))
        assert 12.5 * speaker.played - len("sentence") <= chars <= 12.5 * 2.0 + 1, (said, speaker.played)
        # each word with its time: frames in order, at increasing times within the 2 s played
        assert [f.text for f in words_seen.seen] == words
        times = [f.pts for f in words_seen.seen]
        assert times == sorted(times) and (times[-1] - times[0]) / 1e9 < 2.0


def _livekit_say_interrupted(server, text: str, speaker, **options):
    """``text`` said by an ``AgentSession(use_tts_aligned_transcript=True)`` wired to ``speaker``
    through LiveKit's TranscriptSynchronizer, as a room wires it, and interrupted 2.5 s in: the
    assistant messages of the session's history."""
    from livekit.agents import Agent, AgentSession
    from livekit.agents.voice.transcription import TranscriptSynchronizer

    from higgs_pack.serve.integrations.livekit_tts import HiggsTTS

    async def run():
        higgs = HiggsTTS(base_url=server.url, sample_rate=16000, seed=3, **options, **BY_SENTENCE)
        session = AgentSession(tts=higgs, use_tts_aligned_transcript=True)
        sync = TranscriptSynchronizer(next_in_chain_audio=speaker, next_in_chain_text=None)
        session.output.audio, session.output.transcription = sync.audio_output, sync.text_output
        await session.start(Agent(instructions="Say what you are given."))
        handle = session.say(text)
        await asyncio.sleep(2.5)
        handle.interrupt()
        await handle
        said = [m for m in session.history.items if m.type == "message" and m.role == "assistant"]
        await session.aclose()
        await higgs.aclose()
        return said

    return asyncio.run(run())


def _livekit_speaker():
    """LiveKit's audio sink interface over a speaker that plays in real time: a segment plays from its
    first frame, and clear_buffer (an interruption) stops it where it is (``cut_at``: seconds played)."""
    from livekit.agents.voice import io

    class Speaker(io.AudioOutput):
        def __init__(self) -> None:
            super().__init__(label="speaker", capabilities=io.AudioOutputCapabilities(pause=False))
            self.started, self.pushed, self.ending = None, 0.0, None
            self.cut_at: float | None = None  # seconds played when a segment was interrupted

        async def capture_frame(self, frame) -> None:
            await super().capture_frame(frame)
            if self.started is None:
                self.started = time.time()
                self.on_playback_started(created_at=self.started)
            self.pushed += frame.duration

        def flush(self) -> None:
            super().flush()
            if self.started is not None:
                self.ending = asyncio.get_running_loop().call_later(
                    max(0.0, self.pushed - (time.time() - self.started)), self._finished, False)

        def clear_buffer(self) -> None:
            if self.started is not None:
                self._finished(True)

        def _finished(self, interrupted: bool) -> None:
            if self.ending is not None:
                self.ending.cancel()
            position = min(time.time() - self.started, self.pushed)
            if interrupted:
                self.cut_at = position
            self.started, self.pushed, self.ending = None, 0.0, None
            self.on_playback_finished(playback_position=position, interrupted=interrupted)

    return Speaker()


class TestLiveKit:
    livekit = pytest.importorskip("livekit.agents", reason="the [livekit] extra (livekit-agents) is not installed: `nox -s integrations` runs these tests in a venv with it")

    def test_a_stream_gives_frames_at_the_rate_asked_and_timed_transcripts(self, server):
        from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT

        from higgs_pack.serve.integrations.livekit_tts import HiggsTTS

        async def run():
            tts = HiggsTTS(base_url=server.url, sample_rate=16000, seed=3, **BY_SENTENCE)
            stream = tts.stream()
            stream.push_text("Hello there. How are")
            stream.push_text(" you today?")
            stream.end_input()
            events = [event async for event in stream]
            await stream.aclose()
            await tts.aclose()
            return events

        events = asyncio.run(run())
        frames = [e.frame for e in events]
        assert {f.sample_rate for f in frames} == {16000} and {f.num_channels for f in frames} == {1}
        seconds = sum(f.samples_per_channel for f in frames) / 16000
        assert seconds >= 4.0
        timed = [t for f in frames for t in f.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])]
        # a TimedString per word (aligned_transcript), back to back within a sentence
        assert [t.strip() for t in timed] == ["Hello", "there.", "How", "are", "you", "today?"]
        assert timed[0].start_time == pytest.approx(0.0, abs=1e-3)
        assert timed[1].start_time == pytest.approx(timed[0].end_time, abs=1e-3)
        assert timed[2].start_time == pytest.approx(timed[1].end_time + 0.2, abs=1e-3)  # the pause
        assert timed[-1].end_time == pytest.approx(seconds, abs=0.1)
        assert events[-1].is_final

    def test_every_turn_of_a_session_starts_speaking_after_its_first_words(self, server):
        """The server's default commit rule (first_commit_words 3) on one session kept open across two
        turns (each stream's end flushes: a response's end): each turn's first audio comes once its
        first words are whole, before the turn's text ends, the second turn's as the first's."""
        from higgs_pack.serve.integrations.livekit_tts import HiggsTTS

        async def run() -> list[float]:
            tts = HiggsTTS(base_url=server.url, seed=3)
            seconds = []
            for turn in (["One", " two", " three", " four", " five", " six."],
                         ["Seven", " eight", " nine", " ten", " eleven", " twelve."]):
                stream = tts.stream()
                for token in turn[:5]:
                    stream.push_text(token)
                first = await asyncio.wait_for(stream.__anext__(), 30)  # no end of input yet
                stream.push_text(turn[5])
                stream.end_input()
                frames = [first.frame, *[event.frame async for event in stream]]
                await stream.aclose()
                seconds.append(sum(f.samples_per_channel for f in frames) / 24000)
            await tts.aclose()
            return seconds

        seconds = asyncio.run(run())
        assert all(s >= 4.0 for s in seconds), seconds  # two parts of >= 2 s each per turn

    def test_closing_a_stream_mid_sentence_cancels_it_and_the_session_goes_on(self, server):
        from higgs_pack.serve.integrations.livekit_tts import HiggsTTS

        async def run():
            tts = HiggsTTS(base_url=server.url, seed=2, **BY_SENTENCE)
            stream = tts.stream()
            stream.push_text(LONG + " ")
            stream.flush()
            async for _ in stream:  # the first audio
                break
            assert server.metric("higgs_pack_active_batch") == 1
            await stream.aclose()  # what the agent does on barge-in
            await asyncio.to_thread(_wait_idle, server, 0, 10)
            assert server.metric("higgs_pack_in_flight") == 1  # the session stays open
            after = tts.synthesize("After the cut.")
            frames = [event.frame async for event in after]
            await after.aclose()
            await tts.aclose()
            return frames

        frames = asyncio.run(run())
        seconds = sum(f.samples_per_channel for f in frames) / 24000
        assert 2.0 <= seconds < 10  # the new text alone: nothing of the stopped sentence came after it
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and server.metric("higgs_pack_in_flight"):
            time.sleep(0.05)
        assert server.metric("higgs_pack_in_flight") == 0


    def test_after_an_interruption_the_transcript_is_cut_where_the_user_interrupted(self, server):
        """A LiveKit AgentSession with use_tts_aligned_transcript, its outputs wired as RoomIO wires
        them (a TranscriptSynchronizer over the audio sink, which here is a speaker playing in real
        time): the agent says a turn of some 8 s and is interrupted about 2 s in; the assistant
        message in the session's history is marked interrupted and holds the turn's first words, up
        to about where playback stopped (the synchronizer paces them by the TimedStrings)."""
        text, speaker = CUT_TURN, _livekit_speaker()
        (said,) = _livekit_say_interrupted(server, text, speaker, max_new_tokens=100)
        words = (said.text_content or "").split()
        assert said.interrupted
        # a prefix of the turn cut inside its first sentence, where playback stopped, within a word
        assert words == text.split()[:len(words)], said.text_content
        assert speaker.cut_at is not None and 1.0 < speaker.cut_at < CUT_SENTENCE_S - 0.5
        assert abs(len(words) - _words_started(speaker.cut_at)) <= 1, (said.text_content, speaker.cut_at)

    def test_an_interruption_before_the_sentences_end_cuts_the_transcript_at_the_words_heard(self, server):
        """As above, but the turn is LONG, a sentence still being generated when the agent is
        interrupted about 2 s in (its audio.done, which times its words, never comes): the assistant
        message holds the words the server's audio.cancelled says were heard (a prefix of the
        sentence), not the whole sentence nor nothing."""
        speaker = _livekit_speaker()
        generated = server.metric("higgs_pack_engine_frames_total")
        (said,) = _livekit_say_interrupted(server, LONG, speaker)
        assert server.metric("higgs_pack_engine_frames_total") - generated < LONG_CAP_FRAMES  # cut mid-sentence
        words = (said.text_content or "").split()
        assert said.interrupted
        assert 1 <= len(words) < 20 and words == LONG.split()[:len(words)], said.text_content
        # the server's estimate (12.5 characters a second, or slower: the rate of a session with no finished
        # sentence) at the point played, within a word
        chars = sum(map(len, words))
        assert speaker.cut_at is not None and chars <= 12.5 * speaker.cut_at + len("sentence"), \
            (said.text_content, speaker.cut_at)
