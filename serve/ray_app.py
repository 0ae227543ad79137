"""The speech server on Ray Serve: the same FastAPI app (:func:`~higgs_pack.serve.app.create_app`)
in every replica, each replica with its own loaded bundle and continuous-batching engine.

Two entries:

- :func:`build_app`, the application builder that Ray's CLI and config files name::

      serve run higgs_pack.serve.ray_app:build_app source=dist/higgs-audio-v3-tiny-cpu-int4 num_replicas=2

- :func:`deployment`, the same from Python: ``serve.run(deployment("dist/...", num_replicas=2))``.

How Ray 2.60 runs the app (read from ``ray/serve/api.py`` ``ingress`` and
``ray/serve/_private/replica.py``, ``http_util.py``): the replica constructs
:class:`SpeechDeployment`, calls its ``__serve_build_asgi_app__``, then runs the app's ASGI
lifespan startup through uvicorn's ``LifespanOn`` before the replica counts as started.  On
a graceful stop it drains the requests in flight (up to ``graceful_shutdown_timeout_s``),
then calls the replica's ``__del__``: the ingress wrapper runs the lifespan shutdown (the
app's lifespan closes the server) and then the class's own ``__del__``.  The app's lifespan
starts warm-up on a thread and returns at once, which under Ray would let the proxy route
requests to a replica still warming up (answered 503); so the constructor loads and warms up
the bundle itself, and the app is built with ``warm_up=False``: a replica takes traffic only
once it is warm.  ``__del__`` closes the server again (a no-op after the lifespan did), so
the engine stops even where the lifespan shutdown never ran.

Sizing (the defaults of :func:`deployment` and :func:`build_app`):

- ``max_ongoing_requests`` per replica is the server's capacity, ``max_batch + max_queue``
  (20 with the defaults): Ray sends a replica no more than it admits, and queues the rest
  itself (``max_queued_requests``, unbounded by default; set it to answer 503 beyond).
  Without ``max_batch``, 4 rows are assumed; a bundle that cannot batch (the NPU variant,
  OpenVINO on a GPU, dml bundles) runs one row, so give ``max_batch=1`` there or the replica answers 429
  beyond ``1 + max_queue``.
- autoscaling's ``target_ongoing_requests`` is :func:`target_ongoing_requests`: the batch's
  rows plus half of them waiting (6 for 4 rows).  Below the rows a replica's batch still has
  room, and the engine reads the decoder's weights once per step for all its rows, so a
  fuller batch costs little more per step; once every row is busy each waiting request adds
  a whole request's time to its time to first audio, so Ray adds a replica when half a batch
  waits, before the queue grows.
- ``ray_actor_options.num_cpus`` is :data:`NUM_CPUS` (1): a scheduling reservation, not a
  limit.  ONNX Runtime sizes its thread pool to the machine's cores (unless the bundle's
  session options set ``intra_op_num_threads``), so on a real bundle run one replica per node
  (``max_replicas_per_node=1``) and reserve the node's cores.

Readiness: :meth:`SpeechDeployment.check_health` (Ray calls it every ``health_check_period_s``,
10 s by default) fails once the replica's engine has stopped, and Ray replaces the replica.
Every answer carries ``x-served-by``: the replica's id.

A voice uploaded with ``POST /v1/audio/voices`` is encoded by the replica that took it.  Give
every replica the same ``voices_dir`` (a shared volume) and all of them serve it at once (the
store looks names up in the folder, :mod:`higgs_pack.serve.voices`); without one it stays in
that replica's memory.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from higgs_pack.errors import InputError, Problem, did_you_mean, install_extra

try:
    from ray import serve
    from ray.serve import Application
    from ray.serve.config import AutoscalingConfig
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"higgs_pack.serve.ray_app needs Ray Serve ({exc}); " + install_extra("ray")) from exc

from higgs_pack.serve.app import create_app
from higgs_pack.serve.config import ServeConfig, settings
from higgs_pack.serve.server import DEFAULT_MAX_BATCH, SpeechServer

#: Ray Serve's logger: a replica writes it to its own log file (``logs/serve/replica_*.log``).
log = logging.getLogger("ray.serve")

#: The deployment's name (a config file's ``deployments: - name:`` overrides its options).
DEPLOYMENT_NAME = "HiggsSpeech"
#: CPUs Ray reserves per replica (``ray_actor_options.num_cpus``).
NUM_CPUS = 1.0
#: Response header naming the replica that answered.
SERVED_BY = "x-served-by"


def capacity(config: ServeConfig) -> int:
    """Requests one replica admits: the batch's rows (``max_batch``, else 4) plus ``max_queue``."""
    return (config.max_batch or DEFAULT_MAX_BATCH) + config.max_queue


