"""Build the fork as the distribution ``megatron-core`` at ``<base>+fork.<N>.g<digest8>``.

N counts the carried patches and digest8 is the first 8 hex digits of the series digest (entries
and bytes), so the label changes whenever the carried series changes. A dev build appends
``.dev.<commit8>``. The sources are the materialized tree ``megatron/`` (pinned upstream +
``patches/<base>/series``), which ``tools/fork.py materialize`` creates; a build (``build``,
hence ``bdist_wheel`` and ``pip install``) materializes it when it is missing (base:
$MEGATRON_FORK_BASE, else the pin's default). Metadata commands (``--version``, ``egg_info``)
never touch the tree: the version comes from the series files alone. The dataset
helper ``helpers.cpp`` is compiled for the running Python. Of the package ``megatron_fork`` (our
tooling) only the runtime verify ships, with a manifest of the base, its hashes and the applied
patches, so that ``megatron-fork-verify`` can check an installation.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_namespace_packages, setup
from setuptools.command.build import build
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "tools"))

from megatron_fork import (  # noqa: E402  pylint: disable=C0413
    dist,
    manifest,
    queue,
    series,
    sources,
    upstream,
)
from megatron_fork.workspace import Workspace  # noqa: E402  pylint: disable=C0413

try:
    from pybind11.setup_helpers import Pybind11Extension
except ImportError:  # building metadata only
    Pybind11Extension = None

WS = Workspace(HERE)
PIN = upstream.load_pin(WS.pin_file)
# The base megatron/ was built on; a build that materializes it uses $MEGATRON_FORK_BASE.
BASE = WS.base() or os.environ.get("MEGATRON_FORK_BASE") or PIN["default"]
PATCHES = series.load_series(WS.patch_dir(BASE))
VERSION = (
    f"{PIN['bases'][BASE]['version']}+fork.{len(PATCHES)}.g{series.series_digest(PATCHES)[:8]}"
)
if upstream.is_git_base(PIN, BASE):
    VERSION += f".dev.{PIN['bases'][BASE]['commit'][:8]}"


def prepare_tree():
    """Materialize megatron/ if it was not (a fresh clone's holds only the fork's source files);
    refuse one that does not match patches/.

    Only a build calls it: metadata commands read the series, never the tree.
    """
    if WS.base() is None:
        tool = [sys.executable, str(HERE / "tools" / "fork.py")]
        subprocess.run([*tool, "materialize", "--base", BASE], check=True)
    if not queue.is_current(WS, BASE) and not os.environ.get("MEGATRON_FORK_ALLOW_STALE"):
        sys.exit(
            "megatron/ does not match patches/ (edits not exported, or patches changed since it "
            "was materialized). Run `tools/fork.py export` or `tools/fork.py materialize`; set "
            "MEGATRON_FORK_ALLOW_STALE=1 to build it anyway."
        )


# The same requirements and extras as the upstream release the fork replaces, read from its
# pinned wheel (the cache, or MEGATRON_FORK_WHEEL_DIR) or, for dev, the pinned commit's
# pyproject.toml (MEGATRON_FORK_GIT_REPO); tools/install.sh sets both.
REQUIRES, EXTRAS = dist.requirements_for(
    PIN,
    BASE,
    wheel_dir=os.environ.get("MEGATRON_FORK_WHEEL_DIR"),
    git_repo=os.environ.get("MEGATRON_FORK_GIT_REPO"),
)
VERSION_LINE = (
    "\n# Set by the fork's build: the installed distribution's version (never a surrounding\n"
    "# repository's commit hash).\n__version__ = {!r}\n"
)


class CleanBuildPerBase(build):
    """``build`` in ``build/dist/<base>/``, emptied first: a wheel holds only this build's files.

    setuptools reuses ``build/lib.*`` between builds and never removes what a previous build put
    there, so a build after another base's shipped that base's extra modules.
    """

    def initialize_options(self):
        """Default the build directory to this base's own."""
        super().initialize_options()
        self.build_base = str(WS.dist_build_dir(BASE))

    def run(self):
        """Materialize the tree if needed, remove what any earlier build left, then build."""
        listed = WS.base() is not None
        prepare_tree()
        if not listed:  # setup() listed the packages of a tree that was not there yet
            self.distribution.packages = packages()
            self.distribution.package_data = package_data()
            self.reinitialize_command("build_py")
        shutil.rmtree(self.build_lib, ignore_errors=True)
        super().run()


