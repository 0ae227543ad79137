"""``higgs-pack serve``: an OpenAI-compatible speech server over one loaded bundle.

The rooms:

- :mod:`~higgs_pack.serve.config`: :class:`ServeConfig`, the server's settings and limits;
- :mod:`~higgs_pack.serve.errors`: :class:`ApiError`, errors in OpenAI's body shape;
- :mod:`~higgs_pack.serve.speech`: the ``POST /v1/audio/speech`` body, checked field by field
  and turned into a :class:`~higgs_pack.runtime.request.SynthesisRequest`;
- :mod:`~higgs_pack.serve.schema`: the request bodies as the API docs (``/docs``) show them;
- :mod:`~higgs_pack.serve.formats`: OpenAI's response formats (mp3, opus, aac, flac, wav, pcm),
  each streamed as it is encoded (PyAV), and server-sent events;
- :mod:`~higgs_pack.serve.tempo`: ``speed``, a pitch-keeping time stretch (FFmpeg's atempo), and
  timings scaled to match;
- :mod:`~higgs_pack.serve.voices`: the voice store (encoded once, kept as codes on disk);
- :mod:`~higgs_pack.serve.metrics`: Prometheus metrics;
- :mod:`~higgs_pack.serve.server`: :class:`SpeechServer`, the loaded bundle, its engine and
  the request bookkeeping (queue bound, cancellation, readiness);
- :mod:`~higgs_pack.serve.app`: the ASGI app (FastAPI) with every route;
- :mod:`~higgs_pack.serve.cli`: the ``serve`` command (uvicorn);
- :mod:`~higgs_pack.serve.ray_app`: the same app as a Ray Serve deployment.

Needs the ``[serve]`` extra (FastAPI, uvicorn, python-multipart, prometheus-client,
fastapi-offline for the API docs' own copy of Swagger UI, and PyAV for the encoders and the
stretch); the runtime without it has no web stack.
"""
