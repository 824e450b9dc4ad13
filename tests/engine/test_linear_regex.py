"""Stop regexes on RE2: the same matches as the ``regex`` package, in linear time."""

from __future__ import annotations

import time
from typing import Any

import pytest
import regex
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from prefixkv.engine.linear_regex import compile_linear, to_re2
from prefixkv.engine.sampling_params import SamplingParams
from prefixkv.engine.stop_regex import StepBudget, compile_stop_regex, first_match

# characters where Python's and RE2's classes part: an Arabic-Indic digit (\d in Python only),
# a superscript two (\w, not \d), an accented letter (\w), an em space (\s), a newline ($, .)
ALPHABET = "ab_1 \n\u0663\u00b2\u00e9\u2003."

ATOMS = ["a", "b", "_", r"\.", ".", r"\d", r"\D", r"\w", r"\W", r"\s", r"\S", "[ab]", "[^a]",
         r"[\d_]", r"[^\W\d]", r"[a-c\s]", r"\n", "\u00e9", r"\u0663"]


def patterns() -> st.SearchStrategy[str]:
    atom = st.sampled_from(ATOMS)
    quantified = st.tuples(atom, st.sampled_from(["", "", "*", "+", "?", "{1,2}", "+?", "{2}"])).map("".join)
    seq = st.lists(quantified, min_size=1, max_size=4).map("".join)
    group = st.lists(seq, min_size=1, max_size=3).map(lambda alts: "(" + "|".join(alts) + ")")
    body = st.lists(st.one_of(quantified, group, group.map(lambda g: g + "+")), min_size=1,
                    max_size=3).map("".join)
    return st.tuples(st.sampled_from(["", "", "^", r"\A", "(?s)"]), body,
                     st.sampled_from(["", "", "$", r"\Z"])).map("".join)


@settings(max_examples=1500, deadline=None)
@example(r"\d", "\u0663", 0)  # \d: a Unicode digit (ASCII-only in RE2's own \d)
@example(r"\w\b", "\u00e9", 0)
@example(r"a$", "a\n", 0)  # $ before a final newline
@example(r"a\Z", "a\n", 0)
@example(r"^a", "ba", 1)  # ^ is the text's start, not the search's
@example(r"(?s)a.b", "a\nb", 0)
@example(r"\s", "\u2003", 0)
@example(r"[^\W\d]", "\u00b2", 0)
@given(patterns(), st.text(ALPHABET, max_size=12), st.integers(0, 12))
def test_rE2_finds_a_match_exactly_when_the_regex_package_does(pattern: str, text: str, start: int) -> None:
    try:
        reference = regex.compile(pattern)
    except regex.error:
        assume(False)
        return
    linear = compile_linear(pattern)
    if linear is None:
        return  # the regex package searches it (see the next test for what that is)
    start = min(start, len(text))
    assert linear.found(text, start) == (reference.search(text, start) is not None), linear.re2_pattern


def test_the_generated_patterns_mostly_run_on_rE2() -> None:
    """The property above is not vacuous: the constructs it draws from all translate."""
    for atom in ATOMS:
        for pattern in (atom, f"^({atom}|b)+{atom}$", rf"\A{atom}*?\Z", f"(?s){atom}{{2}}"):
            assert to_re2(pattern) is not None, pattern


@pytest.mark.parametrize("pattern", [
    r"\bword", r"a\B", r"a(?=b)", r"(?<!x)y", r"(a)\1", r"(?P<n>a)(?P=n)", "a++", "(?>ab)",
    "(?i)stop", "(?m)^a", "(?a)\\w", "(?x)a b(?i:c)", "a$b", "(a$)b", r"\p{L}", "a{1001}",
])
def test_what_the_two_engines_read_differently_stays_on_the_regex_package(pattern: str) -> None:
    assert compile_linear(pattern) is None
    rx = compile_stop_regex(pattern)[0]
    assert rx.linear is None and rx.compiled.pattern == pattern


def test_a_pattern_that_backtracks_for_ever_is_linear_on_rE2() -> None:
    """``^(a|aa)+b`` on a run of a's takes the regex package exponential time (~2 s at 30 a's);
    on RE2 32 searches of a run of 5,000 take well under a step's budget."""
    rx = compile_stop_regex(r"^(a|aa)+b")[0]
    assert rx.linear is not None
    budget, t0 = StepBudget(), time.perf_counter()
    assert first_match([rx] * 32, "a" * 5_000, 0, 4_999, budget) is None
    assert time.perf_counter() - t0 < 1.0 and budget.left > 0
    assert first_match([rx], "a" * 99 + "b", 0, 99, StepBudget()) is rx


