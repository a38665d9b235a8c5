"""The suite's order of files (tests/schedule.py): the listed files exist and go first."""

from __future__ import annotations

from tests.schedule import LONGEST_FIRST, TESTS, file_rank


def test_every_listed_file_exists_once():
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    assert [f for f in LONGEST_FIRST if not (TESTS / f).is_file()] == []


def test_listed_files_go_first_in_their_order_the_rest_after():
    paths = [TESTS / "unit" / "test_schedule.py", *(TESTS / f for f in reversed(LONGEST_FIRST))]
    ranked = sorted(paths, key=file_rank)
    assert ranked == [*(TESTS / f for f in LONGEST_FIRST), TESTS / "unit" / "test_schedule.py"]
    assert file_rank(TESTS.parent / "tools" / "run_demo.py") == len(LONGEST_FIRST)  # outside tests/
