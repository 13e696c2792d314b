"""What a task is, below the enqueue paths (internal; the public names are re-exported
by :mod:`sqla_jobs.tasks`).

Tasks, their options (the ``TypedDict`` declarations and :class:`Unique`), the checks an
enqueue runs on its arguments, and :class:`Registry`, the empty base of
:class:`~sqla_jobs.tasks.Jobs`. The binder (``_enqueue``) and the adapters over it
(session, Core connection, flow) need all of this, so it sits below them; ``Jobs``, whose
methods call those adapters, sits one layer up, so that no import runs in a circle.

A job stores a task *name* and its arguments as JSON. Arguments are checked against the
handler's signature when the job is enqueued, in the caller's process, so a typo fails
the web request that made it instead of a worker an hour later.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import logging
import math
import operator
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Generic,
    Literal,
    NamedTuple,
    ParamSpec,
    Protocol,
    TypedDict,
    TypeVar,
    overload,
)

from ._storable import (
    DURATION_MAX_SECONDS,
    INT_MAX,
    INT_MAX_DIGITS,
    JSON_MAX_DEPTH,
    JSONB_SAFE_CHARS,
    META_MAX_BYTES,
    META_RESERVED_PREFIX,
    QUEUE_MAX_BYTES,
    SCHEDULE_NAME_MAX_BYTES,
    UNIQUE_KEY_MAX_BYTES,
    Encodings,
    check_name,
    digits_unbounded,
    int_problem,
    jsonb_problem,
    shorten,
    text_problem,
)
from .errors import EnqueueError
from .model import (
    DEFAULT_RESULT_TTL,
    JobStatus,
)
from .throttle import ConcurrencyKey

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session
    from typing_extensions import Unpack

    from .tasks import Jobs


log = logging.getLogger("sqla_jobs.enqueue")


class SessionFactory(Protocol):
    """What ``Jobs(session_factory=...)`` is: called with the worker's engine as ``bind``,
    it makes the session one transactional run writes in. A ``sessionmaker`` (for the
    threaded worker) or an ``async_sessionmaker`` (for the asyncio worker) is one."""

    def __call__(self, *, bind: Any) -> Session | AsyncSession: ...


P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T", bound="Task[Any, Any]")


@dataclass(frozen=True)
class Unique:
    """How a job is unique: the value of the ``unique=`` option (``unique=True`` is
    ``unique=Unique()``).

    At most one live (scheduled, ready or running) job holds a key. With no field set the
    key is derived from the task and its arguments; the other fields choose the key and
    its scope (River groups them alike, in ``UniqueOpts``).

    :param key: the key itself, instead of the derived one (the flat ``unique_key=``).
    :param within: the key is held for this long after the job that took it was enqueued,
        finished or not (``unique_for=``).
    :param states: the statuses in which a job holds its key (``unique_states=``).
    :param on_conflict: ``"keep"`` (the holder stays) or ``"replace"`` (a holder that has
        not started takes the new arguments and options) (``unique_on_conflict=``).

    Checked where it is used (``with_options``, an enqueue, ``@jobs.task``), as the flat
    keywords are.
    """

    key: str | None = None
    within: float | timedelta | None = None
    states: Iterable[str] | None = None
    on_conflict: Literal["keep", "replace"] | None = None

    def __post_init__(self) -> None:
        # Frozen and hashable: a list of states would make the value unhashable.
        if self.states is not None and not isinstance(self.states, (str, bytes)):
            object.__setattr__(self, "states", tuple(self.states))

    def flat(self) -> dict[str, Any]:
        """The flat options this value stands for (those that are set)."""
        flat: dict[str, Any] = {"unique": True}
        for name, value in zip(
            _UNIQUE_FIELDS, (self.key, self.within, self.states, self.on_conflict), strict=True
        ):
            if value is not None:
                flat[name] = value
        return flat


#: The flat keywords of :class:`Unique`'s fields, in its order: deprecated aliases of
#: ``unique=Unique(...)``, accepted for one more release.
_UNIQUE_FIELDS = ("unique_key", "unique_for", "unique_states", "unique_on_conflict")


class ManyOptions(TypedDict, total=False):
    """The options of ``enqueue_many`` (one set for every row of a call); the part of
    :class:`EnqueueOptions` that a batch takes. None means "not given"."""

    queue: str | None
    priority: int | None
    run_at: datetime | None
    delay: float | timedelta | None
    max_attempts: int | None
    unique: bool | Unique | None
    meta: Mapping[str, Any] | None


class EnqueueOptions(ManyOptions, total=False):
    """The enqueue options, declared once: every entry point takes them from here
    (``Task.with_options``, ``ConfiguredTask.with_options``, and the keywords that
    ``session.enqueue``, ``jobs.enqueue(conn)`` and the sharded sessions accept at run
    time), and :func:`check_options` checks them by these names. A new option is added
    here, then to :meth:`Jobs.job_values`, which turns it into columns.

    ``unique_key``, ``unique_for``, ``unique_states`` and ``unique_on_conflict`` are the
    deprecated flat spellings of ``unique=Unique(key=, within=, states=, on_conflict=)``;
    they are accepted, without a warning, for one more release.
    """

    keep_result: bool | float | timedelta | None
    after: Iterable[Any] | None
    on_parent_failure: str | None
    unique_key: str | None
    unique_for: float | timedelta | None
    unique_states: Iterable[str] | None
    unique_on_conflict: Literal["keep", "replace"] | None


class TaskOptions(TypedDict, total=False):
    """The keywords of ``@jobs.task(...)`` besides ``transactional``: the task's own
    settings, and the enqueue options a task sets defaults for (a call's options win).
    The unique ones are :class:`EnqueueOptions`' (``unique_key`` aside: jobs of one task
    cannot share one key)."""

    name: str | None
    queue: str | None
    max_attempts: int | None
    retry: RetryPolicy | None
    priority: int
    timeout: float | None
    concurrency_key: ConcurrencyKey | None
    keep_result: bool | float | timedelta
    unique: bool | Unique
    unique_for: float | timedelta | None
    unique_states: Iterable[str] | None
    unique_on_conflict: Literal["keep", "replace"] | None


#: The enqueue options' names, as :class:`EnqueueOptions` declares them.
OPTION_NAMES: tuple[str, ...] = tuple(EnqueueOptions.__annotations__)
#: The names ``enqueue_many`` takes as keywords (:class:`ManyOptions`).
MANY_OPTION_NAMES: tuple[str, ...] = tuple(ManyOptions.__annotations__)
#: The names ``@jobs.task`` takes besides ``transactional`` (:class:`TaskOptions`).
TASK_OPTION_NAMES: tuple[str, ...] = tuple(TaskOptions.__annotations__)


def many_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The keywords of an ``enqueue_many`` call, which must be :class:`ManyOptions`'
    (a ``TypeError`` as for a keyword the function does not take)."""
    for name in options:
        if name not in _MANY_OPTION_SET:
            raise TypeError(f"enqueue_many() got an unexpected keyword argument {name!r}")
    return dict(options)


