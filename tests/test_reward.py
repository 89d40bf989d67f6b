import random
import re
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, where reward.py lives

from grpo.grading import (  # noqa: E402
    MAX_DEFAULT_WORKERS,
    RewardScorer,
    call_reward,
    default_num_workers,
    equal_reward_groups,
    keyword_columns,
    load_reward_fn,
    peer_contract,
)
from reward import (  # noqa: E402
    FORMAT_REGEX,
    compute_score,
    compute_score_think_answer,
    digit_fraction,
    has_format,
    has_think_answer_format,
    is_equivalent,
    last_boxed,
    think_answer,
)

# -----------------------------------------------------------------------------
# format


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<think>a</think> so \\boxed{3}", True),
        ("  \n<think>a\nb</think>\n\\boxed{\\frac{7}{2}} done\n ", True),  # surrounding whitespace is stripped
        ("<think></think>\\boxed{}", True),
        ("<think>a</think> \\boxed{\\frac{7}{2}}", True),  # nested braces
        ("a</think> \\boxed{3}", False),  # missing <think>
        ("<think>a \\boxed{3}", False),  # missing </think>
        ("<think>a \\boxed{3}</think>", False),  # boxed inside the thinking only
        ("\\boxed{3}<think>a</think>", False),  # boxed before think
        ("<think>a</think> the answer is 3", False),  # no boxed
        ("<think>a</think> \\boxed{3", False),  # boxed never closed
        ("x <think>a</think> \\boxed{3}", False),  # text before <think>
    ],
)
def test_format(response, expected):
    """Guards against rewarding (or not rewarding) the <think>...</think> ... \\boxed{} format wrongly."""
    assert has_format(response) is expected
    assert bool(re.fullmatch(FORMAT_REGEX, response.strip(), re.DOTALL)) is expected


