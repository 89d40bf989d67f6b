"""
The rewards: the geo3k recipe and the demos' toy rewards. A reward of one's own keeps the same contract
(docs/reward.md has the whole of it):

- Named in the config as `reward.reward_fn: path/to/file.py:function`.
- Called once per answer as fn(response, ground_truth): the answer's text (with tools, every turn of it) and the
  row's data.answer_key column as a string. A further parameter that can be passed by keyword gets the row's column
  of its name, or `question` (the problem before the format prompt) or `prompt` (the chat text the model read);
  a `**kwargs` gets them all.
- Returns a number (the overall reward), or a dict with "overall" and any other keys, each logged as reward/<key>
  ("accuracy" is the console's acc and online filtering's key). Every value a finite number.
- Runs in grading processes, each call bounded by reward.timeout: an exception, a wrong value or a timeout scores 0
  on every key for that answer (reward/errors, reward/timeouts); when every answer of a step fails, the run stops.

grpo/grading.py loads, checks and runs it (RewardScorer, kept here under its name too).

- compute_score: the geo3k recipe, overall = 0.9 * accuracy + 0.1 * format; degenerate answers are settled by
  cheap guards (settle_cheaply) before any symbolic grading.
- compute_score_think_answer: the same for GLM-4.1V's <think>...</think><answer>...</answer> format, the answer read
  inside its box tokens, a \\boxed{} or plain.
- digit_fraction, first_digit, leading_digit: the toy rewards of the CPU, vision and tool demos.
"""

import re

from grpo.grading import RewardScorer  # noqa: F401 (a kept name: reward.RewardScorer)

# -----------------------------------------------------------------------------
# the geo3k reward

# The format the recipe asks for. has_format() below accepts exactly the strings this matches.
FORMAT_REGEX = r"<think>.*</think>.*\\boxed\{.*\}.*"
PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def has_format(response: str) -> bool:
    """True if the response fullmatches FORMAT_REGEX (with re.DOTALL) after stripping whitespace.

    Written as a chain of find()s rather than with the regex: the three greedy .* backtrack cubically
    on degenerate outputs such as "</think>\\boxed{" repeated (0.2 s at 7.5k chars, 28 s at 30k),
    and RL policies do produce those. Taking the earliest occurrence of each piece is always optimal.
    """
    rest = after_think(response)
    if rest is None:
        return False
    boxed = rest.find("\\boxed{")
    return boxed != -1 and rest.find("}", boxed + len("\\boxed{")) != -1


