"""Seeded, download-free benchmark workloads: shared-prefix, multi-turn chat, no-sharing control.

A trace is a list of *sessions*; a session is one or more chat turns against the same
conversation. Independent requests (shared-prefix, control) are one-turn sessions. Session
starts are open-loop Poisson arrivals; within a multi-turn session turn k+1 is sent a think time
after turn k's reply has fully arrived (it must contain that reply), like a user would.

Text is built from pseudo-words of 3-6 lowercase letters, each exactly one token of the simulated
engine's tokenizer (`sim.tokenizer`), so `*_tokens` parameters are token counts the engine sees
(plus the chat template's few tokens per message). The same (parameters, seed) give the same trace
in every process; different seeds give disjoint texts (no accidental sharing across trials).

- `shared_prefix`: SGLang's generated-shared-prefix shape — G groups, each with a long system
  prompt shared by its prompts, a short distinct question per prompt; groups interleaved at random.
- `multi_turn`: C conversations of T turns; every turn resends the whole history (a unique
  per-conversation context, every earlier user turn and every earlier assistant reply).
- `no_sharing`: unique prompts, nothing reusable across requests (the control).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


@dataclass(frozen=True, slots=True)
class Turn:
    user: str
    max_tokens: int
    gap_s: float = 0.0  # think time after the previous turn's reply (0 for the first turn)


@dataclass(frozen=True, slots=True)
class Session:
    sid: str
    start_s: float  # offset from the trace start
    system: str | None
    turns: tuple[Turn, ...]
    group: int | None = None  # shared-prefix group (for per-group analysis)


@dataclass(frozen=True)
class Trace:
    workload: str
    seed: int
    rate: float  # offered requests/s (all turns counted)
    duration_s: float  # arrival window of session starts
    sessions: tuple[Session, ...]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def describe(self) -> dict[str, Any]:
        return {"workload": self.workload, "seed": self.seed, "rate": self.rate, "duration_s": self.duration_s,
                "sessions": len(self.sessions), "requests": self.num_requests, **self.params}


def build_messages(session: Session, turn: int, replies: list[str]) -> list[dict[str, str]]:
    """The chat `messages` of `session`'s turn `turn` (0-based): system prompt, then every earlier
    user turn followed by its assistant reply (`replies[j]`, exactly as received), then this turn."""
    if len(replies) < turn:
        raise ValueError(f"turn {turn} needs {turn} earlier replies, got {len(replies)}")
    msgs: list[dict[str, str]] = []
    if session.system is not None:
        msgs.append({"role": "system", "content": session.system})
    for j in range(turn):
        msgs.append({"role": "user", "content": session.turns[j].user})
        msgs.append({"role": "assistant", "content": replies[j]})
    msgs.append({"role": "user", "content": session.turns[turn].user})
    return msgs


class _Text:
    """Seeded pseudo-word text; each word is one token of the sim tokenizer (≤ 6 letters)."""

    def __init__(self, rng: random.Random, vocab_size: int = 4096) -> None:
        self.rng = rng
        words: set[str] = set()
        while len(words) < vocab_size:
            n = rng.randint(3, 6)
            # alternate consonant/vowel: pronounceable, and never a digit or punctuation
            w = "".join(rng.choice(_CONSONANTS if i % 2 == 0 else _VOWELS) for i in range(n))
            words.add(w)
        self.words = sorted(words)

    def words_text(self, n: int, prefix: str = "") -> str:
        body = " ".join(self.rng.choices(self.words, k=n))
        return f"{prefix} {body}" if prefix else body


def _poisson_starts(rng: random.Random, rate: float, n: int) -> list[float]:
    t = 0.0
    out = []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _count(rate: float, duration_s: float, per_session: int = 1) -> int:
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration_s must be > 0")
    return max(1, round(rate * duration_s / per_session))


def shared_prefix(seed: int, rate: float, duration_s: float, *, groups: int = 8, system_tokens: int = 1536,
                  question_tokens: int = 96, output_tokens: int = 24) -> Trace:
    """G groups × P prompts (P = enough for rate × duration requests), shuffled, Poisson arrivals."""
    if groups < 1:
        raise ValueError("groups must be ≥ 1")
    rng = random.Random(f"shared_prefix/{seed}")
    text = _Text(rng)
    n = _count(rate, duration_s)
    per_group = math.ceil(n / groups)
    systems = [text.words_text(system_tokens, prefix=f"group {g} {seed}") for g in range(groups)]
    slots = [(g, i) for g in range(groups) for i in range(per_group)]
    rng.shuffle(slots)
    slots = slots[:n]
    starts = _poisson_starts(rng, rate, n)
    sessions = tuple(
        Session(f"sp{seed}-g{g}-p{i}", t, systems[g], (Turn(text.words_text(question_tokens), output_tokens),), g)
        for (g, i), t in zip(slots, starts)
    )
    return Trace("shared_prefix", seed, rate, duration_s, sessions,
                 {"groups": groups, "prompts_per_group": per_group, "system_tokens": system_tokens,
                  "question_tokens": question_tokens, "output_tokens": output_tokens})


def multi_turn(seed: int, rate: float, duration_s: float, *, turns: int = 4, context_tokens: int = 1024,
               user_tokens: int = 64, output_tokens: int = 32, think_s: float = 0.3) -> Trace:
    """Conversations start as a Poisson process at rate/turns; each has a unique context (system
    prompt) and `turns` user turns; think times between turns are exponential (mean think_s)."""
    if turns < 1:
        raise ValueError("turns must be ≥ 1")
    rng = random.Random(f"multi_turn/{seed}")
    text = _Text(rng)
    n = _count(rate, duration_s, turns)
    starts = _poisson_starts(rng, rate / turns, n)
    sessions = []
    for c, t in enumerate(starts):
        system = text.words_text(context_tokens, prefix=f"conversation {c} {seed}")
        ts = tuple(
            Turn(text.words_text(user_tokens, prefix=f"turn {k}"), output_tokens,
                 0.0 if k == 0 else rng.expovariate(1.0 / think_s) if think_s > 0 else 0.0)
            for k in range(turns)
        )
        sessions.append(Session(f"mt{seed}-c{c}", t, system, ts))
    return Trace("multi_turn", seed, rate, duration_s, tuple(sessions),
                 {"turns": turns, "context_tokens": context_tokens, "user_tokens": user_tokens,
                  "output_tokens": output_tokens, "think_s": think_s})


def no_sharing(seed: int, rate: float, duration_s: float, *, prompt_tokens: int = 1536,
               output_tokens: int = 32) -> Trace:
    """Unique prompts (no system prompt, nothing in common but the template's first tokens)."""
    rng = random.Random(f"no_sharing/{seed}")
    text = _Text(rng)
    n = _count(rate, duration_s)
    starts = _poisson_starts(rng, rate, n)
    sessions = tuple(
        Session(f"ns{seed}-{i}", t, None, (Turn(text.words_text(prompt_tokens, prefix=f"{seed} {i}"), output_tokens),))
        for i, t in enumerate(starts)
    )
    return Trace("no_sharing", seed, rate, duration_s, sessions,
                 {"prompt_tokens": prompt_tokens, "output_tokens": output_tokens})


WORKLOADS: dict[str, Callable[..., Trace]] = {
    "shared_prefix": shared_prefix,
    "multi_turn": multi_turn,
    "no_sharing": no_sharing,
}


def make_trace(workload: str, seed: int, rate: float, duration_s: float, **params: Any) -> Trace:
    try:
        gen = WORKLOADS[workload]
    except KeyError:
        raise ValueError(f"unknown workload {workload!r}; expected one of {sorted(WORKLOADS)}") from None
    return gen(seed, rate, duration_s, **params)


def trace_digest(trace: Trace) -> str:
    """A short stable fingerprint of a trace's content (for the results file)."""
    import hashlib

    h = hashlib.blake2b(digest_size=8)
    for s in trace.sessions:
        h.update(repr(asdict(s)).encode())
    return h.hexdigest()
