"""A small, deterministic, built-in text corpus.

It lets the demo and the tests train and evaluate a language model with no
download: short Python functions and docstrings generated from templates by a
seeded RNG. The text is learnable (templates repeat with varying names and
constants), so loss curves are meaningful, and a held-out split is drawn from
disjoint seeds.
"""

from __future__ import annotations

import random

_NAMES = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lam", "rho"]
_VERBS = ["add", "scale", "shift", "clip", "count", "merge", "split", "total", "pick", "sum"]
_OPS = [("+", "plus"), ("-", "minus"), ("*", "times")]


def _snippet(rng: random.Random) -> str:
    kind = rng.randrange(4)
    name = f"{rng.choice(_VERBS)}_{rng.choice(_NAMES)}"
    k = rng.randrange(1, 10)
    op, word = rng.choice(_OPS)
    if kind == 0:
        return f'def {name}(x):\n    """Return x {word} {k}."""\n    return x {op} {k}\n'
    if kind == 1:
        return (
            f"def {name}(items):\n    total = 0\n    for item in items:\n"
            f"        total = total {op} item\n    return total\n"
        )
    if kind == 2:
        return f"def {name}(a, b):\n    if a > b:\n        return a {op} {k}\n    return b {op} {k}\n"
    return f"assert {name}({k}) == {k} {op} {k}\n"


def corpus(n: int, *, seed: int) -> list[str]:
    """``n`` snippets drawn from a generator seeded with ``seed``."""
    rng = random.Random(seed)
    return [_snippet(rng) for _ in range(n)]


def train_corpus(n: int = 4000) -> list[str]:
    return corpus(n, seed=1234)


def heldout_corpus(n: int = 200) -> list[str]:
    return corpus(n, seed=987654)