def test_format_agrees_with_regex_on_random_strings():
    """Guards against the linear-time format check drifting from the regex the recipe specifies."""
    pieces = ["<think>", "</think>", "\\boxed{", "{", "}", "x", " ", "\n"]
    rng = random.Random(0)
    for _ in range(5000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        assert has_format(text) == bool(re.fullmatch(FORMAT_REGEX, text.strip(), re.DOTALL)), text


def test_format_is_fast_on_degenerate_output():
    """Guards against regex backtracking: this string takes the spec regex ~30 s."""
    text = "<think>" + "</think>\\boxed{" * 2000
    start = time.monotonic()
    assert has_format(text) is False
    assert time.monotonic() - start < 0.1


# -----------------------------------------------------------------------------
# answer extraction


@pytest.mark.parametrize(
    "text, expected",
    [
        ("\\boxed{3}", "3"),
        ("first \\boxed{2} then \\boxed{ 5 }", "5"),  # the last boxed is the answer, stripped
        ("\\boxed{\\frac{7}{2}}", "\\frac{7}{2}"),
        ("\\boxed{2 \\sqrt { 221 }} cm", "2 \\sqrt { 221 }"),
        ("\\boxed{{a}{b}}", "{a}{b}"),
        ("\\boxed{2} and \\boxed{\\frac{7}{2}", None),  # the last one is unclosed: truncated, no answer
        ("the answer is 3", None),
        ("", None),
    ],
)
def test_last_boxed(text, expected):
    """Guards against grading the wrong boxed answer or cutting nested braces short."""
    assert last_boxed(text) == expected


# -----------------------------------------------------------------------------
# accuracy


@pytest.mark.parametrize(
    "given, ground_truth",
    [
        ("2\\sqrt{221}", "2 \\sqrt { 221 }"),
        ("\\sqrt{884}", "2 \\sqrt { 221 }"),
        ("y = 2\\sqrt{221}", "2 \\sqrt { 221 }"),
        ("\\frac{40}{3}", "\\frac { 40 } { 3 }"),
        ("\\dfrac{40}{3}", "\\frac { 40 } { 3 }"),
        ("40/3", "\\frac { 40 } { 3 }"),
        ("12.50", "12.5"),
        ("12.5", "12.50"),
        ("48.0", "48"),
        ("48^\\circ", "48"),
        ("48^{\\circ}", "48"),
        ("48°", "48"),
        ("48 degrees", "48"),
        ("x = 48", "48"),
        ("x=48", "48"),
        ("\\angle A = 48^\\circ", "48"),
        ("48 cm", "48"),
        ("48 \\text{ cm}", "48"),
        ("48 cm^2", "48"),
        ("48\\text{cm}^2", "48"),
        ("48 units", "48"),
        ("\\frac{8}{\\sqrt{3}}", "\\frac { 8 \\sqrt { 3 } } { 3 }"),
        ("4\\pi", "4 \\pi"),
    ],
)
def test_equivalent_answer_styles(given, ground_truth):
    """Guards against marking a correct answer wrong because of its notation."""
    assert is_equivalent(given, ground_truth)


@pytest.mark.parametrize(
    "given, ground_truth",
    [
        ("49", "48"),
        ("-48", "48"),
        ("4.8", "48"),
        ("x = 49", "48"),
        ("48, 49", "48"),
        ("48 + x", "48"),
        ("\\frac{3}{40}", "\\frac { 40 } { 3 }"),
        ("3/40", "\\frac { 40 } { 3 }"),
        ("13.33", "\\frac { 40 } { 3 }"),
        ("29.73", "2 \\sqrt { 221 }"),
        ("2\\sqrt{220}", "2 \\sqrt { 221 }"),
        ("12.57", "4 \\pi"),
        ("", "48"),
    ],
)
def test_wrong_answers_grade_zero(given, ground_truth):
    """Guards against a lenient grader paying reward for wrong answers."""
    assert not is_equivalent(given, ground_truth)


# -----------------------------------------------------------------------------
# overall score


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<think>r</think> \\boxed{\\frac{40}{3}}", (1.0, 1.0, 1.0)),
        ("so \\boxed{\\frac{40}{3}}", (0.9, 0.0, 1.0)),  # correct but unformatted
        ("<think>r</think> \\boxed{\\frac{3}{40}}", (0.1, 1.0, 0.0)),  # formatted but wrong
        ("<think>r</think> \\boxed{7} no, \\boxed{\\frac{40}{3}}", (1.0, 1.0, 1.0)),  # last boxed counts
        ("<think>r</think> the answer is 40/3", (0.0, 0.0, 0.0)),  # no boxed, no accuracy
    ],
)
def test_compute_score(response, expected):
    """Guards against wrong weighting of accuracy and format in the overall reward."""
    score = compute_score(response, "\\frac { 40 } { 3 }")
    assert (score["overall"], score["format"], score["accuracy"]) == pytest.approx(expected)


BOX = ("<|begin_of_box|>", "<|end_of_box|>")


