"""The exit codes of every ``kvsidecar`` command (documented in docs/operations.md)."""

EXIT_OK, EXIT_NO_TARGET, EXIT_USAGE = 0, 1, 2
