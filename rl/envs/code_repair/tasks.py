"""The code_repair corpus: small Python packages with one planted bug each, made from a seed.

A task is a package of three or four functions drawn from the templates below (names, constants
and test inputs drawn too), spread over two modules, with a test file of two tests per function.
One function carries one of its template's bugs; the generator keeps only bugs that at least one
of its tests catches, and records the fix (file, buggy text, correct text). Everything follows
from (split, index, seed): task 17 of "train" is the same package on every machine, and the
"eval" split draws from its own stream, so held-out tasks are not training tasks.

Expected values come from running the correct template code here, at generation time; that code
is the generator's own, never the model's.

Each task also has held-out cases, the ones its reward is scored on: more calls of the same
functions, drawn from a stream of their own, none of them a call the tests show, with their
expected values. They are never written into the task's files, so the model cannot read them,
and their expected values never enter the sandbox (the environment judges outside it): a
package that overfits, or forges, the visible tests gains nothing. A draw whose bug no test, or
no held-out case, catches is drawn again.
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
HELD_OUT_PER_FUNCTION = 4
"""Held-out cases per function; for the buggy one, the first half are drawn to expose its bug."""


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
    `run_tests` tool reports on."""
    held_out: tuple[tuple[str, Any], ...]
    """(call, expected value) of each case the reward is scored on (see the module docstring)."""
    held_out_failing: int
    """How many of the held-out cases the package fails as given."""


@lru_cache(maxsize=16384)
def make_task(seed: int, split: str, index: int) -> Task:
    """Task `index` of `split`; the same arguments give the same package everywhere."""
    stream = f"code_repair:{seed}:{split}:{index}"
    rng, held_out_rng = random.Random(stream), random.Random(f"{stream}:held_out")
    while True:  # a draw whose bug goes uncaught is drawn again from the same streams
        task = _draw(rng, held_out_rng)
        if task is not None:
            return task


@dataclass(frozen=True)
class _Function:
    """One function of a drawn package, as the generator knows it."""

    name: str
    template: Template
    correct: Any
    wrong: Any | None
    """The buggy version, for the function that carries the bug."""


def _draw(rng: random.Random, held_out_rng: random.Random) -> Task | None:
    package = f"{rng.choice(PACKAGES)}{rng.randint(1, 99)}"
    modules = rng.sample(MODULES, 2)
    chosen = rng.sample(TEMPLATES, rng.randint(3, 4))
    buggy = rng.randrange(len(chosen))
    sources, tests, cases, fix = {m: [] for m in modules}, [], [], None
    functions, failing = [], 0
    for i, template in enumerate(chosen):
        name, module = rng.choice(template.names), modules[i % 2]
        k = rng.randint(2, 5)
        source = template.source.format(name=name, k=k)
        correct, wrong = _compile(source, name), None
        if i == buggy:
            good, bad = rng.choice(template.bugs)
            good, bad = good.format(k=k), bad.format(k=k, k1=k + 1)
            broken = source.replace(good, bad, 1)
            fix = (f"{package}/{module}.py", broken, source)  # whole functions: unique
            wrong = _compile(broken, name)
        for t in range(TESTS_PER_FUNCTION):
            args = _distinguishing(rng, template, correct, wrong, t)
            want = correct(*args)
            if wrong is not None and _outcome(wrong, args) != want:
                failing += 1
            tests.append(_test(name, f"{name}_{t + 1}", args, want))
            cases.append((f"test_{name}_{t + 1}", _call(name, args), want))
        sources[module].append(broken if i == buggy else source)
        functions.append(_Function(name, template, correct, wrong))
    if failing == 0 or fix is None:
        return None
    imports = "".join(
        f"from {package}.{m} import {_names(sources[m])}\n" for m in modules if sources[m]
    )
    files = {f"{package}/__init__.py": imports}
    files |= {f"{package}/{m}.py": "\n\n".join(s) for m, s in sources.items() if s}
    header = f"from {package} import {_names([s for m in modules for s in sources[m]])}"
    files[f"tests/test_{package}.py"] = header + "\n\n\n" + "\n\n".join(tests)
    held_out = _held_out(held_out_rng, functions, {call for _, call, _ in cases})
    if held_out is None:
        return None
    return Task(package, files, fix, len(tests), failing, tuple(cases), *held_out)


def _held_out(
    rng: random.Random, functions: list[_Function], shown: set[str]
) -> tuple[tuple[tuple[str, Any], ...], int] | None:
    """The held-out cases of a package's functions, none of them a call its tests show, and how
    many of them the buggy package fails; None when none of them exposes the bug."""
    cases, failing = [], 0
    for function in functions:
        for i in range(HELD_OUT_PER_FUNCTION):
            expose = function.wrong is not None and i < HELD_OUT_PER_FUNCTION // 2
            args = _unseen(rng, function, shown, expose) or _unseen(rng, function, shown, False)
            if args is None:
                return None
            want = function.correct(*args)
            failing += function.wrong is not None and _outcome(function.wrong, args) != want
            cases.append((_call(function.name, args), want))
    return (tuple(cases), failing) if failing else None


def _unseen(
    rng: random.Random, function: _Function, shown: set[str], expose: bool
) -> tuple[Any, ...] | None:
    """Arguments, within 50 draws, whose call is not in `shown` and, when `expose`, on which the
    buggy version answers wrongly; None when no draw is."""
    make = INPUTS[function.template.args]
    for _ in range(50):
        args = make(rng)
        if _call(function.name, args) in shown:
            continue
        if not expose or _outcome(function.wrong, args) != _outcome(function.correct, args):
            return args
    return None


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
