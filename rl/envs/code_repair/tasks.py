"""The code_repair corpus: small Python packages with one planted bug each, made from a seed.

A task is a package of three or four functions drawn from the templates below (names, constants
and test inputs drawn too), spread over two modules, with a test file of two tests per function.
One function carries one of its template's bugs; the generator keeps only bugs that at least one
of its tests catches, and records the fix (file, buggy text, correct text). Everything follows
from (split, index, seed): task 17 of "train" is the same package on every machine, and the
"eval" split draws from its own stream, so held-out tasks are not training tasks.

Expected values come from running the correct template code here, at generation time; that code
is the generator's own, never the model's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Any


@dataclass(frozen=True)
class Template:
    names: tuple[str, ...]
    source: str
    """A function `{name}`; `{k}` is a drawn constant where the template has one."""
    bugs: tuple[tuple[str, str], ...]
    """(correct text, buggy text) pairs; the correct text occurs once in the source."""
    args: str
    """Which input maker the tests draw arguments from (see INPUTS)."""


def _ints(rng: random.Random) -> tuple[Any, ...]:
    return ([rng.randint(-9, 9) for _ in range(rng.randint(1, 6))],)


def _ints_and_pick(rng: random.Random) -> tuple[Any, ...]:
    xs = _ints(rng)[0]
    return xs, rng.choice(xs + [rng.randint(-9, 9)])


def _clamp(rng: random.Random) -> tuple[Any, ...]:
    return rng.randint(-9, 9), rng.randint(-5, 0), rng.randint(1, 6)


def _count(rng: random.Random) -> tuple[Any, ...]:
    xs = _ints(rng)[0]
    return xs, rng.randint(0, len(xs) + 1)


def _text(rng: random.Random) -> tuple[Any, ...]:
    words = ["level", "Noon", "abc", "kayak", "python", "Race car", "step on no pets", "a b"]
    return (rng.choice(words),)


def _sentence(rng: random.Random) -> tuple[Any, ...]:
    words = ["alpha", "beta", "gamma", "delta", "x", "ok", "bug", "fix"]
    return (" ".join(rng.choice(words) for _ in range(rng.randint(1, 4))),)


INPUTS = {
    "ints": _ints,
    "ints_pick": _ints_and_pick,
    "clamp": _clamp,
    "count": _count,
    "text": _text,
    "sentence": _sentence,
}

TEMPLATES = (
    Template(
        ("total", "sum_all", "add_up"),
        "def {name}(xs):\n    result = 0\n    for i in range(len(xs)):\n"
        "        result += xs[i]\n    return result\n",
        (
            ("range(len(xs))", "range(1, len(xs))"),
            ("result = 0", "result = 1"),
            ("result += xs[i]", "result = xs[i]"),
        ),
        "ints",
    ),
    Template(
        ("count_above", "how_many_over", "count_greater"),
        "def {name}(xs, limit):\n    count = 0\n    for x in xs:\n        if x > limit:\n"
        "            count += 1\n    return count\n",
        (("x > limit", "x >= limit"), ("count += 1", "count += 2"), ("x > limit", "x < limit")),
        "ints_pick",
    ),
    Template(
        ("clamp", "bound", "limit_to"),
        "def {name}(x, lo, hi):\n    if x < lo:\n        return lo\n    if x > hi:\n"
        "        return hi\n    return x\n",
        (("return lo", "return hi"), ("x < lo", "x > lo"), ("return hi", "return lo")),
        "clamp",
    ),
    Template(
        ("scale", "multiply_all", "times"),
        "def {name}(xs, factor={k}):\n    return [x * factor for x in xs]\n",
        (("x * factor", "x + factor"), ("for x in xs]", "for x in xs[1:]]")),
        "ints",
    ),
    Template(
        ("last_items", "tail", "take_last"),
        "def {name}(xs, n):\n    if n <= 0:\n        return []\n    return xs[-n:]\n",
        (("xs[-n:]", "xs[n:]"), ("n <= 0", "n < 0"), ("xs[-n:]", "xs[-n - 1:]")),
        "count",
    ),
    Template(
        ("is_palindrome", "reads_same_backwards", "mirrored"),
        'def {name}(text):\n    cleaned = text.lower().replace(" ", "")\n'
        "    return cleaned == cleaned[::-1]\n",
        (("cleaned[::-1]", "cleaned[::1]"), ("text.lower()", "text"), ('" ", ""', '"a", ""')),
        "text",
    ),
    Template(
        ("mean", "average", "avg"),
        "def {name}(xs):\n    if not xs:\n        return 0.0\n    return sum(xs) / len(xs)\n",
        (("/ len(xs)", "/ (len(xs) + 1)"), ("sum(xs) /", "sum(xs[1:]) /")),
        "ints",
    ),
    Template(
        ("max_index", "argmax", "index_of_largest"),
        "def {name}(xs):\n    best = 0\n    for i in range(1, len(xs)):\n"
        "        if xs[i] > xs[best]:\n            best = i\n    return best\n",
        (
            ("xs[i] > xs[best]", "xs[i] < xs[best]"),
            ("range(1, len(xs))", "range(1, len(xs) - 1)"),
            ("best = i", "best = xs[i]"),
        ),
        "ints",
    ),
    Template(
        ("title_words", "capitalize_all", "headline"),
        "def {name}(text):\n    words = text.split()\n"
        '    return " ".join(w[:1].upper() + w[1:] for w in words)\n',
        (("w[1:]", "w[2:]"), ("w[:1].upper()", "w[:1]"), ('" ".join', '"".join')),
        "sentence",
    ),
    Template(
        ("running_sum", "prefix_sums", "cumulative"),
        "def {name}(xs):\n    out = []\n    acc = {k}\n    for x in xs:\n        acc += x\n"
        "        out.append(acc)\n    return out\n",
        (
            ("acc += x\n        out.append(acc)", "out.append(acc)\n        acc += x"),
            ("acc = {k}", "acc = {k1}"),
        ),
        "ints",
    ),
    Template(
        ("dedupe", "unique", "drop_repeats"),
        "def {name}(xs):\n    seen = set()\n    out = []\n    for x in xs:\n"
        "        if x not in seen:\n            seen.add(x)\n            out.append(x)\n"
        "    return out\n",
        (("seen.add(x)\n            ", ""), ("out.append(x)", "out.insert(0, x)")),
        "ints",
    ),
)

PACKAGES = ("numkit", "seqtools", "textops", "mathbits", "listlib", "calc", "tally", "arrays")
MODULES = ("core", "ops", "helpers", "basic", "extra", "util")
TESTS_PER_FUNCTION = 2


@dataclass(frozen=True)
class Task:
    package: str
    files: dict[str, str]
    """Relative path -> text: the package (with the bug) and its tests."""
    fix: tuple[str, str, str]
    """(path, buggy function, correct function): the edit that repairs the package."""
    tests: int
    failing_at_start: int
    cases: tuple[tuple[str, str, Any], ...]
    """(test name, call, expected value) of each test, as its test file spells them: what the
    environment judges a run by, outside the sandbox."""


@lru_cache(maxsize=16384)
def make_task(seed: int, split: str, index: int) -> Task:
    """Task `index` of `split`; the same arguments give the same package everywhere."""
    rng = random.Random(f"code_repair:{seed}:{split}:{index}")
    while True:  # a draw whose bug no test catches is drawn again from the same stream
        task = _draw(rng)
        if task is not None:
            return task


def _draw(rng: random.Random) -> Task | None:
    package = f"{rng.choice(PACKAGES)}{rng.randint(1, 99)}"
    modules = rng.sample(MODULES, 2)
    chosen = rng.sample(TEMPLATES, rng.randint(3, 4))
    buggy = rng.randrange(len(chosen))
    sources, tests, cases, fix = {m: [] for m in modules}, [], [], None
    failing = 0
    for i, template in enumerate(chosen):
        name, module = rng.choice(template.names), modules[i % 2]
        k = rng.randint(2, 5)
        source = template.source.format(name=name, k=k)
        correct = _compile(source, name)
        if i == buggy:
            good, bad = rng.choice(template.bugs)
            good, bad = good.format(k=k), bad.format(k=k, k1=k + 1)
            broken = source.replace(good, bad, 1)
            fix = (f"{package}/{module}.py", broken, source)  # whole functions: unique
            wrong = _compile(broken, name)
        for t in range(TESTS_PER_FUNCTION):
            args = _distinguishing(rng, template, correct, wrong if i == buggy else None, t)
            want = correct(*args)
            if i == buggy and _outcome(wrong, args) != want:
                failing += 1
            tests.append(_test(name, f"{name}_{t + 1}", args, want))
            cases.append((f"test_{name}_{t + 1}", _call(name, args), want))
        sources[module].append(broken if i == buggy else source)
    if failing == 0 or fix is None:
        return None
    imports = "".join(
        f"from {package}.{m} import {_names(sources[m])}\n" for m in modules if sources[m]
    )
    files = {f"{package}/__init__.py": imports}
    files |= {f"{package}/{m}.py": "\n\n".join(s) for m, s in sources.items() if s}
    header = f"from {package} import {_names([s for m in modules for s in sources[m]])}"
    files[f"tests/test_{package}.py"] = header + "\n\n\n" + "\n\n".join(tests)
    return Task(package, files, fix, len(tests), failing, tuple(cases))


def _compile(source: str, name: str) -> Any:
    scope: dict[str, Any] = {}
    exec(compile(source, "<template>", "exec"), scope)  # the generator's own template code
    return scope[name]


def _outcome(fn: Any, args: tuple[Any, ...]) -> Any:
    try:
        return fn(*[list(a) if isinstance(a, list) else a for a in args])
    except Exception as err:  # noqa: BLE001 - a buggy function may raise: that fails its test
        return err


def _distinguishing(
    rng: random.Random, template: Template, correct: Any, wrong: Any | None, attempt: int
) -> tuple[Any, ...]:
    """Test arguments; for the buggy function's first test, ones that expose the bug."""
    make = INPUTS[template.args]
    for _ in range(50):
        args = make(rng)
        if wrong is None or attempt > 0 or _outcome(wrong, args) != _outcome(correct, args):
            return args
    return make(rng)


def _call(name: str, args: tuple[Any, ...]) -> str:
    return f"{name}({', '.join(map(repr, args))})"


def _test(name: str, test_name: str, args: tuple[Any, ...], want: Any) -> str:
    call = _call(name, args)
    return (
        f"def test_{test_name}():\n    got = {call}\n"
        f'    assert got == {want!r}, f"{call.replace("{", "{{").replace("}", "}}")} '
        f'returned {{got!r}}, expected {want!r}"\n'
    )


def _names(sources: list[str]) -> str:
    return ", ".join(s.split("(", 1)[0].removeprefix("def ") for s in sources)