@pytest.mark.parametrize(
    "response, answer, formatted, expected",
    [
        # GLM-4.1V-Thinking's own form: the value in its box tokens inside the answer block
        (f"<think>r</think><answer>{BOX[0]}\\frac{{40}}{{3}}{BOX[1]}</answer>", "\\frac{40}{3}", True, (1.0, 1.0, 1.0)),
        (f" <think>r\n</think>\n<answer>So x = {BOX[0]}40/3{BOX[1]}.</answer>\n", "40/3", True, (1.0, 1.0, 1.0)),
        ("<think>r</think><answer>\\boxed{\\frac{40}{3}}</answer>", "\\frac{40}{3}", True, (1.0, 1.0, 1.0)),
        ("<think>r</think><answer> 40/3 </answer>", "40/3", True, (1.0, 1.0, 1.0)),  # plain
        (f"<think>r</think><answer>{BOX[0]}\\frac{{3}}{{40}}{BOX[1]}</answer>", "\\frac{3}{40}", True, (0.1, 1.0, 0.0)),
        ("<think>r</think><answer>13.33</answer>", "13.33", True, (0.1, 1.0, 0.0)),  # wrong: rounded
        # the last box counts, the answer block's, never the thinking's
        (f"<think>{BOX[0]}7{BOX[1]}</think><answer>{BOX[0]}7{BOX[1]} or {BOX[0]}40/3{BOX[1]}</answer>", "40/3",
         True, (1.0, 1.0, 1.0)),
        ("<think>so \\boxed{\\frac{40}{3}}</think>", None, False, (0.0, 0.0, 0.0)),  # the think block only
        ("<think>r</think>", None, False, (0.0, 0.0, 0.0)),
        ("<think><answer>40/3</answer>", None, False, (0.0, 0.0, 0.0)),  # </think> missing: still thinking
        # missing or malformed tags: no format credit; an answer block after the thinking still grades
        ("<answer>40/3</answer>", "40/3", False, (0.9, 0.0, 1.0)),  # no think block
        ("<think>r</think> 40/3", None, False, (0.0, 0.0, 0.0)),  # no answer block
        ("<think>r</think><answer>40/3", None, False, (0.0, 0.0, 0.0)),  # cut off before </answer>
        (f"<think>r</think><answer>{BOX[0]}40/3</answer>", None, True, (0.1, 1.0, 0.0)),  # box never closed
        ("<think>r</think>so<answer>40/3</answer>", "40/3", False, (0.9, 0.0, 1.0)),  # text between the blocks
        ("<think>r</think><answer>7</answer><answer>40/3</answer>", "40/3", False, (0.9, 0.0, 1.0)),  # two blocks
        ("<think>r</think><answer>40/3</answer> done", "40/3", False, (0.9, 0.0, 1.0)),  # text after the answer
        ("x<think>r</think><answer>40/3</answer>", "40/3", False, (0.9, 0.0, 1.0)),  # text before <think>
        ("<think>r</think><answer> </answer>", None, True, (0.1, 1.0, 0.0)),  # an empty answer
    ],
)  # fmt: skip
def test_think_answer_score(response, answer, formatted, expected):
    """Guards against the GLM-4.1V recipe's reward grading the wrong part of an answer (a box in the thinking, the
    first of two, the text around the box tokens), crediting a malformed or cut-off answer, or weighting its parts
    otherwise than compute_score does."""
    assert think_answer(response) == answer
    assert has_think_answer_format(response) is formatted
    score = compute_score_think_answer(response, "\\frac { 40 } { 3 }")
    assert (score["overall"], score["format"], score["accuracy"]) == pytest.approx(expected)


def test_think_answer_is_fast_on_degenerate_output():
    """Guards against the format check or the extraction backtracking on the degenerate outputs RL policies write."""
    for junk in ("<think></think><answer>" * 20000, "<answer></think><|begin_of_box|>" * 20000):
        start = time.perf_counter()
        compute_score_think_answer(junk, "3")
        assert time.perf_counter() - start < 0.5


def test_digit_fraction():
    """Guards against the CPU demo's toy reward counting whitespace or non-ASCII digits."""
    assert digit_fraction("12 ab", "") == {"overall": 0.5, "format": 0.0, "accuracy": 1.0}
    assert digit_fraction("1 a b", "")["accuracy"] == 0.0
    assert digit_fraction("٣٣ 12", "")["overall"] == 0.5  # Arabic-Indic digits are not ASCII digits
    assert digit_fraction(" \n", "")["overall"] == 0.0


# -----------------------------------------------------------------------------
# RewardScorer

RESPONSES = ["<think>r</think> \\boxed{48^\\circ}", "\\boxed{49}", "no answer", "<think>r</think> \\boxed{12.50}"]
GROUND_TRUTHS = ["48", "48", "48", "12.5"]


def test_direct_path_matches_compute_score():
    """Guards against the in-process path (timeout=None) scoring differently from the reward function."""
    scorer = RewardScorer(timeout=None)
    assert scorer.score(RESPONSES, GROUND_TRUTHS) == [compute_score(r, g) for r, g in zip(RESPONSES, GROUND_TRUTHS)]


