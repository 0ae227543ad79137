"""``higgs-pack serve SOURCE``: the OpenAI-compatible speech server, on uvicorn.

Found by the runtime CLI through the ``higgs_pack.commands`` entry points; needs the
``[serve]`` extra.  The socket is bound before the bundle loads, so a port in use is said at
once; the line ``serving http://HOST:PORT`` is printed when it is bound (``--port 0`` picks a
free port).  SIGTERM or Ctrl-C stops accepting, lets the requests in flight finish for
``--grace-seconds``, then exits: after SIGTERM by that signal (143 in a shell), after Ctrl-C
(SIGINT) with status 130, as the other commands do; Ctrl-C while the bundle loads exits 130 too.

Every option may be set from the environment instead, under the name click derives from the option
(``auto_envvar_prefix``): ``--max-batch`` is ``HIGGS_PACK_SERVE_MAX_BATCH``, ``--voices-dir``
``HIGGS_PACK_SERVE_VOICES_DIR``, a repeatable option takes its values separated by spaces; an option on
the command line wins.  ``--api-key`` keeps its own name, ``HIGGS_PACK_API_KEY``.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Any

import click

from higgs_pack.errors import InputError
from higgs_pack.serve.config import ServeConfig, settings

log = logging.getLogger(__name__)

#: Exit status after Ctrl-C (128 + SIGINT), as every higgs-pack command.
INTERRUPTED = 130


class BadAddress(click.ClickException):
    """A ``--host`` or ``--port`` the server cannot listen on: an error in the options, exit status 2
    (as a bad option: docs/using/cli.md), with the message alone (no usage text)."""

    exit_code = 2


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6).

    Raises:
        BadAddress: the port is taken or the address is not this machine's.
    """
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        family = socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise BadAddress(f"port {port} on {host} is in use; choose another with --port "
                                       "(--port 0 picks a free one)") from exc
        raise BadAddress(f"cannot listen on {host}:{port} ({exc.strerror}); give an address of this "
                                   "machine with --host (127.0.0.1 for this machine only)") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


#: The prefix of the environment variables that set serve's options (``HIGGS_PACK_SERVE_<OPTION>``).
ENV_PREFIX = "HIGGS_PACK_SERVE"


def config_options(command: Any) -> Any:
    """``command`` with one click option per :class:`~higgs_pack.serve.config.ServeConfig` setting,
    made from its declaration (:class:`~higgs_pack.serve.config.Setting`): flag, help, kind, least
    value, unit, default (shown in the option's unit), environment variable."""
    kinds = {"whole": int, "number": float, "text": str, "texts": str,
             "folder": click.Path(file_okay=False, path_type=Path), "file": click.Path(dir_okay=False, path_type=Path)}
    defaults = ServeConfig()
    for name, setting in reversed(settings().items()):  # decorators apply bottom-up: keep the declared order
        kind = kinds[setting.kind] if setting.choices is None else click.Choice(setting.choices)
        if setting.minimum is not None:
            low = setting.minimum
            kind = click.IntRange(min=int(low)) if setting.kind == "whole" else click.FloatRange(min=low)
        default = getattr(defaults, name)
        default = None if default is None or default == () else \
            default / setting.unit if setting.unit != 1 else default
        command = click.option(setting.flag, setting.name, type=kind,
                               default=default, show_default=default is not None, help=setting.help,
                               multiple=setting.kind == "texts", envvar=setting.envvar, metavar=setting.metavar,
                               )(command)
    return command


def envvar(setting: Any) -> str:
    """The environment variable that sets ``setting`` (a :class:`~higgs_pack.serve.config.Setting`):
    its own, else ``HIGGS_PACK_SERVE_`` and its option's name in capitals."""
    return setting.envvar or f"{ENV_PREFIX}_{setting.name.upper()}"


def from_environment(ctx: click.Context, message: str) -> str:
    """``message`` (an error about the settings) with, for each setting it names (by its flag or its
    field's name) whose value came from the environment, where that value came from: a user who
    never typed ``--max-kv-mb`` learns which variable to change.  The one way every setting's
    error names its environment variable."""
    from click.core import ParameterSource

    came = [f"{setting.flag} was set by {envvar(setting)} in the environment"
            for name, setting in settings().items()
            if ctx.get_parameter_source(setting.name) is ParameterSource.ENVIRONMENT
            and (setting.flag in message or name in message or setting.name in message)]
    return message + (f" ({'; '.join(came)})" if came else "")


