"""What every exercise checker must do, for every checker of every chapter (found by name:
``chunkstate.exercises.chNN_*.check_*``): pass the shipped solution, let the error of a
learner's unfinished stub (``NotImplementedError``) out unchanged rather than turn it into a
verdict, and give a verdict (an ``AssertionError`` saying what was expected) on an answer of the
wrong kind, not a ``TypeError`` from inside the checker. Each chapter's ``test_exercises_chNN.py`` adds the wrong answers its checkers reject."""
import importlib
import inspect
import pkgutil

import pytest

import chunkstate.exercises


def _checkers():
    found = []
    for info in pkgutil.iter_modules(chunkstate.exercises.__path__):
        module = importlib.import_module(f"chunkstate.exercises.{info.name}")
        found += [(f"{info.name}.{name}", fn) for name, fn in vars(module).items()
                  if name.startswith("check_") and inspect.isfunction(fn) and fn.__module__ == module.__name__]
    return found


CHECKERS = _checkers()


def test_every_chapter_has_checkers():
    chapters = {name.split("_", 1)[0] for name, _ in CHECKERS}
    assert chapters == {f"ch{n:02d}" for n in range(13)}, sorted(chapters)
    assert len(CHECKERS) >= 20
    assert all(list(inspect.signature(fn).parameters) == ["fn"] for _, fn in CHECKERS)


@pytest.mark.parametrize("check", [fn for _, fn in CHECKERS], ids=[name for name, _ in CHECKERS])
def test_shipped_solution_passes(check):
    check()


@pytest.mark.parametrize("check", [fn for _, fn in CHECKERS], ids=[name for name, _ in CHECKERS])
def test_stub_error_propagates(check):
    def stub(*args, **kwargs):
        raise NotImplementedError("the learner's stub")

    with pytest.raises(NotImplementedError, match="the learner's stub"):
        check(stub)


@pytest.mark.parametrize("answer", [None, 3, "x", (1.5, 2.5)], ids=["None", "int", "str", "tuple"])
@pytest.mark.parametrize("check", [fn for _, fn in CHECKERS], ids=[name for name, _ in CHECKERS])
def test_a_wrong_kind_of_answer_gets_a_verdict(check, answer):
    """A function returning the wrong kind of thing (nothing, a number, a string, a tuple of floats)
    is told so by an ``AssertionError``, as a wrong value is: never a ``TypeError`` or
    ``AttributeError`` from deep inside the checker (``len(None)``, ``None.shape``)."""
    def wrong(*args, **kwargs):
        return answer

    with pytest.raises(AssertionError):
        check(wrong)