def flat_unique(options: Mapping[str, Any]) -> Mapping[str, Any]:
    """``options`` with a ``unique=Unique(...)`` spelled out as the flat keywords that
    :meth:`Jobs.job_values` takes (the mapping itself when it holds none: the common
    case costs one look-up). A field given both ways is an error, not a silent choice."""
    unique = options.get("unique")
    if unique is None or unique.__class__ is bool or not isinstance(unique, Unique):
        return options
    flat = dict(options)
    for name, value in unique.flat().items():
        if name != "unique" and flat.get(name) is not None:
            raise EnqueueError(
                f"give unique=Unique(...) or {name}=, not both ({name} is deprecated)"
            )
        flat[name] = value
    return flat


#: A handler parameter may not have an option's name: the keyword would be ambiguous.
RESERVED_NAMES = frozenset(OPTION_NAMES)
_OPTION_SET = RESERVED_NAMES
_TASK_OPTION_SET = frozenset(TASK_OPTION_NAMES)
_MANY_OPTION_SET = frozenset(MANY_OPTION_NAMES)
_SMALLINT_MAX = 32767


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter and a cap: the default retry policy.

    The n-th retry waits ``min(cap, base * factor ** (n - 1))`` seconds, then a random
    ``±jitter`` fraction of that, so that a thousand jobs failing together (a partner API
    went down) do not all come back in the same second.
    """

    base: float = 2.0
    factor: float = 2.0
    cap: float = 3600.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        # Written so that NaN fails each test: ``Backoff(cap=nan)`` retried at once, for
        # ever (``max(0.0, nan)`` is 0.0).
        numbers = (self.base, self.factor, self.cap, self.jitter)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
            raise ValueError(f"invalid Backoff {self!r}: its fields are numbers of seconds")
        if not (
            0 <= self.base < math.inf
            and 1 <= self.factor < math.inf
            and self.cap >= 0  # infinite: no cap (a retry's delay is bounded where it is set)
            and 0 <= self.jitter <= 1
        ):
            raise ValueError(
                f"invalid Backoff {self!r}: base is finite seconds >= 0, cap seconds >= 0, "
                "factor a finite number >= 1, jitter a fraction from 0 to 1"
            )

    def __call__(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1 for the first)."""
        try:
            grown = self.base * self.factor ** max(attempt - 1, 0)
        except OverflowError:  # past attempt 1,024 at factor 2: a float holds no more
            grown = math.inf
        delay = min(self.cap, grown)
        if self.jitter:
            delay *= 1 + random.uniform(-self.jitter, self.jitter)
        return max(0.0, min(delay, self.cap))


