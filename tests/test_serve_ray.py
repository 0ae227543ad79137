"""Issue 20 item 6: the speech server scaled out on Ray Serve (:mod:`higgs_pack.serve.ray_app`).

A local Ray instance (2 CPUs, no dashboard, no usage stats) runs the deployment with two
replicas on the real tiny cpu int4 bundle, each with its own engine; requests go through
Ray's HTTP proxy on 127.0.0.1, among them a stream read by the official ``openai`` client.
The example config files (a Ray cluster's and KubeRay's) are checked against Ray's own schema;
they are not run here.
"""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
import yaml
from conftest import slow_fixture

ray = pytest.importorskip("ray", reason="Ray Serve is the [ray] extra: pip install 'higgs-pack[ray]'")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is the [ray] extra: pip install 'higgs-pack[ray]'")
openai = pytest.importorskip("openai", reason="the official openai client is a dev dependency")

from ray.serve.schema import ServeDeploySchema  # noqa: E402

from higgs_pack.errors import InputError  # noqa: E402
from higgs_pack.serve import ray_app  # noqa: E402
from higgs_pack.serve.config import ServeConfig  # noqa: E402
from higgs_pack.serve.server import SpeechServer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "higgs-audio-v3-tiny"
TEXT = "Hello there, this is a test of the speech server."
FRAMES = 48  # 1.92 s of audio per request: a few streamed chunks
#: Longest wait for Ray to start the application (both replicas loaded and warmed up), seconds.
START_TIMEOUT_S = 150.0


def test_build_app_sizes_each_replica_from_its_engine():
    source, config, keywords = ray_app.parse_args(
        {"source": "dist/b", "max_batch": "2", "max_queue": "4", "min_replicas": "1", "max_replicas": "3",
         "num_cpus": "0.5", "model_names": "tts-1, tts-1-hd", "allow_origins": "http://localhost:3000"})
    assert source == "dist/b" and config.max_batch == 2 and config.max_queue == 4
    assert config.model_names == ("tts-1", "tts-1-hd") and config.allow_origins == ("http://localhost:3000",)
    options = ray_app.deployment_options(config, **{k: v for k, v in keywords.items() if k != "device"})
    assert options["max_ongoing_requests"] == 6  # the server's capacity: 2 rows + 4 waiting
    scaling = options["autoscaling_config"]
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (1, 3, 3)  # 2 rows + 1
    assert options["ray_actor_options"] == {"num_cpus": 0.5} and "num_replicas" not in options
    assert options["graceful_shutdown_timeout_s"] == config.grace_seconds
    fixed = ray_app.deployment_options(ServeConfig(), num_replicas=2, health_check_period_s=2)
    assert fixed["num_replicas"] == 2 and fixed["max_ongoing_requests"] == 4 + 16 and fixed["health_check_period_s"] == 2
    given = ray_app.deployment_options(ServeConfig(), autoscaling_config={"max_replicas": 5, "target_ongoing_requests": 9})
    assert given["autoscaling_config"].target_ongoing_requests == 9  # a target given is kept
    assert [ray_app.target_ongoing_requests(n) for n in (1, 2, 4, 8)] == [2, 3, 6, 12]


@pytest.mark.parametrize(("args", "words"), [
    ({"max_batch": 2}, "needs source=BUNDLE"),
    ({"source": "b", "num_replica": 2}, "'num_replica' (did you mean 'num_replicas'?)"),
    ({"source": "b", "max_batch": "four", "max_upload_mb": "big"},
     "max_batch='four' is not a whole number (as higgs-pack serve --max-batch: Requests decoded together"),
    ({"source": "b", "max_kv_mb": "x"}, "max_kv_mb='x' is not a number (as higgs-pack serve --max-kv-mb"),  # Ray had none
    ({"source": "b", "max_batch": "0"}, "max_batch must be a whole number >= 1"),
    ({"source": "b", "num_replicas": "2", "max_replicas": "3"}, "not both"),
    ({"source": "b", "min_replicas": "4", "max_replicas": "3"}, "must be greater than or equal to min_replicas"),
])
def test_build_app_refuses_bad_arguments_and_names_them(args, words):
    with pytest.raises(InputError) as caught:
        ray_app.build_app(args)
    assert words in str(caught.value)


