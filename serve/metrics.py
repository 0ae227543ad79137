"""Prometheus metrics of one server (``GET /metrics``), in their own registry.

Names (all prefixed ``higgs_pack_``): ``requests_total{route,status}``,
``request_seconds`` and ``time_to_first_audio_seconds`` histograms, ``real_time_factor``
(compute seconds per second of audio; below 1 is faster than real time), ``frames_total``,
``audio_seconds_total``, ``engine_frames_total`` and ``engine_steps_total`` (the engine's
own counts, cancelled requests included), ``codec_frames_total`` (frames its codec thread decoded), ``queue_depth`` (requests waiting for a row), ``active_batch`` (rows
busy), ``in_flight`` (requests admitted and not done), ``ready``, and the engine's KV bytes
where it reports them (``kv_blocks_in_use`` and ``kv_prefix_blocks_shared`` only for a paged
decoder's block pool); the voice prefix cache's ``prefix_cache_hits_total``,
``prefix_cache_misses_total``, ``prefix_cache_bytes`` and ``prefix_cache_entries``; the engine's
``prefill_positions_total``, ``prefill_seconds_total`` and ``join_max_frame_gap_seconds``
(longest wait of a running request for its next frame while a prompt joined).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["CONTENT_TYPE", "Metrics"]

_SECONDS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)
_RTF = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


class Metrics:
    """The server's metrics.

    Args:
        server: the :class:`~higgs_pack.serve.server.SpeechServer` whose engine and queue
            the gauges read at each scrape.
    """

    def __init__(self, server: Any):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("higgs_pack_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.request_seconds = Histogram("higgs_pack_request_seconds", "Seconds from request to last byte",
                                         ["route"], buckets=_SECONDS, registry=r)
        self.first_audio = Histogram("higgs_pack_time_to_first_audio_seconds",
                                     "Seconds from request to the first audio bytes of a stream", buckets=_SECONDS,
                                     registry=r)
        self.real_time_factor = Histogram("higgs_pack_real_time_factor",
                                          "Seconds of compute per second of audio, per request", buckets=_RTF,
                                          registry=r)
        self.frames = Counter("higgs_pack_frames", "Audio frames generated (25 per second)", registry=r)
        self.audio_seconds = Counter("higgs_pack_audio_seconds", "Seconds of audio answered", registry=r)
        Gauge("higgs_pack_queue_depth", "Requests waiting for a row of the batch", registry=r).set_function(
            lambda: server.engine.waiting)
        Gauge("higgs_pack_active_batch", "Rows of the batch holding a request", registry=r).set_function(
            lambda: server.engine.busy_rows)
        Gauge("higgs_pack_max_batch", "Rows the engine decodes together", registry=r).set_function(
            lambda: server.engine.max_batch)
        Gauge("higgs_pack_in_flight", "Requests admitted and not finished", registry=r).set_function(
            lambda: server.in_flight)
        Gauge("higgs_pack_ready", "1 when the bundle is loaded and warmed up", registry=r).set_function(
            lambda: float(server.ready))
        r.register(_EngineCollector(server))
        Gauge("higgs_pack_kv_bytes", "KV cache bytes reserved by the admitted requests", registry=r).set_function(
            lambda: server.engine.kv_bytes_in_use)
        if server.engine.kv_blocks_in_use is not None:  # a paged decoder's block pool; none without one
            Gauge("higgs_pack_kv_blocks_in_use", "KV blocks the requests name now in the paged decoder's pool (a "
                  "shared voice prefix block once)", registry=r).set_function(
                lambda: server.engine.kv_blocks_in_use or 0)
            Gauge("higgs_pack_kv_prefix_blocks_shared", "Voice prefix KV blocks that several requests name now (paged "
                  "decoder)", registry=r).set_function(lambda: server.engine.prefix_blocks_shared or 0)
        Gauge("higgs_pack_kv_budget_bytes", "Most KV bytes the admitted requests may reach (0: no limit)",
              registry=r).set_function(lambda: server.engine.kv_budget_bytes or 0)

    def render(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)


class _EngineCollector:
    """The engine's own counters (:class:`~higgs_pack.runtime.engine.state.EngineStats`), read
    at each scrape: frames and steps of every request, cancelled ones included."""

    def __init__(self, server: Any):
        self._server = server

    def describe(self):
        return []

    def collect(self):
        stats = self._server.engine.stats
        yield CounterMetricFamily("higgs_pack_engine_frames", "Frames the engine generated (rows advanced)",
                                  value=stats.frames)
        yield CounterMetricFamily("higgs_pack_engine_steps", "Batched decode steps the engine ran", value=stats.steps)
        yield CounterMetricFamily("higgs_pack_engine_step_seconds", "Seconds inside the engine's decode steps",
                                  value=stats.step_seconds)
        yield CounterMetricFamily("higgs_pack_prefill_positions", "Prompt positions the engine prefilled "
                                  "(cached voice prefixes not counted)", value=stats.prefill_positions)
        yield CounterMetricFamily("higgs_pack_prefill_seconds", "Seconds the engine spent prefilling prompts",
                                  value=stats.prefill_seconds)
        yield GaugeMetricFamily("higgs_pack_engine_step_mean_seconds", "Mean seconds of one batched decode step "
                                "(0 before any)", value=0.0 if not stats.steps else stats.engine_step_ms / 1000)
        yield GaugeMetricFamily("higgs_pack_join_max_frame_gap_seconds", "Longest wait of a running request for "
                                "its next frame while another prompt was prefilled",
                                value=stats.join_max_frame_gap_ms / 1000)
        yield CounterMetricFamily("higgs_pack_first_audio_holds", "Times the engine held its steps while a "
                                  "stream's first audio was in the codec", value=stats.first_audio_holds)
        yield CounterMetricFamily("higgs_pack_first_audio_hold_seconds", "Seconds the engine held its steps for "
                                  "streams' first audio", value=stats.first_audio_hold_seconds)
        cache = self._server.engine.prefix_cache
        if cache is not None:
            cached = cache.stats
            yield CounterMetricFamily("higgs_pack_prefix_cache_hits", "Voice prompt prefixes served from the KV "
                                      "cache (memory or a persisted file)", value=cached.hits)
            yield CounterMetricFamily("higgs_pack_prefix_cache_misses", "Voice prompt prefixes computed (not cached)",
                                      value=cached.misses)
            yield GaugeMetricFamily("higgs_pack_prefix_cache_bytes", "KV bytes of voice prefixes held in memory",
                                    value=cached.bytes)
            yield GaugeMetricFamily("higgs_pack_prefix_cache_entries", "Voice prefixes held in memory",
                                    value=cached.entries)
        codec = self._server.engine.codec.stats
        yield CounterMetricFamily("higgs_pack_codec_frames", "Frames the engine's codec thread decoded (each "
                                  "window's context frames included)", value=codec.frames)
        yield CounterMetricFamily("higgs_pack_codec_runs", "Runs of the engine's codec thread (one run decodes the "
                                  "windows or stream steps of several requests)", value=codec.runs)
        yield CounterMetricFamily("higgs_pack_codec_seconds", "Seconds the engine's codec thread spent in runs",
                                  value=codec.seconds)
        yield GaugeMetricFamily("higgs_pack_codec_max_run_seconds", "The engine's longest codec run (it shares "
                                "the cores with the decode steps while it runs)", value=codec.max_run_seconds)