#: ``json.dumps(value, allow_nan=False)`` builds a new encoder at every call (any keyword
#: but the defaults does); one shared encoder does the same check for half the cost.
#: ``ensure_ascii=False`` keeps the text as it is, so the encoding also shows where to look
#: for what PostgreSQL cannot store (see :meth:`Task.bind_args`).
#: Compact separators: the text is also what the INSERT sends (:class:`CheckedArgs`).
_check_json = json.JSONEncoder(allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode


def _c_encoder() -> Callable[[Any, int], list[str]] | None:
    """``_check_json``'s C encoder, built once, without its circular-reference dict.

    ``JSONEncoder.encode`` builds a new C encoder (and a dict to detect circular
    references) at every call: for a job's few arguments that setup is more than half the
    cost (measured: 1.4 µs of 2.2 µs for ``{"i": 12345}``). This is the same C encoder with
    the same settings, built once: called with ``(value, 0)`` it returns the pieces of the
    text. Without the circular-reference dict a circular value fails with
    ``RecursionError``; its callers then encode again with ``_check_json`` for the message.
    Text that encodes is the same either way. None without the C accelerator
    (``json.encoder.c_make_encoder`` is None on some interpreters).
    """
    # The module's own names for its C parts (typeshed does not declare them).
    make = getattr(json.encoder, "c_make_encoder", None)
    escape = getattr(json.encoder, "c_encode_basestring", None)
    if make is None or escape is None:
        return None
    encoder: Callable[[Any, int], list[str]] = make(
        None, json.JSONEncoder().default, escape, None, ":", ",", False, False, False
    )
    return encoder


_c_encode = _c_encoder()


def _encode_args(value: Any) -> str:
    """``_check_json(value)`` through :data:`_c_encode`; a failure is to be checked again
    with ``_check_json`` for its message (see :func:`_c_encoder`)."""
    if _c_encode is None:
        return _check_json(value)
    return "".join(_c_encode(value, 0))


#: The canonical form of a task and its arguments, for derived unique keys.
_canonical_json = json.JSONEncoder(sort_keys=True, separators=(",", ":")).encode

#: Read once: an enum member's ``.value`` is a descriptor call, once per enqueue_many row.
_READY = JobStatus.READY.value


class CheckedArgs(dict[str, Any]):
    """A job's arguments as :meth:`Task.bind_args` checked them, with the JSON text that
    check wrote (``json``). The INSERT (or COPY) sends that text instead of encoding the
    arguments a second time: for a bulk enqueue the encoding was a fifth of the cost of a
    row. It is a plain dict otherwise; one built elsewhere is encoded as before."""

    __slots__ = ("json",)
    json: str


#: A retry policy maps the number of the attempt that just failed to seconds to wait.
RetryPolicy = Callable[[int], float]


@dataclass(eq=False)
class Task(Generic[P, R]):
    """A registered handler and its defaults. Calling it runs the function directly."""

    fn: Callable[P, R]
    name: str
    registry: Jobs
    queue: str
    max_attempts: int
    retry: RetryPolicy
    priority: int = 0
    timeout: float | None = None
    transactional: bool = False
    #: The handler takes a ``steps`` runner (:mod:`sqla_jobs.steps`): ``@jobs.task(durable=True)``.
    durable: bool = False
    is_async: bool = False
    #: Unique by default (``@jobs.task(unique=True, unique_for=...)``); a call's options win.
    unique: bool = False
    unique_scope: UniqueScope | None = None
    #: Computes the job's ``concurrency_key`` from its arguments at enqueue (see
    #: :mod:`sqla_jobs.throttle`).
    concurrency_key: ConcurrencyKey | None = None
    #: Keep the handler's return value (``True``: for the registry's default retention,
    #: or a ``timedelta``); see :meth:`Jobs.result`.
    keep_result: bool | float | timedelta = False
    signature: inspect.Signature = field(init=False, repr=False)
    #: The parameter names when every parameter can be passed by keyword (no
    #: positional-only ones, no ``*args``/``**kwargs``), else None. Then a call made of
    #: keywords (``enqueue_many``, and every stored job) is checked with two set
    #: comparisons instead of ``Signature.bind``, which costs more per row than the bulk
    #: INSERT does.
    _keywords: frozenset[str] | None = field(init=False, repr=False, default=None)
    _required: frozenset[str] = field(init=False, repr=False, default=frozenset())
    #: The ``*args`` parameter's name, if any: its tuple is the call's own, not a value.
    _var_positional: str | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        sig = inspect.signature(self.fn)
        params = list(sig.parameters.values())
        if self.transactional:
            if "session" not in sig.parameters:
                raise TypeError(
                    f"task {self.name!r} is transactional, so its handler must take a "
                    "'session' parameter"
                )
            params = [p for p in params if p.name != "session"]
        if self.durable:
            if self.transactional:
                raise TypeError(
                    f"task {self.name!r}: durable and transactional do not go together (a "
                    "transactional run is one transaction, so there is nothing to resume); "
                    "give a step a 'session' parameter instead, and its writes commit with "
                    "its checkpoint"
                )
            if "steps" not in sig.parameters:
                raise TypeError(
                    f"task {self.name!r} is durable, so its handler must take a 'steps' parameter"
                )
            params = [p for p in params if p.name != "steps"]
        clash = RESERVED_NAMES.intersection(p.name for p in params)
        if clash:
            raise TypeError(
                f"task {self.name!r}: parameter name(s) {sorted(clash)} are enqueue options; "
                "rename them"
            )
        self.signature = sig.replace(parameters=params)
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        if all(p.kind in kinds for p in params):
            self._keywords = frozenset(p.name for p in params)
            self._required = frozenset(p.name for p in params if p.default is p.empty)
        star = [p.name for p in params if p.kind == inspect.Parameter.VAR_POSITIONAL]
        self._var_positional = star[0] if star else None

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.fn(*args, **kwargs)

    def bind_args(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> CheckedArgs:
        """Check arguments against the handler's signature; return them as a JSON-able dict."""
        if type(kwargs) is not dict and not isinstance(kwargs, Mapping):
            # An enqueue_many item that is neither task.args(...) nor a mapping.
            raise EnqueueError(
                f"task {self.name!r}: each job's arguments must be task.args(...) or a "
                f"mapping of keyword arguments, not {type(kwargs).__name__}"
            )
        keywords = self._keywords
        if (
            not args
            and keywords is not None
            and kwargs.keys() <= keywords
            and self._required <= kwargs.keys()
        ):
            arguments = CheckedArgs(kwargs)
        else:
            try:
                bound = self.signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise EnqueueError(f"task {self.name!r}: {exc}") from None
            arguments = CheckedArgs(bound.arguments)
        try:
            text = _encode_args(arguments)
        except (TypeError, ValueError, RecursionError):
            # Rare: find the culprit, one argument at a time, for the message.
            for key, value in arguments.items():
                try:
                    _check_json(value)
                except RecursionError:
                    # Worded as the walk words a nesting the encoder took (Python 3.13's
                    # encoder takes deeper ones): one message, whichever Python runs.
                    raise EnqueueError(
                        f"task {self.name!r}: argument {key!r} {_too_deep()}"
                    ) from None
                except (TypeError, ValueError) as exc:
                    raise EnqueueError(
                        f"task {self.name!r}: argument {key!r} is not JSON-serialisable ({exc})"
                    ) from None
            raise
        if _suspect(text):
            found = _unstorable(
                arguments, exact=True, var_positional=self._var_positional, size=len(text)
            )
            if found is not None:
                name, where, why = found
                raise EnqueueError(f"task {self.name!r}: argument {name!r}{where} {why}")
        arguments.json = text
        return arguments

    def bind_many(self, items: Iterable[TaskArgs[Any] | Mapping[str, Any]]) -> list[CheckedArgs]:
        """:meth:`bind_args` for each of ``items`` (``task.args(...)`` or dicts of keyword
        arguments): the same checks, the same result, the same error for a bad item, at
        what an ``enqueue_many`` of 100,000 rows can afford per row.

        When every item is keywords only (a dict) with one same key set, the key set is
        checked against the signature once; the JSON of all of them is written by the C
        encoder in one loop of C (:data:`_c_encode`), and one look at all the texts joined
        says whether any needs the walk of :meth:`bind_args` (a NUL, a surrogate, a nested
        dict whose keys may not be strings). Otherwise (positional arguments, another key
        set, a mapping that is not a dict, an argument that does not encode), each item
        goes through :meth:`bind_args`, in order, and the first bad one raises.
        """
        listed = items if isinstance(items, list) else list(items)
        fast = self._json_of_same_keywords(listed)
        if fast is None:
            return list(map(self._bind_item, listed))
        plain, texts = fast
        checked = list(map(CheckedArgs, plain))
        for arguments, text in zip(checked, texts, strict=True):
            arguments.json = text
        return checked

    def bind_many_json(self, items: Iterable[TaskArgs[Any] | Mapping[str, Any]]) -> list[str]:
        """The JSON text of each of ``items``, checked as :meth:`bind_many` checks them,
        for a caller that writes them at once and keeps nothing else (``enqueue_many`` on a
        connection): no copy of each item's arguments is made (a quarter of a row's check
        at 100,000 rows per call)."""
        listed = items if isinstance(items, list) else list(items)
        fast = self._json_of_same_keywords(listed)
        if fast is not None:
            return fast[1]
        return [self._bind_item(item).json for item in listed]

    def _bind_item(self, item: TaskArgs[Any] | Mapping[str, Any]) -> CheckedArgs:
        """:meth:`bind_args` for one ``enqueue_many`` item, ``task.args(...)`` or keywords."""
        if isinstance(item, TaskArgs):
            return self.bind_args(item.args, item.kwargs)
        return self.bind_args((), item)

    def _json_of_same_keywords(
        self, items: list[Any]
    ) -> tuple[list[dict[str, Any]], list[str]] | None:
        """The fast path of :meth:`bind_many`: the items' keyword dicts and their JSON
        texts, when all are keywords with one key set that fits the signature and encode
        (else None, and nothing was raised); raises :class:`EnqueueError` for a value that
        PostgreSQL cannot store."""
        plain = _same_keywords(items, self._keywords, self._required)
        if plain is None:
            return None
        try:
            if _c_encode is None:
                texts = list(map(_check_json, plain))
            else:
                texts = list(map("".join, map(_c_encode, plain, itertools.repeat(0))))
        except (TypeError, ValueError, RecursionError):
            return None
        joined = "\n".join(texts)
        # As in bind_args (see _suspect), once for all the texts: each starts with the one
        # '{' of its dict unless an argument holds a dict (or a '{').
        if (
            "\\u0000" in joined
            or joined.count("{") != len(texts)
            or "[" in joined
            or "e+" in joined
            or "-0.0" in joined
            or not (joined.isascii() or _is_utf8(joined))
            or (len(joined) > _long_text())
        ):
            for arguments, text in zip(plain, texts, strict=True):
                if _suspect(text):
                    found = _unstorable(arguments, exact=True, size=len(text))
                    if found is not None:
                        name, where, why = found
                        raise EnqueueError(f"task {self.name!r}: argument {name!r}{where} {why}")
        return plain, texts

    def call_args(self, stored: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Turn stored JSON arguments back into a call, ``*args`` and ``**kwargs`` included.

        :raises TypeError: a stored argument is not a parameter of the handler (renamed
            or removed since the job was enqueued), and the handler takes no ``**kwargs``.
            The job fails rather than run without it (a renamed ``user_id`` would have
            run every queued job with ``account_id``'s default); a handler that takes
            ``**kwargs`` gets such arguments there.
        """
        if self._keywords is not None and stored.keys() <= self._keywords:
            return (), dict(stored)
        parameters = self.signature.parameters
        unknown = [name for name in stored if name not in parameters]
        if not unknown:
            bound = inspect.BoundArguments(self.signature, dict(stored))
            return bound.args, bound.kwargs
        extra = next(
            (p.name for p in parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None
        )
        if extra is None:
            names = ", ".join(map(repr, unknown))
            raise TypeError(
                f"task {self.name!r}: the job's stored argument(s) {names} are not "
                f"parameters of its handler, which takes ({', '.join(parameters)}): renamed "
                "or removed since the job was enqueued? It is not run without them"
            )
        bound = inspect.BoundArguments(
            self.signature, {k: v for k, v in stored.items() if k in parameters}
        )
        kwargs = bound.kwargs
        for name in unknown:
            kwargs.setdefault(name, stored[name])
        return bound.args, kwargs

    def with_options(self, **options: Unpack[EnqueueOptions]) -> ConfiguredTask[P, R]:
        """This task with enqueue options bound, for a type-checked enqueue.

        ``session.enqueue(task, ...)`` passes everything after the task to the handler, so
        that a type checker can hold the call to the handler's signature; the options
        come first, here: ``session.enqueue(send.with_options(queue="urgent", delay=60),
        to="a@example.com")``. Each option is checked now (a bad one raises
        :class:`EnqueueError`); ``delay`` counts from each enqueue, not from this call, so
        the result can be kept in a module and used again.
        """
        return ConfiguredTask(self, {}).with_options(**options)

    def args(self, *args: P.args, **kwargs: P.kwargs) -> TaskArgs[Task[P, R]]:
        """One job's arguments for ``enqueue_many``, checked by the type checker against
        the handler's signature (a plain mapping is checked only at run time)."""
        return TaskArgs(args, kwargs)


class DurableTask(Task[P, R]):
    """A ``durable=True`` task whose handler takes its step runner as its first parameter
    (``def fulfil(steps: Steps, order_id: int)``): ``P`` is the rest, what an enqueue
    passes. At run time a :class:`Task` like any other."""

    if TYPE_CHECKING:

        def __call__(  # type: ignore[override]
            self, steps: Any, /, *args: P.args, **kwargs: P.kwargs
        ) -> R: ...


class TransactionalTask(Task[P, R]):
    """A ``transactional=True`` task whose handler takes the session as its first
    parameter: ``P`` is the rest, what ``session.enqueue`` passes.

    At run time it is a :class:`Task` like any other (calling it calls the handler with
    whatever is given); the class exists so that a type checker knows that a direct call
    needs the session first, while an enqueue must not pass one.
    """

    if TYPE_CHECKING:

        def __call__(  # type: ignore[override]
            self, session: Any, /, *args: P.args, **kwargs: P.kwargs
        ) -> R: ...


@dataclass(frozen=True, eq=False, init=False)
class TaskArgs(Generic[T]):
    """The arguments of one call of a task's handler (see :meth:`Task.args`).

    Generic in the task's whole type, not only in its parameters: a type checker then
    matches the rows of ``enqueue_many(task, rows)`` to the task by its type, which mypy
    does more strictly than matching two parameter lists.
    """

    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]

    # Built once per enqueue_many row: the frozen dataclass's own __init__ looks
    # object.__setattr__ up for each field; bound once, a tenth of the cost goes (0.48 µs
    # a row where it was 0.54). Not slots: a frozen dataclass with slots cannot take
    # ``TaskArgs[X](...)``'s ``__orig_class__`` on Python 3.11, and writing the instance
    # dict instead would give the garbage collector one more object per row to walk.
    def __init__(
        self,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        _set: Callable[[object, str, Any], None] = object.__setattr__,
    ) -> None:
        _set(self, "args", args)
        _set(self, "kwargs", kwargs)


@dataclass(frozen=True, eq=False)
class ConfiguredTask(Generic[P, R]):
    """A task with enqueue options bound (see :meth:`Task.with_options`).

    ``session.enqueue``, ``session.enqueue_many`` and ``jobs.enqueue`` take it in place
    of the task; the handler's arguments follow it and are type-checked against the
    handler's signature.
    """

    task: Task[P, R]
    #: The options given, checked; only those that were set.
    options: Mapping[str, Any]

    def with_options(self, **options: Unpack[EnqueueOptions]) -> ConfiguredTask[P, R]:
        """These options on top of the ones already bound (a later one wins).

        They are kept flat (``unique=Unique(within=...)`` as ``unique=True,
        unique_for=...``), so that a later ``with_options(unique=True)`` keeps the scope."""
        unknown = options.keys() - _OPTION_SET
        if unknown:
            raise TypeError(f"with_options() got an unexpected keyword argument {min(unknown)!r}")
        given = flat_unique(options)
        run_at, delay = given.get("run_at"), given.get("delay")
        merged = dict(self.options)
        for key, value in given.items():
            if value is not None:
                merged[key] = list(value) if key == "after" else value
        if run_at is not None and delay is not None:
            raise EnqueueError("give run_at or delay, not both")
        # One replaces the other when given in a later call.
        if run_at is not None:
            merged.pop("delay", None)
        elif delay is not None:
            merged.pop("run_at", None)
        check_options(merged)
        return ConfiguredTask(self.task, merged)

    def args(self, *args: P.args, **kwargs: P.kwargs) -> TaskArgs[Task[P, R]]:
        """One job's arguments for ``enqueue_many``; see :meth:`Task.args`."""
        return TaskArgs(args, kwargs)

    @property
    def name(self) -> str:
        return self.task.name

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"<ConfiguredTask {self.task.name!r} {options}>"


def check_options(options: Mapping[str, Any]) -> None:
    """Check enqueue options as ``job_values`` would; raise :class:`EnqueueError`. The
    names are :class:`EnqueueOptions`'."""
    options = flat_unique(options)
    unknown = options.keys() - _OPTION_SET
    if unknown:
        raise EnqueueError(f"unknown enqueue option(s) {sorted(unknown)}")
    if "queue" in options:
        _check_queue(options["queue"])
    if "priority" in options:
        _check_priority(options["priority"])
    if "max_attempts" in options:
        _check_max_attempts(options["max_attempts"])
    if "unique_key" in options:
        _check_unique_key(options["unique_key"])
    if "meta" in options:
        check_meta(options["meta"])
    check_unique_scope(
        options.get("unique_for"), options.get("unique_states"), options.get("unique_on_conflict")
    )
    if "keep_result" in options:
        keep_seconds(options["keep_result"], None)
    if "on_parent_failure" in options:
        _check_on_parent_failure(options["on_parent_failure"])
    _run_at(options.get("run_at"), options.get("delay"), None)


def merge_options(
    configured: ConfiguredTask[Any, Any], given: Mapping[str, Any]
) -> tuple[Task[Any, Any], dict[str, Any]]:
    """The task and the enqueue options of a call made with a :class:`ConfiguredTask`:
    those it carries, and those also given as keywords (``given``; None and False mean
    "not given"). An option given both ways is an error, not a silent choice."""
    options = dict(configured.options)
    for key, value in flat_unique(given).items():
        if value is None or value is False:
            continue
        if key in options:
            raise EnqueueError(
                f"task {configured.task.name!r}: option {key!r} given both by with_options() "
                "and by keyword"
            )
        options[key] = value
    if "run_at" in options and "delay" in options:
        raise EnqueueError("give run_at or delay, not both")
    return configured.task, options


def _is_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _same_keywords(
    items: list[Any], keywords: frozenset[str] | None, required: frozenset[str]
) -> list[dict[str, Any]] | None:
    """The items' keyword dicts, if each is keywords only (``task.args(**kw)`` or a dict),
    all with the key set of the first, and that key set fits the handler's signature
    (``keywords``, ``required``: see :class:`Task`); else None."""
    if keywords is None or not items:
        return None
    first = items[0]
    first = first.kwargs if isinstance(first, TaskArgs) else first
    if type(first) is not dict:
        return None
    seen = frozenset(first)
    if not (seen <= keywords and required <= seen):
        return None
    # A few passes of C over the list rather than a loop of Python per item (a third of
    # a row's check at 100,000 rows per call): every item of one exact type, no
    # positional arguments, every dict an exact dict (the C encoder's fast path, and no
    # mapping code of the caller's to run) with as many keys as the first, each of them
    # one of the first's.
    kinds = set(map(type, items))
    if kinds == {TaskArgs}:
        if any(map(_positional, items)):
            return None
        out = list(map(_keywords_of, items))
    elif kinds == {dict}:
        out = list(items)
    else:
        return None
    if set(map(type, out)) != {dict} or set(map(len, out)) != {len(seen)}:
        return None
    if not all(map(seen.issuperset, out)):
        return None
    return out


_positional = operator.attrgetter("args")
_keywords_of = operator.attrgetter("kwargs")


def _suspect(text: str) -> bool:
    """Whether the JSON text of a job's arguments may hold something the walk of
    :func:`_unstorable` must look at; the one encoding says whether to look, in a few
    scans of C. A surrogate fails UTF-8 (only non-ASCII text can hold one); a NUL always
    comes out escaped as ``\\u0000``; a nested dict (whose keys may not be strings)
    shows a ``{`` past the first character, a list or tuple a ``[`` (a tuple comes back as
    a list; nesting is counted); a float that comes back as an int is written with
    ``e+``, negative zero as ``-0.0``; only a long text can break a ``jsonb`` limit or
    hold an int past ``numeric``. Each may be a false alarm (a string that holds those
    characters), which the walk clears."""
    return (
        "[" in text
        or "{" in text[1:]
        or "\\u0000" in text
        or "e+" in text
        or "-0.0" in text
        or not (text.isascii() or _is_utf8(text))
        or (len(text) > _long_text())
    )


def _long_text() -> int:
    """JSON text longer than this may break a ``jsonb`` limit, or hold an int past what a
    worker reads back (which Python writes only once its own digits limit is lifted)."""
    return INT_MAX_DIGITS if digits_unbounded() else JSONB_SAFE_CHARS


#: Values the exact walk has nothing to look at in: they are stored as they are.
_PLAIN = frozenset({bool, type(None)})
#: A float at least this large is written with an exponent and no decimal point, which
#: PostgreSQL's JSON (a numeric) gives back as an int.
_FLOAT_AS_INT = 1e16


def _unstorable(
    arguments: Mapping[str, Any],
    *,
    exact: bool = False,
    var_positional: str | None = None,
    size: int = 0,
) -> tuple[str, str, str] | None:
    """The first value in the arguments that PostgreSQL could not store in JSON (a string
    or dict key with a NUL or a surrogate, an int past ``numeric``, more than ``jsonb``
    holds when their JSON text is ``size`` characters), a dict key that is not a string,
    or nesting past :data:`~sqla_jobs._storable.JSON_MAX_DEPTH`, as ``(argument, " (at
    path)", why)``.

    ``exact``: also what would come back changed, so that a job runs with exactly the
    arguments it was given or is refused at enqueue: a tuple (back as a list; the tuple
    of the ``var_positional`` parameter's ``*args`` is the call's own), a float that would
    come back as an int, negative zero (back as 0.0)."""
    big_ints = digits_unbounded()
    # What needs no look: ints unless Python may write one past numeric, floats unless
    # their round trip is checked.
    plain = _PLAIN | (set() if big_ints else {int}) | (set() if exact else {float})
    numbers = _NUMBERS - {int} if big_ints else _NUMBERS
    for name, value in arguments.items():
        # Iterative, depth first: the encoder accepted the nesting, so a Python recursion
        # here could still run out of stack.
        stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
        while stack:
            item, path = stack.pop()
            if isinstance(item, str):
                problem = text_problem(item)
                if problem is not None:
                    return name, _where(name, path), problem
            elif isinstance(item, dict):
                if len(path) + 2 > JSON_MAX_DEPTH:
                    return name, "", _too_deep()
                for key in item:
                    if not isinstance(key, str):
                        as_json = next(iter(json.loads(json.dumps({key: 0}))))
                        return (
                            name,
                            _where(name, path),
                            f"has the dict key {key!r}, which is not a string: JSON would "
                            f"store it as {as_json!r} (use string keys)",
                        )
                    problem = text_problem(key)
                    if problem is not None:
                        why = f"has the dict key {shorten(key)} that {problem}"
                        return name, _where(name, path), why
                children = [(k, v) for k, v in item.items() if type(v) not in plain]
                stack.extend((child, (*path, key)) for key, child in reversed(children))
            elif isinstance(item, (list, tuple)):
                own = path == () and name == var_positional  # the tuple of *args
                if exact and isinstance(item, tuple) and not own:
                    return (
                        name,
                        _where(name, path),
                        f"is a {type(item).__name__}, which JSON stores as an array: the "
                        "handler would get a list (pass a list)",
                    )
                if len(path) + 2 > JSON_MAX_DEPTH:
                    return name, "", _too_deep()
                # Most lists hold numbers or strings alone: told in a few passes of C.
                kinds = set(map(type, item))
                if kinds <= plain or (exact and kinds <= numbers and _floats_kept(item)):
                    continue
                stack.extend(
                    (item[i], (*path, i))
                    for i in range(len(item) - 1, -1, -1)
                    if type(item[i]) not in plain
                )
            elif isinstance(item, float):
                if not exact:
                    continue
                if item == 0 and math.copysign(1.0, item) < 0:
                    return (
                        name,
                        _where(name, path),
                        "is -0.0, which PostgreSQL's JSON (a numeric) has no sign for: the "
                        "handler would get 0.0",
                    )
                if abs(item) >= _FLOAT_AS_INT:
                    return (
                        name,
                        _where(name, path),
                        f"is the float {item!r}, which PostgreSQL's JSON (a numeric) gives back "
                        "as an int, having no fraction to write: pass an int, or a string",
                    )
            elif isinstance(item, int) and big_ints:
                problem = int_problem(item)
                if problem is not None:
                    return name, _where(name, path), problem
    if size > JSONB_SAFE_CHARS:
        for name, value in arguments.items():
            problem = jsonb_problem(value)
            if problem is not None:
                return name, "", problem
        problem = jsonb_problem(dict(arguments))
        if problem is not None:
            return "(all of them)", "", problem
    return None


#: The types of a list of numbers alone, whose floats :func:`_floats_kept` checks at once.
_NUMBERS = frozenset({int, float, bool})


def _floats_kept(numbers: list[Any] | tuple[Any, ...]) -> bool:
    """Whether no float among ``numbers`` (ints, floats and bools, no other type) would
    come back changed, told without a loop of Python: none is 1e16 or more across, and
    none is a zero (``-0.0 == 0``; a zero of any kind sends the list to the walk)."""
    return min(numbers) > -_FLOAT_AS_INT and max(numbers) < _FLOAT_AS_INT and 0 not in numbers


def _too_deep() -> str:
    return (
        f"is nested more than {JSON_MAX_DEPTH} levels deep (Python's json encodes and "
        "decodes it by recursion, at the flush and in the worker)"
    )


def ascii_row(row: Mapping[str, Any]) -> bool:
    """:func:`ascii_rows` for one row, as ``session.enqueue`` makes it: a few scans of C,
    a quarter of a microsecond."""
    args = row["args"]
    text = args.json if type(args) is CheckedArgs else _args_text(args)
    if not (text.isascii() and row["task"].isascii() and row["queue"].isascii()):
        return False
    if "unique_key" in row or "concurrency_key" in row or "meta" in row:
        return ascii_rows([row])
    return True


def ascii_rows(rows: Sequence[Mapping[str, Any]]) -> bool:
    """Whether every text of job rows (checked values of :meth:`Jobs.job_values`, or a
    run of them: ``first`` and ``args``) is ASCII, which every encoding of PostgreSQL
    holds; a scan of C per text."""
    first: Mapping[str, Any] | None = getattr(rows, "first", None)
    heads = [first] if first is not None else rows
    for row in heads:
        if not (row["task"].isascii() and row["queue"].isascii()):
            return False
        # The other texts, when a row has them (most have none).
        for column in ("unique_key", "concurrency_key"):
            if column in row:
                value = row[column]
                if isinstance(value, str) and not value.isascii():
                    return False
        meta = row.get("meta")
        if meta is not None and not _check_json(meta).isascii():
            return False
    arguments = getattr(rows, "args", None)
    if arguments is None:
        arguments = [row["args"] for row in rows]
    try:
        # Checked arguments carry their text: read in C, scanned once.
        texts = list(map(_checked_text, arguments))
    except AttributeError:
        texts = list(map(_args_text, arguments))
    return "".join(texts).isascii()


def check_encoding(rows: Sequence[Mapping[str, Any]], encodings: Encodings) -> None:
    """Refuse job rows (as :func:`ascii_rows` takes them) that hold text the database or
    its connections cannot carry (see :class:`~sqla_jobs._storable.Encodings`), which would
    fail only at the flush or COMMIT, or in the worker. Raises :class:`EnqueueError`
    naming the column, or the argument and where in it."""
    first: Mapping[str, Any] | None = getattr(rows, "first", None)
    heads = [first] if first is not None else rows
    for row in heads:
        for column in ("task", "queue", "unique_key", "concurrency_key"):
            value = row.get(column)
            if isinstance(value, str) and not value.isascii():
                problem = encodings.problem(value)
                if problem is not None:
                    raise EnqueueError(f"{column} {shorten(value)} {problem}")
        meta = row.get("meta")
        if meta is not None:
            found = _not_encodable({"meta": meta}, encodings)
            if found is not None:
                raise EnqueueError(f"meta{_where('meta', found[0][1:])} {found[1]}")
    task = (heads[0] if heads else {}).get("task")
    arguments = getattr(rows, "args", None)
    if arguments is None:
        arguments = [row["args"] for row in rows]
    for args in arguments:
        if not _args_text(args).isascii():
            check_encoding_text(task, args, encodings)


def check_encoding_text(task: Any, args: Any, encodings: Encodings) -> None:
    """:func:`check_encoding` for one job's arguments: a dict, or its JSON text."""
    value = json.loads(args) if isinstance(args, str) else args
    found = _not_encodable(value, encodings)
    if found is not None:
        path, why = found
        name = str(path[0]) if path else "?"
        raise EnqueueError(f"task {task!r}: argument {name!r}{_where(name, path[1:])} {why}")


def _not_encodable(value: Any, encodings: Encodings) -> tuple[tuple[Any, ...], str] | None:
    """The path to the first string (or dict key) in the JSON-able ``value`` that
    ``encodings`` refuses, and why; None if there is none."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            problem = None if item.isascii() else encodings.problem(item, json=True)
            if problem is not None:
                return path, problem
        elif isinstance(item, dict):
            for key in item:
                if isinstance(key, str) and not key.isascii():
                    problem = encodings.problem(key, json=True)
                    if problem is not None:
                        return path, f"has the dict key {shorten(key)} that {problem}"
            pairs = list(item.items())
            stack.extend((child, (*path, key)) for key, child in reversed(pairs))
        elif isinstance(item, (list, tuple)):
            stack.extend((item[i], (*path, i)) for i in range(len(item) - 1, -1, -1))
    return None


_checked_text = operator.attrgetter("json")


def _args_text(args: Any) -> str:
    """The JSON text of a job's arguments: what their check wrote, or the text itself."""
    if isinstance(args, str):
        return args
    text = getattr(args, "json", None)
    return text if isinstance(text, str) else _check_json(args)


def _where(name: str, path: tuple[Any, ...]) -> str:
    if not path:
        return ""
    return f" (at {name}{''.join(f'[{p!r}]' for p in path)})"


#: A run of more digits than :data:`~sqla_jobs._storable.INT_MAX_DIGITS` in JSON text: an int
#: no worker reads back, or (rarely) a string of digits, which the walk tells apart.
_LONG_INT = re.compile("[0-9]{" + str(INT_MAX_DIGITS + 1) + ",}")


def long_int_problem(value: Any, name: str, text: str) -> str | None:
    """Why ``value`` (encoded as ``text``) holds an int no worker could read back, or None:
    for what is not checked by :func:`_unstorable`'s walk (a result, a progress note).

    With Python's default limit the encoder itself refuses an int of more than 4,300
    digits; a producer that lifted the limit would write one, and every reader of the row
    (a worker, ``Jobs.result``) would fail to decode it. Looked for only when the limit is
    lifted and the text shows such a run of digits; the message starts with ``name``.
    """
    if len(text) <= INT_MAX_DIGITS or not digits_unbounded() or not _LONG_INT.search(text):
        return None
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, int) and not isinstance(item, bool):
            problem = int_problem(item)
            if problem is not None:
                return f"{name}{''.join(f'[{p!r}]' for p in path)} {problem}"
        elif isinstance(item, dict):
            stack.extend((child, (*path, key)) for key, child in item.items())
        elif isinstance(item, (list, tuple)):
            stack.extend((child, (*path, i)) for i, child in enumerate(item))
    return None


def json_problem(value: Any, name: str = "value") -> str | None:
    """Why ``value`` cannot be stored as JSON in PostgreSQL (not JSON-serialisable, a NUL
    or a surrogate in a string, a dict key that is not a string), or ``None``; the
    message starts with ``name``."""
    try:
        text = _check_json(value)
    except RecursionError:
        return f"{name} {_too_deep()}"
    except (TypeError, ValueError) as exc:
        return f"{name} is not JSON-serialisable ({exc})"
    if _suspect(text) or text.startswith("{"):
        found = _unstorable({name: value}, size=len(text))
        if found is not None:
            _, where, why = found
            return f"{name}{where} {why}"
    return None


def check_meta(meta: Mapping[str, Any], *, own_keys: bool = False) -> dict[str, Any]:
    """A job's ``meta``, checked: a JSON object with string keys, storable, at most
    :data:`~sqla_jobs._storable.META_MAX_BYTES` of JSON, and no key of the library's own
    (``sqla_jobs.``) unless ``own_keys`` (the library's enqueue hooks write some). Raises
    :class:`EnqueueError`."""
    if not isinstance(meta, Mapping):
        raise EnqueueError(f"meta must be a dict (a JSON object), got {type(meta).__name__}")
    checked = dict(meta)
    for key in checked:
        if not isinstance(key, str):
            raise EnqueueError(f"meta keys must be strings, got {key!r}")
        if key.startswith(META_RESERVED_PREFIX) and not own_keys:
            raise EnqueueError(
                f"meta key {key!r}: keys starting with {META_RESERVED_PREFIX!r} are reserved "
                "for sqla-jobs"
            )
    try:
        text = _check_json(checked)
    except RecursionError:
        raise EnqueueError(f"meta {_too_deep()}") from None
    except (TypeError, ValueError) as exc:
        raise EnqueueError(f"meta is not JSON-serialisable ({exc})") from None
    if _suspect(text):
        for key in checked:
            problem = text_problem(key)
            if problem is not None:
                raise EnqueueError(f"meta key {shorten(key)} {problem}")
        found = _unstorable(checked)
        if found is not None:
            name, where, why = found
            raise EnqueueError(f"meta key {name!r}{where} {why}")
    size = len(text.encode())
    if size > META_MAX_BYTES:
        raise EnqueueError(
            f"meta is {size} bytes of JSON; at most {META_MAX_BYTES} are allowed (meta is for "
            "tags and correlation ids: pass data to the handler as arguments)"
        )
    return checked


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


class _TransactionalDecorator(Protocol):
    """What ``@jobs.task(transactional=True)`` returns, for a type checker."""

    @overload
    def __call__(self, fn: Callable[Concatenate[Session, P], R], /) -> TransactionalTask[P, R]: ...

    @overload
    def __call__(
        self, fn: Callable[Concatenate[AsyncSession, P], R], /
    ) -> TransactionalTask[P, R]: ...

    @overload
    def __call__(self, fn: Callable[..., R], /) -> Task[..., R]: ...


class Registry:
    """What every job registry is: :class:`sqla_jobs.tasks.Jobs` derives from it, and the
    modules under ``tasks`` (the binder, the session, the Core connection) test for it
    where a call may take a registry or a session, without importing the module that
    imports them. It adds nothing: ``Jobs`` is the whole registry.
    """

    __slots__ = ()


def _unique_fields(unique: object, *flat: Any) -> tuple[Any, Any, Any, Any]:
    """The key, period, states and conflict rule of ``unique=Unique(...)``, with the flat
    keywords of the same call (``flat``, in :class:`Unique`'s order); refuses one given
    both ways."""
    spelled = flat_unique(dict(zip(_UNIQUE_FIELDS, flat, strict=True), unique=unique))
    key, within, states, on_conflict = (spelled.get(name) for name in _UNIQUE_FIELDS)
    return key, within, states, on_conflict


def derive_unique_key(task: str, arguments: Mapping[str, Any]) -> str:
    """``<task>:<sha256 hex>``: a key equal for equal task and arguments, whatever the keyword
    order, and short whatever their size (the unique index holds about 2.7 kB a row).

    The digest is of the canonical JSON (sorted keys, no spaces) of ``[task, arguments]``.
    The task name in front is for people reading the table; one over 200 bytes is cut
    there (the digest covers all of it).
    """
    digest = hashlib.sha256(_canonical_json([task, arguments]).encode()).hexdigest()
    prefix = task
    if len(task) > _KEY_PREFIX_MAX_BYTES // 4:
        encoded = task.encode()
        if len(encoded) > _KEY_PREFIX_MAX_BYTES:
            prefix = encoded[:_KEY_PREFIX_MAX_BYTES].decode(errors="ignore")
    return f"{prefix}:{digest}"


_KEY_PREFIX_MAX_BYTES = 200


def check_schedule_name(name: str, hint: str = "") -> None:
    """Raise ``ValueError`` unless ``name`` can name a schedule (text, at most 200 bytes)."""
    if not name:
        raise ValueError("schedule name must be a non-empty string")
    check_name(name, "schedule name", SCHEDULE_NAME_MAX_BYTES, ValueError, hint)


#: The range of ``run_at``: what a ``datetime`` can hold, less a day at either end, since a
#: job's times are read back in the connection's time zone, which may be a day off UTC.
_EARLIEST = datetime.min.replace(tzinfo=timezone.utc) + timedelta(days=1)
_LATEST = datetime.max.replace(tzinfo=timezone.utc) - timedelta(days=1)


def _run_at(
    run_at: datetime | None, delay: float | timedelta | None, now: datetime | None
) -> datetime | None:
    if run_at is not None and delay is not None:
        raise EnqueueError("give run_at or delay, not both")
    if run_at is not None:
        if not isinstance(run_at, datetime):
            raise EnqueueError(f"run_at must be a datetime, got {run_at!r}")
        if run_at.utcoffset() is None:
            raise EnqueueError("run_at must be timezone-aware (e.g. datetime.now(timezone.utc))")
        # Compared without converting: a conversion to UTC could itself overflow.
        if not _EARLIEST <= run_at <= _LATEST:
            raise EnqueueError(
                f"run_at {run_at.isoformat()} is out of range: it must lie between "
                f"{_EARLIEST.date()} and {_LATEST.date()} UTC"
            )
        return run_at
    if delay is not None:
        seconds = delay.total_seconds() if isinstance(delay, timedelta) else delay
        if (
            not isinstance(seconds, (int, float))
            or isinstance(seconds, bool)
            or seconds != seconds
            or seconds < 0
        ):
            raise EnqueueError(f"delay must be a number of seconds >= 0, got {delay!r}")
        if seconds == 0:
            # Now, by the database's clock, as with no delay: counted from this host's
            # clock, a host ahead of the database stored a ready job whose run_at the
            # database had not reached, which no claim took until it did.
            return None
        try:
            when = (now or _utcnow()) + timedelta(seconds=seconds)
        except OverflowError:  # inf, or past what a datetime holds
            when = None
        if when is None or when > _LATEST:
            raise EnqueueError(
                f"delay={delay!r} is too long: the job would run after {_LATEST.date()} UTC, "
                "the latest run_at allowed"
            )
        return when
    return None


def _check_queue(queue: object) -> str:
    """``queue``, checked, as a plain ``str``.

    A ``str`` subclass (``class Queue(str, Enum)``) passes the check, but what it turns
    into on the way to the database differs by path: the INSERT's driver sent its value
    (``'mail'``), COPY's text its ``str()`` (``'Queue.MAIL'``), a queue no worker reads.
    Its plain value, taken here once, is what every path stores."""
    if not isinstance(queue, str) or not queue:
        raise EnqueueError(f"queue must be a non-empty string, got {queue!r}")
    if type(queue) is not str:
        queue = str.__str__(queue)  # the characters, whatever its __str__ says
    check_name(queue, "queue", QUEUE_MAX_BYTES, EnqueueError)
    return queue


def _plain_int(value: int) -> int:
    """An ``int`` subclass (``class Prio(int, Enum)``) as a plain ``int``: COPY's text
    of it was its ``str()`` (``'Prio.HIGH'``), which the server refused."""
    return value if type(value) is int else int.__int__(value)


def _check_priority(priority: object) -> int:
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise EnqueueError(f"priority must be an integer, got {priority!r}")
    if priority < 0:
        raise EnqueueError(f"priority must be >= 0 (higher runs first), got {priority}")
    if priority > _SMALLINT_MAX:
        raise EnqueueError(f"priority must be <= {_SMALLINT_MAX}, got {priority}")
    return _plain_int(priority)


def _check_unique_key(key: object) -> None:
    if not isinstance(key, str) or not key:
        raise EnqueueError(f"unique_key must be a non-empty string, got {key!r}")
    check_name(key, "unique_key", UNIQUE_KEY_MAX_BYTES, EnqueueError)


class UniqueScope(NamedTuple):
    """How a unique job's key is held, beyond "one live job per key" (see
    docs/howto/unique.md). Built by :func:`check_unique_scope`; None stands for the plain rule.
    """

    #: The key stays taken this long after the enqueue that took it, whatever becomes of
    #: the job (finished and deleted included); None: only while the job is in ``states``.
    period: timedelta | None
    #: The statuses of the holding job that block a new job with the key.
    states: tuple[str, ...]
    #: ``"keep"``: a blocked enqueue returns the holder unchanged. ``"replace"``: it
    #: gives the waiting holder its arguments and run time (debounce).
    on_conflict: str
    #: ``states`` as given (None: the mode's default), so a call can override the rest.
    given_states: tuple[str, ...] | None


#: What ``unique_states`` may name: a finished job is remembered by ``unique_for`` only.
_UNIQUE_STATES = (JobStatus.SCHEDULED.value, JobStatus.READY.value, JobStatus.RUNNING.value)
#: Only a job that has not started can take new arguments.
_REPLACEABLE_STATES = (JobStatus.SCHEDULED.value, JobStatus.READY.value)
_CONFLICT_MODES = ("keep", "replace")


def check_unique_scope(
    unique_for: object,
    unique_states: object,
    on_conflict: object,
    error: type[Exception] = EnqueueError,
    default: UniqueScope | None = None,
) -> UniqueScope | None:
    """Check the scope options of a unique job (each None when not given, then taken from
    ``default``, the task's); the scope, or None when they amount to the plain rule (one
    live job per key, keep the holder), which ``<table>_unique`` enforces on its own.
    Raises ``error`` naming the problem."""
    if default is not None:
        if unique_for is None:
            unique_for = default.period
        if unique_states is None:
            unique_states = default.given_states
        if on_conflict is None:
            on_conflict = default.on_conflict
    period: timedelta | None = None
    if unique_for is not None:
        seconds = unique_for.total_seconds() if isinstance(unique_for, timedelta) else unique_for
        if (
            not isinstance(seconds, (int, float))
            or isinstance(seconds, bool)
            or not 0 < seconds < 10 * 365 * 86400  # NaN fails both
        ):
            raise error(
                f"unique_for must be a period > 0 (seconds or a timedelta, under ten "
                f"years), got {unique_for!r}"
            )
        period = timedelta(seconds=seconds)
    mode = "keep" if on_conflict is None else on_conflict
    if mode not in _CONFLICT_MODES:
        raise error(f"unique_on_conflict must be 'keep' or 'replace', got {on_conflict!r}")
    given: tuple[str, ...] | None = None
    if unique_states is not None:
        if isinstance(unique_states, str) or not isinstance(unique_states, Iterable):
            raise error(
                f"unique_states must be a collection of statuses, e.g. ('scheduled', "
                f"'ready'), got {unique_states!r}"
            )
        named = [str(s) if isinstance(s, JobStatus) else s for s in unique_states]
        unknown = [s for s in named if s not in _UNIQUE_STATES]
        if unknown:
            raise error(
                f"unique_states: {unknown!r} cannot hold a key; choose among "
                f"{_UNIQUE_STATES} (unique_for covers finished jobs)"
            )
        if not named:
            raise error("unique_states must name at least one status")
        given = tuple(s for s in _UNIQUE_STATES if s in named)
    if mode == "replace":
        if period is not None:
            raise error(
                "unique_on_conflict='replace' cannot be combined with unique_for: a "
                "finished job cannot take new arguments, so the last enqueue would be lost; "
                "use delay= for the debounce window"
            )
        states = _REPLACEABLE_STATES if given is None else given
        if not set(states) <= set(_REPLACEABLE_STATES):
            raise error(
                "unique_on_conflict='replace' replaces a job that has not started: "
                f"unique_states must be among {_REPLACEABLE_STATES}, got {states!r}"
            )
    else:
        states = _UNIQUE_STATES if given is None else given
        if period is None and states == _UNIQUE_STATES:
            return None
    return UniqueScope(period, states, mode, given)


def _check_max_attempts(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise EnqueueError(f"max_attempts must be an integer >= 1, got {value!r}")
    if value > INT_MAX:
        raise EnqueueError(f"max_attempts must be <= {INT_MAX} (an int column), got {value}")
    return _plain_int(value)


def keep_seconds(value: object, registry: Jobs | None) -> float | None:
    """``keep_result`` as seconds (None: keep nothing). ``True`` is the registry's
    ``keep_done``, or a day."""
    if value is None or value is False:
        return None
    if value is True:
        ttl = (registry.keep_done if registry is not None else None) or DEFAULT_RESULT_TTL
        return ttl.total_seconds()
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise EnqueueError(
            f"keep_result must be True, False, seconds or a timedelta, got {value!r}"
        )
    if not 0 <= seconds <= DURATION_MAX_SECONDS:  # NaN and infinity fail too
        # The completion computes when the result expires: past the year 9999 it would
        # fail, with every other outcome of its batch.
        raise EnqueueError(
            f"keep_result must be a duration from 0 to {DURATION_MAX_SECONDS:.0f} seconds "
            f"(100 years), got {value!r}"
        )
    return seconds


def _check_on_parent_failure(value: object) -> None:
    if value not in ("cancel", "run"):
        raise EnqueueError(f"on_parent_failure must be 'cancel' or 'run', got {value!r}")
