"""The exit statuses of the ``higgs-pack`` command beyond 0, 1 (a check or a line failed) and 2
(a bad argument or an error): those of a program stopped by a signal (128 + its number), as shells
report them.  Its own module so the console script's start-up (:mod:`.entry`) and the CLI share
them without importing each other."""

#: After Ctrl-C (SIGINT).
EXIT_INTERRUPTED = 128 + 2
#: After the reader of ``-o -`` closed the pipe (SIGPIPE).
EXIT_BROKEN_PIPE = 128 + 13
#: After SIGTERM.
EXIT_TERMINATED = 128 + 15
