"""The package's metadata tells the truth: one version everywhere, valid classifiers,
project URLs, and README images that show on the package index's page."""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

import sqla_jobs
from sqla_jobs.cli import main

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]


def project() -> dict[str, Any]:
    data: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return data


def test_one_version_in_pyproject_the_changelog_and_the_package() -> None:
    version = project()["version"]
    heading = re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert heading is not None
    assert heading[1] == version, "the topmost CHANGELOG heading names another version"
    installed = metadata.version("sqla-jobs")
    assert installed == version, (
        f"the installed metadata says {installed} and pyproject.toml says {version}: "
        "reinstall (pip install -e .) after changing the version"
    )
    assert sqla_jobs.__version__ == version


def test_the_command_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"sqla-jobs {sqla_jobs.__version__}"


def test_classifiers_are_pypis_and_say_the_status_and_the_pythons() -> None:
    trove = pytest.importorskip("trove_classifiers")
    classifiers = project()["classifiers"]
    unknown = [c for c in classifiers if c not in trove.classifiers]
    assert unknown == [], "PyPI refuses an upload with unknown classifiers"
    assert any(c.startswith("Development Status :: ") for c in classifiers)
    floor = re.fullmatch(r">=3\.(\d+)", project()["requires-python"])
    assert floor is not None
    minors = sorted(
        int(m[1])
        for c in classifiers
        if (m := re.fullmatch(r"Programming Language :: Python :: 3\.(\d+)", c))
    )
    assert minors and minors[0] == int(floor[1]), "the oldest Python named is requires-python's"
    assert minors == list(range(minors[0], minors[-1] + 1))


def test_project_urls_and_absolute_readme_images() -> None:
    urls = project()["urls"]
    assert {"Homepage", "Repository", "Issues", "Changelog"} <= set(urls)
    repository = urls["Repository"].removeprefix("https://github.com/")
    raw = f"https://raw.githubusercontent.com/{repository}/main/"
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)", (ROOT / "README.md").read_text())
    assert images
    for url in images:
        # A relative image works on the repository's page, not on the package index's.
        assert url.startswith(raw), url
        assert (ROOT / url.removeprefix(raw)).is_file(), url


def _source_copy(tmp_path: Path) -> Path:
    """What the distributions are built from, copied out of the checkout (a ``build/``
    directory left there would hide a missing package)."""
    import shutil

    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for top in ("sqla_jobs", "alembic_ext", "tests"):
        shutil.copytree(ROOT / top, source / top, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "MANIFEST.in"):
        shutil.copy(ROOT / name, source / name)
    return source


def test_the_wheel_holds_every_module_and_data_file(tmp_path: Path) -> None:
    """The built wheel, not the checkout: the suite imports the package from the source
    tree (an editable install), so a module the wheel leaves out would pass every other
    test and fail every user's first ``import``. Built from a copy of the sources (a
    ``build/`` directory left in the checkout would hide a missing package), without
    build isolation (no download: the dev extra installs setuptools), and compared file
    by file."""
    import subprocess
    import zipfile

    source = _source_copy(tmp_path)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps"]
    built = subprocess.run(
        [*pip_wheel, "--no-build-isolation", "-w", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for top in ("sqla_jobs", "alembic_ext"):
        for path in (source / top).rglob("*"):
            if path.is_file():
                relative = path.relative_to(source).as_posix()
                assert relative in names, f"{relative} is not in the wheel"


def test_the_sdist_builds_the_package_and_holds_no_partial_suite(tmp_path: Path) -> None:
    """setuptools adds ``tests/test*.py`` to an sdist by default, without the conftest,
    helpers and fixtures they import: a suite that fails at its first import. MANIFEST.in
    leaves the tests out (they live in the repository) and puts the changelog in."""
    import subprocess
    import tarfile

    source = _source_copy(tmp_path)
    built = subprocess.run(
        [sys.executable, "-c", "from setuptools import build_meta as b; b.build_sdist('dist')"],
        cwd=source,
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr
    (sdist,) = (source / "dist").glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert not [name for name in names if name.startswith("tests/")]
    assert {"README.md", "LICENSE", "CHANGELOG.md", "pyproject.toml"} <= names
    for top in ("sqla_jobs", "alembic_ext"):
        for path in (source / top).rglob("*"):
            if path.is_file():
                assert path.relative_to(source).as_posix() in names, path


def test_sqla_jobs_aio_without_the_asyncio_extra_names_it() -> None:
    """A core install has no greenlet, so SQLAlchemy's asyncio support does not import:
    ``sqla_jobs.aio`` said only "cannot import name 'AsyncJobSession'"."""
    import subprocess

    import sqlalchemy

    if sqlalchemy.__version__.startswith("2.0."):
        pytest.skip("SQLAlchemy 2.0 imports its asyncio support without greenlet")
    code = "import sys; sys.modules['greenlet'] = None; import sqla_jobs.aio"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 1
    assert "pip install 'sqla-jobs[asyncio]'" in result.stderr.splitlines()[-1]


def test_each_recipe_s_extra_brings_the_commands_its_readme_runs() -> None:
    """The FastAPI recipe runs ``uvicorn``, and says ``.[examples]`` brings it."""
    readme = (ROOT / "examples" / "fastapi_app" / "README.md").read_text()
    assert re.search(r"^uvicorn ", readme, re.MULTILINE)
    extra = project()["optional-dependencies"]["examples"]
    assert any(re.match(r"uvicorn\b", requirement) for requirement in extra)
