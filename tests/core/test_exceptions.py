"""tether/_exceptions.py draws its whole tree in its docstring: the drawing names every class, and
each class's bases are the ones drawn (its parent in the tree, then the bracketed builtins)."""

from __future__ import annotations

import builtins
import inspect
import re

import pytest

from tether import _exceptions

Drawing = dict[str, tuple[str | None, tuple[str, ...], str]]
"""class name -> (parent, standard-library bases, what it means)"""

_LINE = re.compile(
    r"(?P<indent>(?:│   |    )*)(?P<branch>├── |└── )?(?P<name>[A-Za-z]\w*)"
    r"(?: \[(?P<bases>\w+(?:, \w+)*)\])?(?: {2,}(?P<what>\S.*))?"
)


def parse(tree: str) -> Drawing:
    drawn: Drawing = {}
    parents: list[str] = []  # the ancestors of the line being read
    for line in tree.splitlines():
        match = _LINE.fullmatch(line)
        assert match, f"not a line of the tree: {line!r}"
        depth = len(match["indent"]) // 4 + 1 if match["branch"] else 0
        assert depth <= len(parents) and (depth or not drawn), f"{line!r} is at the wrong depth"
        del parents[depth:]
        name = match["name"]
        assert name not in drawn, f"{name} is drawn twice"
        bases = tuple(match["bases"].split(", ")) if match["bases"] else ()
        drawn[name] = (parents[-1] if parents else None, bases, match["what"] or "")
        parents.append(name)
    return drawn


def drawing() -> Drawing:
    """The tree: the docstring's second paragraph."""
    return parse((inspect.getdoc(_exceptions) or "").split("\n\n")[1])


def defined() -> dict[str, type[BaseException]]:
    return {
        name: obj
        for name, obj in vars(_exceptions).items()
        if isinstance(obj, type)
        and issubclass(obj, _exceptions.TetherError)
        and obj.__module__ == _exceptions.__name__
    }


def test_the_drawing_names_every_class() -> None:
    drawn = drawing()
    assert set(drawn) == set(defined())
    assert [name for name, (parent, _, _) in drawn.items() if parent is None] == ["TetherError"]
    for name, (parent, _, what) in drawn.items():
        assert parent is None or what, f"{name} is drawn without saying what it means"


@pytest.mark.parametrize("name", sorted(defined()))
def test_each_class_has_the_bases_drawn(name: str) -> None:
    parent, bases, _ = drawing()[name]
    expected = tuple(getattr(builtins, base) for base in bases)
    expected = (getattr(_exceptions, parent), *expected) if parent else expected or (Exception,)
    assert defined()[name].__bases__ == expected


def test_every_class_is_exported_and_all_is_sorted() -> None:
    assert set(defined()) <= set(_exceptions.__all__) <= set(vars(_exceptions))
    assert _exceptions.__all__ == sorted(_exceptions.__all__)


@pytest.mark.parametrize(
    "tree",
    [
        "Root\n├── A  a\n        └── B  skips a level",
        "Root\n├── A  a\n└── A  twice",
        "Root\n  ├── A  mis-indented",
        "Root\nOther",
    ],
)
def test_a_wrong_drawing_is_refused(tree: str) -> None:
    with pytest.raises(AssertionError):
        parse(tree)


def test_a_drawing_is_read_as_drawn() -> None:
    tree = "Root\n├── A [ValueError]  a\n│   └── B  b\n└── C [OSError, TimeoutError]  c"
    assert parse(tree) == {
        "Root": (None, (), ""),
        "A": ("Root", ("ValueError",), "a"),
        "B": ("A", (), "b"),
        "C": ("Root", ("OSError", "TimeoutError"), "c"),
    }
