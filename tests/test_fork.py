"""A researcher's fork, as one is written: a new advantage estimator added at the end of train_grpo.py's code and
registered in ADVANTAGE_ESTIMATORS, a loss with a setting of its own, statistics of its own recorded in
collect_rollouts (one line each) and a folder of its own, and nothing else. It must compute, pass the config check
and the dry run, train with its statistics and settings, and leave the docs' tests green: the suite checks
behaviour, never the loop file's size."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.make_synthetic_data import make_geo3k_like

REPO = Path(__file__).resolve().parent.parent

# about 60 lines: two variants, their helpers, docstrings and comments, as a fork is written
FORK = '''

# ----------------------------------------------------------------------------------------------------------------------
# Fork: a median baseline. The group's median is a baseline that one lucky or broken answer cannot move, where the
# mean moves by 1/n of it; the spread is the mean absolute deviation from the median, for the same reason.
# Use: `algorithm.adv_estimator: median` in a config, or algorithm.adv_estimator=median on the command line.
# Measured against grpo at three seeds on the tiny demo before any GPU time; keep it only if it holds at 7B.
# What it leaves alone: the loss, the KL, the aggregation; the advantage is still one number per answer,
# broadcast over its tokens by the loss, as every estimator's is.


def _group_median(groups):
    """The lower median of each group: torch.median's, which returns an element of the group (no averaging of the
    two middle values, so a group of 0/1 rewards keeps a 0/1 baseline)."""
    return groups.median(dim=1, keepdim=True).values  # (G, 1)


def _mean_abs_deviation(groups, centre):
    """Mean |score - centre| per group: a spread that a single outlier moves by 1/n of its distance."""
    return (groups - centre).abs().mean(dim=1, keepdim=True)  # (G, 1)


def _median_advantages(scores, group_size, eps):
    """Advantage = (score - group median) / (mean |score - median| + eps).

    Same contract as the other estimators: scores (N,) in consecutive groups of `group_size` answers to one prompt,
    advantages (N,) back, the same for every token of an answer. A lone answer has no group: advantage 0.
    `eps` keeps a group whose answers all but one tie from dividing by a near-zero spread.
    """
    if group_size == 1:
        return torch.zeros_like(scores)
    groups = scores.view(-1, group_size)  # (G, n)
    centre = _group_median(groups)  # (G, 1)
    spread = _mean_abs_deviation(groups, centre)  # (G, 1)
    adv = (groups - centre) / (spread + eps)  # (G, n)
    # a group whose answers all scored the same teaches nothing, as with GRPO's own estimator
    same = (groups == groups[:, :1]).all(dim=1, keepdim=True)  # (G, 1)
    adv = torch.where(same, torch.zeros_like(adv), adv)
    return adv.view(-1)  # (N,)


def _median_centred_advantages(scores, group_size, eps):
    """The same baseline without the scaling: score - group median, as Dr. GRPO drops GRPO's division by the std
    (a group of near-equal scores is not blown up to unit spread)."""
    if group_size == 1:
        return torch.zeros_like(scores)
    groups = scores.view(-1, group_size)  # (G, n)
    return (groups - _group_median(groups)).view(-1)  # (N,)


# Both registered: algorithm.adv_estimator=median or median_centred selects one; the config check, the dry run and
# the parametrised tests read this table, so nothing else needs to change.
ADVANTAGE_ESTIMATORS["median_centred"] = _median_centred_advantages
ADVANTAGE_ESTIMATORS["median"] = _median_advantages


def _cispo_loss(logp, old_logp, advantages, clip_low, clip_high, clip_dual, mask, is_cap=5.0):
    """CISPO (https://arxiv.org/abs/2506.13585): no token's gradient is clipped away; its importance weight is capped
    at `is_cap` (its own setting: actor.policy_loss_kwargs={is_cap: ...}) and held constant. Returns (loss (B, T),
    capped (B, T): the tokens whose weight the cap cut)."""
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))  # (B, T)
    weight = ratio.clamp(max=is_cap).detach()  # (B, T)
    return -advantages * weight * logp, ratio > is_cap


POLICY_LOSSES["cispo"] = _cispo_loss
'''


# a rollout statistic and a count of the fork's own, each one line where it is computed (inserted after ANCHOR)
ANCHOR = '        timings["time/reward"] += time.perf_counter() - t0\n'
ROLLOUT_LINES = """\
        stats.count("rollout/fork_answers", len(batch_samples))  # answers sampled this step, over all ranks
        stats.count("rollout/fork_rank_count", rank + 1)  # 1 on rank 0, 2 on rank 1: the step's total is 3
"""


MY_REWARD = """def score(response, ground_truth):
    return float(response.strip() == ground_truth.strip())
"""


def forked_tree(tmp_path) -> Path:
    """A copy of the repository's tracked files with FORK added after the last definition of train_grpo.py,
    ROLLOUT_LINES in collect_rollouts and a folder of its own, my_task/."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    tree = tmp_path / "fork"
    for name in files:
        if (REPO / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, tree / name)
    loop = tree / "train_grpo.py"
    text = loop.read_text()
    assert text.count(ANCHOR) == 1
    text = text.replace(ANCHOR, ANCHOR + ROLLOUT_LINES)
    guard = text.rindex('\nif __name__ == "__main__":')
    loop.write_text(text[:guard].rstrip("\n") + "\n" + FORK + "\n" + text[guard:])
    (tree / "my_task").mkdir()  # a folder of the fork's own, as docs/reward.md's example makes one
    (tree / "my_task" / "reward.py").write_text(MY_REWARD)
    subprocess.run(["git", "init", "-q"], cwd=tree, check=True)  # a fork is a clone: the docs' tests read git's files
    subprocess.run(["git", "add", "-A"], cwd=tree, check=True)
    assert len(FORK.strip("\n").splitlines()) >= 50  # the size of a variant with its helpers and comments
    return tree


@pytest.fixture(scope="module")
def fork_tree(tmp_path_factory) -> Path:
    return forked_tree(tmp_path_factory.mktemp("fork"))


def test_a_forked_estimator_computes_passes_the_dry_run_and_the_docs_tests(
    fork_tree, tmp_path, tiny_model_dir, monkeypatch, capsys
):
    """Guards against a layout that fights a fork: a test that fails on the loop file's length or on a folder of the
    fork's own (the layout table's test once asked it to name my_task/), a config check that knows only the shipped
    estimators and losses, a dry run that refuses the new keys or passes a misspelled setting of the loss's own (it
    would end the first step with a TypeError, after the models loaded)."""
    tree = fork_tree
    spec = importlib.util.spec_from_file_location("train_grpo_fork", tree / "train_grpo.py")
    fork = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fork)

    scores = torch.tensor([0.0, 1.0, 1.0, 5.0, 1.0, 1.0, 1.0, 1.0])  # two groups of 4; the second all equal
    adv = fork.compute_advantages(scores, 4, "median")
    # group 1: median 1 (lower median of 0, 1, 1, 5), mean |x - 1| = (1 + 0 + 0 + 4) / 4 = 1.25
    assert adv[:4].tolist() == pytest.approx([-1 / 1.25, 0.0, 0.0, 4 / 1.25], rel=1e-5)
    assert adv[4:].tolist() == [0.0] * 4
    assert fork.compute_advantages(scores, 4, "median_centred")[:4].tolist() == [-1.0, 0.0, 0.0, 4.0]

    data = make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=32, seed=0)
    monkeypatch.setattr(fork, "setup_distributed", lambda *a: pytest.fail("a dry run formed a process group"))
    monkeypatch.chdir(REPO)
    argv = ["configs/tiny.yaml", f"actor.model_path={tiny_model_dir}", f"data.train_files={data}",
            f"data.val_files={data}", "algorithm.adv_estimator=median", "actor.policy_loss=cispo",
            "actor.policy_loss_kwargs={is_cap: 0.5}", "--dry-run"]  # fmt: skip
    assert fork.main(argv) == 0
    capsys.readouterr()
    # the loss's own setting misspelled: refused, naming the arguments the function takes
    assert fork.main([*argv[:-2], "actor.policy_loss_kwargs={is_cpa: 0.5}", "--dry-run"]) == 2
    assert "actor.policy_loss_kwargs: _cispo_loss takes no argument 'is_cpa'; its own arguments: is_cap" in (
        capsys.readouterr().err
    )
    # an estimator nobody registered is still refused, naming the valid ones
    assert fork.main([*argv[:-4], "algorithm.adv_estimator=mean_of_medians", "--dry-run"]) == 2
    assert "'grpo_passk', 'median_centred', 'median']" in capsys.readouterr().err

    docs = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_docs.py"],
                          cwd=tree, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert docs.returncode == 0, docs.stdout[-3000:]


