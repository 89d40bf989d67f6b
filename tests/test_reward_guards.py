"""reward.settle_cheaply: degenerate answers settled in milliseconds, no legitimate label changed."""

import random
import time

import pytest

from bench.bench_reward import HOSTILE, legitimate_pairs, make_step
from grpo.grading import RewardScorer, default_num_workers
from reward import (
    PLAIN_NUMBER,
    compute_score,
    grade_symbolically,
    largest_exponent,
    largest_factorial,
    last_boxed,
    nesting_depth,
    settle_cheaply,
)

TRUTHS = ["48", "\\frac { 40 } { 3 }", "2 \\sqrt { 221 }", "12.5"]

# -----------------------------------------------------------------------------
# the measures


@pytest.mark.parametrize(
    "text, expected",
    [("48", 0), ("\\frac { 8 \\sqrt { 3 } } { 3 }", 2), ("((1))", 2), ("(" * 50, 50), ("{[(1)]}", 3), (")(", 1)],
)
def test_nesting_depth(text, expected):
    """Guards against unclosed or mixed brackets escaping the depth limit."""
    assert nesting_depth(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("48^\\circ", 0),
        ("48^{\\circ}", 0),
        ("x^2 + \\text{cm}^{2}", 2),
        ("2^{10}", 10),
        ("2^{-5000}", 5000),
        ("2^-5000", 5000),
        ("(9^9)^9", 9),  # a power of a power is no tower: 9^81
        ("9^99", 99),
        ("9^9^9", float("inf")),
        ("9 ^ 9 ^ 9", float("inf")),
        ("9^{9^{9}}", float("inf")),
        ("10^{10^{10^{10}}}", float("inf")),
        ("a^{(b^c)}", float("inf")),
        ("2^{x}", 0),
    ],
)
def test_largest_exponent(text, expected):
    """Guards against a power tower or a huge power reaching sympy, or a plain power counted as one."""
    assert largest_exponent(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("48", 0),
        ("5!", 5),
        ("1000000!", 1000000),
        ("(10^{6})!", float("inf")),
        ("x!", float("inf")),
        ("3\\!\\sqrt{2}", 0),
    ],
)
def test_largest_factorial(text, expected):
    """Guards against a huge factorial reaching sympy, or LaTeX's "\\!" spacing read as a factorial."""
    assert largest_factorial(text) == expected


# -----------------------------------------------------------------------------
# degenerate answers: milliseconds, no timeout


@pytest.fixture(scope="module")
def warm_graders():
    """sympy and math_verify's parser build their tables on first use (~1 s): once per worker, not per answer."""
    grade_symbolically("\\frac{7}{2}", "2 \\sqrt { 3 }")


@pytest.mark.parametrize("truth", TRUTHS)
@pytest.mark.parametrize("style", sorted(HOSTILE))
def test_hostile_styles_grade_fast(warm_graders, style, truth):
    """Guards against a degenerate answer costing seconds of sympy (a timeout in training) instead of milliseconds."""
    response = HOSTILE[style](random.Random(0))
    start = time.perf_counter()
    score = compute_score(response, truth)
    assert time.perf_counter() - start < 0.5
    # "junk_outside_box" boxes a legitimate 48: its junk is outside the box, where only the linear format check looks
    assert score["accuracy"] == float(style == "junk_outside_box" and truth == "48")
    if style != "junk_outside_box":
        assert settle_cheaply(last_boxed(response), truth) is False  # settled by a guard, not by luck in sympy


def test_hostile_styles_through_scorer_without_timeout():
    """Guards against a degenerate answer still needing the timeout when graded the way the trainer grades."""
    rng = random.Random(1)
    responses = [HOSTILE[style](rng) for style in sorted(HOSTILE) for _ in TRUTHS]
    truths = TRUTHS * len(HOSTILE)
    with RewardScorer(timeout=10.0, num_workers=default_num_workers()) as scorer:
        got = scorer.score(responses, truths)
    assert (scorer.n_timeouts, scorer.n_errors) == (0, 0)
    assert got == [compute_score(r, t) for r, t in zip(responses, truths)]


# -----------------------------------------------------------------------------
# legitimate answers: the guards never change a label


def test_guards_never_change_a_legitimate_label():
    """Guards against a guard marking a legitimate answer differently from mathruler + math_verify.

    Plain numbers on both sides are settled by value, which must agree with the graders; every other legitimate
    answer must reach the graders, untouched by the limits for degenerate ones."""
    pairs = legitimate_pairs(300, seed=0)
    assert sum(grade_symbolically(g, t) for g, t in pairs) > 50  # both labels well represented
    for given, truth in pairs:
        settled = settle_cheaply(given, truth)
        if PLAIN_NUMBER.fullmatch(given) and PLAIN_NUMBER.fullmatch(truth):
            assert settled == grade_symbolically(given, truth), (given, truth)
        else:
            assert settled is None, (given, truth)


@pytest.mark.parametrize(
    "given, truth",
    [
        # the longest, deepest and most powerful legitimate forms we could think of
        ("m \\angle ABC = 48^{\\circ}", "48"),
        ("\\text{the area is } 48 \\text{ square centimeters}", "48"),
        ("x = \\frac{12}{\\sin\\left(30^{\\circ}\\right)}", "24"),
        ("\\sqrt{\\left(\\frac{7}{2}\\right)^{2}+\\left(\\frac{5}{2}\\right)^{2}}", "\\frac { \\sqrt { 74 } } { 2 }"),
        ("y = \\frac{4\\left(\\sqrt{3}+1\\right)}{3} \\text{ cm}^{2}", "\\frac { 4 \\sqrt { 3 } + 4 } { 3 }"),
        ("m \\angle ABC = 2 \\sqrt { 221 } \\text{ units}^{2}", "2 \\sqrt { 221 }"),
        ("2^{10}", "1024"),
        ("5!", "120"),
        ("29.732137494637012", "2 \\sqrt { 221 }"),
    ],
)
def test_extreme_legitimate_forms_reach_the_graders(given, truth):
    """Guards against limits set so tight that an unusual but legitimate answer is settled without the graders."""
    assert settle_cheaply(given, truth) is None


# -----------------------------------------------------------------------------
# a step-sized batch


def test_step_sized_batch_grades_without_timeouts():
    """Guards against grading a step still needing timeouts when 2 % of it is degenerate, or workers grading
    differently from a direct call. (Its time is measured in bench/bench_reward.py, not asserted here.)"""
    responses, truths, styles = make_step(prompts=100, n=5, hostile_fraction=0.02, seed=1)
    assert sum(s is not None for s in styles) == 10
    with RewardScorer(timeout=10.0, num_workers=default_num_workers()) as scorer:
        got = scorer.score(responses, truths)
    assert (scorer.n_timeouts, scorer.n_errors) == (0, 0)
    assert got == [compute_score(r, t) for r, t in zip(responses, truths)]
