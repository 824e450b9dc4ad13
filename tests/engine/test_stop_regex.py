"""Stop regexes (SGLang's ``stop_regex``): validation, the search window, the time limit."""

from __future__ import annotations

import pytest
import regex
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefixkv.engine.sampling_params import SamplingParams
from prefixkv.engine.stop_regex import MAX_STOP_REGEX, MAX_STOP_REGEX_LEN, compile_stop_regex


@pytest.mark.parametrize("value, says", [
    ("(", "not a valid regular expression"),
    ("a?", "matches the empty string"),
    ("", "non-empty"),
    (["ok", 3], "non-empty strings"),
    (b"ab", "a str, a list of str"),
    (["x"] * (MAX_STOP_REGEX + 1), f"at most {MAX_STOP_REGEX} patterns"),
    ("x" * (MAX_STOP_REGEX_LEN + 1), f"at most {MAX_STOP_REGEX_LEN} characters"),
])
def test_bad_patterns_are_value_errors_naming_stop_regex(value: object, says: str) -> None:
    with pytest.raises(ValueError, match="stop_regex") as err:
        SamplingParams(stop_regex=value)  # type: ignore[arg-type]
    assert says in str(err.value)


@pytest.mark.parametrize("pattern, width", [
    (r"\n\n", 2), (r"ab{2,3}", 4), (r"x\d{2}", 3),
    (r"[0-9]+\.", None),  # unbounded
    (r"foo\B", None), (r"a(?=b)", None), (r"(?<=x)y", None), (r"^ab", None),  # look outside
    (r"(x)\1", None), (r"\p{L}{3}", None),  # a back-reference; the regex package's own syntax
])
def test_the_window_is_the_longest_match_of_a_self_contained_pattern(pattern: str, width: int | None) -> None:
    assert compile_stop_regex(pattern)[0].width == width


PATTERNS = [r"ab", r"b{2,3}c", r"[0-9]+\.", r"a(?=b)", r"ab\B", r"(?<=c)a", r"(a)b\1", r"c$", r"^b",
            r"\bba", r"a.{0,3}c"]


@settings(max_examples=300, deadline=None)
@example(r"a(?=b)", ["a", "b"], 0)  # the match ends before the new text: a lookahead saw it
@example(r"ab\B", ["ab", "a"], 0)  # ... an assertion after the match
@example(r"b{2,3}c", ["0b", "b", "bc"], 0)  # the match starts two tokens back
@given(st.sampled_from(PATTERNS), st.lists(st.text("abc.0 ", min_size=1, max_size=3), min_size=1, max_size=25),
       st.integers(0, 4))
def test_the_windowed_search_stops_where_a_full_search_first_matches(
        pattern: str, chunks: list[str], min_steps: int) -> None:
    """Fed a token's text at a time (the first ``min_steps`` unchecked, as under
    ``min_tokens``), the windowed search fires at the first step whose text holds a match
    after the unchecked part, as a search of all that text would."""
    rx = compile_stop_regex(pattern)[0]
    whole = regex.compile(pattern)
    text, check_from = "", 0
    fired = expected = None
    for i, chunk in enumerate(chunks):
        old = len(text)
        text += chunk
        if i < min_steps:
            check_from = len(text)
            continue
        if expected is None and whole.search(text, check_from) is not None:
            expected = i
        if fired is None and rx.found(text, check_from, old):
            fired = i
        if fired is not None or expected is not None:
            break
    assert fired == expected


def test_a_search_past_its_time_limit_is_a_value_error_naming_the_pattern() -> None:
    rx = compile_stop_regex(r"^(a|aa)+\d")[0]  # exponential backtracking on a run of a's
    assert rx.width is None and not rx.found("aaaa", 0, 3)
    with pytest.raises(ValueError, match=r"stop_regex '\^\(a\|aa\)\+\\\\d' took longer than"):
        rx.found("a" * 40, 0, 39)