def _serve_config_of(text: str) -> ServeDeploySchema:
    return ServeDeploySchema.model_validate(yaml.safe_load(text))


def test_the_example_configs_are_configs_ray_accepts():
    cluster = _serve_config_of((REPO_ROOT / "serve" / "ray-serve.example.yaml").read_text())
    kuberay = yaml.safe_load((REPO_ROOT / "serve" / "kuberay-rayservice.example.yaml").read_text())
    assert kuberay["kind"] == "RayService" and kuberay["apiVersion"] == "ray.io/v1"
    on_kubernetes = _serve_config_of(kuberay["spec"]["serveConfigV2"])
    for config in (cluster, on_kubernetes):
        (app,) = config.applications
        assert app.import_path == "higgs_pack.serve.ray_app:build_app"
        source, server, keywords = ray_app.parse_args(app.args)
        assert source.startswith("/models/")
        options = ray_app.deployment_options(server, **keywords)
        assert options["max_ongoing_requests"] == server.max_batch + server.max_queue == 20
        assert options["autoscaling_config"].target_ongoing_requests == 6  # 4 rows + 2 waiting
        for override in app.deployments:
            assert override.name == ray_app.DEPLOYMENT_NAME
    workers = kuberay["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    assert workers["containers"][0]["volumeMounts"][0]["mountPath"] == "/models"


def test_the_health_check_fails_once_the_engine_stopped(cpu_int4_bundle):
    server = SpeechServer.open(cpu_int4_bundle, ServeConfig(max_batch=1))
    try:
        assert ray_app.health_problem(server) is None
        server.engine.close(timeout=30)
        assert "engine has stopped" in ray_app.health_problem(server)
    finally:
        server.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@slow_fixture(scope="module")
def ray_proxy(cpu_int4_bundle, tmp_path_factory):
    """The application on a local Ray instance, two replicas, as ``serve run`` would build it
    from its ``key=value`` arguments; yields (proxy URL, replica logs folder)."""
    saved = {k: os.environ.get(k) for k in ("RAY_USAGE_STATS_ENABLED",)}
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    logs = tmp_path_factory.mktemp("ray-serve-logs")
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = ray_app.build_app({"source": str(cpu_int4_bundle), "num_replicas": "2", "max_batch": "4",
                                 "max_queue": "4"})
        failed: list[BaseException] = []

        def run() -> None:
            try:
                serve.run(app, name="higgs", route_prefix="/", logging_config={"logs_dir": str(logs)})
            except BaseException as exc:  # said by the test below
                failed.append(exc)

        runner = threading.Thread(target=run, daemon=True)
        runner.start()
        runner.join(START_TIMEOUT_S)
        if runner.is_alive() or failed:
            raise AssertionError(f"the application did not start within {START_TIMEOUT_S:.0f} s: "
                                 f"{failed or serve.status()}")
        yield f"http://127.0.0.1:{port}", logs
    finally:
        serve.shutdown()
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _request(url: str, fields: dict, client: str = "httpx") -> dict:
    """One speech request; returns its status, content type, ``x-served-by`` and the pieces
    of its body as they arrived."""
    body = {"model": MODEL, "input": TEXT, "max_new_tokens": FRAMES, **fields}
    if client == "openai":
        speech = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120).audio.speech
        extra = {k: body.pop(k) for k in ("seed", "max_new_tokens")}
        with speech.with_streaming_response.create(**body, voice="default", extra_body=extra) as response:
            return {"status": response.status_code, "type": response.headers["content-type"],
                    "by": response.headers.get(ray_app.SERVED_BY), "pieces": list(response.iter_bytes())}
    with httpx.stream("POST", url + "/v1/audio/speech", json=body, timeout=120) as response:
        return {"status": response.status_code, "type": response.headers["content-type"],
                "by": response.headers.get(ray_app.SERVED_BY), "pieces": list(response.iter_raw())}


