"""The one error type a user ever sees from lightfleet: a one-line message, exit status 2."""
from __future__ import annotations

import difflib
import sys
from contextlib import contextmanager
from typing import Any, Iterable, Iterator


class ConfigError(Exception):
    """Bad input: names the key, the value (None: the key itself is the problem) and what is
    allowed, with a "did you mean" when `choices` holds a near match of the value."""

    def __init__(self, key: str, value: Any, allowed: str, choices: Iterable[str] = ()):
        hint = did_you_mean(str(value), choices)
        super().__init__(f"{key}{'' if value is None else f'={value!r}'}: {allowed}{hint}")
        self.key, self.value, self.allowed = key, value, allowed

    @classmethod
    def unknown_key(cls, key: str, known: Iterable[str]) -> "ConfigError":
        parent, _, leaf = key.rpartition(".")
        return cls(key, None, f"{parent or 'the config'} has no key {leaf!r}{did_you_mean(leaf, known)}")


class Refusal(Exception):
    """A configuration that is well-formed but must not run (a forbidden strategy combination)."""


def first_line(error: BaseException) -> str:
    """The first line of `error`'s message; its type's name when it has none."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def error_line(error: BaseException) -> str:
    """`error` in one line, its type first: `RuntimeError: mat1 and mat2 shapes ...`."""
    return f"{type(error).__name__}: {first_line(error)}" if str(error).strip() else type(error).__name__


def require(ok: bool, key: str, value: Any, allowed: str, choices: tuple = ()) -> None:
    """Raise ConfigError(key, value, allowed) unless `ok`."""
    if not ok:
        raise ConfigError(key, value, allowed, choices)


def require_at_least(lowest: int, **values: Any) -> None:
    """For constructors: ValueError("name=value: must be >= lowest") for a value below `lowest`
    (the command names the config key: runner.config.arguments.check_builds)."""
    for name, value in values.items():
        if value < lowest:
            raise ValueError(f"{name}={value!r}: must be >= {lowest}")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    by_lower = {choice.lower(): choice for choice in choices}  # 1f1b -> 1F1B: case is a typo too
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=3, cutoff=0.75)
    return f" (did you mean {' or '.join(by_lower[c] for c in close)}?)" if close else ""


@contextmanager
def exit_on_user_error() -> Iterator[None]:
    """Bad input: one line on stderr, exit status 2, no traceback."""
    try:
        yield
    except Refusal as refusal:
        print(f"lightfleet: refused: {refusal}", file=sys.stderr)
        sys.exit(2)
    except ConfigError as error:
        print(f"lightfleet: error: {error}", file=sys.stderr)
        sys.exit(2)
