"""What PostgreSQL can store, checked before anything is sent to it.

Some values are refused only when they reach the database: a NUL character in text or
JSON, a string that is not valid Unicode, an index entry over about 2.7 kB, a NOTIFY
payload over 8,000 bytes, a number past its column (an ``int``, a ``numeric``), more than
``jsonb`` holds, text a database that is not UTF-8 cannot store. A job is INSERTed at the
caller's flush or commit, so such a value would fail the caller's whole transaction
there, far from the enqueue that caused it. These checks run inside ``enqueue`` and at
declaration instead; the table's own CHECK constraints stay the last line.

Some are about reading the value back rather than storing it: JSON nested past
:data:`JSON_MAX_DEPTH` (Python's ``json`` recurses), an int Python will not write or read
(:func:`int_problem` takes the number of digits), non-ASCII JSON over a connection that is
not UTF-8 (:class:`Encodings`).
"""

from __future__ import annotations

import codecs
import json
import math
import re
import sys
import weakref
from collections import Counter
from typing import Any, NamedTuple

import sqlalchemy as sa

from .errors import ResultError

__all__ = [
    "BIGINT_MAX",
    "DURATION_MAX_SECONDS",
    "INT_MAX",
    "INT_MAX_DIGITS",
    "JSONB_MAX_BYTES",
    "JSONB_MAX_ELEMENTS",
    "JSONB_MAX_KEYS",
    "JSONB_SAFE_CHARS",
    "JSON_MAX_DEPTH",
    "META_MAX_BYTES",
    "META_RESERVED_PREFIX",
    "NUMERIC_MAX_DIGITS",
    "PROGRESS_MAX_BYTES",
    "QUEUE_MAX_BYTES",
    "SCHEDULE_NAME_MAX_BYTES",
    "SMALLINT_MAX",
    "UNIQUE_KEY_MAX_BYTES",
    "Encodings",
    "check_name",
    "database_encodings",
    "digits_unbounded",
    "finite_seconds",
    "int_problem",
    "json_text_depth",
    "jsonb_problem",
    "known_encodings",
    "text_problem",
]

#: The largest values of PostgreSQL's integer columns (``priority`` is a smallint,
#: ``max_attempts`` and ``attempts`` ints, ids bigints).
SMALLINT_MAX = 2**15 - 1
INT_MAX = 2**31 - 1
BIGINT_MAX = 2**63 - 1

#: How deeply arguments may nest (the arguments object itself is the first level).
#: PostgreSQL takes deeper JSON, but Python's ``json`` encodes and decodes it by recursion:
#: a value that encodes at the caller's depth can fail the flush's encoding, deeper in the
#: stack, or the worker's decoding. 500 levels leave room for both.
JSON_MAX_DEPTH = 500

#: What ``jsonb`` holds (PostgreSQL's ``JENTRY_OFFLENMASK``): a string of at most this
#: many bytes, and at most this many bytes of contents in one array or object.
JSONB_MAX_BYTES = 2**28 - 1
#: Elements of one ``jsonb`` array, and keys of one object: PostgreSQL builds each in one
#: allocation, which may not reach 1 GB (``invalid memory alloc request size``).
JSONB_MAX_ELEMENTS = 2**24
JSONB_MAX_KEYS = 2**23
#: JSON text this long or shorter cannot reach a ``jsonb`` limit: the cheapest way to an
#: array of :data:`JSONB_MAX_ELEMENTS` is two characters an element (``0,``), and no
#: element takes more than six times its text in ``jsonb``.
JSONB_SAFE_CHARS = 2**25
#: Digits before the decimal point of a ``numeric``, which is what ``jsonb`` keeps a
#: number as. Python writes no int this long unless ``sys.set_int_max_str_digits`` lifted
#: its own limit (4,300 digits).
NUMERIC_MAX_DIGITS = 131_072

