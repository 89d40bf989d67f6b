"""The engine/trainer mismatch (mismatch.py): the corrections against hand computations and edge cases, the
per-modality measure, the config checks, and under torchrun the start guard and runs with each correction on."""

import json
import math
import re

import pytest
import torch

import train_grpo
from grpo.mismatch import STATS, _gap_metrics, measure, modality, parse_rs_thresholds
from tests.launch import REPO

E = math.exp


def _t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_corrections_resolve_in_train_grpo():
    """Guards against the public names moving: checks outside the repo call them as train_grpo attributes."""
    assert train_grpo.rollout_is_weights(_t([[0.0]]), _t([[1.0]]), "token", 2.0).item() == 1.0
    assert train_grpo.rollout_rejection_mask(_t([[5.0]]), _t([[1.0]]), "token_k2", 1.0).item() == 0.0


def test_token_weights_truncate_clamp_and_zero_the_padding():
    """Guards against an uncapped weight, a weight on padding (even a NaN there), an exp() that overflows past the
    +-20 clamp, and a gradient through the weights."""
    log_ratio = _t([[0.0, math.log(3), -1.0, float("nan")], [30.0, -30.0, 0.5, 0.0]]).requires_grad_()
    mask = _t([[1, 1, 1, 0], [1, 1, 1, 0]])
    w = train_grpo.rollout_is_weights(log_ratio, mask, "token", 2.0)
    torch.testing.assert_close(w, _t([[1.0, 2.0, E(-1), 0.0], [2.0, E(-20), E(0.5), 0.0]]))
    assert not w.requires_grad
    big = train_grpo.rollout_is_weights(log_ratio.detach(), mask, "token", 1e12)
    assert big[1, 0].item() == pytest.approx(E(20), rel=1e-6)  # clamped at +20, not inf


def test_sequence_weights_are_the_exp_of_the_summed_log_ratios():
    """Guards against a sequence weight taken per token, from padding, or without the clamp on the sum."""
    log_ratio = _t([[0.5, 0.25, 9.0], [-1.0, -1.0, 0.0], [0.1, 0.0, 0.0], [15.0, 15.0, 0.0]])
    mask = _t([[1, 1, 0], [1, 1, 0], [1, 0, 0], [1, 1, 0]])
    tis = train_grpo.rollout_is_weights(log_ratio, mask, "sequence", 10.0)
    torch.testing.assert_close(tis, _t([[E(0.75)] * 2 + [0], [E(-2)] * 2 + [0], [E(0.1), 0, 0], [10.0, 10.0, 0]]))
    uncapped = train_grpo.rollout_is_weights(log_ratio, mask, "sequence", 1e12)
    assert uncapped[3, 0].item() == pytest.approx(E(20), rel=1e-6)  # the sum 30 clamped to 20
    # IcePop: a weight outside [0.5, 2] is zeroed, not truncated; e^0.75 = 2.12 and e^-2 = 0.14 are out
    ice = train_grpo.rollout_is_weights(log_ratio, mask, "sequence", "0.5_2.0")
    torch.testing.assert_close(ice, _t([[0, 0, 0], [0, 0, 0], [E(0.1), 0, 0], [0, 0, 0]]))
    ice_token = train_grpo.rollout_is_weights(_t([[0.6, -0.6, 0.7, -0.8]]), _t([[1, 1, 1, 1]]), "token", "0.5_2")
    torch.testing.assert_close(ice_token, _t([[E(0.6), E(-0.6), 0.0, 0.0]]))  # e^0.7 > 2, e^-0.8 < 0.5


def test_all_masked_and_one_token_batches():
    """Guards against NaN or non-zero output when a micro-batch has no live token (a surplus micro-batch), and
    against an off-by-one on a one-token answer."""
    empty = torch.zeros(2, 3)
    for level in ("token", "sequence"):
        assert train_grpo.rollout_is_weights(_t([[1.0] * 3] * 2), empty, level, 2.0).abs().sum() == 0
    for mode in ("token_k1", "seq_sum_k1", "seq_mean_k3", "seq_max_k2"):
        assert train_grpo.rollout_rejection_mask(_t([[1.0] * 3] * 2), empty, mode, 2.0).sum() == 0
    one = train_grpo.rollout_is_weights(_t([[0.3]]), _t([[1.0]]), "sequence", 2.0)
    torch.testing.assert_close(one, _t([[E(0.3)]]))
    assert train_grpo.rollout_rejection_mask(_t([[0.3]]), _t([[1.0]]), "seq_mean_k2", 0.04).item() == 0  # 0.045
    assert train_grpo.rollout_rejection_mask(_t([[0.3]]), _t([[1.0]]), "seq_mean_k2", 0.05).item() == 1