def test_first_match_reports_the_first_pattern_in_order_on_either_engine() -> None:
    both = compile_stop_regex([r"x(?=y)", r"\d+", r"z"])  # a lookahead (regex package), two on RE2
    assert [rx.linear is None for rx in both] == [True, False, False]
    assert first_match(both, "xy 12 z", 0, 0, StepBudget()) is both[0]
    assert first_match(both, "12 z", 0, 0, StepBudget()) is both[1]
    assert first_match(both, "z", 0, 0, StepBudget()) is both[2]
    spent = StepBudget(used=1.0)
    with pytest.raises(ValueError, match="in one step"):
        first_match(both, "nothing", 0, 0, spent)


def test_a_lone_surrogate_is_searched_by_the_regex_package() -> None:
    rx = compile_stop_regex(r"a\d")[0]
    assert rx.linear is not None
    assert rx.found("\ud800a1", 0, 0, StepBudget()) and not rx.found("\ud800ab", 0, 0, StepBudget())


A = ord("a")


def test_32_slow_patterns_no_longer_fail_a_request_or_change_its_tokens(make_llm: Any, helpers: Any) -> None:
    """Issue 40's 32 slow stop regexes (``^(a|aa)+b`` ... on an output forced to a run of a's)
    failed their request once a step's searches passed the budget; on RE2 the request runs to
    its length with exactly the tokens it has without them, and its neighbour is unchanged."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    good = helpers.tokens(1, 20)
    plain = SamplingParams(n=4, temperature=0.0, max_tokens=64, ignore_eos=True, allowed_token_ids=[A])
    slow = SamplingParams(n=4, temperature=0.0, max_tokens=64, ignore_eos=True, allowed_token_ids=[A],
                          stop_regex=[rf"^(a|aa)+{c}" for c in "0123456789bcdefghijklmnopqrstuvw"])
    assert all(rx.linear is not None for rx in slow.stop_regexes)
    prompt = helpers.tokens(5, 8)
    reference = make_llm().generate([good, prompt], [greedy, plain])
    llm = make_llm()
    outs = llm.generate([good, prompt], [greedy, slow])
    assert outs[1].error is None
    assert [o.finish_reason for o in outs[1].outputs] == ["length"] * 4
    assert [o.token_ids for o in outs[1].outputs] == [o.token_ids for o in reference[1].outputs]
    assert outs[0].outputs[0].token_ids == reference[0].outputs[0].token_ids
    helpers.assert_no_leak(llm)


def test_what_rE2_compiles_for_one_request_is_bounded_and_the_rest_backtracks() -> None:
    """RE2 compiles on the server's event loop (a class such as ``\\w`` ~0.6 ms, ``\\w{200}``
    6 ms only to give up): one request's patterns may cost MAX_LINEAR_COST together; past it
    a pattern is searched by the regex package (same matches, the backtracking budget)."""
    from prefixkv.engine.linear_regex import MAX_LINEAR_COST, linear_cost

    assert linear_cost(r"\w") == len(to_re2(r"\w") or "") > 10_000  # Python's Unicode \w, written out
    assert linear_cost(r"\w{4}") == 4 * (linear_cost(r"\w") + 4) <= MAX_LINEAR_COST  # type: ignore[operator]
    assert linear_cost(r"\w{5}") is None  # over MAX_LINEAR_COST
    assert linear_cost(r"\w{200}") is None and compile_linear(r"\w{200}") is None
    assert to_re2(r"\w" * 100) is None  # 1.2 MB of RE2 text: not even written
    assert compile_stop_regex(r"\w{200}")[0].linear is None
    many = compile_stop_regex([rf"\w+x{i}" for i in range(32)])
    on_re2 = [rx.linear is not None for rx in many]
    assert on_re2[0] and not on_re2[-1] and on_re2 == sorted(on_re2, reverse=True)
    assert sum(linear_cost(rx.pattern) or 0 for rx in many if rx.linear) <= MAX_LINEAR_COST
    cheap = compile_stop_regex([rf"^(a|aa)+{c}" for c in "0123456789bcdefghijklmnopqrstuvw"])
    assert all(rx.linear is not None for rx in cheap)
    assert first_match(many, "hello ax9", 0, 0, StepBudget()) is many[9]  # backtracking
    assert first_match(many, "hello ax0", 0, 0, StepBudget()) is many[0]  # RE2
