"""What a user is told (issue 25): a mismatch names its real cause and fix, ``strict=False``
never drops saved state silently, and an error raised to the caller is not also logged."""
import logging

import pytest
import torch

from flexckpt import Checkpointer, LoadError, StructureMismatch


def _model_and_adamw(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _trained(tmp_path):
    """Step 10 of a model and AdamW that took one step; returns the saved moments."""
    model, opt = _model_and_adamw(0)
    model(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(10, {"model": model, "optim": opt, "step": 10}).result()
    return {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}


def test_a_fresh_optimizer_is_told_how_to_create_its_state_and_following_it_loads_the_moments(tmp_path):
    saved = _trained(tmp_path)
    model, opt = _model_and_adamw(1)  # a restart: the optimizer has no state yet
    with Checkpointer(str(tmp_path)) as ck:
        with pytest.raises(StructureMismatch) as e:
            ck.load({"model": model, "optim": opt, "step": 0})
        msg = str(e.value)
        assert "'optim/state/0/exp_avg'" in msg and "the optimizer under 'optim' has no state yet" in msg
        assert "get_optimizer_state_dict(model, optimizer)" in msg and "README's FSDP2 section" in msg
        assert "\n" not in msg
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        get_optimizer_state_dict(model, opt)  # what the message says: creates the state in place
        state = {"model": model, "optim": opt, "step": 0}
        assert ck.load(state) == 10 and state["step"] == 10
    got = opt.state_dict()["state"][0]
    assert torch.equal(got["exp_avg"], saved["exp_avg"]) and torch.equal(got["exp_avg_sq"], saved["exp_avg_sq"])


def test_strict_false_lists_and_counts_the_saved_keys_it_left_out(tmp_path, caplog):
    _trained(tmp_path)
    model, opt = _model_and_adamw(1)
    state = {"model": model, "optim": opt, "step": 0}
    with Checkpointer(str(tmp_path)) as ck, caplog.at_level(logging.WARNING, logger="flexckpt"):
        assert ck.load(state, strict=False) == 10 and state["step"] == 10
        stats = ck.last_load_stats
    left = [f"optim/state/{p}/{k}" for p in (0, 1) for k in ("exp_avg", "exp_avg_sq", "step")]
    assert stats.not_loaded == sorted(left) and stats.missing == [] and stats.skipped == sorted(left)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "left out 6 key(s) the checkpoint holds" in warnings[0]
