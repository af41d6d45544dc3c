"""Stop strings on plain text: the earliest match wins, only text that ends after the checked part counts."""

from __future__ import annotations

from pagedllm.engine.stop_checker import StopChecker, StopMatch


def test_earliest_match_and_where_the_text_ends():
    checker = StopChecker(["world", "lo w"], include_stop_str_in_output=False)
    assert checker.find("hello world", new_start=5) == StopMatch("lo w", 3)
    assert StopChecker(["world", "lo w"], True).find("hello world", new_start=5) == StopMatch("lo w", 7)


def test_only_matches_ending_in_the_new_text_count():
    checker = StopChecker(["ab"], include_stop_str_in_output=False)
    assert checker.find("ab cd", new_start=3) is None  # "ab" was in the text already checked
    assert checker.find("xa" + "b", new_start=2) == StopMatch("ab", 1)  # spans the old and the new text


def test_holdback_is_the_longest_stop_minus_one_unless_included():
    assert StopChecker(["a", "abcd"], False).holdback == 3
    assert StopChecker(["abcd"], True).holdback == 0
