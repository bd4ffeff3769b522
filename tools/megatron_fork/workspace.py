"""Where a checkout keeps its files: ``megatron/``, its patch queue, ``patches/`` and ``build/``.

Every location the tool reads or writes comes from a :class:`Workspace` that its caller builds
once (the CLI from the checkout it runs in, setup.py from the directory it builds, the test
harness from the repository under test) and passes in; nothing here is a module-level default.
This module is the one reader of the record of which base ``megatron/`` was materialized from.
"""

from dataclasses import dataclass
from pathlib import Path

from . import EXIT_USAGE, ForkError

BASE_FILE = "fork-base"  # inside the queue's git dir: the base megatron/ was built on
PIN_NAME = "upstream.toml"  # inside patches/: the pinned upstream bases


@dataclass(frozen=True)
class Workspace:
    """Where a materialized tree, its queue and the series live.

    Args:
        root: the directory that holds ``megatron/`` (the work tree of the queue).
        pq: the queue's git directory (default ``root/.pq``).
        patch_root: the directory of per-base series and the pin (default ``root/patches``).
        build: scratch and lock directory (default ``root/build``).
    """

    root: Path
    pq: Path = None
    patch_root: Path = None
    build: Path = None

    def __post_init__(self):
        root = Path(self.root)
        object.__setattr__(self, "root", root)
        object.__setattr__(self, "pq", Path(self.pq) if self.pq else root / ".pq")
        object.__setattr__(
            self, "patch_root", Path(self.patch_root) if self.patch_root else root / "patches"
        )
        object.__setattr__(self, "build", Path(self.build) if self.build else root / "build")

    @property
    def tree(self):
        """The materialized ``megatron/`` directory."""
        return self.root / "megatron"

    @property
    def pin_file(self):
        """The upstream pin, ``patches/upstream.toml``."""
        return self.patch_root / PIN_NAME

    @property
    def base_file(self):
        """Where materialize records the base of ``megatron/`` (inside the queue)."""
        return self.pq / BASE_FILE

    def base(self):
        """The base ``megatron/`` was materialized from (None when there is no such tree)."""
        if not self.tree.is_dir() or not self.base_file.is_file():
            return None
        return self.base_file.read_text().strip() or None

    def default_base(self, pin):
        """The base to work on when none is named: ``megatron/``'s, else the pin's default."""
        return self.base() or pin["default"]

    def dist_build_dir(self, base):
        """The setuptools build directory of ``base`` (setup.py empties it before a build)."""
        return self.build / "dist" / base

    def patch_dir(self, base=None):
        """The series directory of ``base`` (default: the materialized one)."""
        base = base or self.base()
        if base is None:
            raise ForkError(
                "no materialized base: run `tools/fork.py materialize` (or name the base)",
                EXIT_USAGE,
            )
        return self.patch_root / base