#: A queue name is in the claim index and is the payload of every NOTIFY that wakes its
#: workers (at most 8,000 bytes); 128 bytes of UTF-8 is far more than a name needs.
QUEUE_MAX_BYTES = 128
#: A ``unique_key`` given by the caller is an entry of the unique index, whose rows hold
#: about 2.7 kB at most.
UNIQUE_KEY_MAX_BYTES = 1024
#: A schedule's jobs get the unique key ``periodic:<name>:<tick>``; 200 bytes keeps it
#: well inside the unique index.
SCHEDULE_NAME_MAX_BYTES = 200
#: A job's ``meta`` is for tags and correlation ids, not a second set of arguments: every
#: claim returns it and the ``<table>_meta`` GIN index holds an entry per value in it. 8 KiB
#: of JSON is far more than tags need, and keeps a mistake (a document passed as meta)
#: from riding every claim.
META_MAX_BYTES = 8192
#: ``meta`` keys that start with this belong to sqla-jobs (``sqla_jobs.trace``: the trace
#: context of the enqueuing span); ``enqueue`` refuses them from the caller.
META_RESERVED_PREFIX = "sqla_jobs."
#: A progress note rides the heartbeat's statement and is rewritten with the row: a
#: number and a sentence, or a small object, fit in far less than 4 KiB.
PROGRESS_MAX_BYTES = 4096
#: The most digits an int in a job's JSON may have: what a Python with its default limit
#: (``sys.int_info.default_max_str_digits``) reads back. A producer that lifted the limit
#: (``sys.set_int_max_str_digits``) could write more (up to ``numeric``'s
#: :data:`NUMERIC_MAX_DIGITS`), and no worker could read the row.
INT_MAX_DIGITS = 4300
#: The longest duration added to ``now()`` (``keep_result``, ``Jobs(keep_done=...,
#: keep_dead=...)``, a retry delay or a snooze, the CLI's windows): 100 years. A result's
#: retention end and a job's next ``run_at`` must stay times that PostgreSQL and Python's
#: datetime hold (before the year 10000), or the statement that computes them (a worker's
#: completion, the retention duty) would fail, far from the call that asked for it.
DURATION_MAX_SECONDS = 100 * 365.25 * 86400


