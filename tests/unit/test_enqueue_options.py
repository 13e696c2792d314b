"""The enqueue options are declared once (:class:`sqla_jobs.tasks.EnqueueOptions`), and
every entry point takes exactly those.

Two kinds of entry points: those whose options a type checker sees (``with_options``,
``enqueue_many``, ``@jobs.task``) must spell them as ``**options: Unpack[<declaration>]``
and list no option of their own; those whose keywords are the handler's (``enqueue`` on
a session, a connection or a sharded session) must hand on, as options, exactly the
declared names. A new option added to the declaration and forgotten by an entry point,
or an option listed by hand again, fails here.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import typing
from typing import Any
from unittest import mock

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase

from sqla_jobs import JobMixin, Jobs, JobSession, Unique
from sqla_jobs import _tasks as t
from sqla_jobs.sharding import AsyncShardedJobSession, ShardedJobSession, ShardedManyOptions


class Base(DeclarativeBase): ...


class Job(JobMixin, Base):
    __tablename__ = "option_jobs"


jobs = Jobs(Job)


@jobs.task
def handler(x: int) -> None: ...


#: Keyword-only parameters an entry point may have besides the declared options: they
#: are not enqueue options (how a task runs, where a job goes).
NOT_OPTIONS = {"transactional", "durable", "shard", "shard_with"}

#: (entry point, the declaration its ``**options`` must unpack)
TYPED = [
    (t.Task.with_options, "EnqueueOptions"),
    (t.ConfiguredTask.with_options, "EnqueueOptions"),
    (Jobs.task, "TaskOptions"),
    (Jobs.enqueue_many, "ManyOptions"),
    (JobSession.enqueue_many, "ManyOptions"),
    (ShardedJobSession.enqueue_many, "ShardedManyOptions"),
    (AsyncShardedJobSession.enqueue_many, "ShardedManyOptions"),
]


def _signatures(fn: Any) -> list[inspect.Signature]:
    """The implementation's signature and its overloads'."""
    found = [inspect.signature(fn)]
    if sys.version_info >= (3, 11):
        found += [inspect.signature(o) for o in typing.get_overloads(fn)]
    return found


def test_option_names_are_the_declaration() -> None:
    assert tuple(t.EnqueueOptions.__annotations__) == t.OPTION_NAMES
    assert tuple(t.ManyOptions.__annotations__) == t.MANY_OPTION_NAMES
    assert set(t.MANY_OPTION_NAMES) < set(t.OPTION_NAMES)
    sharded = set(ShardedManyOptions.__annotations__)
    assert sharded - set(t.MANY_OPTION_NAMES) == {"shard", "shard_with"}
    assert frozenset(t.OPTION_NAMES) == t.RESERVED_NAMES
    # The task-level unique options are the enqueue ones (a key aside).
    unique = {n for n in t.TASK_OPTION_NAMES if n.startswith("unique")}
    assert unique < set(t.OPTION_NAMES)
    assert set(t._UNIQUE_FIELDS) - unique == {"unique_key"}


def test_unique_fields_are_the_flat_aliases() -> None:
    fields = [f.name for f in dataclasses.fields(Unique)]
    assert len(fields) == len(t._UNIQUE_FIELDS)
    assert set(t._UNIQUE_FIELDS) <= set(t.OPTION_NAMES)
    flat = Unique(key="k", within=5, states=["ready"], on_conflict="keep").flat()
    assert flat == {
        "unique": True,
        "unique_key": "k",
        "unique_for": 5,
        "unique_states": ("ready",),
        "unique_on_conflict": "keep",
    }


@pytest.mark.parametrize(("fn", "declaration"), TYPED, ids=lambda v: getattr(v, "__qualname__", v))
def test_typed_entry_points_unpack_the_declaration(fn: Any, declaration: str) -> None:
    if sys.version_info < (3, 11):
        pytest.skip("typing.get_overloads needs Python 3.11")
    signatures = _signatures(fn)
    for sig in signatures:
        params = list(sig.parameters.values())
        var_kw = [p for p in params if p.kind is p.VAR_KEYWORD]
        assert len(var_kw) == 1, sig
        assert str(var_kw[0].annotation) == f"Unpack[{declaration}]", sig
        own = {p.name for p in params if p.kind is p.KEYWORD_ONLY} - NOT_OPTIONS
        assert not own, f"{fn.__qualname__} lists options of its own: {sorted(own)}"


class _Taken(Exception):
    """Raised by the spy in place of Jobs.bind_row: what reached it as options."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options


def _spy(self: Any, task: Any, args: Any, kwargs: Any, **options: Any) -> Any:
    raise _Taken(options)


def _taken(call: Any) -> set[str]:
    with mock.patch.object(Jobs, "bind_row", _spy), pytest.raises(_Taken) as caught:
        call()
    return set(caught.value.options)


ALL = {name: object() for name in t.OPTION_NAMES}


def test_session_enqueue_takes_the_declared_options() -> None:
    session = JobSession()
    assert _taken(lambda: session.enqueue(handler, 1, **ALL)) == set(t.OPTION_NAMES)


def test_connection_enqueue_takes_the_declared_options() -> None:
    connection = mock.MagicMock(spec=sa.Connection)
    assert _taken(lambda: jobs.enqueue(connection, handler, 1, **ALL)) == set(t.OPTION_NAMES)


def test_sharded_enqueue_takes_the_declared_options() -> None:
    session = ShardedJobSession(
        shard_chooser=lambda *a, **k: "a",
        identity_chooser=lambda *a, **k: ["a"],
        execute_chooser=lambda *a, **k: ["a"],
        shards={"a": sa.create_engine("postgresql+psycopg://")},
    )
    taken = _taken(lambda: session.enqueue(handler, 1, shard="a", **ALL))
    assert taken == set(t.OPTION_NAMES)


def test_check_options_knows_exactly_the_declared_names() -> None:
    with pytest.raises(t.EnqueueError, match="unknown enqueue option"):
        t.check_options({"not_an_option": 1})
    with pytest.raises(TypeError, match="unexpected keyword argument 'queu'"):
        handler.with_options(queu="q")  # type: ignore[call-arg]
