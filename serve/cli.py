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
import signal
import socket
from pathlib import Path
from typing import Any

import click

from higgs_pack.manifests.errors import InputError
from higgs_pack.serve.config import (
    GRACE_SECONDS,
    MAX_INPUT_CHARS,
    MAX_QUEUE,
    MAX_REF_SECONDS,
    MAX_UPLOAD_BYTES,
)

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


#: The prefix of the environment variables that set serve's options (HIGGS_PACK_SERVE_<OPTION>).
ENV_PREFIX = "HIGGS_PACK_SERVE"


@click.command(context_settings={"auto_envvar_prefix": ENV_PREFIX})
@click.argument("source")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 for every interface: set --api-key then).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="TCP port (0: a free one, printed).")
@click.option("--device", help="Where to run: OpenVINO CPU/GPU/NPU/AUTO, or an execution provider (as `load`).")
@click.option("--max-batch", type=click.IntRange(min=1),
              help="Requests decoded together (default: 4 where the backend batches, else 1).")
@click.option("--max-queue", default=MAX_QUEUE, show_default=True, type=click.IntRange(min=0),
              help="Requests waiting beyond the batch; one more is answered 429.")
@click.option("--api-key", envvar="HIGGS_PACK_API_KEY", help="Require Authorization: Bearer KEY on /v1/* "
              "(or set HIGGS_PACK_API_KEY).")
@click.option("--voices-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep uploaded voices here; its parent folder must exist (default: in memory, lost at exit).")
@click.option("--allow-local-media", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="ref_audio may name a file under this folder (default: never).")
@click.option("--max-kv-mb", type=click.FloatRange(min=1), help="KV cache budget of the requests in the batch, "
              "MiB (default: half the memory available at start); a request that does not fit waits.")
@click.option("--max-input-chars", default=MAX_INPUT_CHARS, show_default=True, type=click.IntRange(min=1),
              help="Longest `input` of a speech request, characters; a longer one is answered 400.")
@click.option("--max-upload-mb", default=MAX_UPLOAD_BYTES / 2**20, show_default=True,
              type=click.FloatRange(min=0.01), help="Largest voice upload or ref_audio, MiB.")
@click.option("--max-ref-seconds", default=MAX_REF_SECONDS, show_default=True, type=click.FloatRange(min=0.5),
              help="Longest reference clip (ref_audio, or a voice upload), seconds; a longer one is answered 400.")
@click.option("--grace-seconds", default=GRACE_SECONDS, show_default=True, type=click.FloatRange(min=0.1),
              help="On SIGTERM or Ctrl-C, seconds the requests in flight have to finish; those still running "
              "then are cut off (a 503 where no audio was sent yet).")
@click.option("--model-name", multiple=True, help="Another name `model` may take (repeatable).")
@click.option("--allow-origin", multiple=True, metavar="ORIGIN",
              help="A web page origin (http://localhost:3000, or *) whose scripts may call this server besides "
              "its own pages (repeatable); requests from other pages are refused with 403.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              help="How much the server logs (debug adds a line per request).")
def serve(source, host, port, device, max_batch, max_queue, api_key, voices_dir, allow_local_media, max_kv_mb,
          max_input_chars, max_upload_mb, max_ref_seconds, grace_seconds, model_name, allow_origin,
          log_level) -> None:
    """Serve SOURCE (a bundle, an installed name, a model slug, hf://...) over the OpenAI speech API:
    POST /v1/audio/speech, voices, models, /health, /ready, /metrics, and a demo page at /.

    Each option may be set from the environment: HIGGS_PACK_SERVE_ and the option's name in capitals
    (--max-batch: HIGGS_PACK_SERVE_MAX_BATCH); the command line wins."""
    try:
        import uvicorn

        from higgs_pack.serve.app import CutOffLog, create_app
    except ImportError as exc:  # the command is registered by the runtime; its web stack is the extra's
        from higgs_pack.manifests.errors import install_extra
        from higgs_pack.runtime.cli import MissingExtra

        raise MissingExtra(f"`higgs-pack serve` needs the [serve] extra, which is not installed ({exc}); "
                           + install_extra("serve")) from exc
    from higgs_pack.serve.config import ServeConfig
    from higgs_pack.serve.server import SpeechServer

    logging.getLogger("higgs_pack").setLevel(log_level.upper())
    try:
        config = ServeConfig(max_batch=max_batch, max_queue=max_queue, api_key=api_key, voices_dir=voices_dir,
                             allow_local_media=allow_local_media, max_input_chars=max_input_chars,
                             max_upload_bytes=int(max_upload_mb * 2**20), max_ref_seconds=max_ref_seconds,
                             max_kv_bytes=int(max_kv_mb * 2**20) if max_kv_mb else None, grace_seconds=grace_seconds, model_names=tuple(model_name),
                             allow_origins=tuple(allow_origin))
    except InputError as exc:
        raise click.UsageError(str(exc)) from exc
    if not _loopback(host) and api_key is None:
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
    app = create_app(server)
    shown = sock.getsockname()
    url_host = f"[{shown[0]}]" if sock.family == socket.AF_INET6 else shown[0]
    click.echo(f"serving http://{url_host}:{shown[1]} (model {server.models[0]}, max_batch "
               f"{server.engine.max_batch}, max_queue {config.max_queue}); /ready answers 200 once warmed up",
               err=True)
    grace = int(grace_seconds + 0.999)  # uvicorn takes whole seconds

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
