"""flextrain's pure parts and the zephon held-out split: configuration, schedule, loss
independence from D, and the split (disjoint, fingerprinted only when set)."""
from __future__ import annotations

import os

import pytest
import torch

from flextrain.config import ConfigError, differences, fingerprint, load_config, working_sizes
from flextrain.model import Transformer, token_loss_sum
from flextrain.schedule import lr_scale
from zephon_state import InMemory, Mix, Pipeline
from zephon_state.holdout import HoldoutConfig, held_out


def test_set_overrides_a_file_and_a_preset(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('steps = 7\n[data]\nglobal_batch = 32\n[optim]\nplacement = "fsdp"\n')
    cfg = load_config("small", str(f), ["data.global_batch=64", "optim.muon_lr=0.01", "run_dir=/x"])
    assert (cfg.steps, cfg.data.global_batch, cfg.optim.placement, cfg.optim.muon_lr) == (7, 64, "fsdp", 0.01)
    assert (cfg.model.d_model, cfg.run_dir) == (256, "/x")


def test_bad_values_name_the_field():
    with pytest.raises(ConfigError, match="data.global_batch=12 must be a multiple of data.lanes=8"):
        load_config(sets=["data.global_batch=12"])
    with pytest.raises(ConfigError, match="unknown key 'd_modle'"):
        load_config(sets=["model.d_modle=3"])
    with pytest.raises(ConfigError, match="vocab_size=1000 but the GPT-2 tokenizer has 50257"):
        load_config(sets=["model.vocab_size=1000"])


def test_performance_settings_do_not_change_the_fingerprint():
    base = load_config()
    perf = load_config(sets=["data.micro_batch=1", "optim.placement=fsdp", "ckpt_every=5", "data.workers=2"])
    assert fingerprint(base.to_dict()) == fingerprint(perf.to_dict())
    assert differences(base.to_dict(), perf.to_dict()) == []
    other = load_config(sets=["data.max_length=128", "seed=3"])
    assert differences(base.to_dict(), other.to_dict()) == ["data.max_length: saved 256, now 128", "seed: saved 0, now 3"]


def test_the_blocks_preset_holds_under_15_percent_of_its_parameters_in_embedding_and_head():
    """Issue 30: a real model's mix (Llama 3 8B: about 13%) through its own 4,096-token BPE,
    whose vocabulary is exactly the model's; exact counts from the model as built."""
    from flextrain.data import check_inputs
    from zephon_state import load_tokenizer

    cfg = load_config("blocks")
    with torch.device("meta"):
        model = Transformer(cfg.model)
    counts = {n: p.numel() for n, p in model.named_parameters()}
    edge = counts["embed.weight"] + counts["head.weight"]
    blocks = sum(counts[n] for n in model.hidden_matrices())
    assert (sum(counts.values()), edge, blocks, len(model.hidden_matrices())) == (31_465_984, 4_194_304, 27_262_976, 40)
    assert edge / sum(counts.values()) <= 0.15
    tok = load_tokenizer(cfg.data.tokenizer)
    assert tok.tokenizer.get_vocab_size(with_added_tokens=True) == cfg.model.vocab_size == 4096
    check_inputs(cfg.data, cfg.model.vocab_size)  # its sources through the same path as tiny's and small's
    assert cfg.data.sources == load_config("tiny").data.sources


def test_working_sizes_divide_lanes_and_batch():
    assert working_sizes(8, 16) == [1, 2, 4, 8]
    assert working_sizes(8, 16, micro_batch=3) == [8]  # 16/8 = 1 row: one microbatch of 1


def test_schedule_warms_up_then_decays_to_the_floor():
    assert lr_scale(0, 100, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_scale(9, 100, 10, "cosine", 0.1) == 1.0
    assert lr_scale(10, 100, 10, "cosine", 0.1) == 1.0
    assert lr_scale(100, 100, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_scale(55, 100, 10, "linear", 0.0) == pytest.approx(0.5)


def test_loss_over_the_global_label_count_does_not_depend_on_the_split():
    """Sum of token losses over two halves / all labels == the loss of the whole; a mean of
    per-half means would weight tokens differently when halves hold different label counts."""
    from flextrain.config import ModelConfig

    torch.manual_seed(0)
    model = Transformer(ModelConfig(d_model=32, n_heads=2, d_ff=64, n_layers=1))
    model.init_weights(0)
    ids = torch.randint(0, 50257, (4, 16))
    labels = torch.randint(0, 50257, (4, 16))
    labels[0, 3:] = -100  # one row mostly ignored
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(16).repeat(4, 1),
             "document_ids": torch.zeros(4, 16, dtype=torch.int32)}
    whole, n = token_loss_sum(model, batch)
    halves = [token_loss_sum(model, {k: v[i:i + 2] for k, v in batch.items()}) for i in (0, 2)]
    assert sum(h[1] for h in halves) == n == 4 * 16 - 13
    # float32 sums in another grouping: a few ulps
    torch.testing.assert_close(sum(h[0] for h in halves) / n, whole / n, rtol=1e-6, atol=0)
    per_half_mean = sum(h[0] / h[1] for h in halves) / 2
    assert abs(per_half_mean - whole / n) > 1e-3


def test_holdout_split_is_disjoint_and_fixed():
    mask = held_out("prose", 1000, HoldoutConfig(0.1, seed=1))
    assert mask.tolist() == held_out("prose", 1000, HoldoutConfig(0.1, seed=1, side="heldout")).tolist()
    assert 60 < mask.sum() < 140
    assert mask.tolist() != held_out("prose", 1000, HoldoutConfig(0.1, seed=2)).tolist()


def _pipe(texts, holdout=None):
    p = Pipeline(Mix({"m": InMemory(texts)}, {"m": 1.0})).tokenize().pack_flat(max_length=16).batch(2)
    return p.holdout(*holdout) if holdout else p


def test_holdout_sides_never_share_a_document_and_enter_the_fingerprint():
    texts = [f"document number {i} " * 3 for i in range(60)]
    seen = {}
    for side in ("train", "heldout"):
        with _pipe(texts, (0.2, 0, side)) as p:
            seen[side] = {int(t) for _ in range(20) for t in next(p).input_ids.ravel()}
            fields = p.plan_fields()
            assert fields["holdout"] == {"fraction": 0.2, "seed": 0, "side": side}
    with _pipe(texts) as plain:
        assert "holdout" not in plain.plan_fields()  # no split: the old fingerprint
    numbers = {i for i in range(60)}
    from zephon_state import load_tokenizer
    tok = load_tokenizer("gpt2")
    ids = {i: tok.tokenizer.encode(f" {i}").ids[0] for i in numbers}
    in_train = {i for i, t in ids.items() if t in seen["train"]}
    in_heldout = {i for i, t in ids.items() if t in seen["heldout"]}
    assert in_heldout and in_train and not (in_train & in_heldout)


@pytest.mark.parametrize("cmd", [[], ["train"], ["plan"]])
def test_every_subcommand_has_help(cmd, capsys):
    from flextrain.cli import main

    with pytest.raises(SystemExit) as e:
        main([*cmd, "--help"])
    assert e.value.code == 0 and "usage: flextrain" in capsys.readouterr().out


def test_set_lr_reaches_the_update_and_plan_layouts_match_the_optimizer():
    from flexshard import ShardedOptimizer, plan_layouts

    w = torch.nn.Parameter(torch.ones(4, 32))
    b = torch.nn.Parameter(torch.ones(32))
    opt = ShardedOptimizer({"w": w, "b": b}, muon_params=["w"])
    assert plan_layouts({"w": (4, 32), "b": (32,)}, 1, muon_params=["w"]) == {e.name: e.layout for e in opt.entries}
    opt.set_lr(muon=0.0, adamw=0.5)
    assert opt.lrs == (0.0, 0.5)
    w.grad, b.grad = torch.ones(4, 32), torch.ones(32)
    opt.reduce_gradients()
    opt.step()
    assert torch.equal(w.detach(), torch.full((4, 32), 1.0 * (1 - 0.0 * 0.1)))  # lr 0: no update, no decay
    assert torch.allclose(b.detach(), torch.full((32,), 1.0 * (1 - 0.5 * 0.01) - 0.5), atol=1e-6)  # Adam's first step: lr * sign


def test_resume_without_a_checkpoint_is_refused_in_one_line(tmp_path, capsys):
    from flextrain.cli import main

    assert main(["train", "--run-dir", str(tmp_path), "--resume", "--set", "steps=1"]) == 2
    assert capsys.readouterr().err == (f"flextrain: --resume: no committed checkpoint under {tmp_path / 'ckpt'}; "
                                       "drop --resume to start a new run there\n")
    assert sorted(os.listdir(tmp_path)) == []  # the refused run leaves the folder as it found it


@pytest.mark.parametrize("argv,err", [
    (["--world", "0"], "flextrain: --world 0: must be >= 1\n"),
    (["--world", "2", "--batches", "-1"],
     "flextrain: --batches -1: must be >= 0 (how many of the next global batches to digest)\n"),
])
def test_plan_refuses_a_bad_world_or_batch_count_in_one_line(tmp_path, capsys, argv, err):
    from flextrain.cli import main

    assert main(["plan", str(tmp_path / "run"), *argv]) == 2
    assert capsys.readouterr().err == err
    assert not (tmp_path / "run").exists()


def test_plan_into_a_closed_pipe_exits_141_without_a_traceback(tmp_path, capsys, monkeypatch, closed_stdout):

    import flextrain.restore
    from flextrain.cli import main

    monkeypatch.setattr(flextrain.restore, "plan_restore", lambda *a, **k: {"ok": True})
    monkeypatch.setattr(flextrain.restore, "describe", lambda plan: "line\n" * 10_000)
    closed_stdout()
    assert main(["plan", str(tmp_path), "--world", "2"]) == 141
    assert capsys.readouterr().err == ""


def test_a_world_of_one_is_one_rank_in_messages():
    from flexshard.world import ranks

    assert (ranks(1), ranks(0), ranks(3)) == ("1 rank", "0 ranks", "3 ranks")
    cfg = load_config(sets=["data.lanes=2", "data.global_batch=6", "data.micro_batch=4"])
    with pytest.raises(ConfigError, match=r"^cannot run on 1 rank: the per-rank batch 6 "):
        cfg.check_world(1)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_world_the_data_does_not_split_over_is_said_by_rank_0_only(tmp_path, capsys, monkeypatch, rank):
    import flextrain.trainer
    from flextrain.cli import main

    monkeypatch.setattr(flextrain.trainer, "init_distributed", lambda backend: (int(rank), 3))  # as torchrun's rank
    monkeypatch.setenv("RANK", rank)
    assert main(["train", "--run-dir", str(tmp_path), "--set", "steps=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flextrain: cannot run on 3 ranks: ") if rank == "0" else err == ""


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_diverged_run_is_said_by_rank_0_only(tmp_path, capsys, monkeypatch, rank):
    """Every rank stops on the same gathered loss with the same message: said once."""
    import flextrain.trainer
    from flextrain.cli import main

    def diverged(cfg, resume=None, preempt=None):
        raise flextrain.trainer.TrainingDiverged("step 3: the loss is nan; stopped on every rank")

    monkeypatch.setattr(flextrain.trainer, "run", diverged)
    monkeypatch.setenv("RANK", rank)
    assert main(["train", "--run-dir", str(tmp_path), "--set", "steps=1"]) == 2
    err = capsys.readouterr().err
    assert err == ("flextrain: step 3: the loss is nan; stopped on every rank\n" if rank == "0" else "")


def test_a_missing_or_malformed_config_file_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^--config .*nope.toml: cannot read it \(No such file or directory\)$"):
        load_config("tiny", str(tmp_path / "nope.toml"))
    (tmp_path / "bad.toml").write_text("steps = [\n")
    with pytest.raises(ConfigError, match=r"bad.toml: not valid TOML: Invalid value"):
        load_config("tiny", str(tmp_path / "bad.toml"))
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ConfigError, match=r"list.json: wants a table of sections and keys, got list$"):
        load_config("tiny", str(tmp_path / "list.json"))
    (tmp_path / "typo.toml").write_text("stepz = 7\n")
    with pytest.raises(ConfigError, match=r"typo.toml: stepz: unknown key 'stepz'; known: \['run_dir', 'seed'"):
        load_config("tiny", str(tmp_path / "typo.toml"))
    (tmp_path / "typo.toml").write_text("[data]\nmax_lenght = 64\n")
    with pytest.raises(ConfigError, match=r"typo.toml: data.max_lenght: unknown key 'max_lenght'; known: \['sources'"):
        load_config("tiny", str(tmp_path / "typo.toml"))
    (tmp_path / "ok.toml").write_text("steps = 7\n[data]\nmax_length = 64\n")
    cfg = load_config("tiny", str(tmp_path / "ok.toml"))
    assert (cfg.steps, cfg.data.max_length) == (7, 64)


def test_weights_finite_finds_one_bad_element_and_survives_an_overflowing_sum():
    """The save step's weights check: one NaN or infinity anywhere fails it, whatever its
    position among large values; finite values whose sum overflows fp32 pass (the
    element-by-element fallback); empty tensors count as finite."""
    from flextrain.trainer import weights_finite

    good = [torch.randn(37, 5), torch.empty(0), torch.randn(11)]
    assert weights_finite(good) and weights_finite([]) and weights_finite([torch.empty(0, 3)])
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in (0, 93, 184):
            t = torch.randn(37, 5)
            t.view(-1)[where] = bad
            assert not weights_finite([good[0], t, good[2]]), (bad, where)
    huge = torch.full((64,), 3e38)
    assert not bool(huge.sum().isfinite())  # the fallback's case: the sum overflows
    assert weights_finite([huge, -huge])
    huge_then_inf = huge.clone()
    huge_then_inf[-1] = -float("inf")  # +inf from the overflow, -inf here: the sum is NaN, the tensor not finite
    assert not weights_finite([huge_then_inf])


def test_the_demo_refuses_a_folder_it_did_not_write_and_leaves_it_whole(tmp_path, capsys):
    """The demo empties --dir first: a folder holding anything but an earlier demo's runs is
    refused before a byte is removed."""
    from flextrain.demo import main

    (tmp_path / "reference").mkdir()
    (tmp_path / "my-notes.txt").write_text("mine")
    assert main(["--dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"demo: --dir {tmp_path} holds ['my-notes.txt'], not only an earlier demo's "
                                       f"folders, and the demo empties it first; pass a new folder\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-notes.txt", "reference"]
    with pytest.raises(SystemExit) as e:
        main(["--dir", str(tmp_path / "new"), "--steps", "3"])
    assert e.value.code == 2 and "--steps 3: must be >= 4" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("loader", ["zephon", "usual"])
def test_a_source_path_is_read_as_zephon_state_reads_it(tmp_path, loader):
    """``.ndjson`` (and ``.jsonl.zstd``) are JSON Lines to zephon_state: the trainer reads
    them as such, not as text files whose documents would be the raw JSON."""
    import json

    from flextrain.config import DataConfig
    from flextrain.data import build_pipeline
    from flextrain.usual_loader import UsualLoader

    lines = "".join(json.dumps({"text": f"document {i} says {'word ' * i}"}) + "\n" for i in range(40))
    (tmp_path / "a.jsonl").write_text(lines)
    (tmp_path / "a.ndjson").write_text(lines)

    def first_rows(path):
        d = DataConfig(sources={"a": str(path)}, shares={"a": 1.0}, max_length=16, lanes=1, global_batch=1,
                       micro_batch=1, shuffle_buffer=4, loader=loader)
        p = UsualLoader(d, 0, 0, 1) if loader == "usual" else build_pipeline(d, 0, 0, 1)
        try:
            return [next(p).input_ids.tolist() for _ in range(3)]
        finally:
            p.close()

    assert first_rows(tmp_path / "a.ndjson") == first_rows(tmp_path / "a.jsonl")


def test_a_source_zephon_state_refuses_is_named_by_its_config_field():
    from flextrain.data import source

    with pytest.raises(ConfigError, match=r"^data.sources\['web'\]='' is not allowed: source paths must be a "
                                          r"non-empty string"):
        source("web", "")


def test_the_cli_imports_no_torch_before_its_signal_handler_is_installed():
    """``flextrain train`` installs its SIGTERM handler first; torch (seconds to import) comes
    after. The CLI module, and the closed-pipe exit it shares with flexckpt's, import no torch."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, flextrain.cli, flextrain.preempt; "
            "print(sorted(m for m in ('torch', 'flexckpt', 'numpy') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (0, "[]\n"), out.stderr[-2000:]


def test_plan_of_a_missing_or_checkpoint_folder_says_which_folder_to_give(tmp_path, capsys):
    from flexckpt import Checkpointer
    from flextrain.cli import main

    with Checkpointer(str(tmp_path / "run" / "ckpt"), rank=0, world_size=1, run_id="t") as ck:
        ck.save(3, {"trainer": {"step": 3}}).result(timeout=30)
    assert main(["plan", str(tmp_path / "run" / "ckpt"), "--world", "2"]) == 2
    assert capsys.readouterr().err == (f"flextrain: no committed checkpoint under {tmp_path}/run/ckpt/ckpt; "
                                       f"{tmp_path}/run/ckpt is a checkpoint folder: give the run folder, "
                                       f"{tmp_path}/run\n")
    assert main(["plan", str(tmp_path / "nope"), "--world", "2"]) == 2
    assert capsys.readouterr().err == (f"flextrain: {tmp_path}/nope does not exist; give the run folder of "
                                       "flextrain train (its --run-dir)\n")
    assert main(["plan", str(tmp_path / "run"), "--world", "2", "--step", "7"]) == 2
    assert capsys.readouterr().err == (f"flextrain: step 7 is not a committed checkpoint under {tmp_path}/run/ckpt; "
                                       "committed: [3]\n")  # its folder named once
    assert sorted(os.listdir(tmp_path)) == ["run"] and sorted(os.listdir(tmp_path / "run" / "ckpt")) == ["step-000000000003"]