def test_workers_match_direct_path_in_order():
    """Guards against a worker pool returning results out of order or different from a direct call."""
    with RewardScorer(timeout=5.0, num_workers=2) as scorer:
        got = scorer.score(RESPONSES * 3, GROUND_TRUTHS * 3)
        workers = [w.proc for w in scorer._workers]
    assert got == [compute_score(r, g) for r, g in zip(RESPONSES * 3, GROUND_TRUTHS * 3)]
    assert (scorer.n_timeouts, scorer.n_errors) == (0, 0)
    assert not any(proc.is_alive() for proc in workers)  # the context manager leaves no orphan processes


MAIN_SCRIPT = """
import os, sys
sys.path.insert(0, sys.argv[1])
if __name__ == "__mp_main__":  # spawn's re-run of this script in a child
    open(sys.argv[2], "a").write("imported")
if __name__ == "__main__":
    import reward
    with reward.RewardScorer("reward.py:digit_fraction", timeout=30.0, num_workers=2) as scorer:
        print(scorer.score(["1 2 3", "7"], ["3", "3"]))
    print(__spec__, __file__ == sys.argv[0])
"""


def test_workers_start_without_the_trainers_main_script(tmp_path):
    """Guards against each grading worker importing the trainer's script again (spawn runs the parent's main
    script in the child): seconds of torch and FSDP imports at every worker start, on every rank. The workers still
    grade, and the script's own __spec__ and __file__ are as they were."""
    import subprocess

    script, marker = tmp_path / "main_script.py", tmp_path / "imported"
    script.write_text(MAIN_SCRIPT)
    repo = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, str(script), repo, str(marker)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    scores, main_state = out.stdout.splitlines()
    assert __import__("ast").literal_eval(scores) == [digit_fraction("1 2 3", "3"), digit_fraction("7", "3")]
    assert main_state == "None True"
    assert not marker.exists()


USER_REWARD = """
import os

def length_reward(response, ground_truth):
    if response == "raise":
        raise RuntimeError("bad input")
    if response == "crash":
        os._exit(3)
    if response == "hang":  # one big-int power of minutes, as sympy computes on 9^{9^{9}}: no signal interrupts it
        9 ** 9 ** 9
    return {"overall": len(response) / 10, "format": 0.0, "accuracy": float(response == ground_truth), "length": 1.0}
"""


@pytest.fixture
def user_spec(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_REWARD)
    return f"{path}:length_reward"


def test_hung_grader_times_out_and_scorer_recovers(user_spec):
    """Guards against a hung grader hanging training: sympy runs for minutes on some hostile answers (9^{9^{9}} did,
    before reward.settle_cheaply), in one big-int operation that only killing the worker can stop."""
    with RewardScorer(user_spec, timeout=1.0) as scorer:
        scorer.score(["x"], ["x"])  # let the worker start before timing
        start = time.monotonic()
        got = scorer.score(["hang", "abcde"], ["", "abcde"])
        assert time.monotonic() - start < 1.0 + 5.0
        assert got[0] == {"overall": 0.0, "format": 0.0, "accuracy": 0.0, "length": 0.0}  # zeros, every key
        assert got[1]["accuracy"] == 1.0  # the replacement worker grades the next item
        assert (scorer.n_timeouts, scorer.n_errors) == (1, 0)
        assert scorer.score(["xyz"], ["xyz"])[0]["accuracy"] == 1.0


def test_user_reward_file_runs_in_workers(user_spec):
    """Guards against user rewards failing to load by path in the worker, or losing their extra keys."""
    with RewardScorer(user_spec, timeout=5.0) as scorer:
        got = scorer.score(["abcde", "xy"], ["abcde", "z"])
    assert got == [
        {"overall": 0.5, "format": 0.0, "accuracy": 1.0, "length": 1.0},
        {"overall": 0.2, "format": 0.0, "accuracy": 0.0, "length": 1.0},
    ]


