"""The tool demo (configs/tiny_tools.yaml, `make demo-tools`): a task only a tool's picture answers must be learnt."""

from tests.test_vision_demo import assert_demo_learns

COLOURS = 4  # scripts/make_synthetic_data.py COLOURS: an answer without the tool's picture is right 1 time in 4


def test_tool_demo_learns_what_only_the_tools_picture_says(tiny_tools_model_dir, tmp_path):
    """Guards against a tool loop whose picture never reaches the answer that follows it (the tool turn's pixels
    lost or misplaced in the engine's continuation, the trainer's interleaved layouts, the shared prefixes, the
    ranks' rebalancing), and against a demo whose policy stops calling: the prompt's picture is a blank, so accuracy
    above 1/4 needs the tool's picture, read in the tool turn. One run of the demo's config: the vision demo's
    assertions (a blind start, the last 5 steps and the final greedy validation at least 0.2 above the ceiling), and
    nearly every answer calling the tool over the last 5 steps."""
    from scripts.make_synthetic_data import COLOURS as colours
    from scripts.make_synthetic_data import make_tool_task

    assert len(colours) == COLOURS
    config = "configs/tiny_tools.yaml"
    rows = assert_demo_learns(config, make_tool_task, 60, 1 / COLOURS, tiny_tools_model_dir, tmp_path, timeout=600)
    calls = [r["tool/call_share"] for r in rows]
    first, last = sum(calls[:5]) / 5, sum(calls[-5:]) / 5
    print(f"{config}: call share first 5 steps {first:.2f} -> last 5 {last:.2f}, lowest step {min(calls):.2f}")
    assert last >= 0.9, calls
    assert all(r["tool/error"] == r["tool/timeout"] == 0 for r in rows)


def test_leading_digit_grades_the_start_of_the_last_turn():
    """Guards against a tool-demo reward that favours answers without a call (first_digit over the whole last turn
    gives them the whole token budget to write a digit in, a calling answer only what the tool turn left) or that
    lets a call marker in the last turn push the answer out of the graded span."""
    from reward import LEADING_CHARS, leading_digit

    assert leading_digit("</tool_call> 3 blue", "3")["accuracy"] == 1.0
    assert leading_digit("<tool_call></tool_call>2", "2")["accuracy"] == 1.0
    assert leading_digit("x" * LEADING_CHARS + "3", "3") == {"overall": 0.0, "format": 0.0, "accuracy": 0.0}
    assert leading_digit("It is 4", "3")["accuracy"] == 0.0
