"""`train_grpo.py CONFIG --dry-run` (preflight.py): every check that needs no GPU, in-process with the tiny model and a
small synthetic file; each mistake a user makes with their own data and reward is one FAIL line naming the key."""

import re

import pytest

import train_grpo
from grpo import preflight
from scripts.make_synthetic_data import make_geo3k_like

REWARDS = """
def good(response, ground_truth, question, **columns):
    return {"overall": float(ground_truth in response), "has_images": float("images" in columns)}

def wrong_type(response, ground_truth):
    return "correct"

def wants_level(response, ground_truth, level, source=""):
    return 1.0

def verl_form(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0

def verl_defaults(data_source, solution_str, ground_truth=None, extra_info=None):
    return float(solution_str in data_source)  # called here: the ground truth in the answer, always 1

def exact(response, ground_truth):
    return float(ground_truth in response)

def any_of(response, ground_truth, answer):
    return float(any(a in response for a in answer))
"""


@pytest.fixture
def dry_run(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """main([...tiny config..., *overrides, "--dry-run"]) -> (exit code, stdout lines). Nothing may form a process
    group or load weights."""
    data = make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=32, seed=0)  # (two rollout batches of 16)
    (tmp_path / "rewards.py").write_text(REWARDS)
    monkeypatch.setattr(train_grpo, "setup_distributed", lambda *a: pytest.fail("a dry run formed a process group"))
    base = ["configs/tiny.yaml", f"actor.model_path={tiny_model_dir}", f"data.train_files={data}",
            f"data.val_files={data}", f"reward.reward_fn={tmp_path / 'rewards.py'}:good"]  # fmt: skip

    def run(*overrides):
        code = train_grpo.main([*base, *overrides, "--dry-run"])
        return code, capsys.readouterr().out.splitlines()

    run.dir = tmp_path
    return run


def test_a_good_config_passes_and_says_what_it_checked(dry_run):
    """Guards against a dry run that checks the memory plan alone, or passes without saying what it looked at."""
    code, lines = dry_run("trainer.nnodes=2", "trainer.n_gpus_per_node=8")
    assert code == 0, lines
    checked = [line for line in lines if line.startswith("ok ")]
    assert [line.split(":")[0].split(maxsplit=1)[1] for line in checked] == [
        "config and paths", "memory plan", "model", "data", "reward", "tools"
    ]  # fmt: skip
    text = "\n".join(lines)
    assert "fits 2 nodes x 8 GPUs" in text and "world 16" in text  # the world it was told, not one node
    assert "train_files: 32 sampled prompts parse (0 bad rows" in text and "images in 64 prompts" in text
    assert "returns {'overall': 1.0, 'has_images': 1.0} on a sample answer" in text  # the row's columns reached it
    assert lines[-1] == "dry run: 6 of 6 checks passed"


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "reward.reward_fn={dir}/rewards.py:goood",
            "FAIL  reward: reward.reward_fn: reward spec '{dir}/rewards.py:goood': "
            "{dir}/rewards.py has no function 'goood' (its functions: any_of, exact, good, verl_defaults, verl_form, "
            "wants_level, wrong_type)",
        ),
        (  # a keyword parameter the data has no column for, and no default (`source` has one: no error of its own)
            "reward.reward_fn={dir}/rewards.py:wants_level",
            "FAIL  reward: reward.reward_fn='{dir}/rewards.py:wants_level': its parameter 'level' has no default, and "
            "the sample row has no column 'level' (nor is it question or prompt): name a column of data.train_files, "
            "or give it a default",
        ),
        (  # verl's parameters: the missing one is not what to fix, the order is
            "reward.reward_fn={dir}/rewards.py:verl_form",
            "FAIL  reward: reward.reward_fn='{dir}/rewards.py:verl_form': its parameters are verl's (data_source, "
            "solution_str, ground_truth, extra_info); this trainer calls fn(response, ground_truth) once per answer: "
            "wrap it, def score(response, ground_truth): return verl_form('<data_source>', response, ground_truth)",
        ),
        (  # a call that succeeds, on the wrong arguments: refused by its parameters
            "reward.reward_fn={dir}/rewards.py:verl_defaults",
            "FAIL  reward: reward.reward_fn='{dir}/rewards.py:verl_defaults': its parameters are verl's (data_source, "
            "solution_str, ground_truth, extra_info); this trainer calls fn(response, ground_truth) once per answer: "
            "wrap it, def score(response, ground_truth): return verl_defaults('<data_source>', response, ground_truth)",
        ),
        (
            "reward.reward_fn={dir}/rewards.py:wrong_type",
            "FAIL  reward: reward.reward_fn='{dir}/rewards.py:wrong_type': "
            "TypeError: the reward function returned str 'correct'; it must return a number or a dict with an "
            "'overall' key",
        ),
        (
            "data.prompt_key=question",
            "FAIL  data: data.train_files: {dir}/train.parquet: no row has "
            "data.prompt_key='question'; the file's columns: ['answer', 'images', 'problem']",
        ),
        (  # a file smaller than the batch, which the run refuses once its ranks have formed and read all the data
            "data.rollout_batch_size=64",
            "FAIL  data: data.train_files: 32 usable train prompts are fewer than one rollout batch "
            "(data.rollout_batch_size=64 over 8 ranks): lower it or add data",
        ),
        (
            "data.image_key=image",
            "FAIL  data: data.train_files: {dir}/train.parquet: no row has data.image_key='image', but column "
            "'images' holds images: set data.image_key=images (the file's columns: ['answer', 'images', 'problem'])",
        ),
    ],
)
def test_each_mistake_fails_in_one_line_naming_the_key(dry_run, override, expected):
    """Guards against a misspelled reward function, a reward of the wrong type or asking for a column the data does not
    have, a missing data column or an image column no row has reaching the GPUs (the engine's start, the process
    group) before anything says so."""
    code, lines = dry_run(override.format(dir=dry_run.dir))
    assert code == 1
    failed = [line for line in lines if line.startswith("FAIL")]
    assert len(failed) == 1 and failed[0].startswith(expected.format(dir=dry_run.dir)), failed
    assert lines[-1] == f"dry run: {4 if 'data.' in override else 5} of 6 checks passed"  # (data: reward not called)