#: Eight requests at once: (fields, client); each streamed one has a whole twin (same seed).
BURST = [
    ({"seed": 11, "response_format": "pcm"}, "httpx"),
    ({"seed": 11, "response_format": "pcm", "stream_format": "audio"}, "openai"),
    ({"seed": 12, "response_format": "wav"}, "httpx"),
    ({"seed": 12, "response_format": "wav", "stream_format": "audio"}, "httpx"),
    ({"seed": 13, "response_format": "pcm"}, "httpx"),
    ({"seed": 13, "response_format": "pcm", "stream_format": "sse"}, "httpx"),
    ({"seed": 14, "response_format": "wav"}, "httpx"),
    ({"seed": 14, "response_format": "pcm", "stream_format": "audio"}, "httpx"),
]


def _samples(answer: dict) -> np.ndarray:
    data = b"".join(answer["pieces"])
    if answer["type"] == "audio/wav":
        samples, rate = sf.read(io.BytesIO(data), dtype="int16")  # the open-length header too
        assert rate == 24000 and samples.ndim == 1
        return samples
    assert answer["type"] == "audio/pcm" and len(data) % 2 == 0
    return np.frombuffer(data, "<i2")


def test_two_replicas_answer_every_request_whole_and_streamed_through_the_proxy(ray_proxy):
    url, logs = ray_proxy
    ready = httpx.get(url + "/ready", timeout=10)
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    status = serve.status().applications["higgs"]
    assert status.deployments[ray_app.DEPLOYMENT_NAME].replica_states == {"RUNNING": 2}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(BURST)) as pool:
        answers = list(pool.map(lambda request: _request(url, *request), BURST))
    seconds = time.perf_counter() - t0
    assert [a["status"] for a in answers] == [200] * len(BURST), [b"".join(a["pieces"])[:300] for a in answers]
    served_by = {a["by"] for a in answers}
    assert None not in served_by and len(served_by) == 2, served_by  # both replicas served
    for (fields, _), answer in zip(BURST, answers, strict=True):
        if fields.get("stream_format"):
            assert len(answer["pieces"]) > 1, f"{fields} came in one piece"
    whole = {fields["seed"]: _samples(a) for (fields, _), a in zip(BURST, answers, strict=True)
             if "stream_format" not in fields}
    for (fields, _), answer in zip(BURST, answers, strict=True):
        want = whole[fields["seed"]]
        assert 0 < want.size <= 960 * FRAMES and want.size % 960 == 0 and np.abs(want).max() > 0
        if fields.get("stream_format") == "sse":
            assert answer["type"].startswith("text/event-stream")
            lines = b"".join(answer["pieces"]).decode().splitlines()
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
            # one sentence: its speech.segment event follows the delta that completes its audio (issue 30 item 2)
            assert [e["type"] for e in events] == (["speech.audio.delta"] * (len(events) - 2)
                                                   + ["speech.segment", "speech.audio.done"])
            assert events[-2]["text"] == TEXT and events[-2]["end"] == pytest.approx(want.size / 24000)
            audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-2])
            assert len(audio) == 2 * want.size and events[-1]["usage"]["output_tokens"] == want.size // 960
        elif fields.get("stream_format") == "audio":
            if answer["type"] == "audio/wav":
                head = b"".join(answer["pieces"])[:44]
                assert head[4:8] == b"\xff\xff\xff\xff" and head[40:44] == b"\xff\xff\xff\xff"
            assert _samples(answer).size == want.size  # complete: as long as the whole answer
    print(f"\n{len(BURST)} requests through Ray's proxy on 2 replicas: {seconds:.1f} s; "
          f"served by {sorted(served_by)}")

    serve.delete("higgs")  # a graceful stop: Ray drains, then runs the lifespan shutdown and __del__
    closed = [path.read_text() for path in logs.glob("replica_higgs_HiggsSpeech_*.log")]
    assert len(closed) == 2 and all("warmed up" in text for text in closed)
    assert all("engine stopped and bundle closed by the app's lifespan shutdown" in text for text in closed), \
        closed
