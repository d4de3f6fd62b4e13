"""Exercise checkers, one module per chapter (``from chunkstate.exercises import ch01``).

Each checker takes the reader's function, tests it on fresh random inputs against the reference
and raises ``AssertionError`` with a readable message when it is wrong. Called without a
function it checks the shipped solution, so the test suite proves every checker passes a right
answer (and, in ``tests/test_exercises.py``, rejects a wrong one).
"""