def test_a_file_sampled_by_the_dry_run_is_held_to_the_batch_by_its_rows(dry_run, monkeypatch):
    """Guards against a dry run that parses a sample of a large file measuring the batch against the sample: the
    usable prompts are at most the file's rows, which then decide (32 rows fill a batch of 16 over 16 ranks)."""
    monkeypatch.setattr(preflight, "SAMPLE_ROWS", 8)
    code, lines = dry_run("trainer.nnodes=2", "trainer.n_gpus_per_node=8")
    assert code == 0 and "train_files: 8 sampled prompts parse" in "\n".join(lines), lines
    code, lines = dry_run("data.rollout_batch_size=64")
    failed = [line for line in lines if line.startswith("FAIL")]
    assert code == 1 and failed == [
        "FAIL  data: data.train_files: the 32 rows of the files are fewer than one rollout batch "
        "(data.rollout_batch_size=64 over 8 ranks): lower it or add data"
    ]  # fmt: skip


def test_rows_holding_special_tokens_are_counted_by_the_dry_run_beyond_its_sample(dry_run, monkeypatch):
    """Guards against a dry run that passes a file whose rows would be skipped by the run (special tokens written in
    their text) without saying so because its sample missed them: every row's text is checked."""
    from tests.test_mixed_data import add_dirty_rows

    monkeypatch.setattr(preflight, "SAMPLE_ROWS", 8)
    dirty = add_dirty_rows(str(dry_run.dir / "train.parquet"))  # rows 32-36, past the sample's rows 0, 4, ... 28
    code, lines = dry_run()
    assert code == 0 and f"train_files: 8 sampled prompts parse ({dirty} bad rows" in "\n".join(lines), lines


def test_an_answer_column_of_lists_or_structs_is_named_unless_the_reward_reads_it(dry_run):
    """Guards against answers stored as lists or structs reaching the reward as their text ("['48']", "{'style': ...}")
    and grading every answer wrong (or, with a substring match, passing the dry run's boxed sample): the dry run says
    so, unless the reward takes the column by keyword, as it is."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(dry_run.dir / "train.parquet").to_pylist()
    lists, structs = dry_run.dir / "lists.parquet", dry_run.dir / "structs.parquet"
    pq.write_table(pa.Table.from_pylist([{**r, "answer": [r["answer"]]} for r in rows]), lists)
    struct = [{**r, "answer": {"style": "rule", "ground_truth": r["answer"]}} for r in rows]
    pq.write_table(pa.Table.from_pylist(struct), structs)
    reward = f"reward.reward_fn={dry_run.dir / 'rewards.py'}"
    fixes = {
        lists: "name a column of text, or give the reward a parameter 'answer', which gets the column as the file "
        "has it",
        structs: "set data.answer_key=answer.ground_truth",
    }
    for data, fix in fixes.items():
        code, lines = dry_run(f"data.train_files={data}", f"data.val_files={data}", f"{reward}:exact")
        failed = [line for line in lines if line.startswith("FAIL")]
        assert code == 1 and len(failed) == 1 and failed[0].startswith("FAIL  reward: "), lines
        assert "data.answer_key='answer' holds a " in failed[0] and failed[0].endswith(fix), failed
    code, lines = dry_run(f"data.train_files={lists}", f"data.val_files={lists}", f"{reward}:any_of")
    assert code == 0 and "returns {'overall': 1.0} on a sample answer; it asks for answer by keyword" in "\n".join(
        lines
    )
    fixed = ["data.answer_key=answer.ground_truth", f"{reward}:exact"]
    code, lines = dry_run(f"data.train_files={structs}", f"data.val_files={structs}", *fixed)
    assert code == 0, lines


def test_an_unreachable_hub_is_one_line(dry_run, monkeypatch):
    """Guards against a hub id on a machine without the hub retrying for minutes instead of saying what to do."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(preflight, "hub_reachable", lambda: False)
    code, lines = dry_run("actor.model_path=Qwen/Qwen2.5-VL-3B-Instruct")  # (a size the memory plan knows)
    assert code == 1
    expected = "FAIL  model: actor.model_path='Qwen/Qwen2.5-VL-3B-Instruct': cannot reach the hub: use a local path or "
    assert [line for line in lines if line.startswith("FAIL")] == [expected + "HF_HUB_OFFLINE=1"]
    assert "skip  data: not checked: it needs the model's processor" in lines
    assert not re.search("retry|Retrying", "\n".join(lines))
