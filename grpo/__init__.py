"""The trainer's machinery: what train_grpo.py, rollout.py, reward.py and data.py stand on. Every module here has one
job and is named for it; none imports a top-level file, but the dry run (preflight.py), which checks the user's data
and reward through them."""
