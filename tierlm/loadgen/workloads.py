"""Workloads: the same deterministic list of requests for every server.

A workload is a list of sessions; a session is a list of requests sent one after
another (a conversation), and sessions run side by side. `random` and
`shared-prefix` have one request per session (`chat`: random's prompts as chat
messages); `multi-turn` has one per turn.
Prompts are random token soup from the model's own tokenizer, so their lengths
in tokens are what was asked for, give or take a token at the edges.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class BenchRequest:
    max_tokens: int
    prompt: str | None = None  # /v1/completions
    messages: list[dict] | None = None  # /v1/chat/completions
    input_tokens: int = 0  # as built here, before any chat template
    extra: dict = field(default_factory=dict)  # more body fields (tools, tierlm's own)


@dataclass
class Workload:
    name: str
    sessions: list[list[BenchRequest]]
    params: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(s) for s in self.sessions)


class TokenSoup:
    """Text of an exact token length, made of random ordinary tokens."""

    def __init__(self, tokenizer_path: str | Path, seed: int = 0):
        from tokenizers import Tokenizer

        path = Path(tokenizer_path).expanduser()
        self.tok = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
        special = set(self.tok.get_added_tokens_decoder())
        self.ids = [i for i in range(self.tok.get_vocab_size()) if i not in special]
        self.rng = random.Random(seed)

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def text(self, n: int) -> str:
        if n <= 0:
            return ""
        ids = self.rng.choices(self.ids, k=n + n // 8 + 4)
        text = self.tok.decode(ids)
        for _ in range(4):  # re-encoding merges some tokens; top up and trim
            enc = self.tok.encode(text, add_special_tokens=False).ids
            if len(enc) >= n:
                return self.tok.decode(enc[:n])
            text += self.tok.decode(self.rng.choices(self.ids, k=n - len(enc) + 4))
        return text


def random_workload(
    soup: TokenSoup, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0
) -> Workload:
    """Independent prompts; lengths uniform in [len * (1 - range_ratio), len]."""

    def length(n: int) -> int:
        return max(1, soup.rng.randint(int(n * (1 - range_ratio)), n)) if range_ratio else n

    sessions = []
    for _ in range(num_prompts):
        n_in = length(input_len)
        sessions.append([BenchRequest(length(output_len), prompt=soup.text(n_in), input_tokens=n_in)])
    params = {
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "range_ratio": range_ratio,
    }
    return Workload("random", sessions, params)


# A chat prompt's first soup tokens, as a system message of their own: every
# prompt then differs from the chat template's first few tokens on (no default
# system prompt shared), so no server reuses one prompt's KV for another's.
CHAT_OPENING = 16


def chat_workload(
    soup: TokenSoup, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0
) -> Workload:
    """`random_workload`'s prompts as chat messages (/v1/chat/completions, the
    server's chat template): a system message of CHAT_OPENING soup tokens, then
    the user message with the rest, `input_len` soup tokens in all. The template
    adds its own tokens (the servers' usage counts them)."""

    def length(n: int) -> int:
        return max(1, soup.rng.randint(int(n * (1 - range_ratio)), n)) if range_ratio else n

    sessions = []
    for _ in range(num_prompts):
        n_in = length(input_len)
        opening = min(CHAT_OPENING, n_in // 2)
        messages = [{"role": "system", "content": soup.text(opening)},
                    {"role": "user", "content": soup.text(n_in - opening)}]
        sessions.append([BenchRequest(length(output_len), messages=messages, input_tokens=n_in)])
    params = {
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "range_ratio": range_ratio,
        "system_len": CHAT_OPENING,
    }
    return Workload("chat", sessions, params)


def shared_prefix_workload(
    soup: TokenSoup,
    num_prefixes: int,
    prefix_len: int,
    suffixes_per_prefix: int,
    suffix_len: int,
    output_len: int,
) -> Workload:
    """`num_prefixes` long prefixes (a system prompt, a document), each followed by
    many short distinct suffixes; requests are shuffled."""
    sessions = []
    for _ in range(num_prefixes):
        prefix = soup.text(prefix_len)
        for _ in range(suffixes_per_prefix):
            prompt = prefix + soup.text(suffix_len)
            sessions.append([BenchRequest(output_len, prompt=prompt, input_tokens=prefix_len + suffix_len)])
    soup.rng.shuffle(sessions)
    params = {
        "num_prefixes": num_prefixes,
        "prefix_len": prefix_len,
        "suffixes_per_prefix": suffixes_per_prefix,
        "suffix_len": suffix_len,
        "output_len": output_len,
    }
    return Workload("shared-prefix", sessions, params)


def multi_turn_workload(
    soup: TokenSoup,
    num_conversations: int,
    turns: int,
    system_len: int,
    user_len: int,
    output_len: int,
) -> Workload:
    """Conversations that grow turn by turn, as a coding agent's do: every turn
    resends the whole history plus a new user message. The assistant turns in the
    history are fixed text (not what the server said), so every server sees the
    same prompts."""
    sessions = []
    for _ in range(num_conversations):
        history = [{"role": "system", "content": soup.text(system_len)}]
        n_tokens, session = system_len, []
        for _ in range(turns):
            history = history + [{"role": "user", "content": soup.text(user_len)}]
            n_tokens += user_len
            session.append(BenchRequest(output_len, messages=list(history), input_tokens=n_tokens))
            history = history + [{"role": "assistant", "content": soup.text(output_len)}]
            n_tokens += output_len
        sessions.append(session)
    params = {
        "num_conversations": num_conversations,
        "turns": turns,
        "system_len": system_len,
        "user_len": user_len,
        "output_len": output_len,
    }
    return Workload("multi-turn", sessions, params)