@pytest.mark.parametrize("timeout", [None, 5.0])
def test_exception_in_user_reward_gives_zeros(user_spec, timeout):
    """Guards against one bad item crashing the batch, or its zeros missing keys the other items have."""
    with RewardScorer(user_spec, timeout=timeout) as scorer:
        got = scorer.score(["raise", "abcde"], ["", "abcde"])
    assert got[0] == {"overall": 0.0, "format": 0.0, "accuracy": 0.0, "length": 0.0}
    assert got[1]["accuracy"] == 1.0
    assert (scorer.n_errors, scorer.n_timeouts) == (1, 0)
    assert "bad input" in scorer.last_error


def test_worker_crash_gives_zeros_and_recovers(user_spec):
    """Guards against a dying worker (segfault, os._exit) hanging or killing the batch."""
    with RewardScorer(user_spec, timeout=5.0) as scorer:
        got = scorer.score(["crash", "abcde"], ["", "abcde"])
    assert got[0]["overall"] == 0.0 and got[1]["accuracy"] == 1.0
    assert (scorer.n_errors, scorer.n_timeouts) == (1, 0)


# -----------------------------------------------------------------------------
# the contract of a user's reward: what it returns, what it gets, what stops the run

CONTRACT_REWARDS = """
def as_float(response, ground_truth):
    return float(response == ground_truth)

def as_string(response, ground_truth):
    return "1.0"

def raising(response, ground_truth):
    raise KeyError("no such key")

def with_columns(response, ground_truth, question, level, prompt=None):
    return {"overall": float(level), "asked": float(question.endswith("?")), "prompted": float(prompt is not None)}

def with_kwargs(response, ground_truth, **columns):
    return {"overall": 1.0, "n_columns": float(len(columns)), "has_question": float("question" in columns)}
"""


def test_call_reward_takes_a_number_or_a_dict_with_overall():
    """Guards against a float-returning reward (TRL's kind, verl's compute_score may return one) scoring 0 on every
    answer with an uncounted TypeError, and against a wrong value passing as a score."""
    assert call_reward(lambda r, g: 0.25, "x", "y") == {"overall": 0.25}
    assert call_reward(lambda r, g: 1, "x", "y") == {"overall": 1.0}
    assert call_reward(lambda r, g: {"overall": 1, "format": 0.5}, "x", "y") == {"overall": 1.0, "format": 0.5}
    # one value as numpy and torch compute it (a comparison's numpy bool, a reduction's 0-d tensor)
    import numpy as np
    import torch

    got = call_reward(lambda r, g: {"overall": np.bool_(True), "format": torch.tensor(0.5)}, "x", "y")
    assert got == {"overall": 1.0, "format": 0.5} and all(type(v) is float for v in got.values())
    assert call_reward(lambda r, g: np.array(0.25), "x", "y") == {"overall": 0.25}
    for value, message in (("1.0", "returned str '1.0'"), ({"accuracy": 1.0}, "returned dict"),
                           (None, "returned NoneType"), ({"overall": 1.0, "note": "x"}, "'note' is 'x'"),
                           (float("nan"), "'overall' is nan, not a finite number"),
                           (torch.tensor([1.0, 0.0]), "returned Tensor")):  # fmt: skip
        with pytest.raises(TypeError, match=re.escape(message)):
            call_reward(lambda r, g, v=value: v, "x", "y")


def test_keyword_columns_follow_the_signature():
    """Guards against a reward getting arguments it did not ask for (a TypeError on every answer) or not getting the
    ones it names: the two positional ones stay as they were, further names and **kwargs ask for the row."""
    assert keyword_columns(lambda response, ground_truth: 0) == frozenset()
    assert keyword_columns(lambda r, g, question, *, image=None: 0) == {"question", "image"}
    assert keyword_columns(lambda r, g, **kw: 0) is True
    assert keyword_columns(len) == frozenset()  # no signature: called with the two


@pytest.fixture
def contract_file(tmp_path):
    path = tmp_path / "contract.py"
    path.write_text(CONTRACT_REWARDS)
    return str(path)


