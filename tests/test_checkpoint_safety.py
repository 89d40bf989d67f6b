"""Loading a checkpoint never runs code from it: a crafted pickle in a rank file, in DCP's .metadata or in a shard's
non-tensor entry is refused by name, and its code does not run; rank files of the format before still load.

Each crafted pickle would write a file when unpickled. Every test first shows that torch's own reader runs it (the
file appears), then that ours refuses it (the file stays absent), so a test cannot pass on a payload that is inert.
"""

import os
import pickle
import random

import numpy as np
import pytest
import torch

from grpo import checkpoint


class WritesAFile:
    """Unpickled, this calls exec, which writes `path`: what a pickle planted in a shared checkpoint could do."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return exec, (f"open({self.path!r}, 'w').write('this ran')",)


class Counters:
    n_timeouts = 0
    n_errors = 0


def dcp_checkpoint(path, extra=None):
    """A DCP checkpoint of a tensor and an optimizer-like group of plain values (the kind DCP pickles as bytes)."""
    import torch.distributed.checkpoint as dcp

    optim = {"lr": 1e-3, "betas": (0.9, 0.999), **(extra or {})}
    state = {"model": {"w": torch.arange(6.0).view(2, 3)}, "optim": optim}
    dcp.save(state, checkpoint_id=str(path))
    return state


def empty_state():
    return {"model": {"w": torch.zeros(2, 3)}, "optim": {"lr": 0.0, "betas": (0.0, 0.0)}}


def test_data_only_load_restores_tensors_and_plain_values(one_rank_group, tmp_path):
    """Guards against the data-only reader and planner dropping or changing what DCP's own would load."""
    saved = dcp_checkpoint(tmp_path / "ckpt")
    state = empty_state()
    checkpoint.load_shards(state, str(tmp_path / "ckpt"))
    assert torch.equal(state["model"]["w"], saved["model"]["w"])
    assert state["optim"] == {"lr": 1e-3, "betas": (0.9, 0.999)}


def test_crafted_metadata_is_refused_and_not_run(one_rank_group, tmp_path):
    """Guards against DCP's .metadata being read with plain pickle.load (torch's FileSystemReader)."""
    import torch.distributed.checkpoint as dcp

    path, marker = tmp_path / "ckpt", tmp_path / "pwned"
    dcp_checkpoint(path)
    (path / ".metadata").write_bytes(pickle.dumps(WritesAFile(marker)))
    with pytest.raises(AttributeError):  # torch's reader runs it (then fails on the None that exec returns)
        dcp.FileSystemReader(str(path)).read_metadata()
    assert marker.exists()
    marker.unlink()

    with pytest.raises(checkpoint.UnsafeCheckpointError, match=r"ckpt/\.metadata: refused .*builtins\.exec"):
        checkpoint.check_checkpoint(str(path))
    with pytest.raises(BaseException, match=r"\.metadata: refused"):  # inside dcp.load: DCP's CheckpointException
        checkpoint.load_shards(empty_state(), str(path))
    assert not marker.exists()


def test_crafted_shard_entry_is_refused_and_not_run(one_rank_group, tmp_path):
    """Guards against a shard's non-tensor entries being read with torch.load(weights_only=False) (DCP's planner)."""
    import torch.distributed.checkpoint as dcp

    path, marker = tmp_path / "ckpt", tmp_path / "pwned"
    dcp_checkpoint(path, extra={"eps": WritesAFile(marker)})
    dcp.load({**empty_state(), "optim": {"lr": 0.0, "betas": (0, 0), "eps": 0.0}}, checkpoint_id=str(path))
    assert marker.exists()
    marker.unlink()

    with pytest.raises(BaseException, match=r"ckpt/__0_0\.distcp: refused to load \(entry optim\.eps\)"):
        checkpoint.load_shards({**empty_state(), "optim": {"lr": 0.0, "betas": (0, 0), "eps": 0.0}}, str(path))
    assert not marker.exists()


def test_crafted_rank_file_is_refused_by_the_resume_choice(one_rank_group, tmp_path):
    """Guards against rank_R.pt being read with torch.load(weights_only=False), and against a refused file on one
    rank leaving the others waiting: rank 0 checks every file before any rank loads."""
    path, marker = tmp_path / "out" / "checkpoints" / "step_2", tmp_path / "pwned"
    dcp_checkpoint(path)
    (path / "trainer_state.json").write_text("{}")
    torch.save(checkpoint.rank_state(Counters()), path / "rank_0.pt")
    torch.save({"python_rng": WritesAFile(marker)}, path / "rank_1.pt")
    torch.load(path / "rank_1.pt", weights_only=False)  # torch's full unpickler runs it
    assert marker.exists()
    marker.unlink()

    with pytest.raises(SystemExit, match=r"step_2/rank_1\.pt: refused to load: its pickle would call builtins\.exec"):
        checkpoint.find_resume_checkpoint(str(tmp_path / "out"), "auto")
    with pytest.raises(checkpoint.UnsafeCheckpointError, match=r"rank_1\.pt: refused"):
        checkpoint.read_rank_state(str(path / "rank_1.pt"))
    assert not marker.exists()
    os.remove(path / "rank_1.pt")
    assert checkpoint.find_resume_checkpoint(str(tmp_path / "out"), "auto") == str(path)


def random_streams():
    return random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()


@pytest.mark.parametrize("old_format", [False, True], ids=["current", "before-data-only"])
def test_rank_state_restores_every_random_stream(tmp_path, old_format):
    """Guards against a rank file losing a random stream or a counter, in the current format and in the format
    written before rank files held only tensors (numpy's state as an array), which must still load."""
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    np.random.randn()  # numpy caches the second Gaussian of a pair: its state has has_gauss=1
    scorer = Counters()
    scorer.n_timeouts, scorer.n_errors = 2, 7
    if old_format:  # exactly what save_checkpoint wrote before
        state = {"python_rng": random.getstate(), "numpy_rng": np.random.get_state(),
                 "torch_rng": torch.get_rng_state(), "cuda_rng": None,
                 "reward_counters": {"n_timeouts": 2, "n_errors": 7}}  # fmt: skip
        with pytest.raises(pickle.UnpicklingError):
            torch.load(_save(state, tmp_path), weights_only=True)  # it is not plain data
    else:
        state = checkpoint.rank_state(scorer)
    expected = random_streams()
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    restored = Counters()
    checkpoint.restore_rank_state(checkpoint.read_rank_state(_save(state, tmp_path)), restored)
    assert random_streams() == expected
    assert (restored.n_timeouts, restored.n_errors) == (2, 7)


def _save(state, tmp_path):
    path = str(tmp_path / "rank_0.pt")
    torch.save(state, path)
    return path
