"""The ``higgs-pack`` console script: the CLI (:mod:`higgs_pack.runtime.cli`), with Ctrl-C during
its start-up (importing numpy, click, the runtime: a few tenths of a second) said in one line and
exit status 130, as after the start-up, instead of a traceback.  Imports nothing heavy itself."""

from __future__ import annotations

import sys

from higgs_pack.runtime.exit_status import EXIT_INTERRUPTED


def main() -> None:
    """Import and run the CLI; a KeyboardInterrupt while importing it exits 130."""
    try:
        from higgs_pack.runtime.cli import main as cli
    except KeyboardInterrupt:
        sys.stderr.write("interrupted (Ctrl-C)\n")
        raise SystemExit(EXIT_INTERRUPTED) from None
    cli()
