"""WorkerSettings: one place for defaults, checks and the command line."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from typing import Any

import pytest

from sqla_jobs import WorkerSettings
from sqla_jobs.cli import CommandError, _worker_settings, build_parser
from sqla_jobs.worker.settings import WorkerOptions


def test_the_keyword_form_names_every_field() -> None:
    fields = {f.name for f in dataclasses.fields(WorkerSettings)}
    assert set(typing.get_type_hints(WorkerOptions)) == fields


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("concurrency", 0, "concurrency must be an integer >= 1"),
        ("concurrency", 2.5, "concurrency must be an integer"),
        ("concurrency", True, "concurrency must be an integer"),
        ("claim_limit", 0, "claim_limit must be an integer >= 1"),
        ("completion_batch", -1, "completion_batch must be an integer >= 1"),
        ("lease", 0, "lease must be a finite number of seconds > 0"),
        ("lease", float("inf"), "lease must be a finite"),
        ("poll_interval", -1, "poll_interval must be"),
        ("grace_period", -0.5, "grace_period must be a finite number of seconds >= 0"),
        ("completion_interval", float("nan"), "completion_interval must be"),
        ("prune_interval", 0, "prune_interval must be"),
        ("rescue_interval", 0, "rescue_interval must be"),
        ("listen", "yes", "listen must be True or False"),
        ("name", "", "name must be a non-empty string"),
        ("queues", "mail", "queues must be a sequence of names"),
        ("queues", (), "queues must name at least one queue"),
        ("queues", ("",), "queue names must be non-empty strings"),
        ("queues", ("a\x00b",), "contains a NUL character"),
        ("queues", ("\ud800",), "surrogate"),
        ("queues", ("q" * 129,), "is 129 bytes in UTF-8; at most 128"),
    ],
)
def test_every_field_is_checked(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkerSettings(**{field: value})


def test_every_number_has_an_upper_bound() -> None:
    """Unbounded, ``concurrency=10**30`` started threads until the OS refused, and a lease
    or grace period of 10**30 seconds failed the loop that waited on it."""
    from sqla_jobs.worker.settings import MAXIMA

    hints = typing.get_type_hints(WorkerSettings)
    numbers = {
        f.name
        for f in dataclasses.fields(WorkerSettings)
        if {int, float} & set(typing.get_args(hints[f.name]) or (hints[f.name],))
    }
    assert set(MAXIMA) == numbers, "a numeric setting without a maximum"
    for name, maximum in MAXIMA.items():
        assert getattr(WorkerSettings(**{name: maximum}), name) == maximum
        if isinstance(maximum, int):
            too_big: tuple[float, ...] = (maximum + 1, 10**30)
        else:
            too_big = (maximum * 2, 1e30, 10**30, 10**400, float("inf"))
        for value in too_big:
            with pytest.raises(ValueError, match=rf"{name} must be"):
                WorkerSettings(**{name: value})


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("w\udcff", "surrogate"),  # a byte that is not UTF-8, as the command line gives it
        ("w\x00", "NUL"),
        ("w" * 201, "201 bytes in UTF-8; at most 200"),
    ],
)
def test_a_worker_name_is_text_postgresql_stores(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkerSettings(name=name)


def test_defaults_and_derived_values() -> None:
    settings = WorkerSettings(queues=["a", "b"], lease=4)
    assert settings.queues == ("a", "b") and settings.lease == 4.0
    assert settings.rescue_every == 2.0
    assert WorkerSettings(lease=60).rescue_every == 5.0
    assert settings.replace(concurrency=3).concurrency == 3
    with pytest.raises(TypeError, match="unknown worker setting"):
        settings.replace(concurency=3)


def test_the_command_line_has_a_flag_per_setting_and_no_defaults_of_its_own() -> None:
    parser = build_parser()
    args = parser.parse_args(["worker", "app:jobs"])
    assert _worker_settings(args) == WorkerSettings()
    help_text = parser._subparsers._group_actions[0].choices["worker"].format_help()  # type: ignore[union-attr]
    for f in dataclasses.fields(WorkerSettings):
        assert "--" + (f.metadata["cli"] or f.name.replace("_", "-")) in help_text
    assert "(default: 30)" in help_text  # the lease's default, read from the field


def test_to_argv_round_trips_through_the_command_line() -> None:
    settings = WorkerSettings(
        queues=("mail", "hooks"),
        concurrency=16,
        lease=12.5,
        completion_interval=0.01,
        rescue_interval=3,
        listen=False,
        name="w1",
    )
    argv = ["worker", "app:jobs", *settings.to_argv()]
    assert _worker_settings(build_parser().parse_args(argv)) == settings
    assert WorkerSettings().to_argv() == []


def test_a_bad_value_on_the_command_line_is_one_clear_error() -> None:
    args = build_parser().parse_args(["worker", "app:jobs", "--lease", "0"])
    with pytest.raises(CommandError, match="lease must be a finite number of seconds > 0"):
        _worker_settings(args)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "app:jobs", "--concurrency", "many"])


def test_a_no_flag_says_what_it_turns_off() -> None:
    worker = build_parser()._subparsers._group_actions[0].choices["worker"]  # type: ignore[union-attr]
    helps = {a.option_strings[0]: a.help for a in worker._actions if a.option_strings}
    flags = [f for f in dataclasses.fields(WorkerSettings) if f.type in (bool, "bool")]
    assert {f.metadata["cli"] for f in flags} == {"no-listen", "no-prefetch", "no-log-jobs"}
    for f in flags:
        text = helps["--" + f.metadata["cli"]]
        # The flag's help is what it turns off, not the setting it turns off.
        assert text == f.metadata["off"] and text != f.metadata["help"]
        assert text.startswith(("do not", "log successes")), text
    assert "polling" in helps["--no-listen"] and "only into free slots" in helps["--no-prefetch"]
    assert "at DEBUG" in helps["--no-log-jobs"]


def test_asyncio_without_its_extra_is_a_one_line_install_hint() -> None:
    # A None entry in sys.modules makes the import fail, as if greenlet were not installed.
    code = (
        "import sys; sys.modules['greenlet'] = None\n"
        "from sqla_jobs.cli import main\n"
        "main(['worker', 'app:jobs', '--asyncio', '--database-url', 'postgresql://x@h/db'])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        "sqla-jobs: error: --asyncio needs SQLAlchemy's asyncio support (greenlet): "
        "pip install 'sqla-jobs[asyncio]'\n"
    )