def test_token_rejection_modes():
    """Guards against the k1 bounds read as log-ratio bounds the wrong way round, a lone upper bound not meaning
    [1/u, u], and k2/k3 statistics computed wrongly (k2 = x^2/2, k3 = e^x - 1 - x, x clamped to +-20)."""
    mask = torch.ones(1, 5)
    x = _t([[0.5, 0.8, -0.8, -0.6, 0.0]])
    # lone 2: keep |x| <= log 2 = 0.693
    keep = train_grpo.rollout_rejection_mask(x, mask, "token_k1", 2.0)
    torch.testing.assert_close(keep, _t([[1, 0, 0, 1, 1]]))
    # "0.5_4": keep log 0.5 <= -x <= log 4, i.e. -1.386 <= x <= 0.693
    x2 = _t([[0.8, 0.6, -1.2, -1.5, 0.0]])
    torch.testing.assert_close(train_grpo.rollout_rejection_mask(x2, mask, "token_k1", "0.5_4"), _t([[0, 1, 1, 0, 1]]))
    # k2 <= 0.1: |x| <= 0.447
    torch.testing.assert_close(train_grpo.rollout_rejection_mask(x, mask, "token_k2", 0.1), _t([[0, 0, 0, 0, 1]]))
    torch.testing.assert_close(train_grpo.rollout_rejection_mask(x, mask, "token_k2", 0.2), _t([[1, 0, 0, 1, 1]]))
    # k3 <= 0.2: e^0.5-1.5 = 0.149 in, e^0.8-1.8 = 0.426 out, e^-0.8-0.2 = 0.249 out, e^-0.6-0.4 = 0.149 in
    torch.testing.assert_close(train_grpo.rollout_rejection_mask(x, mask, "token_k3", 0.2), _t([[1, 0, 0, 1, 1]]))
    # beyond +-20: x = 50 counts as 20 (k2 = 200), so a bound of 201 keeps it and 199 does not
    far = _t([[50.0]])
    assert train_grpo.rollout_rejection_mask(far, _t([[1.0]]), "token_k2", 201.0).item() == 1
    assert train_grpo.rollout_rejection_mask(far, _t([[1.0]]), "token_k2", 199.0).item() == 0


def test_sequence_rejection_modes_drop_whole_sequences():
    """Guards against a sequence statistic that counts padding, and a sequence verdict applied to one token only."""
    x = _t([[0.3, 0.3, 7.0], [0.9, 0.0, 0.0], [0.2, -0.2, 0.0]])
    mask = _t([[1, 1, 0], [1, 1, 0], [1, 1, 0]])
    # seq_sum_k1, lone 2: keep |sum x| <= 0.693; sums 0.6, 0.9, 0.0 (the 7.0 is padding)
    torch.testing.assert_close(
        train_grpo.rollout_rejection_mask(x, mask, "seq_sum_k1", 2.0), _t([[1, 1, 0], [0, 0, 0], [1, 1, 0]])
    )
    # seq_mean_k2 <= 0.1: means of x^2/2 are 0.045, 0.2025, 0.02
    torch.testing.assert_close(
        train_grpo.rollout_rejection_mask(x, mask, "seq_mean_k2", 0.1), _t([[1, 1, 0], [0, 0, 0], [1, 1, 0]])
    )
    # seq_max_k3 <= 0.05: maxima e^0.3-1.3 = 0.0499, e^0.9-1.9 = 0.560, e^0.2-1.2 = 0.0214 (e^-0.2+0.2-1 = 0.0187)
    torch.testing.assert_close(
        train_grpo.rollout_rejection_mask(x, mask, "seq_max_k3", 0.05), _t([[1, 1, 0], [0, 0, 0], [1, 1, 0]])
    )
    # seq_sum_k3 <= 0.06: sums 0.0997, 0.560, 0.0401
    torch.testing.assert_close(
        train_grpo.rollout_rejection_mask(x, mask, "seq_sum_k3", 0.06), _t([[0, 0, 0], [0, 0, 0], [1, 1, 0]])
    )


def test_chained_modes_all_must_pass_with_thresholds_per_mode():
    """Guards against chained modes OR-ed instead of AND-ed, thresholds paired with the wrong mode, and a
    lower_upper given to a k2/k3 mode or a wrong count of thresholds accepted."""
    x = _t([[0.5, -0.1, 0.0], [0.05, 0.05, 0.05]])
    mask = _t([[1, 1, 1], [1, 1, 0]])
    # token_k1 in [0.7, 1.5] (x in [-0.405, 0.357]) and seq_mean_k3 <= 0.01: row 0 loses 0.5 by k1, and its mean k3
    # (0.1487 + 0.0048 + 0) / 3 = 0.051 drops the whole row; row 1 passes both
    keep = train_grpo.rollout_rejection_mask(x, mask, "token_k1,seq_mean_k3", "0.7_1.5,0.01")
    torch.testing.assert_close(keep, _t([[0, 0, 0], [1, 1, 0]]))
    only_k1 = train_grpo.rollout_rejection_mask(x, mask, "token_k1,seq_mean_k3", "0.7_1.5,1.0")
    torch.testing.assert_close(only_k1, _t([[0, 1, 1], [1, 1, 0]]))
    assert parse_rs_thresholds(["token_k1", "token_k2"], "3") == [(1 / 3, 3.0), (None, 3.0)]
    with pytest.raises(ValueError, match="upper bound only"):
        train_grpo.rollout_rejection_mask(x, mask, "token_k2", "0.5_2")
    with pytest.raises(ValueError, match="2 thresholds for 3 modes"):
        train_grpo.rollout_rejection_mask(x, mask, "token_k1,token_k2,seq_max_k3", "2,3")
    with pytest.raises(ValueError, match="unknown mode 'seq_max_k1'"):
        train_grpo.rollout_rejection_mask(x, mask, "seq_max_k1", "2")


