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
- `multi_lora`: one long system prompt shared by every request, each request for one of A LoRA
  adapters (`model: "<base>:<adapter>"`, SGLang's form) drawn with Zipf popularity — the engine
  caches the system prompt once per adapter (its radix cache keeps adapters apart), so text
  alone says every request shares it, and only the adapter says where it is cached.
- `mooncake`: a replay of Mooncake's FAST'25 conversation trace (real traffic from Kimi's service,
  a copy in `bench/data/mooncake/`): arrivals, input and output lengths and the prefix-sharing structure
  from the trace, with time compressed and lengths scaled to fit the fleet (see `mooncake`).
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Sequence

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
    model: str = "default"  # the OpenAI `model` its requests name


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


LORA_BASE = "kvroute-sim"  # the bench fleet's model (bench.targets): requests name "<it>:<adapter>"


def lora_names(adapters: int) -> list[str]:
    return [f"lora{k}" for k in range(adapters)]


def multi_lora(seed: int, rate: float, duration_s: float, *, adapters: int = 8, zipf_s: float = 1.0,
               system_tokens: int = 2048, question_tokens: int = 128, output_tokens: int = 12) -> Trace:
    """One system prompt for all, a distinct question each; adapter k (0-based) drawn with weight
    1/(k+1)^zipf_s; Poisson arrivals. `Session.group` is the adapter's index."""
    if adapters < 1:
        raise ValueError("adapters must be ≥ 1")
    rng = random.Random(f"multi_lora/{seed}")
    text = _Text(rng)
    n = _count(rate, duration_s)
    system = text.words_text(system_tokens, prefix=f"shared {seed}")
    names = lora_names(adapters)
    weights = [1.0 / (k + 1) ** zipf_s for k in range(adapters)]
    picks = rng.choices(range(adapters), weights=weights, k=n)
    starts = _poisson_starts(rng, rate, n)
    sessions = tuple(
        Session(f"ml{seed}-{i}", t, system, (Turn(text.words_text(question_tokens, prefix=f"{i}"), output_tokens),),
                k, model=f"{LORA_BASE}:{names[k]}")
        for i, (k, t) in enumerate(zip(picks, starts))
    )
    return Trace("multi_lora", seed, rate, duration_s, sessions,
                 {"adapters": adapters, "zipf_s": zipf_s, "system_tokens": system_tokens,
                  "question_tokens": question_tokens, "output_tokens": output_tokens})


MOONCAKE_BLOCK = 512  # tokens per hash id in the trace


def mooncake_path() -> str:
    """Where the trace lives: $KVROUTE_MOONCAKE_TRACE, else the copy in `bench/data/mooncake/`
    (Apache-2.0, its licence and README beside it), so a checkout anywhere replays it."""
    env = os.environ.get("KVROUTE_MOONCAKE_TRACE")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(here, "data", "mooncake", "conversation_trace.jsonl")


def load_mooncake(path: str | None = None) -> list[dict[str, Any]]:
    """The trace's rows in file order (timestamp ms, input_length, output_length, hash_ids)."""
    p = path or mooncake_path()
    try:
        with open(p, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        raise FileNotFoundError(f"Mooncake trace not found at {p}; set KVROUTE_MOONCAKE_TRACE") from None
    for i, r in enumerate(rows):
        n_blocks = -(-r["input_length"] // MOONCAKE_BLOCK)
        if len(r["hash_ids"]) != n_blocks:
            raise ValueError(f"{p}:{i + 1}: {len(r['hash_ids'])} hash ids for {r['input_length']} tokens "
                             f"(expected {n_blocks} blocks of {MOONCAKE_BLOCK})")
    return rows


class BlockText:
    """Token-exact text for trace blocks: block `h` is always the same `block_tokens` pieces (each one
    sim-tokenizer token), its first six pieces spell (h, seed) in 3-digit groups, so different ids
    differ within their first three tokens and different seeds share nothing."""

    def __init__(self, seed: int, block_tokens: int, vocab: list[str]) -> None:
        if block_tokens < 6:
            raise ValueError("block_tokens must be ≥ 6 (the block's id and seed take six tokens)")
        if not 0 <= seed < 10**9:
            raise ValueError("seed must be in 0..999999999 for trace blocks")
        self.seed, self.block_tokens, self.vocab = seed, block_tokens, vocab
        self._cache: dict[int, list[str]] = {}

    def pieces(self, h: int) -> list[str]:
        got = self._cache.get(h)
        if got is None:
            if not 0 <= h < 10**9:
                raise ValueError(f"hash id {h} out of range 0..999999999")
            digits = f"{h:09d}{self.seed:09d}"
            rng = random.Random(f"mooncake/{self.seed}/{h}")
            got = [digits[i:i + 3] for i in range(0, 18, 3)]
            got += rng.choices(self.vocab, k=self.block_tokens - 6)
            self._cache[h] = got
        return got

    def prompt(self, hash_ids: list[int], tokens: int) -> str:
        """`tokens` tokens: the blocks of `hash_ids` in order, the last one cut to what remains."""
        out: list[str] = []
        for h in hash_ids:
            out.extend(self.pieces(h)[: tokens - len(out)])
        return " ".join(out)


def mooncake(seed: int, rate: float, duration_s: float, *, length_scale: float = 0.125,
             output_scale: float | None = None, start_s: float = 0.0, path: str | None = None,
             min_output_tokens: int = 1) -> Trace:
    """Replay of the Mooncake conversation trace, one single-turn session per row.

    - Slice: the rows from `start_s` (trace seconds) on, as many as `rate` × `duration_s`.
    - Time: compressed by one factor so the slice's mean rate is `rate` (the trace's own
      inter-arrival pattern, bursts included, is kept).
    - Lengths: every 512-token block becomes round(512·length_scale) tokens, input lengths are
      scaled by the same factor (the last block holds what remains), outputs by `output_scale`
      (default: `length_scale`, which keeps the trace's prefill:decode balance) with at least
      `min_output_tokens`. Equal hash ids give identical token blocks, different ids differ at
      their first token: who shares which prefix with whom is the trace's.
    - `seed` only changes the text (disjoint across seeds), never arrivals or lengths.
    """
    if not 0 < length_scale <= 1:
        raise ValueError("length_scale must be in (0, 1]")
    oscale = length_scale if output_scale is None else output_scale
    if oscale <= 0:
        raise ValueError("output_scale must be > 0")
    rows = load_mooncake(path)
    first = next((i for i, r in enumerate(rows) if r["timestamp"] >= start_s * 1000), None)
    n = _count(rate, duration_s)
    if first is None or first + n > len(rows):
        raise ValueError(f"the trace has {len(rows) - (first or len(rows))} rows from {start_s:g} s, "
                         f"{n} needed for {rate:g} req/s × {duration_s:g} s")
    sl = rows[first:first + n]
    t0 = sl[0]["timestamp"] / 1000
    span = max(1e-9, sl[-1]["timestamp"] / 1000 - t0)
    compress = span / (duration_s * (n - 1) / n) if n > 1 else 1.0
    block_tokens = max(6, round(MOONCAKE_BLOCK * length_scale))
    text = BlockText(seed, block_tokens, _Text(random.Random(f"mooncake-vocab/{seed}")).words)
    sessions = []
    for i, r in enumerate(sl):
        tokens = max(1, math.ceil(r["input_length"] * block_tokens / MOONCAKE_BLOCK))
        tokens = min(tokens, block_tokens * len(r["hash_ids"]))
        out = max(min_output_tokens, round(r["output_length"] * oscale))
        sessions.append(Session(f"mc{seed}-{first + i}", (r["timestamp"] / 1000 - t0) / compress, None,
                                (Turn(text.prompt(r["hash_ids"], tokens), out),)))
    return Trace("mooncake", seed, rate, duration_s, tuple(sessions),
                 {"rows": f"{first}..{first + n - 1}", "trace_start_s": round(t0, 3),
                  "time_compression": round(compress, 3), "length_scale": length_scale,
                  "block_tokens": block_tokens, "output_scale": oscale})


WORKLOADS: dict[str, Callable[..., Trace]] = {
    "shared_prefix": shared_prefix,
    "multi_turn": multi_turn,
    "no_sharing": no_sharing,
    "mooncake": mooncake,
    "multi_lora": multi_lora,
}


def make_trace(workload: str, seed: int, rate: float, duration_s: float, **params: Any) -> Trace:
    try:
        gen = WORKLOADS[workload]
    except KeyError:
        raise ValueError(f"unknown workload {workload!r}; expected one of {sorted(WORKLOADS)}") from None
    return gen(seed, rate, duration_s, **params)


def with_models(trace: Trace, models: Sequence[str]) -> Trace:
    """The same trace for a multi-model fleet: a shared-prefix group (else a session, in order) asks
    for models[group % n], so every group's prefix lives on one model's workers and the models
    take equal shares of the sessions. One model: the trace unchanged."""
    if len(models) <= 1:
        return trace
    n = len(models)
    sessions = tuple(replace(s, model=models[(s.group if s.group is not None else i) % n])
                     for i, s in enumerate(trace.sessions))
    return replace(trace, sessions=sessions, params={**trace.params, "models": list(models)})


def trace_digest(trace: Trace) -> str:
    """A short stable fingerprint of a trace's content (for the results file)."""
    import hashlib

    h = hashlib.blake2b(digest_size=8)
    for s in trace.sessions:
        h.update(repr(asdict(s)).encode())
    return h.hexdigest()
