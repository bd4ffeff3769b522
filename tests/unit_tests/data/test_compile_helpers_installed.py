# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import importlib.util
import subprocess
from types import SimpleNamespace

import pytest

from megatron.core.datasets import utils as datasets_utils

HELPER = "megatron.core.datasets.helpers_cpp"


class _MakeRecorder:
    """Stands in for subprocess.run; answers like make in a directory without a Makefile."""

    def __init__(self, returncode):
        self.returncode = returncode
        self.commands = []

    def __call__(self, command, *args, **kwargs):
        self.commands.append(list(command))
        return SimpleNamespace(returncode=self.returncode)


def _layout(monkeypatch, tmp_path, with_makefile: bool, helper_installed: bool, returncode: int):
    """Make compile_helpers() see ``tmp_path`` as megatron/core/datasets."""
    if with_makefile:
        (tmp_path / "Makefile").write_text("default:\n\ttrue\n")
    monkeypatch.setattr(datasets_utils, "__file__", str(tmp_path / "utils.py"))
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == HELPER:
            return SimpleNamespace(name=HELPER) if helper_installed else None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    recorder = _MakeRecorder(returncode)
    monkeypatch.setattr(subprocess, "run", recorder)
    return recorder


def test_installed_tree_with_compiled_helper_does_not_run_make(monkeypatch, tmp_path):
    """A wheel ships helpers_cpp but no Makefile: there is nothing to build, so no make.

    Without the check, make fails ("No targets specified and no makefile found") and
    compile_helpers() exits the process with status 1.
    """
    recorder = _layout(
        monkeypatch, tmp_path, with_makefile=False, helper_installed=True, returncode=2
    )
    datasets_utils.compile_helpers()
    assert recorder.commands == []


def test_source_tree_still_runs_make(monkeypatch, tmp_path):
    """A source checkout has the Makefile: make runs, so an edited helpers.cpp is rebuilt."""
    recorder = _layout(
        monkeypatch, tmp_path, with_makefile=True, helper_installed=True, returncode=0
    )
    datasets_utils.compile_helpers()
    assert recorder.commands == [["make", "-C", str(tmp_path)]]


def test_installed_tree_without_compiled_helper_still_fails(monkeypatch, tmp_path):
    """Without a Makefile and without the compiled helper, the failure is unchanged."""
    recorder = _layout(
        monkeypatch, tmp_path, with_makefile=False, helper_installed=False, returncode=2
    )
    with pytest.raises(SystemExit) as error:
        datasets_utils.compile_helpers()
    assert error.value.code == 1
    assert recorder.commands == [["make", "-C", str(tmp_path)]]
