"""The offline training text of the bundled tiny model, and its two workloads.

- ``docs``: prose from the Python distribution itself — the documentation topics of
  ``pydoc_data`` and the docstrings of a fixed list of standard-library modules (their classes,
  functions and methods). Every 20th text is held out for evaluation.
- ``math``: arithmetic word problems with worked answers, from a seeded generator; the held-out
  problems come from a different seed stream.

Only the standard library is used, so the same text can be rebuilt anywhere (the docs text
follows the running Python version; the assets record which one).
"""

from __future__ import annotations

import importlib
import inspect
import random
import warnings
from dataclasses import dataclass

__all__ = ["Corpus", "build", "docs_texts", "math_problems", "HELD_OUT_EVERY"]

HELD_OUT_EVERY = 20   # every n-th docs text is held out

# Modules that import without side effects (no GUI, no network, no "import this").
_DOC_MODULES = (
    "os", "re", "json", "collections", "itertools", "functools", "string", "textwrap", "argparse", "logging",
    "pathlib", "typing", "dataclasses", "datetime", "decimal", "fractions", "statistics", "random", "math",
    "heapq", "bisect", "csv", "email.message", "http.client", "urllib.parse", "subprocess", "threading",
    "asyncio", "unittest", "doctest", "pickle", "shutil", "tempfile", "inspect", "ast", "contextlib", "abc",
    "enum", "difflib", "zipfile", "tarfile", "sqlite3", "socket", "calendar", "pprint", "operator", "copy",
    "io", "codecs", "locale", "gettext", "optparse", "configparser", "hashlib", "hmac", "secrets", "base64",
    "struct", "array", "queue", "sched", "selectors", "signal", "traceback", "warnings", "weakref", "types",
    "numbers", "cmath", "xml.etree.ElementTree", "html.parser", "ftplib", "smtplib", "imaplib", "mailbox",
    "mimetypes", "uuid", "platform", "sysconfig", "glob", "fnmatch", "filecmp", "stat", "zlib", "gzip", "bz2",
    "lzma", "timeit", "trace", "pdb", "cProfile", "pstats", "tokenize", "dis", "importlib", "pkgutil",
    "concurrent.futures", "multiprocessing.pool", "ipaddress", "shlex", "getopt", "reprlib", "graphlib",
)


@dataclass(frozen=True)
class Corpus:
    train_docs: list[str]
    train_math: list[str]
    eval_docs: list[str]
    eval_math: list[str]


def build(seed: int, n_train_math: int, n_eval_math: int) -> Corpus:
    docs = docs_texts()
    held_out = set(range(0, len(docs), HELD_OUT_EVERY))
    return Corpus(
        train_docs=[text for i, text in enumerate(docs) if i not in held_out],
        train_math=math_problems(random.Random(seed), n_train_math),
        eval_docs=[docs[i] for i in sorted(held_out)],
        # a separate stream: held-out problems share templates but not their numbers and names
        eval_math=math_problems(random.Random(seed + 1_000_003), n_eval_math),
    )


def docs_texts() -> list[str]:
    """pydoc topics (sorted by name), then module docstrings, de-duplicated, in a fixed order."""
    import pydoc_data.topics

    texts = [pydoc_data.topics.topics[name].strip() for name in sorted(pydoc_data.topics.topics)]
    seen = set(texts)
    for module_name in _DOC_MODULES:
        for text in _module_docstrings(module_name):
            if text not in seen and len(text) >= 80:   # one-liners teach little prose
                seen.add(text)
                texts.append(text)
    return texts


