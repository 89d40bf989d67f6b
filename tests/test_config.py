"""Config: YAML + CLI overrides, and the errors a user gets before any model loads."""

import pytest
import torch

from train_grpo import Config, ConfigError, check_config, load_config, main


def _yaml(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def test_precedence_defaults_yaml_cli(tmp_path):
    """Guards against YAML or CLI values being ignored, or the CLI losing to the file."""
    path = _yaml(tmp_path, "rollout:\n  n: 3\n  temperature: 0.7\nactor:\n  lr: 1e-6\n")
    cfg = load_config(path, ["rollout.n=7", "trainer.logger=[console,jsonl]", "data.shuffle=false"])
    assert cfg.rollout.n == 7  # CLI beats YAML
    assert cfg.rollout.temperature == 0.7  # YAML beats default
    assert cfg.actor.lr == 1e-6 and isinstance(cfg.actor.lr, float)  # PyYAML reads 1e-6 as a string
    assert cfg.trainer.logger == ["console", "jsonl"]
    assert cfg.data.shuffle is False
    assert cfg.actor.global_batch_size == Config().actor.global_batch_size  # untouched default


def test_unknown_key_names_the_valid_ones(tmp_path):
    """Guards against a typo (rollout.temprature) silently training with the default."""
    with pytest.raises(ConfigError, match=r"rollout\.temprature.*valid keys of rollout: engine, n, temperature"):
        load_config(_yaml(tmp_path, "rollout:\n  temprature: 0.5\n"))
    with pytest.raises(ConfigError, match="unknown config section 'optim'"):
        load_config(None, ["optim.lr=1"])


@pytest.mark.parametrize(
    "override", ["rollout.n=2.5", "rollout.n=abc", "actor.lr=fast", "data.shuffle=3", "trainer.logger=console"]
)
def test_wrong_type_fails(override):
    """Guards against a float batch size or a string learning rate reaching the trainer."""
    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        load_config(None, [override])


def test_batch_sizes_that_do_not_divide_say_what_to_change():
    """Guards against a deadlock or a silently dropped remainder when batches do not split over ranks."""
    cfg = load_config(None, ["data.rollout_batch_size=12", "actor.global_batch_size=12"])
    with pytest.raises(ConfigError, match="multiple of 8"):
        check_config(cfg, world_size=8)
    cfg = load_config(None, ["data.rollout_batch_size=16", "actor.global_batch_size=16", "rollout.n=3",
                             "actor.micro_batch_size=5"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"16/2 x 3 = 24 .* actor.micro_batch_size=5"):
        check_config(cfg, world_size=2)
    cfg.actor.micro_batch_size = 4
    check_config(cfg, world_size=2)


def test_global_batch_must_divide_rollout_batch():
    """Guards against a rollout batch whose last mini-batch would be short."""
    cfg = load_config(None, ["data.rollout_batch_size=32", "actor.global_batch_size=12"])
    with pytest.raises(ConfigError, match="global_batch_size=12 must divide"):
        check_config(cfg, world_size=2)


def test_default_configs_are_valid():
    """Guards against a shipped config that fails its own checks."""
    for name, world in [("configs/geo3k.yaml", 8), ("configs/geo3k_3b.yaml", 8), ("configs/tiny.yaml", 2),
                        ("configs/qwen3_vl_8b_geo3k.yaml", 8), ("configs/qwen3_5_9b_geo3k.yaml", 8),
                        ("configs/qwen3_vl_30b_a3b_geo3k.yaml", 8),
                        ("configs/qwen3_5_35b_a3b_geo3k.yaml", 8), ("configs/glm4v_9b_geo3k.yaml", 8),
                        ("configs/gemma4_geo3k.yaml", 8), ("configs/gemma4_26b_a4b_geo3k.yaml", 8)]:  # fmt: skip
        check_config(load_config(name), world_size=world)


def test_cli_fails_on_bad_config_before_loading_anything(capsys):
    """Guards against a bad key surfacing only after minutes of model loading."""
    assert main(["configs/tiny.yaml", "actor.model_path=/nonexistent", "rollout.nn=3"]) == 2
    assert "rollout.nn" in capsys.readouterr().err


def test_a_config_file_that_does_not_read_is_one_line(tmp_path, capsys):
    """Guards against a mistyped config path, a YAML indentation slip or an unclosed list on the command line ending
    in a traceback (one from every rank under torchrun) instead of the config error line, naming file and place."""
    (tmp_path / "indent.yaml").write_text("data:\n  train_files: x.parquet\n rollout:\n  n: 4\n")
    cases = [
        ([str(tmp_path / "indent.yaml")], f"{tmp_path / 'indent.yaml'}: while parsing a block mapping"),
        ([str(tmp_path / "missing.yaml")], f"{tmp_path / 'missing.yaml'}: No such file or directory"),
        (["configs/tiny.yaml", "data.train_files=[a,b"], "override 'data.train_files=[a,b': while parsing a flow"),
    ]
    for argv, message in cases:
        assert main([*argv, "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"config error: {message}") and err.count("\n") == 1, err
    with pytest.raises(ConfigError, match="line 3, column 2"):
        load_config(str(tmp_path / "indent.yaml"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.engine=sglang"], r"rollout\.engine='sglang'; valid: \['hf', 'vllm'\]"),
        (["rollout.engine=vllm", "rollout.tensor_parallel_size=3"], r"tensor_parallel_size=3 must divide the 4 ranks"),
        (["rollout.engine=hf", "rollout.tensor_parallel_size=2"], "needs rollout.engine=vllm"),
        (["rollout.engine=vllm", "rollout.sleep_level=3"], r"sleep_level=3; valid: -1 \(auto\), 0 \(never"),
    ],
)
def test_rollout_engine_settings_that_cannot_work(overrides, message):
    """Guards against an engine setting that would only fail inside vLLM, minutes in (or hang: a TP group that
    straddles the ranks never completes its collectives)."""
    cfg = load_config(None, ["data.rollout_batch_size=8", "actor.global_batch_size=8", "rollout.n=2", *overrides])
    with pytest.raises(ConfigError, match=message):
        check_config(cfg, world_size=4)
    cfg.rollout.engine, cfg.rollout.tensor_parallel_size, cfg.rollout.sleep_level = "vllm", 2, 2
    check_config(cfg, world_size=4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor.lora_rank=-1"], r"actor\.lora_rank=-1 \(0 = full fine-tuning\)"),
        (["actor.lora_rank=8", "actor.lora_alpha=0"], r"lora_alpha=0 > 0"),
        (["actor.lora_rank=8", "actor.lora_target_modules=[]"], r"lora_target_modules=\[\] not empty"),
        (["actor.lora_rank=8", "actor.lora_dropout=1.0"], r"actor\.lora_dropout=1\.0 must be in \[0, 1\)"),
    ],
)
def test_lora_settings_that_cannot_work(overrides, message):
    """Guards against a LoRA setting that would train nothing (no targets, a zero scale) or fail inside PEFT."""
    with pytest.raises(ConfigError, match=message):
        check_config(load_config(None, overrides), world_size=8)
    check_config(load_config(None, ["actor.lora_rank=8"]), world_size=8)  # the defaults with LoRA on are valid


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "grpo_passk"])
def test_one_answer_a_prompt_with_a_group_estimator_is_refused(estimator):
    """Guards against rollout.n=1 with an estimator that compares a prompt's answers among themselves: every
    advantage is 0, and the run would train for days on the KL term alone with nothing said. REINFORCE++ whitens
    over the whole batch and learns from one answer a prompt."""
    overrides = ["rollout.n=1", f"algorithm.adv_estimator={estimator}"]
    with pytest.raises(ConfigError, match=r"rollout\.n=1: with one answer a prompt every advantage is 0"):
        check_config(load_config(None, overrides), world_size=8)
    check_config(load_config(None, ["rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus"]), world_size=8)
    check_config(load_config(None, [f"algorithm.adv_estimator={estimator}", "rollout.n=2"]), world_size=8)


def test_routing_replay_that_cannot_work(tiny_model_dir, capsys):
    """Guards against a misspelt replay mode training without replay, and routing replay asked of a dense model,
    which has no routers to replay (it would run and replay nothing): both stop before anything loads."""
    from train_grpo import main

    with pytest.raises(ConfigError, match=r"algorithm\.routing_replay='R3'; valid: none, r3"):
        check_config(load_config(None, ["algorithm.routing_replay=R3"]), world_size=8)
    args = ["configs/tiny.yaml", "algorithm.routing_replay=r3", "data.train_files=configs", "data.val_files="]
    assert main([*args, f"actor.model_path={tiny_model_dir}"]) == 2
    assert "routing_replay=r3 replays routed experts; a qwen2_5_vl model has none" in capsys.readouterr().err


def test_router_balance_weight_that_cannot_work(tiny_model_dir, tiny_family_dir, capsys):
    """Guards against a load-balancing weight that would push experts toward imbalance (negative), or that a dense
    model would silently ignore, having no routers: both stop before anything loads, naming the key."""
    from train_grpo import main

    with pytest.raises(ConfigError, match=r"actor\.router_aux_loss_coef=-0\.1 must be >= 0"):
        check_config(load_config(None, ["actor.router_aux_loss_coef=-0.1"]), world_size=8)
    args = ["configs/tiny.yaml", "actor.router_aux_loss_coef=1e-3", "data.train_files=configs", "data.val_files="]
    assert main([*args, f"actor.model_path={tiny_model_dir}"]) == 2
    assert "router_aux_loss_coef balances routed experts; a qwen2_5_vl model has none" in capsys.readouterr().err
    assert main([*args, f"actor.model_path={tiny_family_dir('qwen3_5_moe')}"]) == 2  # past the model, on to the data
    assert "config error: data.train_files" in capsys.readouterr().err


def test_a_variants_own_settings_are_a_map_checked_against_its_function(monkeypatch, tmp_path):
    """Guards against a variant's setting that needs the config module edited, and against a misspelled one reaching
    the loss or estimator as a TypeError at the first step: `key={...}` on the command line or a YAML map, each name
    one of the function's own arguments, and whether an estimator learns at rollout.n=1 said by its table entry."""
    import train_grpo

    cfg = load_config(None, ["actor.policy_loss_kwargs={cap: 1e-3, mode: x}", "algorithm.adv_estimator_kwargs="])
    assert cfg.actor.policy_loss_kwargs == {"cap": 1e-3, "mode": "x"} and cfg.algorithm.adv_estimator_kwargs == {}
    (tmp_path / "c.yaml").write_text("algorithm:\n  adv_estimator_kwargs: {floor: 0.5}\n")
    assert load_config(str(tmp_path / "c.yaml")).algorithm.adv_estimator_kwargs == {"floor": 0.5}
    with pytest.raises(ConfigError, match=r"actor\.policy_loss_kwargs: expected a map like \{name: value\}"):
        load_config(None, ["actor.policy_loss_kwargs=[1, 2]"])
    with pytest.raises(ConfigError, match="_grpo_advantages takes no argument 'floor'; its own arguments: none"):
        check_config(load_config(str(tmp_path / "c.yaml")), world_size=8)

    def floored(scores, group_size, eps, floor):  # a batch-level estimator with a setting of its own, no default
        return (scores - scores.mean()).clamp(min=floor)

    monkeypatch.setitem(train_grpo.ADVANTAGE_ESTIMATORS, "floored", train_grpo.batch_level(floored))
    chosen = ["algorithm.adv_estimator=floored", "rollout.n=1"]
    with pytest.raises(ConfigError, match=r"floored needs its argument 'floor' \(its own arguments: floor\)"):
        check_config(load_config(None, chosen), world_size=8)
    check_config(load_config(None, [*chosen, "algorithm.adv_estimator_kwargs={floor: -1}"]), world_size=8)
    adv = train_grpo.compute_advantages(torch.tensor([0.0, 1.0, 5.0]), 1, "floored", floor=-0.5)
    assert adv.tolist() == [-0.5, -0.5, 3.0]
