"""A seeded request generator shaped like real prefix-cache traffic.

* shared system prompts (a few hundred tokens) that most requests start with;
* multi-turn conversations: turn k+1's prompt is turn k's prompt, a reply, and a new user
  message, so it resumes exactly where the last turn stopped;
* RAG documents shared across users, placed after a system prompt;
* long prompts (~1.8k-2.5k tokens) that overflow the block pools, so blocks spill to disk
  or are evicted.

Prompt lengths run from a few hundred tokens to ~2.5k (the CPU reference model prefills 4096
tokens in about 0.3 s).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Request", "Workload", "long_prompt_workload", "make_workload"]

MAX_PROMPT = 2560


@dataclass(frozen=True)
class Request:
    rid: int
    kind: str  # "chat", "rag", "long", "long_doc"
    tokens: np.ndarray  # int64 [T]
    conversation: int = -1
    turn: int = 0


@dataclass(frozen=True)
class Workload:
    requests: list[Request]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.requests)


def make_workload(n: int, seed: int = 0, vocab: int = 64, long_every: int = 8) -> Workload:
    rng = np.random.default_rng(seed)

    def toks(lo: int, hi: int) -> np.ndarray:
        return rng.integers(0, vocab, int(rng.integers(lo, hi + 1)), dtype=np.int64)

    systems = [toks(200, 420) for _ in range(3)]
    docs = [toks(300, 700) for _ in range(4)]
    convs: list[np.ndarray] = []
    turns: list[int] = []
    out: list[Request] = []
    for rid in range(n):
        roll = rng.random()
        if rid % long_every == long_every - 1:
            sys_p = systems[int(rng.integers(len(systems)))]
            body = toks(1500, MAX_PROMPT - len(sys_p) - 64)
            out.append(Request(rid, "long", np.concatenate([sys_p, body])))
        elif roll < 0.3 or not convs:
            sys_p = systems[int(rng.integers(len(systems)))]
            doc = docs[int(rng.integers(len(docs)))]
            out.append(Request(rid, "rag", np.concatenate([sys_p, doc, toks(20, 120)])))
        elif roll < 0.55 and len(convs) < 6:
            sys_p = systems[int(rng.integers(len(systems)))]
            convs.append(np.concatenate([sys_p, toks(30, 200)]))
            turns.append(0)
            out.append(Request(rid, "chat", convs[-1], len(convs) - 1, 0))
        else:
            c = int(rng.integers(len(convs)))
            grown = np.concatenate([convs[c], toks(40, 160), toks(20, 120)])  # reply + user
            if len(grown) > MAX_PROMPT:  # the conversation is done: start a fresh one
                sys_p = systems[int(rng.integers(len(systems)))]
                grown = np.concatenate([sys_p, toks(30, 200)])
                turns[c] = -1
            convs[c] = grown
            turns[c] += 1
            out.append(Request(rid, "chat", grown, c, turns[c]))
    return Workload(out)


def long_prompt_workload(prefix: int, resumed: int, seed: int = 0, vocab: int = 64,
                         question: tuple[int, int] = (64, 256)) -> Workload:
    """Realistic lengths: one long shared document (``prefix`` tokens) asked about
    ``resumed + 1`` times. The first request computes the document cold and writes it back;
    every later one resumes from it and computes only its own question."""
    rng = np.random.default_rng(seed)
    doc = rng.integers(0, vocab, prefix, dtype=np.int64)
    out = []
    for rid in range(resumed + 1):
        q = rng.integers(0, vocab, int(rng.integers(question[0], question[1] + 1)),
                         dtype=np.int64)
        out.append(Request(rid, "long_doc", np.concatenate([doc, q])))
    return Workload(out)