@pytest.mark.parametrize("timeout", [None, 5.0])
def test_keyword_columns_reach_the_function(contract_file, timeout):
    """Guards against the question, the prompt and the row's columns not reaching a reward that asks for them, in the
    rank and in the worker processes, and against a reward that asks for nothing getting them."""
    from types import SimpleNamespace

    ex = SimpleNamespace(problem="<image>What is x?", prompt="<chat>What is x?</chat>", answer="3",
                         columns={"level": 4, "answer": "3", "image": {"bytes": b"png"}})  # fmt: skip
    with RewardScorer(f"{contract_file}:with_columns", timeout=timeout) as scorer:
        assert scorer.columns == {"question", "level", "prompt"}
        got = scorer.score(["a", "b"], ["3", "3"], [ex, ex])
    assert got == [{"overall": 4.0, "asked": 1.0, "prompted": 1.0}] * 2
    assert scorer.extra_keys() == ["asked", "prompted"]
    with RewardScorer(f"{contract_file}:with_kwargs", timeout=timeout) as scorer:
        got = scorer.score(["a"], ["3"], [ex])
    assert got[0]["n_columns"] == 5 and got[0]["has_question"] == 1.0  # level, answer, image, question, prompt
    with RewardScorer(f"{contract_file}:as_float", timeout=timeout) as scorer:
        assert scorer.score(["3", "4"], ["3", "3"], [ex, ex]) == [{"overall": 1.0}, {"overall": 0.0}]


@pytest.mark.parametrize("name, error", [("as_string", "TypeError: the reward function returned str '1.0'"),
                                         ("raising", "KeyError: 'no such key'")])  # fmt: skip
@pytest.mark.parametrize("timeout", [None, 5.0])
def test_a_reward_failing_on_every_answer_stops_with_its_error(contract_file, name, error, timeout):
    """Guards against a reward that fails on every answer training a whole run at reward 0 with exit 0: the step stops
    on every rank (the caller has compared the ranks), in one line with the function's error and the answer."""
    with RewardScorer(f"{contract_file}:{name}", timeout=timeout) as scorer:
        scorer.score(["answer one", "answer two"], ["1", "2"])
        assert scorer.all_failed() and scorer.n_errors == 2
        with pytest.raises(SystemExit) as stop:
            scorer.report_failures(1, everywhere=True, first_rank=0, rank=0)
    message = str(stop.value)
    assert message.startswith("error: step 1: the reward function failed on every answer") and "\n" not in message
    assert error in message and "(on the answer 'answer one')" in message
    assert f"reward.reward_fn={contract_file}:{name}" in message


def test_isolated_failures_print_the_first_error_once_a_step(user_spec, capsys):
    """Guards against isolated failures (one hostile answer) stopping the run, printing nothing, or printing on every
    rank and every round: the first rank with a failure prints its first error, once a step."""
    with RewardScorer(user_spec, timeout=None) as scorer:
        scorer.score(["raise", "abcde"], ["", "abcde"])
        assert not scorer.all_failed()
        scorer.report_failures(3, everywhere=False, first_rank=0, rank=0)
        scorer.report_failures(3, everywhere=False, first_rank=0, rank=0)  # a second round of step 3
        scorer.report_failures(4, everywhere=False, first_rank=1, rank=0)  # rank 1 prints step 4's
    out = capsys.readouterr().out
    assert out.count("reward: step") == 1 and "step 3: 1 of 2 answers on rank 0 failed to grade" in out
    assert "RuntimeError: bad input (on the answer 'raise')" in out


# Rewards as verl, EasyR1 (batch and sequential) and TRL call them, as users bring them
PEER_REWARDS = """
def verl_form(data_source, solution_str, ground_truth, extra_info=None):
    return float(ground_truth in solution_str)

def easyr1_batch(reward_inputs, format_weight=0.1):
    if not isinstance(reward_inputs, list):
        raise ValueError("Please use `reward_type=batch` for this reward function.")
    return [{"overall": float(x["ground_truth"] in x["response"]), "accuracy": 1.0} for x in reward_inputs]

def easyr1_sequential(reward_input, format_weight=0.5):
    return {"overall": float(reward_input["ground_truth"] in reward_input["response"])}

def trl_form(completions, solution, **kwargs):
    return [float(s in c) for c, s in zip(completions, solution)]

def trl_with_prompts(prompts, completions, solution):
    assert all("question" in p for p in prompts)
    return [float(s in c) for c, s in zip(completions, solution)]

def verl_dict(response, ground_truth):
    return {"score": float(ground_truth in response), "acc": 1.0}
"""


