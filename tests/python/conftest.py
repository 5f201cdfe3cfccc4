"""pytest configuration of the sparseattn Python suite.

- Seeds every test (torch's global generator) from its node id, so each test is reproducible on its own.
- `gpu` marker: tests that need a CUDA device; skipped with a clear reason where there is none.
- sparseattn import: test modules call helpers.require_sparseattn() at import time. A failed import FAILS
  loudly, unless SPARSEATTN_ALLOW_MISSING is set: then the module is skipped with the reason. Modules that
  only test the naive oracle (test_naive.py) run either way.
"""

from __future__ import annotations

import os
import sys
import zlib

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # sibling modules (helpers, naive_nsa) import whatever pytest's import mode
    sys.path.insert(0, HERE)

from helpers import ALLOW_MISSING_ENV  # noqa: E402

# Two cores: avoid oversubscription between intra-op threads.
torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))

NO_CUDA_REASON = "needs a CUDA device (torch.cuda.is_available() is False on this machine)"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped where there is none")
    config.addinivalue_line("markers", "slow: longer cases (T = 1000 and similar)")
    config.addinivalue_line("markers", "big: needs most of a GPU's memory; scripts/gpu_check.sh runs these alone, "
                                       "after the others")


def pytest_report_header(config):
    try:
        import sparseattn
    except Exception as exc:  # reported here; the test modules decide whether this fails or skips
        return [f"sparseattn: NOT importable ({type(exc).__name__}: {exc}); "
                f"{ALLOW_MISSING_ENV}={os.environ.get(ALLOW_MISSING_ENV, '')!r}"]
    where = os.path.dirname(getattr(sparseattn, "__file__", "?") or "?")
    cuda = "?"
    for name in ("built_with_cuda", "cuda_available"):
        fn = getattr(sparseattn, name, None)
        if callable(fn):
            try:
                cuda = fn()
            except Exception:  # pragma: no cover - informational only
                pass
            break
    return [f"sparseattn {getattr(sparseattn, '__version__', '?')} from {where}; built with CUDA: {cuda}; "
            f"torch {torch.__version__}, CUDA device: {torch.cuda.is_available()}"]


def _sparseattn_import_error():
    try:
        import sparseattn  # noqa: F401
    except Exception as exc:
        return exc
    return None


_IMPORT_ERROR = _sparseattn_import_error()


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """With SPARSEATTN_ALLOW_MISSING set and sparseattn not importable, a test module that fails to import
    because of it (e.g. a plain top-level `import sparseattn`) is reported as skipped, with the reason,
    instead of as a collection error. Without the variable the error stands (fails loudly)."""
    rep = yield
    if (rep.failed and _IMPORT_ERROR is not None and os.environ.get(ALLOW_MISSING_ENV)
            and isinstance(collector, pytest.Module)):
        reason = (f"sparseattn cannot be imported ({type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR}); skipped "
                  f"because {ALLOW_MISSING_ENV} is set")
        rep.outcome = "skipped"
        rep.longrepr = (str(collector.path), None, reason)
    return rep


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason=NO_CUDA_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed(request):
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    yield


@pytest.fixture
def generator(request):
    """A torch.Generator seeded from the test id (for helpers that take one)."""
    g = torch.Generator()
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()) ^ 0x5EED)
    return g


# The attention kernels' two MMA paths (src/cuda/attention/launch.cuh): "auto" takes the wgmma kernels where the
# device runs them (Hopper), "sync" forces the mma.sync kernels. The CUDA entry points read the switch at every
# call, so a test sees the path of its parameter.
@pytest.fixture(params=["auto", "sync"])
def attention_mma(request, monkeypatch):
    if request.param == "sync":
        monkeypatch.setenv("SPARSEATTN_ATTENTION_MMA", "sync")
    else:
        monkeypatch.delenv("SPARSEATTN_ATTENTION_MMA", raising=False)
    return request.param