def test_measure_splits_the_gap_by_modality():
    """Guards against one modality's gap reported under another, padding counted, or the mismatch KL not being
    k3 of the engine's against the trainer's log-probs."""
    from types import SimpleNamespace

    image = SimpleNamespace(image_grid_thw=torch.ones(1, 3), video_grid_thw=None)
    video = SimpleNamespace(image_grid_thw=torch.ones(1, 3), video_grid_thw=torch.ones(1, 3))  # both: video
    text = SimpleNamespace(image_grid_thw=None, video_grid_thw=None)
    kinds = [modality(p) for p in (text, image, video, image)]
    assert kinds == ["text", "image", "video", "image"]
    trainer = _t([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0], [-2.0, -2.0, -2.0], [-1.5, 0.0, 0.0]])
    engine = _t([[-1.0, -2.1, 9.0], [-1.2, -0.7, 0.0], [-2.0, -2.0, -2.0], [-1.0, 0.0, 0.0]])
    mask = _t([[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    stats = dict.fromkeys(STATS, 0.0)
    measure(trainer, engine, mask, kinds, stats)
    m = _gap_metrics(stats)
    k3 = lambda x: E(x) - 1 - x  # noqa: E731
    assert m["rollout/logprob_diff_mean/text"] == pytest.approx(0.05)
    assert m["rollout/logprob_diff_max/text"] == pytest.approx(0.1)
    assert m["rollout/mismatch_kl/text"] == pytest.approx(k3(0.1) / 2, rel=1e-4)
    assert m["rollout/logprob_diff_mean/image"] == pytest.approx((0.2 + 0.3 + 0.5) / 3)
    assert m["rollout/mismatch_kl/image"] == pytest.approx((k3(0.2) + k3(-0.3) + k3(-0.5)) / 3, rel=1e-4)
    assert m["rollout/mismatch_kl/video"] == 0.0 and m["rollout/logprob_diff_max"] == pytest.approx(0.5)
    assert m["rollout/logprob_diff_mean"] == pytest.approx(1.1 / 8)
    stats = dict.fromkeys(STATS, 0.0)
    measure(trainer[:1], engine[:1], mask[:1], ["text"], stats)
    assert [k for k in _gap_metrics(stats) if k.endswith("/image") or k.endswith("/video")] == []  # absent: not 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algorithm.rollout_is=seq"], "algorithm.rollout_is='seq'"),
        (["algorithm.rollout_is=token", "algorithm.rollout_is_threshold=2_0.5"], "lower <= upper"),
        (["algorithm.rollout_is=token", "algorithm.rollout_is_threshold=0"], "must be positive"),
        (["algorithm.rollout_rs=token_k4", "algorithm.rollout_rs_threshold=2"], "unknown mode 'token_k4'"),
        (["algorithm.rollout_rs=token_k2"], "rollout_rs_threshold=''"),
        (["algorithm.tis_cap=-1"], "algorithm.tis_cap=-1"),
        (["algorithm.mismatch_guard=-0.1"], "mismatch_guard=-0.1"),
        (["algorithm.mismatch_action=warn"], "mismatch_action='warn'; valid: stop, skip"),
    ],
)
def test_bad_settings_fail_at_config_time(overrides, message):
    """Guards against a misspelt correction that silently trains without it."""
    with pytest.raises(train_grpo.ConfigError, match=message):
        train_grpo.check_config(train_grpo.load_config(None, overrides), 1)


def test_config_pairs_and_yaml_ranges():
    """Guards against two settings fighting (tis_cap with rollout_is; importance weights on bypass's ratio, which
    is already against the engine), and YAML reading a range such as 0.5_2 as the number 0.52."""
    for pair in (["algorithm.tis_cap=2", "algorithm.rollout_is=token"],
                 ["algorithm.rollout_bypass=true", "algorithm.rollout_is=sequence"],
                 ["algorithm.rollout_bypass=true", "algorithm.tis_cap=2"]):  # fmt: skip
        with pytest.raises(train_grpo.ConfigError):
            train_grpo.check_config(train_grpo.load_config(None, pair), 1)
    cfg = train_grpo.load_config(None, ["algorithm.rollout_rs=token_k1", "algorithm.rollout_rs_threshold=0.5_2"])
    assert cfg.algorithm.rollout_rs_threshold == "0.5_2"
    train_grpo.check_config(cfg, 1)
    ok = ["algorithm.rollout_is=sequence", "algorithm.rollout_is_threshold=0.5_2.0", "algorithm.rollout_bypass=false",
          "algorithm.rollout_rs=seq_mean_k1,seq_max_k3", "algorithm.rollout_rs_threshold=0.9_1.1,0.5"]  # fmt: skip
    train_grpo.check_config(train_grpo.load_config(None, ok), 1)


def test_bypass_takes_the_engines_logprobs_or_says_it_has_none():
    """Guards against bypass silently training on missing or misaligned engine log-probs."""
    from grpo.mismatch import engine_logps
    from rollout import Sample

    (old,) = engine_logps([Sample(0, [5, 6], [-0.5, -1.5], "", False)])
    torch.testing.assert_close(old, _t([-0.5, -1.5]))
    for logprobs in (None, [-0.5]):
        with pytest.raises(RuntimeError, match="rollout_bypass=true takes the engine's log-probs"):
            engine_logps([Sample(0, [5, 6], logprobs, "", False)])


def test_guard_leaves_tool_turns_out_and_still_sees_the_models_tokens(one_rank_group):
    """Guards against the start guard counting a tool turn's tokens: the engine gives them log-prob 0 (it did not
    sample them) while the trainer scores them as any token, so a tool run would be stopped at its first step
    though engine and trainer agree on every token the model wrote. A gap on the model's own tokens must still stop
    it, and the printed figure must count the model's tokens only."""
    from types import SimpleNamespace

    from grpo.mismatch import check_start
    from rollout import Sample

    prompts = [SimpleNamespace(image_grid_thw=torch.tensor([[1, 2, 2]]))]  # an image prompt
    turn = SimpleNamespace(start=2, input_ids=torch.tensor([7, 8, 9]))  # 3 tool tokens after the model's first 2
    engine = [-0.5, -1.0, 0.0, 0.0, 0.0, -0.25, -2.0]
    trainer = _t([-0.5, -1.0, -9.0, -6.0, -4.0, -0.25, -2.0])  # same on the model's 4 tokens, far on the tool's
    sample = Sample(0, [1, 2, 7, 8, 9, 3, 4], engine, "", False, turns=[turn])
    check_start([trainer], [sample], prompts, 0.01, 1)  # passes: the only gap is on the tool turn
    off = trainer.clone()
    off[5] = -0.25 + 1.0  # one model token off by 1 nat: k3 = e - 2 = 0.718 over 4 tokens, 0.18 a token
    with pytest.raises(SystemExit, match=r"image samples of step 1 have a mismatch KL of 0\.18 "):
        check_start([off], [sample], prompts, 0.01, 1)


def test_guard_names_where_engine_and_trainer_part_on_the_worst_answer(one_rank_group, capsys):
    """Guards against a guard that stops a run without saying where the engine and the trainer part, or that asks on
    another answer than the one that tripped it: check_start hands its `locate` the worst prompt of the modality
    (by its answers' mismatch KL) with that prompt's worst answer, never one with tool turns (whose images are not
    the prompt's), prints the report's table and names its first divergence in the error."""
    from types import SimpleNamespace

    from grpo.mismatch import check_start
    from rollout import Sample

    prompts = [SimpleNamespace(image_grid_thw=torch.tensor([[1, 2, 2]]), input_ids=torch.ones(9)) for _ in range(2)]
    turn = SimpleNamespace(start=1, input_ids=torch.tensor([7]))
    samples = [
        Sample(0, [1, 2], [-1.0, -1.0], "", False),  # prompt 0: off by 0.3 a token
        Sample(1, [3, 4], [-1.0, -1.0], "", False),  # prompt 1: off by 0.5 and 1.0 a token, its worst plain answer 2
        Sample(1, [5, 6], [-1.0, -1.0], "", False),
        Sample(1, [7, 7, 8], [-1.0, 0.0, -1.0], "", False, turns=[turn]),  # off by 2 a token, with a tool turn
    ]
    trainer = [_t([-0.7, -0.7]), _t([-0.5, -0.5]), _t([0.0, 0.0]), _t([1.0, -1.0, 1.0])]
    asked = []

    def locate(prompt, answer):
        asked.append((prompt, answer))
        row = {"module": "model.visual.blocks.0", "max": 1e-7, "mean": 1e-8, "departs": False, "note": ""}
        return [row, {**row, "module": "model.language_model.layers.1", "max": 0.6, "mean": 0.4, "departs": True}]

    with pytest.raises(SystemExit, match=r"on that prompt: first divergence: model\.language_model\.layers\.1\. "):
        check_start(trainer, samples, prompts, 0.01, 1, locate)
    assert asked == [(prompts[1], [5, 6])]
    out = capsys.readouterr().out
    assert "worst image prompt" in out and re.search(
        r"model\.language_model\.layers\.1 +6\.00e-01 +4\.00e-01 +YES", out
    )


def _watched(alg, trainer, engine, carried, mb_rows, *, step=3, stats=None):
    """Measure the micro-batches `mb_rows` (lists of row indices) of one optimizer step of image samples whose
    engine log-probs are `engine` and the trainer's `trainer`, each with carried[i] carried tokens, and ask the
    per-step watch; returns (its answer, the stats)."""
    from types import SimpleNamespace

    from grpo.mismatch import measure_and_correct, watch
    from rollout import Sample

    prompts = [SimpleNamespace(image_grid_thw=torch.ones(1, 3), video_grid_thw=None)]
    samples = [Sample(0, [1] * len(e), e, "", False, carried=c) for e, c in zip(engine, carried)]
    stats = dict.fromkeys(STATS, 0.0) if stats is None else stats
    for mb in mb_rows:
        measure_and_correct(_t(trainer)[mb], torch.ones(len(mb), len(trainer[0])), prompts, samples, mb, alg, stats)
    return watch(stats, alg, step), stats


def test_watch_stops_or_skips_a_later_step_past_the_guard_and_leaves_carried_tokens_out(one_rank_group, capsys):
    """Guards against an engine whose state goes bad mid-run (stale caches after a sync, a state restored as garbage
    after a wake) training the run for hours after the start check passed, and against the watch judging the tokens
    a partial rollout carried from earlier steps: their engine log-probs are an older policy's, so a gap there is
    no fault of the engine, while the same gap on the step's own tokens is. Also: each optimizer step judged on its
    own samples, skip mode counting what it skipped, and bypass's later optimizer steps (the policy's own drift) not
    judged."""
    from grpo.mismatch import step_metrics

    cfg = lambda *o: train_grpo.load_config(None, ["algorithm.mismatch_guard=0.01", *o]).algorithm  # noqa: E731
    trainer = [[-1.0, -2.0, -0.5, -1.5]] * 2
    far = [[-3.0, -5.0, -0.5, -1.5], [-3.0, -5.0, -0.5, -1.5]]  # 2 and 3 nats off on the first two tokens
    ok, stats = _watched(cfg(), trainer, far, [2, 2], [[0, 1]])  # those two carried from an earlier step
    assert ok and stats["mismatch/image/tokens"] == 4 and stats["mismatch/mask_tokens"] == 8
    assert step_metrics(stats, cfg())["rollout/mismatch_kl/image"] == pytest.approx(0.0, abs=1e-12)
    k3 = 2 * (E(2) - 3 + E(3) - 4) / 8  # the same gap on fresh tokens: x = 2, 3 twice; 5.12 over the 8 tokens
    with pytest.raises(SystemExit, match=rf"the image samples of step 3 have a mean mismatch KL of {k3:.3g} over "):
        _watched(cfg(), trainer, far, [0, 0], [[0], [1]])
    with pytest.raises(SystemExit, match="algorithm.mismatch_action=skip"):
        _watched(cfg(), trainer, far, [0, 1], [[0, 1]])  # one token carried: 5.2 a token
    with pytest.raises(SystemExit, match="mismatch KL of nan"):  # an engine state gone to garbage
        _watched(cfg(), trainer, [[float("nan")] * 4, trainer[1]], [0, 0], [[0, 1]])
    ok, stats = _watched(cfg("algorithm.mismatch_action=skip"), trainer, far, [0, 0], [[0, 1]])
    assert not ok and stats["mismatch/skipped_steps"] == 1
    assert "warning: the image samples of step 3 have a mean mismatch KL of" in capsys.readouterr().out
    assert step_metrics(stats, cfg("algorithm.mismatch_action=skip"))["actor/mismatch_skipped_steps"] == 1
    # the next optimizer step's samples are judged alone: sound ones pass after the skipped step
    ok, stats = _watched(cfg("algorithm.mismatch_action=skip"), trainer, trainer, [0, 0], [[0, 1]], stats=stats)
    assert ok and stats["mismatch/skipped_steps"] == 1
    assert _watched(cfg("algorithm.mismatch_guard=0"), trainer, far, [0, 0], [[0, 1]])[0]  # 0: off
    # bypass: the first optimizer step is judged (the policy is the one that sampled), later ones are its drift
    ok, stats = _watched(cfg("algorithm.rollout_bypass=true"), trainer, trainer, [0, 0], [[0, 1]])
    assert ok and _watched(cfg("algorithm.rollout_bypass=true"), trainer, far, [0, 0], [[0, 1]], stats=stats)[0]
    with pytest.raises(SystemExit):
        _watched(cfg("algorithm.rollout_bypass=true"), trainer, far, [0, 0], [[0, 1]])


def test_watch_names_where_engine_and_trainer_part_on_the_worst_prompt_of_its_step(one_rank_group, capsys):
    """Guards against a watch that stops a run without saying where the engine and the trainer part, or asks on
    another answer than the start guard would: among its optimizer step's samples, each with its own entry of its
    prompt as update_policy passes them, the worst prompt of the modality is judged by all its answers together
    (grouped by the prompt itself, not by the entry), and its worst answer goes to `locate`. `skip` runs no report."""
    from types import SimpleNamespace

    from grpo.mismatch import measure_and_correct, watch
    from rollout import Sample

    cfg = lambda *o: train_grpo.load_config(None, ["algorithm.mismatch_guard=0.01", *o]).algorithm  # noqa: E731
    a, b = (
        SimpleNamespace(image_grid_thw=torch.ones(1, 3), video_grid_thw=None, input_ids=torch.ones(9)) for _ in "ab"
    )
    prompts = [a, a, b, b]  # answers 0 and 1 of prompt a, 2 and 3 of b
    samples = [Sample(j, [10 + j, 20], [-1.0, -1.0], "", False) for j in range(4)]
    # the trainer above the engine by 1.0, 0.9 (a: k3 0.64 a token) and 1.2, 0 (b: 0.56): the worst answer is b's
    trainer = _t([[0.0, 0.0], [-0.1, -0.1], [0.2, 0.2], [-1.0, -1.0]])
    asked = []

    def locate(prompt, answer):
        asked.append((prompt, answer))
        return [{"module": "model.visual.blocks.0", "max": 3.0, "mean": 2.0, "departs": True, "note": ""}]

    for action, fails in (("skip", False), ("stop", True)):
        alg, stats = cfg(f"algorithm.mismatch_action={action}"), dict.fromkeys(STATS, 0.0)
        # (the last: a filler micro-batch, answer 0 again with its mask zeroed, as micro_batches' live=False)
        for mb, live in (([0, 2], 1.0), ([1, 3], 1.0), ([0], 0.0)):
            measure_and_correct(trainer[mb], torch.full((len(mb), 2), live), prompts, samples, mb, alg, stats)
        if not fails:
            assert not watch(stats, alg, 4, locate, samples, prompts) and asked == []
            continue
        with pytest.raises(SystemExit, match=r"on its worst prompt: first divergence: model\.visual\.blocks\.0\. "):
            watch(stats, alg, 4, locate, samples, prompts)
    assert len(asked) == 1 and asked[0][0] is a and asked[0][1] == [10, 20]  # a: 0.64 a token, its answer 0
    assert "worst image prompt" in capsys.readouterr().out


def test_start_guard_leaves_carried_tokens_out(one_rank_group):
    """Guards against the start guard (after a resume, with partial rollouts) stopping a sound run on the tokens an
    answer carried from before: only the step's own tokens measure the engine."""
    from types import SimpleNamespace

    from grpo.mismatch import check_start
    from rollout import Sample

    prompts = [SimpleNamespace(image_grid_thw=None, video_grid_thw=None)]
    trainer = _t([-1.0, -2.0, -0.5, -1.5])
    engine = [-4.0, -6.0, -0.5, -1.5]
    check_start([trainer], [Sample(0, [1, 2, 3, 4], engine, "", False, carried=2)], prompts, 0.01, 2)
    with pytest.raises(SystemExit, match="the text samples of step 2 have a mismatch KL of"):
        check_start([trainer], [Sample(0, [1, 2, 3, 4], engine, "", False, carried=1)], prompts, 0.01, 2)
    garbage = [float("nan")] * 2 + engine[2:]  # NaN: past any bound on fresh tokens, out of the figure on carried
    check_start([trainer], [Sample(0, [1, 2, 3, 4], garbage, "", False, carried=2)], prompts, 0.01, 2)
    with pytest.raises(SystemExit, match="the text samples of step 2 have a mismatch KL of inf"):
        check_start([trainer], [Sample(0, [1, 2, 3, 4], garbage, "", False, carried=1)], prompts, 0.01, 2)


def _demo_run(tmp_path, model_dir, fault, *overrides, steps=2, rows=32, real=True):
    """configs/tiny.yaml on 2 ranks through tests/mismatch_check.py with `fault` injected into the engine, under
    torchrun (or with real=False forked by the tests' rank server, without torchrun's lines); returns (the train rows
    of metrics.jsonl or None, stdout + stderr)."""
    import subprocess
    import sys

    from scripts.make_synthetic_data import make_geo3k_like
    from tests.launch import REPO, forked

    train = make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=rows, seed=0, text_only_every=4)
    out = tmp_path / "run"
    args = ["tests/mismatch_check.py", fault, "configs/tiny.yaml", f"actor.model_path={model_dir}",
            f"data.train_files={train}", "data.val_files=", f"trainer.output_dir={out}", f"trainer.max_steps={steps}",
            *overrides]  # fmt: skip
    if real:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
        env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
        # one stream, as a terminal or Slurm's log shows it, so that the order of the ranks' and torchrun's lines holds
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=600)  # fmt: skip
        failed, log = proc.returncode != 0, proc.stdout
    else:
        codes, timed_out, log, _ = forked(2, *args, merged=True)
        failed = timed_out or any(codes)
    if failed:
        return None, log
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], log


