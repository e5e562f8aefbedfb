"""docs/configs.md is generated from the config dataclasses: every key has a meaning and the page is current."""

from __future__ import annotations

from dataclasses import dataclass, field

from unirl.config.docs import PAGE, env_classes, main, missing, page, rows


@dataclass
class _Inner:
    """A section documented by its docstring."""

    #: Documented.
    a: int = 1
    b: str = "x"


@dataclass
class _Outer:
    inner: _Inner = field(default_factory=_Inner)
    #: Two lines of
    #: comment.
    c: float = 0.5


def test_every_key_has_a_meaning_and_the_page_is_current(capsys):
    assert missing(env_classes()) == []
    assert main(["--check"]) == 0, capsys.readouterr().err
    assert PAGE.read_text() == page(env_classes())


def test_keys_types_defaults_and_meanings_come_from_the_source():
    assert rows(_Outer) == [("inner", "_Inner", "", "A section documented by its docstring."),
                            ("inner.a", "int", "1", "Documented."), ("inner.b", "str", '"x"', ""),
                            ("c", "float", "0.5", "Two lines of comment.")]
    assert missing({"toy": _Outer}) == ["toy: inner.b"]