def after_think(response: str) -> str | None:
    """What follows the first </think> of a stripped response that opens with <think>, or None (no such block)."""
    text = response.strip()
    if not text.startswith("<think>"):
        return None
    think_end = text.find("</think>", len("<think>"))
    return None if think_end == -1 else text[think_end + len("</think>") :]


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces matched so that \\boxed{\\frac{7}{2}} gives \\frac{7}{2}.

    Returns None if there is no \\boxed{ or the last one is never closed: a truncated answer is no answer.
    """
    start = text.rfind("\\boxed{")
    if start == -1:
        return None
    start += len("\\boxed{")
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[start:i].strip()
            depth -= 1
    return None


# Limits of settle_cheaply. RL policies sometimes box degenerate output: "(((((...", power towers "9^9^9^...",
# "10^{10^{10^{10}}}", 20,000-character boxes. The graders spend seconds on those or hang until RewardScorer's
# timeout (math_verify's LaTeX parser alone takes up to half a second on "((((1))))"). Each limit lies far outside the
# legitimate forms of a Geometry3K answer (plain numbers, fractions, radicals, degrees, units, "x = ...",
# "\angle A = ...") and is relative to the ground truth, so a truth that is itself long, deep or a large power still
# goes to the graders. tests/test_reward_guards.py checks that no label changes on generated legitimate answers.
ANSWER_CHARS_BASE = 100  # a truth like "2 \sqrt { 221 }", however dressed up ("m \angle ABC = ", "^{\circ}",
ANSWER_CHARS_PER_TRUTH_CHAR = 4  # "\text{ cm}^{2}"), stays under 50 characters + 2x its length: a 2x margin
EXTRA_NESTING = 4  # a legitimate form nests at most 3 levels deeper than its truth: \frac{12}{\sin(30^{\circ})}
MAX_EXPONENT = 1000  # geometry needs powers of 2 or 3; sympy is instant at 1000 (a second at 2^{100000000})
MAX_FACTORIAL = 1000  # no geometry answer has a factorial; 1000! is instant (1000000! takes ~6 s)


def nesting_depth(text: str) -> int:
    """Deepest nesting of ( [ { brackets, of any kind; an unclosed bracket counts as open to the end."""
    depth = deepest = 0
    for ch in text:
        if ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}" and depth > 0:
            depth -= 1
    return deepest


def _group_end(text: str, i: int) -> int:
    """Index just past the bracket group that opens at text[i], or len(text) if it never closes."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] in "([{":
            depth += 1
        elif text[j] in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)


def _operand_end(text: str, i: int) -> int:
    """Index just past the operand that starts at text[i]: a bracket group, or a \\command or a sign followed by
    a run of digits, letters and dots (sympy reads the plain-text "9^99" with the whole run as exponent)."""
    if i < len(text) and text[i] in "([{":
        return _group_end(text, i)
    j = i + 1 if i < len(text) and text[i] in "\\+-" else i  # a command's backslash, a sign
    while j < len(text) and (text[j].isalnum() or text[j] == "."):
        j += 1
    return j


def _literal_value(text: str) -> float | None:
    """|value| of a number literal, possibly wrapped in brackets and spaces ("{ 1000 }"); None if not one."""
    text = text.strip("()[]{} ")
    return abs(float(text)) if PLAIN_NUMBER.fullmatch(text) else None


def largest_exponent(text: str) -> float:
    """The largest literal exponent in text; inf for a power tower (a^b^c, a^{b^c}); 0 if there is none.

    A symbolic exponent (x, \\circ, 2n) counts as 0: sympy keeps those unevaluated, so they cost nothing."""
    largest = 0.0
    for i, ch in enumerate(text):
        if ch != "^":
            continue
        start = i + 1
        while start < len(text) and text[start] == " ":
            start += 1
        end = _operand_end(text, start)
        after = text[end:].lstrip(" ")
        if "^" in text[start:end] or after.startswith("^"):
            return float("inf")
        value = _literal_value(text[start:end])
        largest = max(largest, value or 0.0)
    return largest


def largest_factorial(text: str) -> float:
    """The largest n in a factorial n! (inf if n is not a number literal); 0 if there is none.

    "\\!" (LaTeX's negative thin space) is no factorial."""
    largest = 0.0
    for i, ch in enumerate(text):
        if ch != "!" or text[i - 1 : i] == "\\":
            continue
        number = re.search(r"\d+(?:\.\d+)?$", text[:i].rstrip())
        largest = max(largest, float(number.group()) if number else float("inf"))
    return largest


def settle_cheaply(given: str, ground_truth: str) -> bool | None:
    """The label of an answer that needs no symbolic grading, or None to leave it to mathruler and math_verify.

    Plain numbers on both sides are compared by value: both libraries do that too, but only after ~10 ms of
    sympy.simplify per wrong answer, and most geo3k answers are plain decimals. An answer longer, more deeply
    nested, with a larger power or factorial than any legitimate form of the truth (limits above) is wrong: it
    could only be equal by being a padded or inflated form of it, and those are what a policy must not learn.
    Each check is a pass or two over the answer, which is short once the length check has passed.
    """
    truth = ground_truth.strip()
    if PLAIN_NUMBER.fullmatch(given) and PLAIN_NUMBER.fullmatch(truth):
        return float(given) == float(truth)
    if len(given) > ANSWER_CHARS_BASE + ANSWER_CHARS_PER_TRUTH_CHAR * len(truth):
        return False
    if nesting_depth(given) > nesting_depth(truth) + EXTRA_NESTING:
        return False
    if largest_exponent(given) > max(MAX_EXPONENT, largest_exponent(truth)):
        return False
    if largest_factorial(given) > max(MAX_FACTORIAL, largest_factorial(truth)):
        return False
    return None


def grade_symbolically(given: str, ground_truth: str) -> bool:
    """Grade an extracted answer against the ground truth with maintained graders, not our own.

    mathruler (EasyR1's grader) goes first: it is the one geo3k recipes report numbers with. math_verify
    (HuggingFace) then rescues styles mathruler rejects: "48°", "48 units", "48\\text{cm}^2", "y = 2\\sqrt{221}",
    "\\angle A = 48^\\circ". mathruler alone accepts "48 cm^2". Neither accepts any wrong answer in our tests.
    math_verify's own timeouts use SIGALRM, which only works in the main thread and cannot interrupt a long
    big-int operation, so they are off: RewardScorer bounds the whole call by killing its worker instead.
    Imported here, not at the top: a machine without them (a GPU box checking the trainer with the toy reward)
    can still import this module.
    """
    from math_verify import parse, verify
    from mathruler.grader import grade_answer

    if grade_answer(given, ground_truth):
        return True
    gold = parse(f"${ground_truth}$", parsing_timeout=None)
    pred = parse(f"${given}$", parsing_timeout=None)
    return verify(gold, pred, timeout_seconds=None)


def is_equivalent(given: str, ground_truth: str) -> bool:
    """True if the answer grades equal to the ground truth: settled cheaply where it can be, else symbolically."""
    settled = settle_cheaply(given, ground_truth)
    return settled if settled is not None else grade_symbolically(given, ground_truth)


def geo3k_score(answer: str | None, formatted: bool, ground_truth: str) -> dict[str, float]:
    """The geo3k recipes' weights: 0.9 for an answer equivalent to the ground truth, 0.1 for the format."""
    accuracy = float(answer is not None and is_equivalent(answer, ground_truth))
    format_score = float(formatted)
    return {"overall": 0.9 * accuracy + 0.1 * format_score, "format": format_score, "accuracy": accuracy}


def compute_score(response: str, ground_truth: str) -> dict[str, float]:
    """The geo3k recipe: mostly correctness, a little for the <think>...</think> ... \\boxed{} format."""
    return geo3k_score(last_boxed(response), has_format(response), ground_truth)


# -----------------------------------------------------------------------------
# the GLM-4.1V geo3k reward

# GLM-4.1V-Thinking's own answer format: its reasoning in <think> </think>, then the answer in <answer> </answer>, the
# final value inside that wrapped in its box tokens, <|begin_of_box|>...<|end_of_box|>.
BEGIN_OF_BOX, END_OF_BOX = "<|begin_of_box|>", "<|end_of_box|>"


def has_think_answer_format(response: str) -> bool:
    """True if the stripped response is exactly <think>...</think>, then whitespace, then one <answer>...</answer>.

    Chained find()s, as has_format's, so that degenerate outputs cost one pass."""
    rest = after_think(response)
    if rest is None:
        return False
    rest = rest.lstrip()
    if not (rest.startswith("<answer>") and rest.endswith("</answer>")):
        return False
    inner = rest[len("<answer>") : -len("</answer>")]
    return "<answer>" not in inner and "</answer>" not in inner


def think_answer(response: str) -> str | None:
    """The final answer of a <think>...</think><answer>...</answer> response: inside the last closed answer block
    after the thinking, the last box's content (<|begin_of_box|>...<|end_of_box|>), else the last \\boxed{}'s, else
    the block's text. None if there is no closed answer block after the thinking (a <think> never closed is
    thinking to the end), or its box is never closed: an answer written inside the thinking, or cut off, is no
    answer."""
    think_end = response.rfind("</think>")
    if response.rfind("<think>") > think_end:
        return None
    start = response.rfind("<answer>", think_end + 1 if think_end != -1 else 0)
    if start == -1:
        return None
    start += len("<answer>")
    end = response.find("</answer>", start)
    if end == -1:
        return None
    answer = response[start:end]
    box = answer.rfind(BEGIN_OF_BOX)
    if box != -1:
        box_end = answer.find(END_OF_BOX, box)
        if box_end == -1:
            return None
        answer = answer[box + len(BEGIN_OF_BOX) : box_end]
    if "\\boxed{" in answer:
        return last_boxed(answer)
    return answer.strip() or None


def compute_score_think_answer(response: str, ground_truth: str) -> dict[str, float]:
    """The GLM-4.1V geo3k recipe (configs/glm4v_9b_geo3k.yaml): compute_score's weights and grading, for the
    <think>...</think><answer>...</answer> format and the answer inside it (think_answer)."""
    return geo3k_score(think_answer(response), has_think_answer_format(response), ground_truth)


# -----------------------------------------------------------------------------
# the CPU demo's toy reward


def digit_fraction(response: str, ground_truth: str) -> dict[str, float]:
    """Toy reward for the CPU demo: the fraction of non-whitespace characters that are ASCII digits.

    A tiny random model can learn to emit digits within a few dozen steps, so a rising reward shows the
    whole GRPO loop works without a real model. ground_truth is ignored. accuracy: at least half digits.
    """
    chars = [c for c in response if not c.isspace()]
    fraction = sum(c in "0123456789" for c in chars) / len(chars) if chars else 0.0
    return {"overall": fraction, "format": 0.0, "accuracy": float(fraction >= 0.5)}


def digits_unrewarded(response: str, ground_truth: str) -> dict[str, float]:
    """The distillation demo's reward: zero, so the teacher's per-token term is the only signal; the share of digits
    (digit_fraction's) rides along as reward/digits, to watch the student write as its digit-writing teacher does."""
    return {"overall": 0.0, "digits": digit_fraction(response, ground_truth)["overall"]}


def first_digit(response: str, ground_truth: str) -> dict[str, float]:
    """The vision demo's reward: 1 when the first ASCII digit of the response is the answer (one digit). On the
    colour task (scripts/make_synthetic_data.py make_colour_task) the answer is only in the image, so a policy that
    ignores it scores at most 1 / (number of colours) on balanced data. format: the response has a digit at all."""
    digit = next((c for c in response if c in "0123456789"), None)
    correct = float(digit is not None and digit == ground_truth.strip())
    return {"overall": correct, "format": float(digit is not None), "accuracy": correct}


# How much of an answer leading_digit reads: about as many tokens as the vision demo's whole 8-token answers.
LEADING_CHARS = 12


def leading_digit(response: str, ground_truth: str) -> dict[str, float]:
    """The tool demo's reward: first_digit over the first LEADING_CHARS characters of the answer's last turn, the
    tool-call markers left out (a call in the last turn is never answered; it is not the answer either). Reading only
    the start grades an answer that called a tool and one that did not alike: the latter has the whole token budget
    to write in, the former what the tool turn left of it, and first_digit over all of it favours the longer answer."""
    text = response.replace("<tool_call>", "").replace("</tool_call>", "").lstrip()
    return first_digit(text[:LEADING_CHARS], ground_truth)
