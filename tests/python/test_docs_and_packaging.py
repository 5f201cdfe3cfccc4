"""The public API's docstrings (sections and runnable examples), the installed py.typed marker, and the
benchmark creating its output folder only when it writes reports."""

import doctest
import inspect
import os
import subprocess
import sys

import pytest

from helpers import require_sparseattn

sa = require_sparseattn()
import sparseattn.cache  # noqa: E402
import sparseattn.compat  # noqa: E402
import sparseattn.hf  # noqa: E402
import sparseattn.functional  # noqa: E402
import sparseattn.modules  # noqa: E402


def public_callables():
    """(name, object) of every function and class in sparseattn.__all__, and the modules' forward methods."""
    items = [(name, getattr(sa, name)) for name in sa.__all__ if callable(getattr(sa, name))]
    items += [(f"{cls.__name__}.forward", cls.forward) for cls in (sa.NativeSparseAttention,
                                                                    sa.NativeSparseAttentionCore)]
    items += [(f"compat.{name}", getattr(sparseattn.compat, name)) for name in sparseattn.compat.__all__]
    items += [(f"cache.{name}", getattr(sparseattn.cache, name)) for name in sparseattn.cache.__all__]
    items += [(f"hf.{name}", getattr(sparseattn.hf, name)) for name in sparseattn.hf.__all__]
    return items


def takes_arguments(obj) -> bool:
    target = obj.__init__ if inspect.isclass(obj) else obj
    params = [p for p in inspect.signature(target).parameters if p not in ("self",)]
    return bool(params)


@pytest.mark.parametrize("name,obj", public_callables(), ids=[n for n, _ in public_callables()])
def test_docstring_sections(name, obj):
    doc = inspect.getdoc(obj) or ""
    assert doc, f"{name} has no docstring"
    if inspect.isclass(obj) and issubclass(obj, Exception):
        return  # the exception classes say what they mean; they take no documented arguments
    sections = ["Raises:"]
    if not inspect.isclass(obj):
        sections += ["Returns:", "Example:"]
    if takes_arguments(obj) and not (inspect.isclass(obj) and obj is sa.NSAConfig):
        sections.append("Args:")
    if obj is sa.NSAConfig:
        sections.append("Example:")
    missing = [s for s in sections if s not in doc]
    assert not missing, f"{name}'s docstring lacks {missing}"


@pytest.mark.parametrize("module", [sa, sparseattn.functional, sparseattn.modules, sparseattn.compat,
                                    sparseattn.hf, sparseattn.cache],
                         ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    tests = [t for t in finder.find(module, module.__name__) if t.examples]
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctest examples of {module.__name__} failed"
    if module is not sa:
        assert result.attempted > 0


def test_py_typed_is_installed():
    """PEP 561: type checkers read the package's annotations only where py.typed is installed with it."""
    assert os.path.isfile(os.path.join(os.path.dirname(sa.__file__), "py.typed"))


def test_bench_help_creates_no_folder(tmp_path):
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-m", "sparseattn.bench", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage" in proc.stdout.lower()
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def test_bench_without_gpu_creates_no_folder(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("with a GPU this would run the benchmark")
    proc = subprocess.run([sys.executable, "-m", "sparseattn.bench", "--out", "results"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "needs a CUDA GPU" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
