"""Shared test plumbing.

Stages are named `02_gpt.py`, which Python cannot import by name, so `load_stage` loads one by
path. Tests that need CUDA carry `@pytest.mark.gpu` and are skipped on machines without it. On
such machines Triton kernels run through its interpreter, which must be switched on before
triton is first imported.
"""
import importlib.util
import os
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def load_stage(name):
    """Import `ROOT/<name>.py` (e.g. "02_gpt") as a module, once per test session."""
    mod_name = "stage_" + name
    if mod_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(mod_name, ROOT / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[mod_name]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