def test_guard_stops_a_run_whose_engine_lost_an_image(tiny_model_dir, tmp_path):
    """Guards against the silent failure of VLM RL runs: the engine samples a prompt whose image it never saw
    (here one prompt of rank 0 gets a blank image), the trainer scores it with the image, and the run trains on.
    The guard must stop it at step 1 naming the modality, the figure and the bound; the same run without the fault
    must pass the guard and log every modality's mismatch; when the engine's weights go bad after step 2's sync,
    the per-step watch must stop every rank at step 2, before its checkpoint, naming the module where they part;
    and a resume of that run (from step 1) with the lost image must be stopped at its first step, step 2."""
    rows, log = _demo_run(tmp_path / "fault", tiny_model_dir, "blank_image", "trainer.max_steps=1")
    assert rows is None, log[-3000:]
    assert "the image samples of step 1 have a mismatch KL of" in log, log[-3000:]
    assert "algorithm.mismatch_guard=0.01" in log and "images or videos dropped" in log
    # where engine and trainer part on that prompt: its pixels differ, so the vision tower's first block already does
    assert "on that prompt: first divergence: model.visual.blocks.0." in log, log[-3000:]
    # said once, by rank 0, before torchrun's report of the failed ranks; no rank's traceback or failure line
    lines = log.splitlines()
    said = [i for i, line in enumerate(lines) if "engine/trainer mismatch: the image samples" in line]
    torchrun_failure = [i for i, line in enumerate(lines) if re.search(r"failed \(exitcode|ChildFailedError", line)]
    assert len(said) == 1 and torchrun_failure and said[0] < torchrun_failure[0], log[-5000:]
    assert lines[said[0]].startswith("error: engine/trainer mismatch")
    assert not re.search(rf'File "{re.escape(REPO)}/(?!\.venv/)', log) and "failed in phase" not in log, log[-5000:]
    # (the runs below forked by the tests' rank server: torchrun's own lines were checked above)
    rows, log = _demo_run(tmp_path / "clean", tiny_model_dir, "weights@2", "trainer.save_freq=1", steps=2, real=False)
    assert rows is None, log[-3000:]
    # the run stops with the message (said once, by rank 0), naming the modality, its figure and the bound
    stops = re.findall(r"engine/trainer mismatch: the (text|image) samples of step 2 have a mean mismatch KL of "
                       r"([0-9.e+-]+) over the model's tokens.*?above algorithm.mismatch_guard=0.01", log)  # fmt: skip
    assert len(stops) == 1 and all(float(kl) > 0.01 for _, kl in stops), log[-3000:]
    # and where the engine and the trainer part on that modality's worst prompt: every weight of the engine has noise,
    # so the first module the report compares already does (the patch embedding before an image's first vision
    # block, the token embedding before a text's first decoder layer, are not compared themselves)
    first = {"image": "model.visual.blocks.0", "text": "model.language_model.layers.0"}[stops[0][0]]
    assert f"on its worst prompt: first divergence: {first}." in log, log[-3000:]
    (row,) = [json.loads(line) for line in (tmp_path / "clean" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 1 and row["rollout/mismatch_kl/image"] < 1e-6 and row["rollout/mismatch_kl/text"] < 1e-6
    assert "rollout/mismatch_kl/video" not in row
    assert not (tmp_path / "clean" / "run" / "checkpoints" / "step_2").exists()
    rows, log = _demo_run(tmp_path / "clean", tiny_model_dir, "blank_image", steps=2, real=False)
    assert rows is None and "the image samples of step 2 have a mismatch KL of" in log, log[-3000:]


CORRECTION_RUNS = {
    # IcePop token weights, and rejection of tokens outside [0.87, 1.15] and of sequences with a mean k3 above 0.008
    "token": ["algorithm.rollout_is=token", "algorithm.rollout_is_threshold=0.5_2.0",
              "algorithm.rollout_rs=token_k1,seq_mean_k3", "algorithm.rollout_rs_threshold=0.87_1.15,0.008"],
    # truncated sequence weights, and rejection of sequences whose summed log ratio leaves [1/2, 2]
    "sequence": ["algorithm.rollout_is=sequence", "algorithm.rollout_is_threshold=2.0",
                 "algorithm.rollout_rs=seq_sum_k1", "algorithm.rollout_rs_threshold=2.0"],
    # the engine's log-probs as the old ones over two optimizer steps a step, rejecting sequences by their worst k2
    "bypass": ["algorithm.rollout_bypass=true", "actor.global_batch_size=8", "algorithm.rollout_rs=seq_max_k2",
               "algorithm.rollout_rs_threshold=0.045"],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CORRECTION_RUNS))
def test_each_correction_learns_the_demo(name, tiny_model_dir, tmp_path):
    """Guards against a correction that breaks learning, or one that is configured but never applied: the engine's
    log-probs come back with Gaussian noise (std 0.1, so the mismatch KL is about 0.1^2 / 2 = 5e-3 per token, under
    the guard) for the corrections to act on. The demo must learn in 15 steps on 2 ranks, the measured mismatch
    must be the injected one in every modality, and the corrections must show in their metrics."""
    # the token run has the engine's weights go bad after step 8's sync too, with mismatch_action=skip
    fault, skip = ("noise+weights@8", ["algorithm.mismatch_action=skip"]) if name == "token" else ("noise", [])
    rows, log = _demo_run(tmp_path, tiny_model_dir, fault, "actor.lr=3e-3", *CORRECTION_RUNS[name], *skip, steps=15,
                          rows=96, real=False)  # fmt: skip
    assert rows is not None, log[-3000:]
    assert [r["step"] for r in rows] == list(range(1, 16))
    first = sum(r["reward/overall"] for r in rows[:5]) / 5
    last = sum(r["reward/overall"] for r in rows[-5:]) / 5
    print(f"{name} correction: toy reward first 5 steps {first:.3f}, last 5 {last:.3f}")
    assert last > first + 0.1, (first, last)
    if skip:  # step 8 warned, skipped and counted, its weights left as they were; every other step stepped
        bad = rows.pop(7)
        assert bad["actor/mismatch_skipped_steps"] == 1 and bad["actor/skipped_steps"] == 1, bad
        assert "warning: the" in log and "samples of step 8 have a mean mismatch KL of" in log, log[-3000:]
        assert all(r["actor/mismatch_skipped_steps"] == 0 and r["actor/skipped_steps"] == 0 for r in rows)
        sums = [float(x) for x in re.findall(r"sync \d+: weights sum (\S+)", log)]
        assert len(sums) == 15 and sums[8] == sums[7] and len(set(sums)) == 14, sums
    for r in rows:
        # bypass measures the current policy against the engine: the injected noise plus the drift of the step's
        # first optimizer step (lr 3e-3: 0.008 to 0.027 seen), and rejects more (0.27 to 0.53 seen)
        high = 0.05 if name == "bypass" else 8e-3
        # (a modality is measured in the steps that drew it: a quarter of the rows are text-only, and a step's 16
        # prompts hold none of them about once in 160 steps, as at trainer.seed=5)
        for m in ("text", "image"):
            assert f"rollout/mismatch_kl/{m}" not in r or 2e-3 < r[f"rollout/mismatch_kl/{m}"] < high, r
    for m in ("text", "image"):
        assert sum(f"rollout/mismatch_kl/{m}" in r for r in rows) >= len(rows) - 2, m
        # (a sequence counts as rejected when any of its tokens is: token-level rejection touches most of them)
        assert 0 < r["rollout/rs_rejected_token_frac"] < 0.7 and 0 < r["rollout/rs_rejected_seq_frac"] <= 1, r
        if name != "bypass":
            assert 0.5 < r["rollout/is_weight_mean"] < 1.5 and 0 < r["rollout/is_ess"] <= 1, r
    if name == "token":  # IcePop zeroes the tokens whose weight leaves [0.5, 2]: |noise| > 0.69, ~5e-12 of them
        assert all(r["rollout/is_clipped_frac"] < 0.01 for r in rows)
    if name == "sequence":  # sequence weights spread with the summed noise: some are truncated at 2
        assert all(0 < r["rollout/is_clipped_frac"] < 0.5 and r["rollout/is_ess"] < 0.99 for r in rows)


# The module each corruption of tests/locate_check.py scales in the engine only, per prompt: where locate must say the
# engine and the trainer part (the vision tower does not run on a text prompt)
LOCATED = {
    "clean": dict.fromkeys(("image", "video", "text"), "none"),
    "layer": dict.fromkeys(("image", "video", "text"), "model.language_model.layers.1"),
    "vision": {"image": "model.visual.blocks.0", "video": "model.visual.blocks.0", "text": "none"},
    "norm": dict.fromkeys(("image", "video", "text"), "model.language_model.norm"),
}
# a mixture of experts' router, which runs inside its layer and so before the layer's output is compared
ROUTER_LOCATED = dict.fromkeys(("image", "video", "text"), "model.language_model.layers.1.mlp.gate")
# the families without videos (no video prompt), and the modules of Gemma 4's tower, under its own names: its first
# encoder layer, and the projection of its soft tokens into the text model in place of a merger; and the 26B-A4B's
# router, beside its layer's MLP
NO_VIDEOS = ("glm4v", "gemma4", "gemma4_moe")
TOWER_NAMES = dict.fromkeys(("gemma4", "gemma4_moe"), {"model.visual.blocks.0": "model.vision_tower.encoder.layers.0"})
MERGER = dict.fromkeys(("gemma4", "gemma4_moe"), "model.embed_vision")
ROUTER_NAMES = {"gemma4_moe": {ROUTER_LOCATED["text"]: "model.language_model.layers.1.router"}}


def located_for(family: str) -> dict:
    """LOCATED (and ROUTER_LOCATED for a mixture of experts) as `family` names its modules, on its prompts."""
    located = {**LOCATED, "router": ROUTER_LOCATED} if family.endswith("_moe") else LOCATED
    names = {**TOWER_NAMES.get(family, {}), **ROUTER_NAMES.get(family, {})}
    kinds = ("image", "text") if family in NO_VIDEOS else ("image", "video", "text")
    return {case: {k: names.get(m, m) for k, m in per.items() if k in kinds} for case, per in located.items()}


@pytest.mark.parametrize(
    "family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "glm4v", "gemma4", "gemma4_moe"]
)
def test_locate_names_the_module_the_engine_got_wrong(family, tiny_family_dir, tmp_path):
    """Guards against a mismatch report that cannot say where the engine and the trainer part, or says it wrongly:
    with one module's weights scaled in the engine only (decoder layer 1's MLP output x 3, the first vision block's
    MLP x 30, the final norm's gain x 3: corruptions that train on under the guard, a mismatch KL of 0.004-0.006 at
    the first two) the report names that module, as the trainer names it, on every prompt that runs it; a clean
    engine is `none`, each of its modules within a quarter of the dtype's bound (fp32: rounding of 1e-6, 1.2e-5 in
    Gemma 4's decoder layers; Qwen3.5's bf16 engine on CPU: 1e-2), while the corrupted module departs by five times
    the bound or more. On the mixture of experts (its layer case: every expert's MLP output), decoder layer 1's router
    with its experts' rows rolled in the engine only (every token's top-k set changes) is named as that router, before
    its layer (Gemma 4's `layers.1.router`: its projection's rows rolled). GLM-4.1V and Gemma 4 take no videos, so
    their report has no video prompt; Gemma 4's tower is compared
    under its own names (vLLM runs transformers' tower there), and its last-position logits soft-capped on both sides
    (uncapped on the trainer's, its clean logits were 7.7e-5 off). Their decoder layers normalize the MLP's output
    before adding it, so layer 1's case moves the stream less there (GLM-4.1V 3.5e-2, Gemma 4 5.5e-3), still past
    five times the bound."""
    from transformers import AutoConfig

    from grpo.locate import NOISE, TOWER
    from tests.launch import torchrun

    out = tmp_path / "locate.json"
    torchrun(1, "tests/locate_check.py", tiny_family_dir(family), str(out))
    result = json.loads(out.read_text())
    bound = NOISE[torch.bfloat16 if family == "qwen3_5" else torch.float32]
    located = located_for(family)
    assert sorted(result) == sorted(located)
    for case, expected in located.items():
        assert case == "clean" or result[case]["scaled"], case  # the corruption reached a tensor of the family's
        assert sorted(k for k in result[case] if k != "scaled") == sorted(expected), case  # the prompts it ran
        for kind, module in expected.items():
            report = result[case][kind]
            assert report["first"] == module, (case, kind, report)
            rows = {r["module"]: r for r in report["rows"]}
            if case == "clean":
                assert all(r["max"] <= bound / 4 for r in rows.values()), rows
            elif module != "none":
                assert rows[module]["max"] >= 5 * bound, (case, kind, rows[module])
    # the vision modules are compared on image and video prompts, with Qwen3-VL's deepstack mergers, and not on text;
    # every decoder layer, the final norm and the logits on every prompt
    media = "image" if family in NO_VIDEOS else "video"
    assert MERGER.get(family, "model.visual.merger") in {r["module"] for r in result["clean"][media]["rows"]}
    assert not any(r["module"].startswith(TOWER) for r in result["clean"]["text"]["rows"])
    layers = AutoConfig.from_pretrained(tiny_family_dir(family)).get_text_config().num_hidden_layers
    for kind in located["clean"]:
        compared = {r["module"] for r in result["clean"][kind]["rows"]}
        assert {f"model.language_model.layers.{i}" for i in range(layers)} <= compared, (kind, compared)
        assert {"model.language_model.norm", "lm_head"} <= compared, (kind, compared)
    if family == "qwen3_vl":
        assert "model.visual.deepstack_merger_list.1" in {r["module"] for r in result["clean"]["image"]["rows"]}
