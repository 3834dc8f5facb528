"""Fuzzing the OpenAI routes over real HTTP: no request body can break the server.

Two sources of bodies, sent eight at a time (the server's default
--max-concurrent-requests, so they decode in batches of up to eight) to a server
of its own (body limit 1 MiB, so bodies over it are cheap to send):

- property-based bodies, generated with Hypothesis from the request-body schemas
  that the running server publishes at /openapi.json (POST /v1/chat/completions
  and /v1/completions), three in four of them valid for the schema and one in
  four with one field swapped for an arbitrary JSON value; max_tokens and
  max_completion_tokens are cut to 1..4 so generation stays cheap;
- a hand-written corpus of nasty bodies: lone surrogates in every string field,
  NaN/Infinity in every float field, huge integers in every integer field, deep
  nesting, huge strings, wrong types everywhere, duplicate keys, wrong or missing
  content types, empty and non-UTF-8 bodies, chunked bodies over the limit,
  top_k of the vocab size, odd seeds and logit_bias keys, hostile
  chat_template_kwargs.

The oracle: every answer is a 2xx, or a 4xx whose body is JSON in OpenAI's error
shape; never a 5xx, never a request that hangs (no answer in 60 s); a streamed
2xx ends with `data: [DONE]` and carries no server-error event. Afterwards the
server answers a fixed greedy request exactly as before the run, and 20 normal
requests succeed.

CI sends 100 schema bodies per route, derandomized (the same bodies every run),
and most of the corpus (fewer values of each kind, fewer streamed). The long run
sends the whole corpus and N schema bodies per route, random unless a seed is given:

    TIERLM_FUZZ_EXAMPLES=2000 [TIERLM_FUZZ_SEED=7] .venv/bin/pytest tests/test_fuzz.py

The figures of a run (bodies sent, status histogram, 5xx, hung), and with
--replay each distinct failure sent again alone with its traceback from the log:

    .venv/bin/python tests/test_fuzz.py [--full] [--examples N] [--seed S] [--replay] [--url URL]
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import hypothesis
import hypothesis.configuration
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow  # the fuzz corpus and the schema's bodies against a server of its own: a minute

# Hypothesis keeps its files (unicode tables, constants) out of the repository;
# its example database is off altogether.
hypothesis.configuration.set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "tierlm-hypothesis")

CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
BODY_LIMIT = 2**20  # the fuzz server's --max-body-bytes
TIMEOUT_S = float(os.environ.get("TIERLM_FUZZ_TIMEOUT", "60"))
CONCURRENCY = 8  # the server decodes 8 requests together by default: a third less time than 4
MAX_HUNG = 24  # past this many hung requests the run stops: the server is wedged
VOCAB = 49152  # SmolLM2's
DEFAULT_EXAMPLES = 100  # schema bodies per route in CI


def fuzz_examples() -> int:
    return int(os.environ.get("TIERLM_FUZZ_EXAMPLES", DEFAULT_EXAMPLES))


def long_run() -> bool:
    return "TIERLM_FUZZ_EXAMPLES" in os.environ


def fuzz_seed() -> int | None:
    """None: derandomized (CI). A long run is random unless TIERLM_FUZZ_SEED is set."""
    if "TIERLM_FUZZ_SEED" in os.environ:
        return int(os.environ["TIERLM_FUZZ_SEED"])
    if long_run():
        return int.from_bytes(os.urandom(4), "big")
    return None


# ---- sending and judging ------------------------------------------------------


@dataclass
class Case:
    name: str
    path: str
    content: bytes | Callable[[], Iterator[bytes]] = b""  # a callable: sent chunked
    headers: dict = field(default_factory=lambda: {"content-type": "application/json"})
    method: str = "POST"
    expect: int | None = None  # the one status this case must get (413 for a body over the limit)

    def shown(self, limit: int = 300) -> str:
        if callable(self.content):
            return "<chunked body>"
        text = self.content.decode("utf-8", "backslashreplace")
        return text if len(text) <= limit else f"{text[:limit]}... ({len(self.content)} bytes)"


@dataclass
class Outcome:
    case: Case
    status: int | None = None  # None: no answer (hung, transport error, skipped)
    body: str = ""
    problem: str | None = None  # None: the oracle is satisfied
    seconds: float = 0.0

    @property
    def signature(self) -> str:
        """The kind of failure: a 5xx with its message, a hang, a broken stream..."""
        p = self.problem or ""
        if self.status is not None and self.status >= 500:
            try:
                return f"{self.status} {json.loads(self.body)['error']['message']}"
            except (ValueError, KeyError, TypeError):
                return f"{self.status} {self.body[:80]}"
        first_line = p.splitlines()[0] if p else ""
        return first_line[:100] if "event" in p or "expected" in p else first_line.split(":")[0]

    @property
    def field(self) -> str:
        """The field (or kind of body) the case is about, from its name."""
        name = self.case.name.removeprefix("stream ")
        return "schema body" if name.startswith("schema") else re.split(r"[=:]", name)[0][:50]


def _strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def judge(status: int, content_type: str, text: str) -> str | None:
    """None when the answer is one the server may give, else what is wrong with it."""
    if status >= 500:
        return f"{status} from the server"
    if 400 <= status < 500:
        try:
            error = _strict_json(text)["error"]
        except (ValueError, KeyError, TypeError):
            return f"{status} whose body is not an OpenAI error: {text[:200]!r}"
        if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
            return f"{status} whose error has the wrong shape: {text[:200]!r}"
        if (
            not isinstance(error["message"], str)
            or not error["message"]
            or not isinstance(error["type"], str)
        ):
            return f"{status} whose error has no message or type: {text[:200]!r}"
        return None
    if not 200 <= status < 300:
        return f"unexpected status {status}"
    if content_type.startswith("text/event-stream"):
        if not text.rstrip("\n").endswith("data: [DONE]"):
            return f"stream does not end with data: [DONE]: {text[-200:]!r}"
        for line in text.splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            try:
                event = _strict_json(line[6:])
            except ValueError:
                return f"stream event is not JSON: {line[:200]!r}"
            error = event.get("error") if isinstance(event, dict) else None
            if error is not None and error.get("type") == "server_error":
                return f"server-error event in a 200 stream: {error.get('message')}"
        return None
    try:
        answer = _strict_json(text)
    except ValueError:
        return f"{status} whose body is not JSON: {text[:200]!r}"
    if isinstance(answer, dict) and "choices" in answer and not answer["choices"]:
        return f"{status} without choices"
    return None


class Sender:
    """Sends cases CONCURRENCY at a time and judges each answer."""

    def __init__(self, base_url: str, timeout_s: float = TIMEOUT_S, max_hung: int = MAX_HUNG):
        self.base_url, self.timeout_s, self.max_hung = base_url, timeout_s, max_hung
        self.hung = 0
        self._lock = threading.Lock()

    def send_one(self, client: httpx.Client, case: Case, retried: bool = False) -> Outcome:
        if self.hung >= self.max_hung:
            return Outcome(
                case, problem=f"not sent: {self.hung} requests hung before it, the server is wedged"
            )
        content = case.content() if callable(case.content) else case.content
        start = time.monotonic()
        out = Outcome(case)
        try:
            with client.stream(
                case.method, self.base_url + case.path, content=content, headers=case.headers
            ) as r:
                chunks = []
                for chunk in r.iter_bytes():
                    chunks.append(chunk)
                    if time.monotonic() - start > self.timeout_s:
                        raise httpx.ReadTimeout("no end of the answer in time")
                out.status = r.status_code
                out.body = b"".join(chunks).decode("utf-8", "replace")
                out.problem = judge(r.status_code, r.headers.get("content-type", ""), out.body)
                if out.problem is None and case.expect is not None and r.status_code != case.expect:
                    out.problem = f"expected {case.expect}, got {r.status_code}"
        except httpx.TimeoutException:
            with self._lock:
                self.hung += 1
            out.problem = f"hung: no answer in {self.timeout_s:.0f} s"
        except httpx.HTTPError as e:
            if not retried:
                # A kept-alive connection that the server closed (after another request's
                # error) fails the request sent on it: that one is sent again on a new one.
                with httpx.Client(timeout=self.timeout_s) as fresh:
                    return self.send_one(fresh, case, retried=True)
            out.problem = f"transport error {type(e).__name__}: {e}"
        out.seconds = time.monotonic() - start
        return out

    def send(self, cases: list[Case]) -> list[Outcome]:
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        with (
            httpx.Client(timeout=self.timeout_s, limits=limits) as client,
            ThreadPoolExecutor(CONCURRENCY) as pool,
        ):
            return list(pool.map(lambda c: self.send_one(client, c), cases))


def summary(outcomes: list[Outcome], title: str = "fuzz") -> str:
    statuses = collections.Counter(o.status if o.status is not None else "none" for o in outcomes)
    failures = [o for o in outcomes if o.problem]
    hung = sum(1 for o in failures if o.problem.startswith("hung"))
    server_errors = sum(1 for o in outcomes if o.status is not None and o.status >= 500)
    lines = [
        f"{title}: {len(outcomes)} bodies sent, status codes "
        + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items(), key=lambda kv: str(kv[0]))),
        f"  5xx: {server_errors}, hung: {hung}, failures in all: {len(failures)}",
    ]
    by_cause: dict[str, list[Outcome]] = collections.defaultdict(list)
    for o in failures:
        by_cause[o.signature].append(o)
    for cause, group in sorted(by_cause.items(), key=lambda kv: -len(kv[1])):
        smallest = min(group, key=lambda o: len(o.case.shown(10**9)))
        where = list(dict.fromkeys(o.field for o in group))
        lines.append(f"  [{len(group)}x] {cause}")
        lines.append(f"      in: {', '.join(where[:12])}{' ...' if len(where) > 12 else ''}")
        lines.append(f"      e.g. {smallest.case.method} {smallest.case.path} {smallest.case.shown(200)}")
    return "\n".join(lines)


def log_exceptions(log: str) -> list[str]:
    """The last line of each traceback in a server log, in order."""
    return re.findall(r"^(?:[\w.]+(?:Error|Exception|Exit|Interrupt)\b.*)$", log, re.MULTILINE)


# ---- raw JSON ---------------------------------------------------------------------


class Raw(str):
    """JSON text put into a body as it is: NaN, 1e400, a literal a dict cannot hold."""


def dumps(body, ensure_ascii: bool = True) -> bytes:
    """JSON of `body` (NaN and Infinity as JavaScript spells them, surrogates as
    \\uXXXX escapes); Raw values are pasted in unquoted."""
    raws: list[str] = []

    def mark(value):
        if isinstance(value, Raw):
            raws.append(str(value))
            return f"\x00raw{len(raws) - 1}\x00"
        if isinstance(value, dict):
            return {k: mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mark(v) for v in value]
        return value

    text = json.dumps(mark(body), ensure_ascii=ensure_ascii)
    text = re.sub(r'"\\u0000raw(\d+)\\u0000"', lambda m: raws[int(m.group(1))], text)
    return text.encode("utf-8", "surrogatepass")


# ---- bodies from the OpenAPI schema -------------------------------------------------

_ANNOTATIONS = {
    "title",
    "description",
    "default",
    "examples",
    "deprecated",
    "readOnly",
    "writeOnly",
    "format",
    "contentMediaType",
    "contentEncoding",
    "discriminator",
    "$schema",
    "$id",
}

_NASTY_STRINGS = [
    "",
    "\x00",
    "\ud800",
    "\udfff",
    "\ud83d\ude00",
    "\ufeff",
    "\u202e",
    "²",
    "①",
    "-1",
    "49152",
    "<|im_end|>",
    "{{ 1/0 }}",
    "%s%n",
    "\r\n\r\n",
    "user",
    "system",
    "text",
]

# JSON text, surrogates included (json.dumps writes them as \\uXXXX escapes)
_strings = st.one_of(
    st.text(max_size=16),
    st.text(alphabet=st.characters(exclude_categories=()), max_size=8),
    st.sampled_from(_NASTY_STRINGS),
)
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _strings,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_strings, inner, max_size=3),
    max_leaves=8,
)


class SchemaStrategies:
    """Hypothesis strategies for the JSON Schema subset FastAPI publishes
    (OpenAPI 3.1: $ref, anyOf/oneOf/allOf, enum/const, types with their bounds)."""

    def __init__(self, openapi: dict):
        self.root = openapi

    def resolve(self, ref: str) -> dict:
        node = self.root
        for part in ref.removeprefix("#/").split("/"):
            node = node[part.replace("~1", "/").replace("~0", "~")]
        return node

    def request_body(self, path: str) -> dict:
        content = self.root["paths"][path]["post"]["requestBody"]["content"]
        schema = content["application/json"]["schema"]
        return self.resolve(schema["$ref"]) if "$ref" in schema else schema

    def build(self, schema: dict | bool) -> st.SearchStrategy:
        if schema is True or schema == {}:
            return _json_values
        if schema is False:
            return st.nothing()
        schema = {k: v for k, v in schema.items() if k not in _ANNOTATIONS}
        if "$ref" in schema:
            return self.build({**self.resolve(schema.pop("$ref")), **schema})
        if "allOf" in schema:
            merged = dict(schema)
            for part in merged.pop("allOf"):
                part = self.resolve(part["$ref"]) if "$ref" in part else part
                merged.update({k: v for k, v in part.items() if k not in _ANNOTATIONS})
            return self.build(merged)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                rest = {k: v for k, v in schema.items() if k != key}
                return st.one_of([self.build({**rest, **option}) for option in schema[key]])
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        kind = schema.get("type")
        if isinstance(kind, list):
            return st.one_of([self.build({**schema, "type": k}) for k in kind])
        builder = {
            "string": self._string,
            "integer": self._integer,
            "number": self._number,
            "boolean": lambda s: st.booleans(),
            "null": lambda s: st.none(),
            "array": self._array,
            "object": self._object,
        }.get(kind)
        if builder is None:
            raise NotImplementedError(f"JSON-schema without a type this fuzzer knows: {schema}")
        return builder(schema)

    @staticmethod
    def _check(schema: dict, known: set[str]) -> None:
        unknown = set(schema) - known - {"type"}
        if unknown:
            raise NotImplementedError(f"JSON-schema keywords this fuzzer does not know: {sorted(unknown)}")

    def _string(self, s: dict) -> st.SearchStrategy:
        self._check(s, {"minLength", "maxLength", "pattern"})
        lo, hi = s.get("minLength", 0), s.get("maxLength")
        if "pattern" in s:
            strat = st.from_regex(s["pattern"])
        else:
            strat = _strings | st.text(min_size=lo, max_size=hi if hi is not None else max(lo, 16))
        return strat.filter(lambda v: lo <= len(v) and (hi is None or len(v) <= hi))

    def _integer(self, s: dict) -> st.SearchStrategy:
        self._check(s, {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
        lo = math.ceil(s["minimum"]) if "minimum" in s else None
        hi = math.floor(s["maximum"]) if "maximum" in s else None
        if "exclusiveMinimum" in s:
            lo = max(lo if lo is not None else -math.inf, math.floor(s["exclusiveMinimum"]) + 1)
        if "exclusiveMaximum" in s:
            hi = min(hi if hi is not None else math.inf, math.ceil(s["exclusiveMaximum"]) - 1)
        strat = st.integers(min_value=lo, max_value=hi)
        if "multipleOf" in s:
            strat = strat.filter(lambda v: v % s["multipleOf"] == 0)
        return strat

    def _number(self, s: dict) -> st.SearchStrategy:
        self._check(s, {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
        lo = s.get("minimum", s.get("exclusiveMinimum"))
        hi = s.get("maximum", s.get("exclusiveMaximum"))
        floats = st.floats(
            min_value=lo,
            max_value=hi,
            exclude_min="exclusiveMinimum" in s,
            exclude_max="exclusiveMaximum" in s,
            allow_nan=False,
            allow_infinity=False,
        )
        ints = st.integers(
            min_value=None if lo is None else math.ceil(lo), max_value=None if hi is None else math.floor(hi)
        )
        return floats | ints.filter(
            lambda v: (
                (lo is None or v > lo or "exclusiveMinimum" not in s)
                and (hi is None or v < hi or "exclusiveMaximum" not in s)
            )
        )

    def _array(self, s: dict) -> st.SearchStrategy:
        self._check(s, {"items", "minItems", "maxItems", "uniqueItems", "prefixItems"})
        lo = s.get("minItems", 0)
        hi = s.get("maxItems", max(lo, 4))
        if "prefixItems" in s:
            return st.tuples(*[self.build(p) for p in s["prefixItems"]]).map(list)
        return st.lists(
            self.build(s.get("items", True)),
            min_size=lo,
            max_size=hi,
            unique_by=(lambda v: json.dumps(v, sort_keys=True)) if s.get("uniqueItems") else None,
        )

    def _object(self, s: dict) -> st.SearchStrategy:
        self._check(
            s,
            {
                "properties",
                "required",
                "additionalProperties",
                "propertyNames",
                "minProperties",
                "maxProperties",
            },
        )
        props = s.get("properties", {})
        required = set(s.get("required", ()))
        fixed = st.fixed_dictionaries(
            {k: self.build(v) for k, v in props.items() if k in required},
            optional={k: self.build(v) for k, v in props.items() if k not in required},
        )
        extra_schema = s.get("additionalProperties", True)
        if extra_schema is False:
            return fixed
        names = self.build(s["propertyNames"]) if "propertyNames" in s else _strings
        extras = st.dictionaries(
            names.filter(lambda k: k not in props), self.build(extra_schema), max_size=3 if props else 6
        )
        return st.tuples(fixed, extras).map(lambda fe: {**fe[1], **fe[0]})


def _cheap(body: dict, small: list[int]) -> dict:
    """The same body with a generation of at most 4 tokens."""
    body = dict(body)
    body["max_tokens"] = small[0]
    if body.get("max_completion_tokens") is not None:
        body["max_completion_tokens"] = small[1]
    return body


def body_strategy(openapi: dict, path: str) -> st.SearchStrategy:
    schemas = SchemaStrategies(openapi)
    schema = schemas.request_body(path)
    valid = st.tuples(schemas.build(schema), st.lists(st.integers(1, 4), min_size=2, max_size=2))
    valid = valid.map(lambda vs: _cheap(*vs))
    fields = sorted(schema.get("properties", {}))

    def mutate(args):  # one field, top-level or of the first message, swapped for any JSON value
        body, name, value, in_message, index = args
        body = copy.deepcopy(body)
        if in_message and isinstance(body.get("messages"), list) and body["messages"]:
            message = body["messages"][0]
            message[sorted(message)[index % len(message)]] = value
            return body
        body[name] = value
        if name in ("max_tokens", "max_completion_tokens"):
            if value is None:  # a null limit is valid, and without the other one unbounded
                body["max_completion_tokens" if name == "max_tokens" else "max_tokens"] = 2
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and 4 < value <= 10**5:
                body[name] = 4  # valid and long: cheap instead
        return body

    mutated = st.tuples(valid, st.sampled_from(fields), _json_values, st.booleans(), st.integers(0, 7)).map(
        mutate
    )
    return st.one_of(valid, valid, valid, mutated)


def schema_bodies(openapi: dict, path: str, examples: int, seed: int | None) -> list[dict]:
    """`examples` bodies for `path`, the same ones every time when seed is None."""
    bodies: list[dict] = []

    @settings(
        max_examples=examples,
        database=None,
        derandomize=seed is None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(body_strategy(openapi, path))
    def collect(body):
        bodies.append(body)

    if seed is not None:
        collect = hypothesis.seed(seed)(collect)
    collect()
    return bodies


def schema_cases(openapi: dict, examples: int, seed: int | None) -> list[Case]:
    cases = []
    for path in (CHAT, CMPL):
        for i, body in enumerate(schema_bodies(openapi, path, examples, seed)):
            cases.append(Case(f"schema #{i}", path, dumps(body)))
    return cases


# ---- the corpus of nasty bodies --------------------------------------------------------

MSG = [{"role": "user", "content": "hi"}]
CHAT_BODY = {"messages": MSG, "max_tokens": 2}
PARTS_BODY = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 2}
TOOL_BODY = {
    "messages": [
        MSG[0],
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "1"},
    ],
    "max_tokens": 2,
}
CMPL_BODY = {"prompt": "hi", "max_tokens": 2}

SURROGATES = ["\ud800", "\udfff", "x\udbff", "\udc00\ud800", "\ud83d\ude00"]
NON_FINITE = [Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e309"), Raw("-1e309")]
ODD_FLOATS = [Raw("-0.0"), Raw("5e-324"), Raw("1e-400")]
HUGE_INTS = [2**64, 2**63, -(2**63) - 1, -(2**64), 10**400, -(10**400), Raw("1e400"), -1, 0, 2**31]
WRONG_TYPES = [None, True, 1.5, "x", [], {}, [None], {"": None}]
SAMPLING_FLOATS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]
LOGIT_BIAS_KEYS = [
    "²",
    "①",
    "٣",
    "١٢",
    "-1",
    "-0",
    "0",
    "05",
    "+5",
    " 5",
    "5 ",
    "1e3",
    "0x10",
    str(VOCAB - 1),
    str(VOCAB),
    str(VOCAB + 1),
    str(2**64),
    "9" * 400,
    "\ud800",
]


def put(body: dict, where: tuple, value) -> dict:
    """A copy of `body` with the value at `where` (keys and list indices) replaced."""
    body = copy.deepcopy(body)
    node = body
    for step in where[:-1]:
        node = node[step]
    node[where[-1]] = value
    return body


def _name(where: tuple, value) -> str:
    shown = repr(value) if not isinstance(value, Raw) else str(value)
    return f"{'.'.join(map(str, where))}={shown[:40]}"


def corpus_cases(full: bool = False) -> list[Case]:
    """The nasty bodies; CI sends fewer values of each kind (and fewer streamed) than `full`."""
    cases: list[Case] = []
    surrogates = SURROGATES if full else ["\ud800", "\udc00\ud800"]
    non_finite = NON_FINITE if full else NON_FINITE[:4]
    odd_floats = ODD_FLOATS if full else ODD_FLOATS[1:2]
    huge_ints = HUGE_INTS if full else [2**64, -(2**63) - 1, 10**400, Raw("1e400"), -1]
    wrong_types = WRONG_TYPES if full else [None, True, "x", [], {}]

    def add(path, body, name=None, **kw):
        content = body if isinstance(body, bytes) else dumps(body)
        cases.append(Case(name or content[:60].decode("utf-8", "replace"), path, content, **kw))

    def fields(path, base, wheres, values, stream_too=False):  # stream_too: in the full corpus, or "always"
        for where in wheres:
            for value in values:
                add(path, put(base, where, value), _name(where, value))
                if stream_too == "always" or (stream_too and full):
                    add(path, put({**base, "stream": True}, where, value), "stream " + _name(where, value))

    # lone surrogates (and other nasty text) in every string field
    chat_strings = [
        ("model",),
        ("user",),
        ("stop",),
        ("messages", 0, "content"),
        ("messages", 0, "role"),
        ("messages", 0, "name"),
        ("messages", 0, "tool_call_id"),
    ]
    fields(CHAT, CHAT_BODY, chat_strings, surrogates)
    fields(CHAT, {**CHAT_BODY, "stop": ["x"]}, [("stop", 0)], surrogates)
    fields(
        CHAT,
        PARTS_BODY,
        [("messages", 0, "content", 0, "type"), ("messages", 0, "content", 0, "text")],
        surrogates,
    )
    fields(
        CHAT,
        TOOL_BODY,
        [
            ("messages", 1, "tool_calls", 0, "id"),
            ("messages", 1, "tool_calls", 0, "function", "name"),
            ("messages", 1, "tool_calls", 0, "function", "arguments"),
            ("messages", 2, "tool_call_id"),
            ("messages", 2, "name"),
        ],
        surrogates[:2],
    )
    fields(
        CHAT,
        {**CHAT_BODY, "tools": [{"type": "function", "function": {"name": "f"}}]},
        [("tools", 0, "function", "name"), ("tools", 0, "type")],
        surrogates[:2],
    )
    fields(
        CHAT,
        {**CHAT_BODY, "chat_template_kwargs": {"x": "y"}},
        [("chat_template_kwargs", "x")],
        surrogates[:2],
    )
    add(CHAT, {**CHAT_BODY, "chat_template_kwargs": {"\ud800": 1}}, "chat_template_kwargs key surrogate")
    fields(CMPL, CMPL_BODY, [("model",), ("user",), ("stop",), ("prompt",)], surrogates, stream_too=True)
    fields(CMPL, {**CMPL_BODY, "prompt": ["x"]}, [("prompt", 0)], surrogates)
    fields(
        CHAT,
        CHAT_BODY,
        [("messages", 0, "content"), ("stop",), ("model",)],
        ["\x00", "\ufeff", "\u202e", "<|im_end|>", "<|im_start|>system", "{{ 1/0 }}", "{% raw %}", "\r\n"],
    )
    fields(CMPL, CMPL_BODY, [("prompt",)], ["\x00", "<|im_end|>", "<|endoftext|>", " ", "\ufeff"])

    # NaN, Infinity and friends in every float field
    for path, base in ((CHAT, CHAT_BODY), (CMPL, CMPL_BODY)):
        fields(path, base, [(f,) for f in SAMPLING_FLOATS], non_finite)
        fields(path, {**base, "logit_bias": {"5": 1}}, [("logit_bias", "5")], non_finite + [2**64, 10**400])
    fields(CHAT, CHAT_BODY, [(f,) for f in SAMPLING_FLOATS], odd_floats, stream_too=True)

    # huge (and negative, and float-spelt) integers in every integer field
    # (seeds are below, with the engine's edges)
    for path, base, names in (
        (CHAT, CHAT_BODY, ["max_tokens", "max_completion_tokens", "top_k", "n", "top_logprobs"]),
        (CMPL, CMPL_BODY, ["max_tokens", "top_k", "n", "logprobs", "best_of"]),
    ):
        fields(path, base, [(f,) for f in names], huge_ints)
        fields(path, {**base, "stop_token_ids": [0]}, [("stop_token_ids", 0)], huge_ints + [VOCAB, VOCAB + 1])
    fields(CMPL, {**CMPL_BODY, "prompt": [1, 2]}, [("prompt", 0)], huge_ints + [VOCAB, VOCAB + 1, True, 1.0])
    fields(CMPL, {**CMPL_BODY, "prompt": [[1, 2]]}, [("prompt", 0, 0)], [-1, 2**64, 10**400, VOCAB])
    add(CMPL, {**CMPL_BODY, "prompt": [2**64, -1, VOCAB]}, "prompt several bad ids")
    add(CHAT, {"messages": MSG, "max_tokens": None, "max_completion_tokens": 2})
    add(CMPL, {"prompt": "hi", "max_tokens": None})

    # the engine's edges: top_k at and past the vocab, odd seeds, logit_bias keys; streamed too
    for path, base in ((CHAT, CHAT_BODY), (CMPL, CMPL_BODY)):
        fields(
            path, base, [("top_k",)], [VOCAB - 1, VOCAB, VOCAB + 1, 10**6, -2, -1, 0, 1], stream_too="always"
        )
        fields(
            path,
            base,
            [("seed",)],
            [-1, -2, 0, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**400, Raw("1e400"), 1.5],
        )
        fields(path, {**base, "stream": True}, [("seed",)], [-1, 2**64])
        for key in LOGIT_BIAS_KEYS:
            add(path, {**base, "logit_bias": {key: 1}}, f"logit_bias key {key[:20]!r}")
            if full:
                add(
                    path,
                    {**base, "stream": True, "logit_bias": {key: -100}},
                    f"stream logit_bias key {key[:20]!r}",
                )
        add(path, {**base, "logit_bias": {str(i): 100 for i in range(0, VOCAB, 7)}}, "logit_bias 7k keys")
        add(path, {**base, "logit_bias": {str(i): -100 for i in range(VOCAB)}}, "logit_bias every token -100")
        add(path, {**base, "stop_token_ids": list(range(VOCAB))}, "stop on every token")
        add(
            path,
            {
                **base,
                "top_k": 1,
                "top_p": 5e-324,
                "min_p": 1,
                "temperature": 100,
                "repetition_penalty": 10,
                "presence_penalty": 2,
                "frequency_penalty": -2,
            },
            "sampling extremes",
        )
        add(
            path,
            {**base, "temperature": 5e-324, "stream": True, "stream_options": {"include_usage": True}},
            "tiny temperature, streamed with usage",
        )

    # wrong types in every field
    for path, base in ((CHAT, CHAT_BODY), (CMPL, CMPL_BODY)):
        names = [
            "model",
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "logit_bias",
            "seed",
            "stop",
            "stop_token_ids",
            "ignore_eos",
            "n",
            "stream",
            "stream_options",
            "user",
        ]
        names += (
            ["messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "chat_template_kwargs"]
            if path == CHAT
            else ["prompt", "echo", "logprobs", "best_of"]
        )
        values = [v for v in wrong_types]
        for name in names:
            for value in values:
                body = put(base, (name,), value)
                if name == "max_tokens" and value is None:
                    body["max_completion_tokens"] = 2
                add(path, body, _name((name,), value))
        fields(
            path,
            {**base, "stream": True, "stream_options": {"include_usage": True}},
            [("stream_options", "include_usage")],
            wrong_types,
        )
    for where in [
        ("messages", 0),
        ("messages", 0, "role"),
        ("messages", 0, "content"),
        ("messages", 0, "name"),
        ("messages", 0, "tool_calls"),
        ("messages", 0, "tool_call_id"),
    ]:
        fields(CHAT, CHAT_BODY, [where], wrong_types + [[1], [{"function": None}], [{"type": "text"}]])
    fields(
        CHAT,
        PARTS_BODY,
        [
            ("messages", 0, "content", 0),
            ("messages", 0, "content", 0, "type"),
            ("messages", 0, "content", 0, "text"),
        ],
        wrong_types,
    )
    fields(
        CHAT,
        TOOL_BODY,
        [
            ("messages", 1, "tool_calls", 0, "function"),
            ("messages", 1, "tool_calls", 0, "function", "arguments"),
            ("messages", 1, "tool_calls", 0, "function", "name"),
        ],
        wrong_types + [{"a": Raw("NaN")}, [[[[1]]]]],
    )
    fields(
        CHAT,
        {**CHAT_BODY, "tools": [{"type": "function", "function": {"name": "f"}}]},
        [
            ("tools", 0),
            ("tools", 0, "function"),
            ("tools", 0, "function", "name"),
            ("tools", 0, "function", "parameters"),
        ],
        wrong_types + [Raw("NaN")],
    )
    for prompt in [
        [None],
        [[]],
        [[1.5]],
        [[[1]]],
        [["a"]],
        ["a", 1],
        [1, "a"],
        [{}],
        ["a", "b"],
        [[1], [2]],
        [True, False],
        [""],
        [[""]],
    ]:
        add(CMPL, {**CMPL_BODY, "prompt": prompt}, f"prompt={prompt!r}")
    add(CHAT, {"messages": [{"role": "assistant", "content": "hi"}], "max_tokens": 2}, "assistant only")
    add(CHAT, {"messages": [{"role": "tool", "content": "hi"}], "max_tokens": 2}, "tool only")
    add(CHAT, {"messages": [{"role": "system"}], "max_tokens": 2}, "system without content")
    add(CHAT, {"messages": [{"role": "user", "content": []}], "max_tokens": 2}, "empty parts")
    add(CHAT, {"messages": [{"role": "user", "content": ""}], "max_tokens": 2}, "empty content")

    # chat_template_kwargs, and a chat template from the client
    for kwargs in [
        {"tokenize": False},
        {"tokenize": True},
        {"tokenize": "no"},
        {"return_tensors": "np"},
        {"return_tensors": "pt"},
        {"return_tensors": "mlx"},
        {"return_tensors": "jax"},
        {"return_tensors": 1},
        {"return_dict": True},
        {"return_dict": True, "tokenize": False},
        {"return_dict": "yes"},
        {"add_generation_prompt": False},
        {"add_generation_prompt": "x"},
        {"continue_final_message": True},
        {"tools": "x"},
        {"tools": [1]},
        {"tools": [{}]},
        {"tools": [{"type": "function"}]},
        {"tools": None},
        {"documents": "x"},
        {"documents": [1]},
        {"messages": []},
        {"conversation": []},
        {"padding": True},
        {"padding": "max_length"},
        {"truncation": True, "max_length": 1},
        {"max_length": -1},
        {"tokenizer_kwargs": {"x": 1}},
        {"return_assistant_tokens_mask": True},
        {"enable_thinking": False},
        {"__class__": 1},
        {"": 1},
        {"chat_template": "{{ 1/0 }}"},
        {"chat_template": "{{ raise_exception('no') }}"},
        {"chat_template": ""},
        {"chat_template": 5},
        {"chat_template": None},
        {"chat_template": "{{ messages }}"},
        {"chat_template": "{{ x.y.z }}"},
        {"chat_template": "{% include 'other' %}"},
        {"chat_template": "{{ ''.__class__.__mro__ }}"},
        {"chat_template": "{{ messages[0]['content'] * 100000 }}"},
        # a template that runs for minutes (it must not be run, or not for long) and
        # one that makes a 10 MB prompt (10**9 would take the machine's memory)
        {"chat_template": "{% for i in range(100000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"},
        {"chat_template": "{{ 'x' * 10000000 }}"},
        {"chat_template": "tool_use"},
        {"chat_template": "{%"},
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "chat_template": "{{ tools[0].function.name }}",
        },
    ]:
        add(CHAT, {**CHAT_BODY, "chat_template_kwargs": kwargs}, f"chat_template_kwargs={kwargs!r}"[:90])
    add(CHAT, {**CHAT_BODY, "chat_template": "{{ 1/0 }}"}, "top-level chat_template")
    add(
        CHAT,
        {
            **CHAT_BODY,
            "chat_template": 5,
            "add_generation_prompt": "x",
            "tokenize": False,
            "return_tensors": "np",
        },
        "top-level template fields",
    )

    # deep nesting
    deep = 10_000
    arrays, objects = "[" * deep + "]" * deep, '{"a":' * deep + "1" + "}" * deep
    add(CHAT, arrays.encode(), "10k nested arrays as the body")
    add(CHAT, ("[" * 100_000 + "]" * 100_000).encode(), "100k nested arrays as the body")
    add(CHAT, objects.encode(), "10k nested objects as the body")
    add(CHAT, ("[" * 100_000).encode(), "100k unclosed arrays")
    for where in (
        "messages",
        "max_tokens",
        "stop",
        "logit_bias",
        "chat_template_kwargs",
        "tools",
        "stream_options",
        "model",
    ):
        for nested in (arrays, objects):
            add(
                CHAT,
                f'{{"messages":{json.dumps(MSG)},"max_tokens":2,"{where}":{nested}}}'.encode()
                if where != "messages"
                else f'{{"max_tokens":2,"messages":{nested}}}'.encode(),
                f"10k nested in {where}",
            )
    add(
        CHAT,
        f'{{"max_tokens":2,"messages":[{{"role":"user","content":{arrays}}}]}}'.encode(),
        "10k in content",
    )
    add(
        CHAT,
        f'{{"max_tokens":2,"messages":[{{"role":"user","content":"hi","tool_calls":[{objects}]}}]}}'.encode(),
        "10k in tool_calls",
    )
    add(CMPL, f'{{"max_tokens":2,"prompt":{arrays}}}'.encode(), "10k nested prompt")
    for depth in (100, 500, 900):  # deep, but within what a JSON parser takes
        nested = Raw('{"a":' * depth + "1" + "}" * depth)
        add(
            CHAT,
            {**CHAT_BODY, "tools": [{"type": "function", "function": {"name": "f", "parameters": nested}}]},
            f"tools {depth} deep",
        )
        add(CHAT, {**CHAT_BODY, "chat_template_kwargs": {"x": nested}}, f"chat_template_kwargs {depth} deep")
        # rendered into the prompt: 500 and 900 deep make prompts of thousands of tokens, whose
        # prefill took half the corpus's time; asking for the whole context refuses them once
        # they are parsed, validated, rendered and tokenized (100 deep is answered)
        deep_args = put(TOOL_BODY, ("messages", 1, "tool_calls", 0, "function", "arguments"), nested)
        if depth > 100:
            deep_args["max_tokens"] = 8192
        add(CHAT, deep_args, f"tool_call arguments {depth} deep")

    # huge strings, lists and maps (under the 1 MiB limit)
    big = 900_000
    for where in [
        ("messages", 0, "content"),
        ("model",),
        ("stop",),
        ("user",),
        ("messages", 0, "name"),
        ("messages", 0, "tool_call_id"),
    ]:
        add(CHAT, put(CHAT_BODY, where, "a" * big), f"{'.'.join(map(str, where))} of 900k")
    add(
        CHAT,
        dumps(put(CHAT_BODY, ("messages", 0, "content"), "😀" * 200_000), ensure_ascii=False),
        "200k emoji (raw UTF-8)",
    )
    add(
        CHAT,
        dumps(put(CHAT_BODY, ("messages", 0, "content"), "\u0301" * 200_000), ensure_ascii=False),
        "200k combining accents",
    )
    add(CHAT, {**CHAT_BODY, "stop": ["a" * 50_000] * 16}, "16 stop strings of 50k")
    add(CHAT, {**CHAT_BODY, "stop": ["a"] * 10_000}, "10k stop strings")
    add(CHAT, {**CHAT_BODY, "stop_token_ids": [0] * 100_000}, "100k stop_token_ids")
    add(CHAT, {"messages": [{"role": "user", "content": ""}] * 25_000, "max_tokens": 2}, "25k messages")
    add(
        CHAT,
        {**CHAT_BODY, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 30_000}]},
        "30k content parts",
    )
    add(CHAT, {**CHAT_BODY, "tools": [{"type": "function", "function": {"name": "f"}}] * 20_000}, "20k tools")
    add(CHAT, {**CHAT_BODY, **{f"x{i}": i for i in range(60_000)}}, "60k unknown fields")
    add(CMPL, {**CMPL_BODY, "prompt": "a" * big}, "prompt of 900k")
    add(CMPL, {**CMPL_BODY, "prompt": [1] * 150_000}, "prompt of 150k ids")
    add(CMPL, {**CMPL_BODY, "prompt": [1] * 8_189, "max_tokens": 4}, "prompt one past the context's edge")
    add(CMPL, {**CMPL_BODY, "prompt": [1] * 8_189, "max_tokens": 4, "stream": True}, "the same, streamed")
    add(CMPL, {**CMPL_BODY, "prompt": [VOCAB - 1] * 64, "echo": True}, "echo of the last token id")

    # duplicate keys
    msgs = json.dumps(MSG)
    for text in [
        f'{{"messages":{msgs},"max_tokens":2,"max_tokens":1000000}}',
        f'{{"messages":"x","messages":{msgs},"max_tokens":2}}',
        f'{{"messages":{msgs},"messages":"x","max_tokens":2}}',
        '{"messages":[{"role":"user","role":"wizard","content":"hi"}],"max_tokens":2}',
        '{"messages":[{"role":"wizard","role":"user","content":"hi","content":[1]}],"max_tokens":2}',
        f'{{"messages":{msgs},"max_tokens":2,"stream":false,"stream":true}}',
        f'{{"messages":{msgs},"max_tokens":2,"seed":1,"seed":-1}}',
        f'{{"messages":{msgs},"max_tokens":2,"top_k":1,"top_k":{VOCAB}}}',
        f'{{"messages":{msgs},"max_tokens":2,"logit_bias":{{"5":1,"5":1000}}}}',
        f'{{"messages":{msgs},"max_tokens":2,"logit_bias":{{"5":1,"²":1}}}}',
        "{" + '"a":1,' * 50_000 + f'"messages":{msgs},"max_tokens":2}}',
    ]:
        add(CHAT, text.encode(), "duplicate keys: " + text[:60])
    add(CMPL, b'{"prompt":"hi","prompt":[-1],"max_tokens":2}', "duplicate prompt")

    # content types, encodings, empty and broken bodies
    valid = dumps(CHAT_BODY)
    for content_type in [
        None,
        "",
        "text/plain",
        "application/x-www-form-urlencoded",
        "application/xml",
        "multipart/form-data; boundary=x",
        "application/json; charset=utf-16",
        "application/json; charset=latin-1",
        "application/json-patch+json",
        "*/*",
        "application/json, text/plain",
        b"application/json; charset=\xed\xa0\x80",
        "APPLICATION/JSON",
        "json",
    ]:
        add(
            CHAT,
            valid,
            f"content-type {content_type!r}",
            headers={} if content_type is None else {"content-type": content_type},
        )
    add(
        CHAT,
        b"messages=hi&max_tokens=2",
        "form body",
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    add(
        CHAT,
        b'--x\r\nContent-Disposition: form-data; name="messages"\r\n\r\nhi\r\n--x--\r\n',
        "multipart body",
        headers={"content-type": "multipart/form-data; boundary=x"},
    )
    add(CHAT, valid, "gzip claimed", headers={"content-type": "application/json", "content-encoding": "gzip"})
    add(
        CHAT,
        valid,
        "expect 100-continue",
        headers={"content-type": "application/json", "expect": "100-continue"},
    )
    for encoding in ("utf-16", "utf-16-be", "utf-32", "utf-8-sig"):
        add(CHAT, json.dumps(CHAT_BODY).encode(encoding), f"body in {encoding}")
    for raw in [
        b"",
        b" ",
        b"\n",
        b"null",
        b"true",
        b"0",
        b'""',
        b"[]",
        b"{}",
        b"{",
        b"}",
        b'{"messages": [',
        b"\x00",
        b"NaN",
        b"Infinity",
        b"-Infinity",
        b"1e400",
        b"9" * 5000,
        b'"\\ud800"',
        b"\xef\xbb\xbf{}",
        valid + b" trailing",
        valid + valid,
        valid + b"\x00",
        b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,}',
        b"{'messages': [], 'max_tokens': 2}",
        b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":02}',
        b'{"messages":[{"role":"user","content":"\\x41"}]}',
        b'{"messages":[{"role":"user","content":"\\u12"}]}',
    ]:
        add(CHAT, raw, f"raw {raw[:40]!r}")
        add(CMPL, raw, f"raw {raw[:40]!r}")
    # bytes that are not UTF-8: invalid, overlong, CESU-8 surrogates, truncated sequences
    for bad in [
        b"\xff",
        b"\xfe\xff",
        b"\xc0\xaf",
        b"\xed\xa0\x80",
        b"\xe9",
        b"\xe2\x82",
        b"\xf4\x90\x80\x80",
        b"\x80",
    ]:
        add(
            CHAT,
            b'{"messages":[{"role":"user","content":"' + bad + b'"}],"max_tokens":2}',
            f"content bytes {bad!r}",
        )
        add(CMPL, b'{"prompt":"' + bad + b'","max_tokens":2}', f"prompt bytes {bad!r}")
        add(
            CHAT,
            b'{"model":"' + bad + b'","messages":[{"role":"user","content":"hi"}],"max_tokens":2}',
            f"model bytes {bad!r}",
        )
        add(
            CHAT,
            b'{"' + bad + b'":1,"messages":[{"role":"user","content":"hi"}],"max_tokens":2}',
            f"key bytes {bad!r}",
        )

    # bodies at and over the limit: with a length, and chunked (no length) in pieces
    filler = b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"x":"'
    add(
        CHAT,
        filler + b"a" * (BODY_LIMIT + 1 - len(filler) - 2) + b'"}',
        "one byte over the limit",
        expect=413,
    )
    add(CHAT, filler + b"a" * (BODY_LIMIT - len(filler) - 2) + b'"}', "exactly the limit")

    def chunked(total: int, piece: int = 64 * 1024, body: bytes | None = None):
        def gen():
            if body is not None:
                for i in range(0, len(body), piece):
                    yield body[i : i + piece]
                return
            yield filler
            sent = len(filler)
            while sent < total:
                n = min(piece, total - sent)
                yield b"a" * n
                sent += n
            yield b'"}'

        return gen

    for total, name in [
        (BODY_LIMIT + 64 * 1024, "chunked just over the limit"),
        (2 * BODY_LIMIT, "chunked twice the limit"),
    ]:
        cases.append(Case(name, CHAT, chunked(total), expect=413))
        cases.append(Case(name, CMPL, chunked(total), expect=413))
    cases.append(Case("chunked, valid, 1-byte pieces", CHAT, chunked(0, 1, valid)))
    cases.append(
        Case("chunked, valid, streamed answer", CMPL, chunked(0, 7, dumps({**CMPL_BODY, "stream": True})))
    )

    # other methods and paths of the same routes
    for method in ("GET", "PUT", "DELETE", "PATCH"):
        cases.append(Case(f"{method} chat", CHAT, valid, method=method))
    for path in (
        "/v1/models/%ff",
        "/v1/models/%ED%A0%80",
        "/v1/models/" + "a" * 10_000,
        "/v1/models/..%2F..",
        "/v1//completions",
        "/v1/completions?stream=true",
    ):
        cases.append(
            Case(
                f"path {path[:40]}",
                path,
                valid if "completions" in path else b"",
                method="POST" if "completions" in path else "GET",
            )
        )
    return cases


# ---- what must not change ---------------------------------------------------------------

GREEDY = {
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "temperature": 0,
    "max_tokens": 16,
}
GREEDY_TEXT = {"prompt": "The capital of France is", "temperature": 0, "max_tokens": 16}


def greedy_answers(base_url: str) -> tuple[str, str]:
    chat = httpx.post(base_url + CHAT, json=GREEDY, timeout=TIMEOUT_S)
    text = httpx.post(base_url + CMPL, json=GREEDY_TEXT, timeout=TIMEOUT_S)
    assert chat.status_code == 200 and text.status_code == 200, (chat.text, text.text)
    return chat.json()["choices"][0]["message"]["content"], text.json()["choices"][0]["text"]


def normal_cases(count: int = 20) -> list[Case]:
    cases = []
    for i in range(count):
        stream = i % 4 == 3
        if i % 2:
            body = {
                "prompt": f"Count to {i}:",
                "max_tokens": 8,
                "temperature": 0.7,
                "seed": i,
                "stream": stream,
            }
            cases.append(Case(f"normal {i}", CMPL, dumps(body)))
        else:
            body = {"messages": [{"role": "user", "content": f"Say {i}."}], "max_tokens": 8, "stream": stream}
            cases.append(Case(f"normal {i}", CHAT, dumps(body)))
    return cases


def check_unchanged(base_url: str, before: tuple[str, str]) -> list[str]:
    """What is wrong with the server after a fuzz run: [] when it is as it was."""
    problems = []
    try:
        after = greedy_answers(base_url)
        if after != before:
            problems.append(f"the greedy answers changed: {before!r} before, {after!r} after")
    except (AssertionError, httpx.HTTPError) as e:
        problems.append(f"the greedy requests failed after the run: {type(e).__name__}: {str(e)[:300]}")
    outcomes = Sender(base_url).send(normal_cases())
    for o in outcomes:
        if o.problem or o.status != 200:
            problems.append(f"normal request {o.case.name} failed: {o.status} {o.problem or o.body[:200]}")
    return problems


# ---- the tests ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_server(model_path, tmp_path_factory):
    from conftest import start_server, stop_server

    folder = tmp_path_factory.mktemp("fuzz")
    # Blocks of 16 tokens: the bodies' shared template start is a cache hit (more of the
    # cache under bad input, and half the prefill); a body without max_tokens writes 16.
    srv = start_server(
        model_path, folder / "server.log", "--no-ssd-cache", "--max-body-bytes", str(BODY_LIMIT),
        "--cache-block-size", "16", "--default-max-tokens", "16",
    )
    srv.before = greedy_answers(srv.base_url)
    yield srv
    stop_server(srv)


def _fail_with(outcomes: list[Outcome], title: str, server) -> None:
    text = summary(outcomes, title)
    print("\n" + text)
    if any(o.problem for o in outcomes):
        tracebacks = list(dict.fromkeys(log_exceptions(server.log())))
        pytest.fail(
            text + "\n  server log, last line of each traceback:\n    " + "\n    ".join(tracebacks[:40]),
            pytrace=False,
        )


def test_corpus_of_nasty_bodies(fuzz_server):
    outcomes = Sender(fuzz_server.base_url).send(corpus_cases(full=long_run()))
    _fail_with(outcomes, "nasty corpus", fuzz_server)


def test_bodies_from_the_openapi_schema(fuzz_server):
    openapi = httpx.get(fuzz_server.base_url + "/openapi.json").json()
    seed = fuzz_seed()
    cases = schema_cases(openapi, fuzz_examples(), seed)
    outcomes = Sender(fuzz_server.base_url).send(cases)
    _fail_with(outcomes, f"schema bodies ({'derandomized' if seed is None else f'seed {seed}'})", fuzz_server)


def test_server_answers_as_before_after_the_fuzzing(fuzz_server):
    problems = check_unchanged(fuzz_server.base_url, fuzz_server.before)
    assert not problems, "\n".join(problems)


# ---- the figures, as a script ------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description="Fuzz a tierlm server and print the figures.")
    parser.add_argument("--examples", type=int, default=DEFAULT_EXAMPLES, help="schema bodies per route")
    parser.add_argument(
        "--seed", type=int, default=None, help="random bodies from this seed (default: derandomized)"
    )
    parser.add_argument("--url", help="fuzz this running server (its --max-body-bytes should be 1 MiB)")
    parser.add_argument("--log", type=Path, help="with --url: its log, for --replay")
    parser.add_argument(
        "--replay",
        action="store_true",
        help="send one body of each distinct failure again, alone, and show its traceback",
    )
    parser.add_argument("--full", action="store_true", help="the whole corpus (CI sends a part of it)")
    parser.add_argument("--no-corpus", action="store_true")
    parser.add_argument("--no-schema", action="store_true")
    args = parser.parse_args()

    server = None
    if args.url:
        base_url, log_path = args.url.rstrip("/"), args.log
    else:
        sys.path.insert(0, str(Path(__file__).parent))
        from conftest import MODEL_DIR, start_server

        from tierlm.models.default_model import ensure_default_model

        folder = Path(tempfile.mkdtemp(prefix="tierlm-fuzz-"))
        server = start_server(
            ensure_default_model(MODEL_DIR),
            folder / "server.log",
            "--no-ssd-cache",
            "--max-body-bytes",
            str(BODY_LIMIT),
        )
        base_url, log_path = server.base_url, server.log_path
        print(f"server log: {log_path}")
    try:
        before = greedy_answers(base_url)
        cases = [] if args.no_corpus else corpus_cases(full=args.full)
        if not args.no_schema:
            cases += schema_cases(httpx.get(base_url + "/openapi.json").json(), args.examples, args.seed)
        start = time.monotonic()
        outcomes = Sender(base_url).send(cases)
        took = time.monotonic() - start
        print(summary(outcomes, f"fuzz ({len(cases)} bodies in {took:.0f} s)"))
        problems = check_unchanged(base_url, before)
        print(
            "after the run: "
            + ("answers as before, 20 normal requests succeed" if not problems else "\n  ".join(problems))
        )
        if args.replay:
            replay(base_url, log_path, [o for o in outcomes if o.problem])
        return 1 if problems or any(o.problem for o in outcomes) else 0
    finally:
        if server is not None:
            server.stop()


def replay(base_url: str, log_path: Path | None, failures: list[Outcome]) -> None:
    """One body of each distinct failure sent again, alone: its answer and the
    last line of the traceback it leaves in the log."""
    by_cause: dict[tuple[str, str], list[Outcome]] = collections.defaultdict(list)
    for o in failures:
        if not o.problem.startswith("not sent"):
            by_cause[o.signature, o.field].append(o)
    sender = Sender(base_url, max_hung=10**9)
    print("\nreplay, one body of each distinct failure, alone:")
    with httpx.Client(timeout=TIMEOUT_S) as client:
        for cause, group in by_cause.items():
            smallest = min(group, key=lambda o: len(o.case.shown(10**9)))
            seen = len(log_path.read_text(errors="replace")) if log_path else 0
            again = sender.send_one(client, smallest.case)
            time.sleep(0.5)
            new = log_exceptions(log_path.read_text(errors="replace")[seen:]) if log_path else []
            print(f"- {cause[0]} | {cause[1]}  [{len(group)}x]")
            print(f"  {smallest.case.method} {smallest.case.path} {smallest.case.shown(300)}")
            print(f"  -> {again.status} {again.problem}\n  log: {new[-1] if new else '-'}")


if __name__ == "__main__":
    sys.exit(main())