def target_ongoing_requests(max_batch: int) -> int:
    """Autoscaling's target per replica: ``max_batch`` rows plus half of them waiting (at least one)."""
    return max_batch + max(1, max_batch // 2)


class _ServedBy:
    """ASGI middleware: adds ``x-served-by: <replica id>`` to every HTTP answer."""

    def __init__(self, app: Any, replica: str):
        self.app, self.header = app, (SERVED_BY.encode(), replica.encode())

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


def health_problem(server: SpeechServer) -> str | None:
    """Why this replica cannot serve (its engine stopped), or None when it can."""
    if not server.engine.alive:
        return ("the replica's engine has stopped (closed, or its thread failed: see the replica's log); "
                "Ray replaces the replica")
    return None


@serve.deployment(name=DEPLOYMENT_NAME)
@serve.ingress()
class SpeechDeployment:
    """One replica: the bundle loaded, its engine warmed up, the app over them.

    Args:
        source: anything :func:`higgs_pack.load` takes, as seen from the replica's node.
        config: :class:`~higgs_pack.serve.config.ServeConfig`; without ``api_key``, the
            replica's ``HIGGS_PACK_API_KEY`` environment variable is used when set.
        device: as ``higgs-pack serve --device`` (None: the bundle's own).

    Raises:
        HiggsPackError: the bundle cannot be loaded, or warm-up failed (Ray retries the replica).
    """

    async def __init__(self, source: str, config: ServeConfig, device: str | None = None):
        if config.api_key is None and os.environ.get("HIGGS_PACK_API_KEY"):
            config = replace(config, api_key=os.environ["HIGGS_PACK_API_KEY"])
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.server = await asyncio.to_thread(SpeechServer.open, source, config, device=device)
        try:
            seconds = await asyncio.to_thread(self.server.warm_up)
        except BaseException:
            self.server.close()
            raise
        log.info("replica %s (pid %d): %s loaded and warmed up in %.1f s; max_batch %d, capacity %d",
                 self.replica, os.getpid(), self.server.models[0], seconds, self.server.engine.max_batch,
                 self.server.capacity)

    def __serve_build_asgi_app__(self) -> Any:
        app = create_app(self.server, warm_up=False)
        app.add_middleware(_ServedBy, replica=self.replica)
        return app

    def check_health(self) -> None:
        """Ray's health check: raises while the engine cannot take requests."""
        problem = health_problem(self.server)
        if problem is not None:
            raise RuntimeError(problem)

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is None:  # the constructor failed
            return
        by_lifespan = server.stopping and not server.engine.alive
        server.close()
        log.info("replica %s: engine stopped and bundle closed %s", getattr(self, "replica", "?"),
                 "by the app's lifespan shutdown" if by_lifespan else "by __del__ (no lifespan shutdown ran)")


def _autoscaling(config: ServeConfig, given: AutoscalingConfig | dict[str, Any]) -> AutoscalingConfig:
    """``given`` as an :class:`AutoscalingConfig`, with :func:`target_ongoing_requests` when not set."""
    if isinstance(given, AutoscalingConfig):
        values = given.model_dump(exclude_unset=True)
    elif isinstance(given, dict):
        values = dict(given)
    else:
        raise InputError.of(Problem.said(f"autoscaling_config must be a dict or ray.serve.config.AutoscalingConfig, got "
                                         f"{type(given).__name__}"))
    values.setdefault("target_ongoing_requests", target_ongoing_requests(config.max_batch or DEFAULT_MAX_BATCH))
    try:
        return AutoscalingConfig(**values)
    except ValueError as exc:  # pydantic's ValidationError is one
        why = "; ".join(e["msg"] for e in exc.errors()) if hasattr(exc, "errors") else str(exc)
        raise InputError.of(Problem.said(f"autoscaling_config {values} is not valid: {why}")) from exc


def deployment_options(config: ServeConfig | None = None, *, num_replicas: int | str | None = None,
                       autoscaling_config: AutoscalingConfig | dict[str, Any] | None = None,
                       num_cpus: float = NUM_CPUS, name: str = DEPLOYMENT_NAME, **options: Any) -> dict[str, Any]:
    """The options of ``Deployment.options`` for ``config`` (see :func:`deployment` for the arguments).

    Raises:
        InputError: both ``num_replicas`` and ``autoscaling_config``, or an invalid autoscaling config.
    """
    config = config if config is not None else ServeConfig()
    if num_replicas is not None and autoscaling_config is not None:
        raise InputError.of(Problem.said("give num_replicas (a fixed count) or autoscaling (min_replicas, max_replicas, "
                                         "target_ongoing_requests), not both", code="conflicting_fields"))
    scaling: dict[str, Any] = {}  # neither: Ray's default of 1, which a config file's deployments: may override
    if autoscaling_config is not None:
        scaling["autoscaling_config"] = _autoscaling(config, autoscaling_config)
    elif num_replicas is not None:
        scaling["num_replicas"] = num_replicas
    return {"name": name, "max_ongoing_requests": capacity(config), "graceful_shutdown_timeout_s": config.grace_seconds,
            "ray_actor_options": {"num_cpus": num_cpus}, **scaling, **options}


def deployment(source: str | os.PathLike, config: ServeConfig | None = None, *, device: str | None = None,
               num_replicas: int | str | None = None,
               autoscaling_config: AutoscalingConfig | dict[str, Any] | None = None,
               num_cpus: float = NUM_CPUS, name: str = DEPLOYMENT_NAME, **options: Any) -> Application:
    """The speech server as a Ray Serve application, ready for ``serve.run``.

    Args:
        source: the bundle (a folder, an installed name, a model slug, ``hf://...``), loaded by
            every replica on its own node.
        config: the server's settings and limits (default ``ServeConfig()``).
        device: as ``higgs-pack serve --device``.
        num_replicas: a fixed number of replicas (default 1), or ``"auto"`` (Ray's autoscaling
            defaults); not with ``autoscaling_config``.
        autoscaling_config: ``min_replicas``, ``max_replicas``, ``target_ongoing_requests``, ...
            as Ray's :class:`AutoscalingConfig` or a dict; ``target_ongoing_requests``
            defaults to :func:`target_ongoing_requests` of the batch.
        num_cpus: CPUs Ray reserves per replica (see the module docstring).
        name: the deployment's name.
        options: any other option of ``Deployment.options`` (``max_queued_requests``,
            ``health_check_period_s``, ``max_replicas_per_node``, ``ray_actor_options``, ...);
            they win over the defaults above.

    Returns:
        The bound :class:`ray.serve.Application`.

    Raises:
        InputError: both ``num_replicas`` and ``autoscaling_config``, or an invalid autoscaling config.
    """
    settings = deployment_options(config, num_replicas=num_replicas, autoscaling_config=autoscaling_config,
                                  num_cpus=num_cpus, name=name, **options)
    return SpeechDeployment.options(**settings).bind(os.fspath(source), config or ServeConfig(), device)


def _whole(value: Any) -> int:
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit())):
        raise ValueError("a whole number")
    return int(value)