def test_a_fork_trains_with_its_own_statistics_and_settings(fork_tree, tmp_path, tiny_model_dir):
    """Guards against a statistic a fork records in the rollout that never reaches metrics.jsonl (the rollout's
    statistics were logged only under online filtering), against a count logged as rank 0's figure rather than the
    step's total (1 and 2 logged as 1), and against a loss's own setting from the command line that never reaches
    the loss (it once needed a config field and two signatures edited). Two ranks, a step of the forked loop with
    its estimator and its loss."""
    import json

    from tests.launch import torchrun

    data = make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=32, seed=0)
    out = tmp_path / "run"
    torchrun(
        2, str(fork_tree / "train_grpo.py"), "configs/tiny.yaml", "rollout.engine=hf",
        f"actor.model_path={tiny_model_dir}", f"data.train_files={data}", "data.val_files=",
        f"trainer.output_dir={out}", "trainer.max_steps=1",
        "data.rollout_batch_size=8", "actor.global_batch_size=8", "rollout.n=4", "algorithm.adv_estimator=median",
        "actor.policy_loss=cispo", "actor.policy_loss_kwargs={is_cap: 0.5}",
    )  # fmt: skip
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    for r in rows:
        assert r["rollout/fork_answers"] == 8 * 4  # the step's 8 prompts x 4 answers, both ranks' together
        assert r["rollout/fork_rank_count"] == 3
        assert r["rollout/prompts_drawn"] == 8  # the rollout's own statistics too, without online filtering
        # one on-policy update: every ratio is 1, which a cap of 0.5 cuts (the default cap of 5 would cut none)
        assert r["actor/clip_frac"] == pytest.approx(1.0)
