"""The `slow` marker table in tests/conftest.py names tests that exist (a renamed test would silently join the
quick subset)."""

import re
from pathlib import Path

import pytest

from tests.conftest import SLOW

TESTS = Path(__file__).parent


@pytest.mark.parametrize("entry", sorted(SLOW))
def test_slow_table_names_an_existing_test(entry):
    file, _, test = entry.partition("::")
    path = TESTS / file
    assert path.is_file(), entry
    if test:
        assert re.search(rf"^def {re.escape(test)}\(", path.read_text(encoding="utf-8"), re.MULTILINE), entry