def _number(value: Any) -> float:
    try:
        if isinstance(value, bool):
            raise TypeError
        return float(value)
    except (TypeError, ValueError):
        raise ValueError("a number") from None


def _folder(value: Any) -> Path:
    return Path(_text(value))


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("a non-empty string")
    return value.strip()


def _names(value: Any) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise ValueError("names separated by commas, or a list of names")
    return tuple(i.strip() for i in items if i.strip())


def _replicas(value: Any) -> int | str:
    return "auto" if value == "auto" else _whole(value)


#: How each kind of server setting (:class:`~higgs_pack.serve.config.Setting`) is read from a config file.
_PARSERS: dict[str, Callable[[Any], Any]] = {"whole": _whole, "number": _number, "text": _text, "folder": _folder,
                                             "file": _folder, "texts": _names}


def _server_args() -> dict[str, tuple[Callable[[Any], Any], str]]:
    """The server's arguments, made from :class:`~higgs_pack.serve.config.ServeConfig`'s one declaration of
    each setting: its field name (a size in MiB: the option's name, ``max_kv_mb``), its kind, its help."""
    out = {}
    for name, setting in settings().items():
        key = setting.name if setting.unit != 1 else name
        out[key] = (_PARSERS[setting.kind], f"as higgs-pack serve {setting.flag}: {setting.help.rstrip('.')}"
                    + ("; comma-separated" if setting.kind == "texts" else ""))
    return out


