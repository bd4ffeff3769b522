"""``verify`` of an installed fork: it passes on the install and names what is wrong otherwise.

The suite runs in the environment that tools/install.sh made, where the fork is installed as
megatron-core <base>+fork.<N>. A fake site directory built from that install checks the failure
modes without touching the real one.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import bases

REPO = Path(__file__).resolve().parents[2]
# tools/install.sh (and so tools/test.sh) installs the default base of patches/upstream.toml.
BASE = bases.PIN["default"]
PRISTINE = f"pristine-{BASE}"


def _installed_root():
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import megatron_fork, os; print(os.path.dirname(megatron_fork.__file__))",
        ],
        cwd="/",
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return None
    root = Path(proc.stdout.strip()).parent
    return root if (root / "megatron_fork" / "manifest.json").is_file() else None


INSTALLED = _installed_root()


@pytest.fixture
def installed():
    """The installed fork's site directory; a failure (never a skip) when it is missing.

    tools/test.sh (and so CI) installs the fork before running the suite, so a missing install
    there is a broken install step that must not pass as a skip.
    """
    if INSTALLED is None:
        pytest.fail(
            f"the fork is not installed for {sys.executable} (no megatron_fork with a "
            "manifest.json importable outside the checkout); run tools/install.sh, as "
            "tools/test.sh does",
            pytrace=False,
        )
    return INSTALLED


def verify(env=None, args=()):
    """Run the installed verify from / (so no checkout's megatron/ is on sys.path)."""
    return subprocess.run(
        [sys.executable, "-m", "megatron_fork.manifest", *args],
        cwd="/",
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def test_the_wheel_ships_megatron_and_only_the_runtime_verify(installed):
    """Of the tool, the install holds the verify module and its manifest; the series tool (cli,
    queue, records, rebase, ...) runs from the checkout only."""
    shipped = sorted(
        p.name for p in (installed / "megatron_fork").iterdir() if p.name != "__pycache__"
    )
    assert shipped == ["__init__.py", "manifest.json", "manifest.py"], shipped
    proc = subprocess.run(
        [sys.executable, "-c", "import megatron_fork.manifest as m; print(sorted(m.__dict__))"],
        cwd="/",
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr


def test_verify_passes_on_the_install_and_ships_no_test_redirect(installed):
    proc = verify()
    assert proc.returncode == 0, proc.stdout
    assert "verify: OK" in proc.stdout
    manifest = json.loads((installed / "megatron_fork" / "manifest.json").read_text())
    assert manifest["version"].startswith(f"{BASE}+fork.")
    series = bases.series_entries(BASE)
    assert series and [p["name"] for p in manifest["patches"]] == series
    assert not [f for f in manifest["files"] if "harness" in f or "cpu_redirect" in f]
    assert not list((installed / "megatron").rglob("cpu_redirect*"))


def test_verify_catches_upstream_megatron_core_shadowing_the_fork(installed):
    pristine = REPO / "build" / "trees" / PRISTINE
    if not (pristine / "megatron").is_dir():
        subprocess.run(
            [sys.executable, str(REPO / "tools" / "fork.py"), "pristine", BASE], check=True
        )
    proc = verify(env={"PYTHONPATH": str(pristine)})
    assert proc.returncode == 1
    assert "SHADOWED: megatron.core at" in proc.stdout and "verify: FAILED" in proc.stdout


def test_verify_names_modified_missing_and_test_only_files(installed, tmp_path):
    site = tmp_path / "site"
    shutil.copytree(installed / "megatron_fork", site / "megatron_fork")
    shutil.copytree(
        installed / "megatron", site / "megatron", ignore=shutil.ignore_patterns("*.so")
    )
    target = site / "megatron" / "core" / "distributed" / "param_and_grad_buffer.py"
    target.write_text(target.read_text() + "# local edit\n")
    (site / "megatron" / "core" / "package_info.py").unlink()
    (site / "megatron" / "core" / "cpu_redirect.py").write_text("# leaked test helper\n")
    proc = verify(env={"PYTHONPATH": str(site)})
    assert proc.returncode == 1
    assert "modified megatron/core/distributed/param_and_grad_buffer.py" in proc.stdout
    assert "missing megatron/core/package_info.py" in proc.stdout
    assert "test-only code shipped: megatron/core/cpu_redirect.py" in proc.stdout


def _site_copy(installed, site):
    """Copy the installed fork (its packages, tooling and dist-info) into the folder ``site``."""
    shutil.copytree(installed / "megatron_fork", site / "megatron_fork")
    shutil.copytree(
        installed / "megatron",
        site / "megatron",
        ignore=shutil.ignore_patterns("*.so", "__pycache__"),
    )
    for info in installed.glob("megatron_core-*.dist-info"):
        shutil.copytree(info, site / info.name)
    return site


def _sibling_wheel(tmp_path):
    """Build a wheel of a distribution that adds ``megatron/sibling`` to the namespace."""
    src = tmp_path / "sibling-src"
    (src / "megatron" / "sibling").mkdir(parents=True)
    (src / "megatron" / "sibling" / "__init__.py").write_text("NAME = 'sibling'\n")
    (src / "setup.py").write_text(
        "from setuptools import find_namespace_packages, setup\n"
        "setup(name='megatron-sibling', version='1.2.3',\n"
        "      packages=find_namespace_packages(include=['megatron.sibling*']))\n"
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "dist"), str(src)],
        check=True,
    )  # fmt: skip
    return next((tmp_path / "dist").glob("megatron_sibling-*.whl"))


def test_verify_leaves_sibling_namespace_distributions_alone(installed, tmp_path):
    # Megatron-Bridge, megatron-energon and others install into the same `megatron` namespace.
    # pip --target refuses to merge into an existing megatron/, so the sibling is installed into
    # its own target and laid over the copy of the fork's site, as one site-packages holds both.
    site = _site_copy(installed, tmp_path / "site")
    target = tmp_path / "sibling-target"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
         str(_sibling_wheel(tmp_path))],
        check=True,
    )  # fmt: skip
    shutil.copytree(target, site, dirs_exist_ok=True)
    assert (site / "megatron" / "sibling" / "__init__.py").is_file()
    manifest = str(site / "megatron_fork" / "manifest.json")
    proc = verify(env={"PYTHONPATH": str(site)}, args=("--manifest", manifest))
    assert proc.returncode == 0, proc.stdout
    assert "verify: OK" in proc.stdout and "unexpected" not in proc.stdout
    assert "not checked): megatron-sibling 1.2.3 (megatron/sibling)" in proc.stdout
    # What the fork owns is still checked: a stray module inside megatron/core is reported.
    (site / "megatron" / "core" / "stray.py").write_text("# not shipped by the fork\n")
    proc = verify(env={"PYTHONPATH": str(site)}, args=("--manifest", manifest))
    assert proc.returncode == 1 and "unexpected megatron/core/stray.py" in proc.stdout