# The modules of megatron_fork that the wheel ships.
RUNTIME_MODULES = ("__init__", "manifest")


class BuildPyWithManifest(build_py):
    """build_py that pins ``__version__`` and writes megatron_fork/manifest.json."""

    def find_package_modules(self, package, package_dir):
        """Of the tool's package, only the runtime verify (``manifest``) ships: the series tool
        itself is for maintainers and runs from the checkout."""
        modules = super().find_package_modules(package, package_dir)
        if package == "megatron_fork":
            modules = [m for m in modules if m[1] in RUNTIME_MODULES]
        return modules

    def run(self):
        """Build, then pin the version line and write the manifest into the build tree."""
        super().run()
        # The fork's sources that this base's series does not create stay in megatron/ (they
        # are tracked files) but are no part of this base's build.
        for rel in sources.foreign(WS.patch_root, BASE):
            (Path(self.build_lib) / rel).unlink(missing_ok=True)
        info = Path(self.build_lib) / "megatron" / "core" / "package_info.py"
        info.write_text(info.read_text() + VERSION_LINE.format(VERSION))
        data = dist.build_manifest(self.build_lib, PIN, BASE, PATCHES, VERSION)
        out = Path(self.build_lib) / "megatron_fork" / manifest.MANIFEST_NAME
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def packages():
    """The packages the wheel ships: upstream's megatron.core and megatron.training, and the
    runtime verify of ``megatron_fork`` (RUNTIME_MODULES)."""
    return find_namespace_packages(include=["megatron.core*", "megatron.training*"]) + [
        "megatron_fork"
    ]


def package_data():
    """Ship every non-Python upstream file (README, requirements, helpers.cpp, configs)."""
    data = {}
    for path in (HERE / "megatron").rglob("*"):
        if (
            path.is_file()
            and path.suffix not in (".py", ".pyc", ".so")
            and "__pycache__" not in path.parts
        ):
            pkg = ".".join(path.parent.relative_to(HERE).parts)
            data.setdefault(pkg, []).append(path.name)
    return data


ext_modules = []
if Pybind11Extension is not None:
    ext_modules.append(
        Pybind11Extension(
            "megatron.core.datasets.helpers_cpp",
            sources=["megatron/core/datasets/helpers.cpp"],
            language="c++",
            extra_compile_args=["-O3", "-Wall", "-std=c++17"],
        )
    )

setup(
    name="megatron-core",
    version=VERSION,
    description="megatron-core with the fork's distributed-training fixes (see patches/<base>/)",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    # Upstream's wheels say "License: Apache 2.0" next to the classifier "BSD License". Their
    # licence text (LICENSE, Megatron-LM's) is BSD-3-Clause for every file that notes no other
    # licence, then the Apache-2.0 and MIT licences of third-party code the wheel includes (files
    # headed so); the fork's own files are BSD-3-Clause (NOTICE). Both files ship in the wheel's
    # .dist-info/licenses/ (tests/tooling/test_clean_builds.py).
    license_expression="BSD-3-Clause AND Apache-2.0 AND MIT",
    license_files=["LICENSE", "NOTICE"],
    python_requires=">=3.12",
    packages=packages(),
    package_dir={"megatron_fork": "tools/megatron_fork"},
    package_data=package_data(),
    ext_modules=ext_modules,
    cmdclass={"build": CleanBuildPerBase, "build_py": BuildPyWithManifest},
    install_requires=REQUIRES,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["megatron-fork-verify=megatron_fork.manifest:main_verify"]},
)
