"""Voice-agent frameworks speaking to ``higgs-pack serve`` over its live WebSocket
(``/v1/audio/speech/stream``, docs/serving/live.md):

- :mod:`~higgs_pack.serve.integrations.protocol`: the client side of the protocol (messages,
  a reader of the server's events), standard library only;
- :mod:`~higgs_pack.serve.integrations.pipecat_tts`: :class:`HiggsTTSService`, a Pipecat TTS
  service (the ``[pipecat]`` extra: ``pipecat-ai``);
- :mod:`~higgs_pack.serve.integrations.livekit_tts`: :class:`HiggsTTS`, a LiveKit Agents TTS
  plugin (the ``[livekit]`` extra: ``livekit-agents``).

Each module imports its framework; import the one you use.
"""