#: :func:`build_app`'s arguments: name -> (parser, what it is).  The server's are those of
#: ``higgs-pack serve`` (:func:`_server_args`); the rest size the deployment.
ARGS: dict[str, tuple[Callable[[Any], Any], str]] = {
    "source": (_text, "the bundle: a folder, an installed name, a model slug or hf://ORG/REPO (required)"),
    "device": (_text, "as higgs-pack serve --device"),
    **_server_args(),
    "num_replicas": (_replicas, "a fixed number of replicas, or auto (default 1)"),
    "min_replicas": (_whole, "autoscaling: fewest replicas"),
    "max_replicas": (_whole, "autoscaling: most replicas"),
    "target_ongoing_requests": (_number, "autoscaling: requests per replica to aim at (default max_batch * 1.5)"),
    "num_cpus": (_number, f"CPUs Ray reserves per replica (default {NUM_CPUS:g})"),
    "max_queued_requests": (_whole, "requests Ray queues for the deployment before answering 503 (default: no limit)"),
}
_AUTOSCALING_ARGS = ("min_replicas", "max_replicas", "target_ongoing_requests")


def parse_args(args: dict[str, Any]) -> tuple[str, ServeConfig, dict[str, Any]]:
    """:func:`build_app`'s arguments as ``(source, config, keywords of deployment())``.

    Raises:
        InputError: a missing ``source``, an unknown key (the known ones listed), a value of the
            wrong kind, or an invalid server setting.
    """
    unknown = sorted(set(args) - set(ARGS))
    if unknown:
        hints = [f"{k!r}{did_you_mean(k, ARGS)}" for k in unknown]
        raise InputError.of(Problem.said(f"unknown build_app argument(s) {', '.join(hints)}; known: {', '.join(ARGS)}", code="unknown_field"))
    if "source" not in args:
        raise InputError.of(Problem.said("build_app needs source=BUNDLE (a folder, an installed name, a model slug or hf://...)", code="missing_field"))
    values, problems = {}, []
    for key, value in args.items():
        parse, about = ARGS[key]
        try:
            values[key] = parse(value)
        except ValueError as exc:
            problems.append(f"{key}={value!r} is not {exc} ({about})")
    if problems:
        raise InputError.of(Problem.said("; ".join(problems)))
    server = ServeConfig.given(values)
    scaling = {k: values[k] for k in _AUTOSCALING_ARGS if k in values}
    keywords = {k: values[k] for k in ("device", "num_replicas", "num_cpus", "max_queued_requests") if k in values}
    if scaling:
        keywords["autoscaling_config"] = scaling
    return values["source"], server, keywords


def build_app(args: dict[str, Any]) -> Application:
    """Ray Serve's application builder: ``serve run higgs_pack.serve.ray_app:build_app source=...
    [num_replicas=N | min_replicas=A max_replicas=B [target_ongoing_requests=T]] [max_batch=...]``,
    or ``import_path`` and ``args`` in a ``serve deploy`` config file.

    Args:
        args: the keys of :data:`ARGS` (strings from the command line, or YAML values).

    Returns:
        The application of :func:`deployment`.

    Raises:
        InputError: as :func:`parse_args`, or ``num_replicas`` with autoscaling keys.
    """
    source, config, keywords = parse_args(args)
    return deployment(source, config, **keywords)
