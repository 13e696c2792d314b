"""What a core install can import: no pytest, no greenlet, no web stack (the extras are
optional)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def import_without(module: str, blocked: str) -> subprocess.CompletedProcess[str]:
    # A None entry in sys.modules makes any import of that name fail, as if not installed.
    code = f"import sys; sys.modules[{blocked!r}] = None; import {module}; print('ok')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("module", "blocked"),
    [
        ("sqla_jobs", "greenlet"),
        ("sqla_jobs.testing", "pytest"),
        ("sqla_jobs.testing", "greenlet"),
        ("sqla_jobs.cli", "greenlet"),
        ("sqla_jobs", "starlette"),
        ("sqla_jobs", "jinja2"),
        ("sqla_jobs.cli", "starlette"),
        ("sqla_jobs.admin", "starlette"),
        ("sqla_jobs", "prometheus_client"),
        ("sqla_jobs.cli", "prometheus_client"),
        ("sqla_jobs", "opentelemetry"),
        ("sqla_jobs.cli", "opentelemetry"),
        ("sqla_jobs", "flask"),
        ("sqla_jobs.cli", "flask"),
    ],
)
def test_imports_without_optional_packages(module: str, blocked: str) -> None:
    result = import_without(module, blocked)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize(
    ("module", "blocked", "extra"),
    [
        ("sqla_jobs.metrics", "prometheus_client", "metrics"),
        ("sqla_jobs.tracing", "opentelemetry", "tracing"),
        ("sqla_jobs.flask", "flask", "flask"),
    ],
)
def test_an_extra_that_is_missing_says_how_to_install_it(
    module: str, blocked: str, extra: str
) -> None:
    result = import_without(module, blocked)
    assert result.returncode == 1
    assert f"pip install 'sqla-jobs[{extra}]'" in result.stderr
