#!/usr/bin/env python3
"""Entry point of the fork tooling: pin, materialize, export, check, status, verify.

See ``tools/megatron_fork/cli.py`` for the commands and their exit codes.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_fork.cli import main  # noqa: E402  pylint: disable=wrong-import-position

if __name__ == "__main__":
    sys.exit(main())