def finite_seconds(value: object, *, most: float = math.inf) -> bool:
    """Whether ``value`` is a number of seconds a timer or an interval can hold: an int or
    a float (not a bool), > 0 and at most ``most``, which NaN and infinity are not."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    return 0 < value <= most and value < math.inf


def text_problem(text: str) -> str | None:
    """Why PostgreSQL could not store this string (as text or in JSON), or ``None``."""
    if "\x00" in text:
        return "contains a NUL character (\\x00), which PostgreSQL cannot store"
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        return (
            f"contains the surrogate code point U+{ord(text[exc.start]):04X}, which is not "
            "valid Unicode text (PostgreSQL stores UTF-8)"
        )
    return None


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


def json_text_depth(text: str) -> int:
    """How deeply the brackets of a JSON text nest, outside its strings (an unclosed one
    counts): told before ``json.loads`` reads a text from outside. Python's decoder has
    no depth limit of its own, only the interpreter's recursion, which moved between
    versions (3.11 stops near 1,000 levels, 3.12 reads 1,200, 3.13 5,000), so a
    RecursionError alone would refuse a text on one Python and read it on another."""
    if "[" not in text and "{" not in text:
        return 0
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_JSON_STRING.sub("", text)):
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth = max(depth - 1, 0)
    return deepest


def int_problem(value: int, max_digits: int = INT_MAX_DIGITS) -> str | None:
    """Why an int has more decimal digits than ``max_digits`` (by default what a worker
    reads back: :data:`INT_MAX_DIGITS`), or ``None``. Cheap for any size: no decimal text
    is written."""
    # A number of n bits has at most ceil(n * log10(2)) digits: most ints are told by
    # their bit length alone, the rest by one comparison with a power of ten.
    bits = abs(value).bit_length()
    if bits * 0.30103 < max_digits - 1:
        return None
    if abs(value) < _power_of_ten(max_digits):
        return None
    return (
        f"is an int of more than {max_digits:,} digits; a worker reads back at most "
        f"{INT_MAX_DIGITS:,} (Python's default limit): pass it as a string"
    )


_POWERS: dict[int, int] = {}


def _power_of_ten(digits: int) -> int:
    if digits not in _POWERS:
        _POWERS[digits] = 10**digits
    return _POWERS[digits]


def digits_unbounded(limit: int = INT_MAX_DIGITS) -> bool:
    """Whether Python may write an int of more than ``limit`` digits as JSON: only once
    ``sys.set_int_max_str_digits`` lifted its limit (0) or raised it past ``limit``."""
    get = getattr(sys, "get_int_max_str_digits", None)
    if get is None:  # an interpreter from before the limit: no limit
        return True
    current = int(get())
    return current == 0 or current > limit


def jsonb_problem(value: Any) -> str | None:
    """Why ``value`` (a JSON-able value) could not be stored as ``jsonb``: a string over
    :data:`JSONB_MAX_BYTES` of UTF-8, an array of more than :data:`JSONB_MAX_ELEMENTS`
    elements or an object of more than :data:`JSONB_MAX_KEYS` keys, or one whose contents
    would take more than :data:`JSONB_MAX_BYTES`; ``None`` if it fits. Walks the whole
    value: meant for values whose JSON is longer than :data:`JSONB_SAFE_CHARS`."""
    # Post-order, without recursion, each value's size as PostgreSQL lays it out: a string
    # its bytes; a number a numeric (a 6-byte header and 2 bytes per 4 digits, at most) and
    # a container a header and a 4-byte entry per child, both padded to 4 bytes. The
    # contents of one container (its children's sizes) must fit JSONB_MAX_BYTES.
    sizes: list[int] = []
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        item, done = stack.pop()
        if isinstance(item, str):
            size = len(item.encode("utf-8", "surrogatepass"))
            if size > JSONB_MAX_BYTES:
                return f"holds a string of {size:,} bytes; jsonb strings hold {JSONB_MAX_BYTES:,}"
            sizes.append(size)
        elif isinstance(item, (dict, list, tuple)):
            count = 2 * len(item) if isinstance(item, dict) else len(item)
            if not done:
                if isinstance(item, dict) and len(item) > JSONB_MAX_KEYS:
                    return f"holds an object of {len(item):,} keys; jsonb holds {JSONB_MAX_KEYS:,}"
                if not isinstance(item, dict) and len(item) > JSONB_MAX_ELEMENTS:
                    return (
                        f"holds an array of {len(item):,} elements; jsonb holds "
                        f"{JSONB_MAX_ELEMENTS:,}"
                    )
                flat = None if isinstance(item, dict) else _flat_size(item)
                if flat is not None:
                    if flat > JSONB_MAX_BYTES:
                        return (
                            f"holds an array whose contents take about {flat:,} bytes as "
                            f"jsonb; at most {JSONB_MAX_BYTES:,} fit"
                        )
                    sizes.append((4 + 4 * count + flat + 3) & ~3)
                    continue
                stack.append((item, True))
                children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
                stack.extend((child, False) for child in reversed(children))
                continue
            contents = sum(sizes[len(sizes) - count :]) if count else 0
            del sizes[len(sizes) - count :]
            if contents > JSONB_MAX_BYTES:
                kind = "an object" if isinstance(item, dict) else "an array"
                return (
                    f"holds {kind} whose contents take about {contents:,} bytes as jsonb; at "
                    f"most {JSONB_MAX_BYTES:,} fit"
                )
            sizes.append((4 + 4 * count + contents + 3) & ~3)
        elif isinstance(item, (int, float)) and not isinstance(item, bool):
            sizes.append(_numeric_size(len(repr(item))))
        else:
            sizes.append(0)
    return None


_NUMBERS = frozenset({int, float, bool, type(None)})


def _numeric_size(chars: int) -> int:
    """The bytes of a ``numeric`` written in ``chars`` characters, padded, at most: a
    6-byte header and 2 bytes per 4 digits."""
    return (6 + 2 * ((chars + 3) // 4) + 3) & ~3


def _flat_size(items: list[Any] | tuple[Any, ...]) -> int | None:
    """The contents' size of an array of numbers only, or of strings only, in a few passes
    of C (an array of millions of numbers is what makes a big jsonb); None for others."""
    kinds = set(map(type, items))
    if kinds <= _NUMBERS:
        lengths = Counter(map(len, map(repr, items)))
        return sum(_numeric_size(length) * n for length, n in lengths.items())
    if kinds == {str}:
        return len("".join(items).encode("utf-8", "surrogatepass"))
    return None


#: PostgreSQL's server encodings, as Python codecs: what a database that is not UTF-8
#: can store. ``None``: anything (UTF-8), or an encoding not checked here (SQL_ASCII
#: stores bytes unchecked; EUC_TW and MULE_INTERNAL have no Python codec).
_SERVER_CODECS: dict[str, str] = {
    "LATIN1": "iso8859-1",
    "LATIN2": "iso8859-2",
    "LATIN3": "iso8859-3",
    "LATIN4": "iso8859-4",
    "LATIN5": "iso8859-9",
    "LATIN6": "iso8859-10",
    "LATIN7": "iso8859-13",
    "LATIN8": "iso8859-14",
    "LATIN9": "iso8859-15",
    "LATIN10": "iso8859-16",
    "ISO_8859_5": "iso8859-5",
    "ISO_8859_6": "iso8859-6",
    "ISO_8859_7": "iso8859-7",
    "ISO_8859_8": "iso8859-8",
    "KOI8R": "koi8-r",
    "KOI8U": "koi8-u",
    "WIN866": "cp866",
    "WIN874": "cp874",
    **{f"WIN{n}": f"cp{n}" for n in range(1250, 1259)},
    "EUC_JP": "euc-jp",
    "EUC_JIS_2004": "euc-jis-2004",
    "EUC_KR": "euc-kr",
    "EUC_CN": "gb2312",
}


class Encodings(NamedTuple):
    """What text a database and the connections to it carry, when that is not everything
    (see :func:`database_encodings`)."""

    #: The server's encoding and the connection's (client) encoding, as PostgreSQL
    #: names them.
    server: str
    client: str
    #: The Python codecs a value of a text column must encode in: the client's (psycopg
    #: encodes with it) and the server's (which stores it).
    text: tuple[str, ...]
    #: The codec JSON text must encode in to be stored and read back: the server's; or
    #: ASCII when the client is not UTF-8, since psycopg reads JSON as UTF-8 bytes.
    json: str | None

    def problem(self, text: str, *, json: bool = False) -> str | None:
        """Why ``text`` (of a text column, or in JSON) cannot go through, or ``None``."""
        for codec in self.text:
            try:
                text.encode(codec)
            except UnicodeEncodeError as exc:
                return _cannot(text[exc.start], self.server)
        if json and self.json is not None:
            try:
                text.encode(self.json)
            except UnicodeEncodeError as exc:
                if self.json == "ascii":
                    char = text[exc.start]
                    return (
                        f"holds {char!r} (U+{ord(char):04X}), which JSON cannot carry over a "
                        f"connection whose client encoding is {self.client} (psycopg reads "
                        "JSON as UTF-8): connect with client_encoding=utf8"
                    )
                return _cannot(text[exc.start], self.server)
        return None

    def result_error(self, text: str) -> ResultError | None:
        """The error that fails a run whose kept result, the JSON ``text``, cannot go
        through (the rule enqueue holds arguments to), or ``None``. One sentence for the
        three places that check: the run's end, the outcome batch, and a transactional
        task's completion in the handler's own transaction."""
        if text.isascii():
            return None
        problem = self.problem(text, json=True)
        return None if problem is None else ResultError(f"the handler's result {problem}")

    def escape(self, text: str) -> str:
        """``text`` for a text column (``last_error``): each character the connection or
        the database cannot carry written as its escape (``\\u2192``), as the rest stays.
        For text people read, where a refusal would lose what it says."""
        return _escaped(text, self.text)

    def escape_json(self, text: str) -> str:
        """JSON text (a progress note) with each string in it escaped as :meth:`escape`
        does, for JSON (:attr:`json`) too: still JSON, of the same shape, its odd
        characters readable as their escapes. ``text`` itself when nothing needs it."""
        if text.isascii() or self.problem(text, json=True) is None:
            return text
        codecs_ = (*self.text, *((self.json,) if self.json else ()))

        def walk(value: Any) -> Any:
            if isinstance(value, str):
                return _escaped(value, codecs_)
            if isinstance(value, list):
                return [walk(v) for v in value]
            if isinstance(value, dict):
                return {_escaped(k, codecs_): walk(v) for k, v in value.items()}
            return value

        return _json_text(walk(json.loads(text)))


def _escaped(text: str, codecs_: tuple[str, ...]) -> str:
    if text.isascii():
        return text
    for codec in codecs_:
        text = text.encode(codec, "backslashreplace").decode(codec)
    return text


_json_text = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


def _cannot(char: str, server: str) -> str:
    return (
        f"holds {char!r} (U+{ord(char):04X}), which the database's encoding {server} cannot store"
    )


#: What each engine's connections carry (see :func:`database_encodings`), learned once.
_encodings: weakref.WeakKeyDictionary[sa.Engine, Encodings | None] = weakref.WeakKeyDictionary()
_UTF8 = codecs.lookup("utf-8").name


def database_encodings(connection: sa.Connection) -> Encodings | None:
    """What text the database behind ``connection`` stores, and the connection carries,
    when that is not every text (``None``: UTF-8 both ways, nearly always). Read from what
    the server said when the connection opened (no round trip), and kept for the engine."""
    engine = connection.engine
    try:
        return _encodings[engine]
    except KeyError:
        pass
    driver = connection.connection.driver_connection
    info = getattr(driver, "info", None)
    server = client_name = ""
    client = _UTF8
    if info is not None and hasattr(info, "parameter_status"):
        server = info.parameter_status("server_encoding") or ""
        client_name = info.parameter_status("client_encoding") or ""
        client = codecs.lookup(getattr(info, "encoding", None) or _UTF8).name
    server_codec = _SERVER_CODECS.get(server.upper())
    text = tuple(
        dict.fromkeys(codecs.lookup(c).name for c in (client, server_codec) if c and c != _UTF8)
    )
    json = "ascii" if client != _UTF8 else server_codec
    found = Encodings(server or "UTF8", client_name or client, text, json) if text or json else None
    _encodings[engine] = found
    return found


def known_encodings(engine: sa.Engine) -> tuple[bool, Encodings | None]:
    """Whether :func:`database_encodings` learned ``engine``'s, and what it learned."""
    if engine in _encodings:
        return True, _encodings[engine]
    return False, None


def check_name(
    value: str, what: str, limit: int, error: type[ValueError] = ValueError, hint: str = ""
) -> None:
    """Raise ``error`` unless ``value`` is valid text of at most ``limit`` bytes of UTF-8."""
    try:
        size = len(value.encode())
    except UnicodeEncodeError:
        size = -1
    if 0 <= size <= limit and "\x00" not in value:
        return
    problem = text_problem(value) or f"is {size} bytes in UTF-8; at most {limit} are allowed"
    raise error(f"{what} {shorten(value)} {problem}{hint}")


def shorten(value: str, width: int = 60) -> str:
    """``repr(value)``, cut to about ``width`` characters for a message."""
    text = repr(value)
    return text if len(text) <= width else f"{text[: width - 4]}...{text[-1]}"