@pytest.mark.parametrize(
    "name, form",
    [
        ("verl_form", "verl's"),
        ("easyr1_batch", "EasyR1's batch form"),
        ("easyr1_sequential", "EasyR1's sequential form"),
        ("trl_form", "TRL's form"),
        ("trl_with_prompts", "TRL's form"),
    ],
)
def test_a_reward_written_for_another_trainer_is_named_with_a_wrapper_that_grades(tmp_path, name, form):
    """Guards against a reward brought from verl, EasyR1 or TRL stopping the run with an error of its own (a missing
    argument, a string indexed as a dict, a list returned, another trainer's config key) that does not say why: the
    stop names the form and the wrapper to write, and that wrapper, run as written, grades."""
    (tmp_path / "peer.py").write_text(PEER_REWARDS)
    spec = f"{tmp_path / 'peer.py'}:{name}"
    with RewardScorer(spec, timeout=None) as scorer:
        scorer.score(["the answer is 3", "no"], ["3", "3"])
        assert scorer.all_failed()
        with pytest.raises(SystemExit) as stop:
            scorer.report_failures(1, everywhere=True, first_rank=0, rank=0)
    assert form in str(stop.value) and f"reward.reward_fn={spec}" in str(stop.value)
    fn = load_reward_fn(spec)
    code = peer_contract(fn).split("wrap it, ", 1)[1].split(" (")[0]  # "def score(response, ground_truth): ..."
    namespace = {name: fn}
    exec(code, namespace)
    score, columns = namespace["score"], {"prompt": "the question"}  # (a column it asks for: the chat text)
    columns = {k: v for k, v in columns.items() if k in keyword_columns(score)}
    assert [call_reward(score, r, "3", **columns)["overall"] for r in ("the answer is 3", "no")] == [1.0, 0.0]


def test_a_reward_that_grades_is_no_peer_s_and_a_verl_score_dict_is_named():
    """Guards against the peer check naming a function of this trainer's contract, and a verl-style dict (its reward
    under 'score') failing without the key it needs."""
    assert peer_contract(digit_fraction) is None and peer_contract(compute_score) is None
    with pytest.raises(TypeError, match="rename its score to overall"):
        call_reward(lambda response, ground_truth: {"score": 1.0}, "a", "b")


def test_a_reward_imports_the_modules_beside_it(tmp_path):
    """Guards against a reward file that imports its own helper module (beside it, as a script would) failing with
    ModuleNotFoundError in the trainer and in its grading processes, at load and inside its calls; and against its
    folder shadowing the trainer's modules once it has loaded."""
    (tmp_path / "beside_grading.py").write_text("def same(a, b):\n    return float(a == b)\n")
    (tmp_path / "beside_weight.py").write_text("WEIGHT = 2.0\n")
    (tmp_path / "graded.py").write_text(
        "from beside_grading import same\n\n\ndef score(response, ground_truth):\n"
        "    import beside_weight\n\n    return same(response, ground_truth) * beside_weight.WEIGHT\n"
    )
    for timeout in (None, 5.0):  # here, and in the grading processes
        with RewardScorer(f"{tmp_path / 'graded.py'}:score", timeout=timeout) as scorer:
            assert [r["overall"] for r in scorer.score(["3", "4"], ["3", "3"])] == [2.0, 0.0]
    assert sys.path.index(str(tmp_path)) > 0 and sys.path[-1] == str(tmp_path)


def test_a_misspelled_function_lists_the_file_s_functions(contract_file):
    """Guards against a typo in reward.reward_fn naming only what is missing, not what the file has."""
    with pytest.raises(ValueError, match="has no function 'as_flaot' .its functions: as_float, as_string, raising"):
        load_reward_fn(f"{contract_file}:as_flaot")