def refuse_unknown_environment(ctx: click.Context) -> None:
    """Refuse a ``HIGGS_PACK_SERVE_*`` variable that sets no option of ``ctx``'s command (a typo, or
    one a version before read, as ``HIGGS_PACK_SERVE_OPENVINO_ENGINE``): click reads the variables
    it knows and would pass over the others silently, so the server would start without the
    setting its operator meant.

    Raises:
        click.UsageError: naming each such variable and the ones the command reads.
    """
    known = {f"{ENV_PREFIX}_{param.name.upper()}" for param in ctx.command.params
             if isinstance(param, click.Option) and param.name and not param.envvar}  # an envvar of its own: not ours
    unknown = sorted(name for name in os.environ if name.startswith(f"{ENV_PREFIX}_") and name not in known)
    if unknown:
        raise click.UsageError(
            f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} set in the environment but "
            f"{'sets' if len(unknown) == 1 else 'set'} no option of `higgs-pack serve`; unset or rename "
            f"{'it' if len(unknown) == 1 else 'them'} (the variables it reads: {', '.join(sorted(known))})")


@click.command(context_settings={"auto_envvar_prefix": ENV_PREFIX})
@click.argument("source")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 for every interface: set --api-key then).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="TCP port (0: a free one, printed).")
@click.option("--device", help="Where to run: OpenVINO CPU/GPU/NPU/AUTO, or an execution provider (as `load`).")
@config_options
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              help="How much the server logs (debug adds a line per request).")
def serve(source: str, host: str, port: int, device: str | None, log_level: str, **given: Any) -> None:
    """Serve SOURCE (a bundle, an installed name, a model slug, hf://...) over the OpenAI speech API:
    POST /v1/audio/speech, voices, models, /health, /ready, /metrics, and a demo page at /.

    Each option may be set from the environment: HIGGS_PACK_SERVE_ and the option's name in capitals
    (--max-batch: HIGGS_PACK_SERVE_MAX_BATCH); the command line wins."""
    try:
        import uvicorn

        from higgs_pack.serve.app import CutOffLog, create_app
    except ImportError as exc:  # the command is registered by the runtime; its web stack is the extra's
        from higgs_pack.errors import install_extra
        from higgs_pack.runtime.cli import MissingExtra

        raise MissingExtra(f"`higgs-pack serve` needs the [serve] extra, which is not installed ({exc}); "
                           + install_extra("serve")) from exc
    from higgs_pack.serve.config import ServeConfig
    from higgs_pack.serve.server import SpeechServer

    logging.getLogger("higgs_pack").setLevel(log_level.upper())
    ctx = click.get_current_context()
    refuse_unknown_environment(ctx)
    try:
        config = ServeConfig.given(given)
    except InputError as exc:
        raise click.UsageError(from_environment(ctx, str(exc))) from exc
    if not _loopback(host) and config.api_key is None:
        click.echo(f"warning: listening on {host} without --api-key: anyone who reaches this port can use it",
                   err=True)
    sock = bind(host, port)
    # Python's own 5 ms switch interval is kept (the engine process the load test compares with runs at
    # it too): at 0.5 ms the server made 16% fewer frames/s at 16 clients on the tiny bundle and spent
    # more CPU per request (3 paired runs each, 2 vCPUs; the engine thread is made to hand the interpreter
    # lock over ten times as often, mid-step).
    try:
        server = SpeechServer.open(source, config, device=device)
    except KeyboardInterrupt:
        sock.close()
        click.echo("interrupted while loading the bundle; nothing was served", err=True)
        raise SystemExit(INTERRUPTED) from None
    except InputError as exc:  # a setting the bundle does not take: named as it was set
        sock.close()
        raise InputError(from_environment(ctx, str(exc)), problems=exc.problems) from exc
    app = create_app(server)
    shown = sock.getsockname()
    url_host = f"[{shown[0]}]" if sock.family == socket.AF_INET6 else shown[0]
    click.echo(f"serving http://{url_host}:{shown[1]} (model {server.models[0]}, {server.engine_summary()}, "
               f"max_queue {config.max_queue}); /ready answers 200 once warmed up", err=True)
    grace = int(config.grace_seconds + 0.999)  # uvicorn takes whole seconds

    class Uvicorn(uvicorn.Server):
        stopped_by: int | None = None  # the first signal that stopped the server

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.stopped_by = self.stopped_by or sig
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: Any = None) -> None:
            server.stopping = True  # from the signal on: /ready and a new request answer 503 (stopping)
            await super().shutdown(sockets)

    uv = Uvicorn(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=grace,
                                access_log=log_level == "debug"))
    logging.getLogger("uvicorn.error").addFilter(CutOffLog(grace))  # after uvicorn configured its loggers
    try:
        uv.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn raises the SIGINT it stopped on again once it shut down cleanly
        raise SystemExit(INTERRUPTED) from None
    if uv.stopped_by == signal.SIGINT:
        # uvicorn's raise again is ignored where SIGINT came ignored from the parent (a background job of
        # a non-interactive shell: Python then installs no KeyboardInterrupt handler), and it returned: exit
        # 130 all the same, as a Ctrl-C stopped it
        raise SystemExit(INTERRUPTED)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
