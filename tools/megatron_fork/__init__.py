"""Tooling for the megatron-core fork: pinned upstream, patch series, install manifest, verify.

Only the standard library is used here, so the tool runs inside pip's isolated build environment
and on machines without torch.
"""

EXIT_OK = 0
EXIT_FAILED = 1  # a check, verify or status expectation failed
EXIT_USAGE = 2  # bad command line or bad input file (series, pin)
EXIT_HASH = 3  # a wheel's sha256 does not match the pin
EXIT_UNAVAILABLE = 4  # upstream could not be obtained (offline, no cache, no checkout)
EXIT_APPLY = 5  # a patch did not apply with zero fuzz and zero offset
EXIT_DIRTY = 6  # the materialized tree has edits that are not exported; nothing was changed
EXIT_BUSY = 7  # another run holds the workspace lock (waited MEGATRON_FORK_LOCK_WAIT seconds)
EXIT_CONFLICT = 8  # rebase stopped at a conflict; resolve it, then rebase --continue or --abort
EXIT_IO = 9  # an I/O fault (no space, read-only, permission, cross-device, corrupt archive)
EXIT_SIGINT = 130  # interrupted by SIGINT (Ctrl-C); the tree was left as it was
EXIT_SIGTERM = 143  # terminated by SIGTERM; the tree was left as it was


class ForkError(Exception):
    """An error with a user-facing message and a documented exit code.

    Args:
        message: what went wrong, naming the file, patch or base at fault.
        code: the process exit code the CLI returns for it.
    """

    def __init__(self, message, code=EXIT_FAILED):
        super().__init__(message)
        self.code = code