@pytest.mark.parametrize(
    "spec",
    ["my_reward.py", "my_reward.py:", "does_not_exist.py:f", "my_reward.py:missing", "my_reward.txt:length_reward"],
)
def test_bad_specs_raise_value_error(user_spec, spec, monkeypatch):
    """Guards against a typo in the reward spec failing late, deep in a worker, or with an unclear error."""
    monkeypatch.chdir(Path(user_spec.rpartition(":")[0]).parent)
    with pytest.raises(ValueError, match=re.escape(repr(spec))):
        load_reward_fn(spec)
    with pytest.raises(ValueError):
        RewardScorer(spec)


def test_default_spec_found_from_any_cwd(tmp_path, monkeypatch):
    """Guards against the default "reward.py:compute_score" only working when run from the repo root."""
    monkeypatch.chdir(tmp_path)
    assert load_reward_fn("reward.py:compute_score")("\\boxed{2}", "2")["accuracy"] == 1.0


def test_a_bare_name_finds_the_package_module(tmp_path, monkeypatch):
    """Guards against the shipped tools' specs ("tools.py:crop", in configs and docs) breaking when tools.py moved
    into grpo/, and against such a module being loaded a second time, as a copy with classes of its own."""
    from grpo import tools

    monkeypatch.chdir(tmp_path)
    assert load_reward_fn("tools.py:calculate") is tools.calculate
    with pytest.raises(ValueError, match="not found"):
        load_reward_fn("nofile.py:crop")
    (tmp_path / "tools.py").write_text("def calculate(arguments, images):\n    return 'mine'\n")
    assert load_reward_fn("tools.py:calculate")({}, []) == "mine"  # the cwd's file of that name comes first


@pytest.mark.parametrize(
    "cores, local_ranks, expected",
    [(2, 1, 2), (16, 1, MAX_DEFAULT_WORKERS), (16, 8, 2), (16, 4, 4), (4, 8, 1), (1, 1, 1)],
)
def test_default_num_workers_shares_the_cores(monkeypatch, cores, local_ranks, expected):
    """Guards against one rank's graders taking every core of the node, or a rank getting none."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert default_num_workers(local_ranks) == expected


def test_num_workers_below_one_is_rejected():
    """Guards against num_workers=0 (the trainer's "auto") reaching the scorer, whose score() would then never end."""
    with pytest.raises(ValueError, match="default_num_workers"):
        RewardScorer(num_workers=0)


def test_trainer_imports_and_scores_the_toy_reward_without_the_graders():
    """Guards against the geo3k grading libraries being a hard import: a GPU box with torch and transformers but not
    mathruler / math-verify could not even import the trainer to run the toy reward (bench/gpu_check.py). Only the
    geo3k grader may need them, and it says which one is missing."""
    import subprocess

    code = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("mathruler", "math_verify"):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Block())
import train_grpo, reward
from grpo.grading import load_reward_fn
assert load_reward_fn("reward.py:digit_fraction")("12ab", "")["overall"] == 0.5
try:
    reward.compute_score("<think>x</think> \\\\boxed{\\\\frac{7}{2}}", "3.5")
except ModuleNotFoundError as e:
    print("geo3k grader:", e)
"""
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "geo3k grader: No module named" in out.stdout, out.stdout


def test_equal_reward_groups_counts_groups_without_an_advantage():
    """Guards against reward/zero_std_groups counting answers instead of groups, or groups across prompts: consecutive
    groups of n, each counted when its n rewards are one value (all right, all wrong, or all the same partial)."""
    overall = [1.0, 1.0, 0.0, 0.0] + [0.5] * 4 + [0.0] * 4 + [0.0, 0.0, 0.0, 1e-9]
    assert equal_reward_groups(overall, 4) == 2
    assert equal_reward_groups(overall, 2) == 7  # (1, 1), (0, 0), (.5, .5) x 2, (0, 0) x 2, (0, 0); not (0, 1e-9)
    assert equal_reward_groups([], 4) == 0 and equal_reward_groups([0.3], 1) == 1
