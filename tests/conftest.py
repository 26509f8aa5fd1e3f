"""Test configuration: the `gpu` marker, the fast/full GPU grid switch, the fake-binding fixture.

GPU tests (marked `gpu`) are skipped, with the reason, when there is no CUDA GPU, no sm80+ GPU, or
no compiled cutlass_flash._C. Everything else runs on CPU.

    python -m pytest -q tests                      # CPU tests + the fast GPU subset
    python -m pytest -q tests --full               # the whole GPU grid
    CUTLASS_FLASH_FULL_TESTS=1 python -m pytest -q tests
    python -m pytest -q tests --strict-gpu         # a GPU run of a full build: GPU tests that
                                                   # would skip (no GPU, kernel not built) fail

CUTLASS_FLASH_TEST_FAKE_BINDING=1 replaces the compiled kernels by the float64 reference of
tests/fake_c.py, on the GPU: a check of the test harness itself (poisoning, references,
tolerances, compile, graphs), saying nothing about the kernels.
"""

import functools
import os
import threading
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cases import FULL_ENV, full_grid  # noqa: E402

FAKE_BINDING_ENV = "CUTLASS_FLASH_TEST_FAKE_BINDING"
STRICT_ENV = "CUTLASS_FLASH_STRICT_GPU"


def _fake_binding_requested():
    return os.environ.get(FAKE_BINDING_ENV, "").strip().lower() not in ("", "0", "false")


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        default=False,
        help=f"run the whole GPU test grid (same as {FULL_ENV}=1)",
    )
    parser.addoption(
        "--strict-gpu",
        action="store_true",
        default=False,
        help=f"GPU tests fail instead of skipping when there is no GPU or a kernel they need is "
        f"not built (same as {STRICT_ENV}=1): for a GPU run of a full build",
    )


def pytest_configure(config):
    import gpu_check

    gpu_check.STRICT = config.getoption("--strict-gpu") or os.environ.get(STRICT_ENV, "").strip() not in (
        "", "0", "false")
    if _fake_binding_requested():
        from cutlass_flash import _dispatch
        from fake_c import FakeC

        _dispatch._C = FakeC(device="cuda")
        _dispatch.reset_caches()
    config.addinivalue_line(
        "markers",
        "gpu: needs a CUDA GPU (sm80 or newer) and the compiled cutlass_flash._C; skipped "
        "otherwise",
    )


@functools.lru_cache(maxsize=None)
def gpu_skip_reason():
    """None when the GPU tests can run, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA GPU available (torch.cuda.is_available() is False)"
    import cutlass_flash

    err = cutlass_flash.extension_error()
    if err:
        return err
    cap = torch.cuda.get_device_capability()
    if cap < (8, 0):
        return f"GPU has compute capability {cap[0]}.{cap[1]}; cutlass_flash needs sm80+"
    return None


def pytest_report_header(config):
    reason = gpu_skip_reason()
    lines = [f"cutlass_flash GPU tests: {'skipped: ' + reason if reason else 'enabled'}"]
    if reason is None:
        import cutlass_flash

        major, minor = torch.cuda.get_device_capability()
        lines.append(
            f"GPU: {torch.cuda.get_device_name()} (sm{major}{minor}), built kernels: "
            f"{len(cutlass_flash.built_kernels())}"
        )
    lines.append(f"GPU grid: {'full' if full_grid(config) else 'fast'} (--full / {FULL_ENV}=1)")
    import gpu_check

    if gpu_check.STRICT:
        lines.append("strict: GPU tests fail where they would skip (--strict-gpu)")
    if _fake_binding_requested():
        lines.append(f"{FAKE_BINDING_ENV}=1: the GPU tests run the float64 REFERENCE binding of "
                     "tests/fake_c.py, not the kernels")
    return lines


def pytest_collection_modifyitems(config, items):
    reason = gpu_skip_reason()
    if reason is None:
        return
    import gpu_check

    if gpu_check.STRICT:  # pytest_runtest_setup fails them instead
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item):
    import gpu_check

    if gpu_check.STRICT and "gpu" in item.keywords and gpu_skip_reason() is not None:
        pytest.fail(f"--strict-gpu: GPU tests cannot run here: {gpu_skip_reason()}", pytrace=False)


@pytest.fixture
def fake_backend(monkeypatch):
    """Runs the package on CPU against tests/fake_c.FakeC instead of the compiled kernels.

    The fake pretends to be an sm90 GPU with every kernel built; change ``fake.built`` or call
    ``fake.set_capability((8, 0))`` to simulate other builds and GPUs.
    """
    from cutlass_flash import _dispatch
    from fake_c import FakeC

    fake = FakeC()
    fake.capability = (9, 0)

    def set_capability(cap):
        fake.capability = tuple(cap)
        _dispatch.reset_caches()

    def set_built(built):
        fake.built = list(built)
        _dispatch.reset_caches()

    fake.set_capability = set_capability
    fake.set_built = set_built
    monkeypatch.setattr(_dispatch, "_C", fake)
    monkeypatch.setattr(_dispatch, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(_dispatch, "_query_capability", lambda device: fake.capability)
    monkeypatch.setattr(_dispatch, "_device_name", lambda device: "Fake GPU")
    monkeypatch.setattr(_dispatch, "current_stream", lambda device: 0)
    monkeypatch.setattr(_dispatch, "current_device", lambda: None)
    monkeypatch.setattr(_dispatch, "_default_arch", 0)
    monkeypatch.setattr(_dispatch, "_thread_arch", threading.local())
    _dispatch.reset_caches()
    yield fake
    _dispatch.reset_caches()