def _module_docstrings(module_name: str) -> list[str]:
    # importing some modules, and reading some attributes (typing.io, typing.re), warns of deprecations
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            module = importlib.import_module(module_name)
        except ImportError:   # optional modules (e.g. sqlite3) may be missing from a build
            return []
        docs = [inspect.getdoc(module)]
        for name in sorted(vars(module)):
            obj = getattr(module, name)
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(obj):
                docs.append(inspect.getdoc(obj))
                for method_name in sorted(vars(obj)):
                    method = vars(obj)[method_name]
                    if not method_name.startswith("_") and inspect.isfunction(method):
                        docs.append(inspect.getdoc(method))
            elif inspect.isfunction(obj):
                docs.append(inspect.getdoc(obj))
    return [doc.strip() for doc in docs if doc]


# ----------------------------------------------------------------- arithmetic word problems
_NAMES = ("Alice", "Bob", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kofi", "Lena",
          "Maya", "Nils", "Olga", "Priya", "Quinn", "Rosa", "Sven", "Tara")
_ITEMS = ("apples", "books", "pencils", "marbles", "stickers", "cookies", "coins", "cards", "shells", "stamps",
          "oranges", "candles", "buttons", "flowers", "toy cars")
_CONTAINERS = ("boxes", "bags", "baskets", "jars", "crates", "packs")


def math_problems(rng: random.Random, n: int) -> list[str]:
    """``n`` problems, each "Question: ...\\nAnswer: <worked steps> The answer is N."."""
    templates = (_add_then_remove, _groups, _share, _price, _compare, _three_days)
    return [rng.choice(templates)(rng) for _ in range(n)]


def _qa(question: str, steps: list[str], answer: int) -> str:
    return f"Question: {question}\nAnswer: {' '.join(steps)} The answer is {answer}."


def _add_then_remove(rng: random.Random) -> str:
    name, other, item = rng.choice(_NAMES), rng.choice(_NAMES), rng.choice(_ITEMS)
    have, more = rng.randint(2, 60), rng.randint(2, 40)
    give = rng.randint(1, have + more)
    total = have + more
    return _qa(f"{name} has {have} {item}. {name} gets {more} more and gives {give} to {other}. "
               f"How many {item} does {name} have now?",
               [f"{have} + {more} = {total}.", f"{total} - {give} = {total - give}."], total - give)


def _groups(rng: random.Random) -> str:
    name, item, container = rng.choice(_NAMES), rng.choice(_ITEMS), rng.choice(_CONTAINERS)
    groups, each = rng.randint(2, 12), rng.randint(2, 12)
    return _qa(f"{name} has {groups} {container} with {each} {item} in each. How many {item} does {name} have?",
               [f"{groups} * {each} = {groups * each}."], groups * each)


def _share(rng: random.Random) -> str:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    friends, each = rng.randint(2, 9), rng.randint(2, 12)
    total = friends * each
    return _qa(f"{name} shares {total} {item} equally among {friends} friends. How many {item} does each friend get?",
               [f"{total} / {friends} = {each}."], each)


def _price(rng: random.Random) -> str:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    count, price = rng.randint(2, 15), rng.randint(1, 9)
    paid = count * price + rng.randint(0, 20)
    cost = count * price
    return _qa(f"{name} buys {count} {item} at {price} dollars each and pays with {paid} dollars. "
               f"How much change does {name} get?",
               [f"{count} * {price} = {cost}.", f"{paid} - {cost} = {paid - cost}."], paid - cost)


def _compare(rng: random.Random) -> str:
    first, second = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    have, extra = rng.randint(3, 50), rng.randint(1, 30)
    return _qa(f"{first} has {have} {item}. {second} has {extra} more {item} than {first}. "
               f"How many {item} do they have together?",
               [f"{have} + {extra} = {have + extra}.", f"{have} + {have + extra} = {2 * have + extra}."],
               2 * have + extra)


def _three_days(rng: random.Random) -> str:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b, c = rng.randint(1, 30), rng.randint(1, 30), rng.randint(1, 30)
    return _qa(f"{name} collects {a} {item} on Monday, {b} on Tuesday and {c} on Wednesday. "
               f"How many {item} does {name} collect in total?",
               [f"{a} + {b} = {a + b}.", f"{a + b} + {c} = {a + b + c}."], a + b + c)
