"""Test scaffolding: torchtitan 0.3.0's trainer on CPU with gloo, a tiny debug model, a
tokenizer and a corpus made here, and config functions (``--module torchtitan_cpu``).

torchtitan 0.3.0 runs on CPU/gloo only with five shims, each applied by its own function:

1. ``cpu_device``: torchtitan picks "cuda" when no accelerator is found; use torch.cpu.
2. ``partial_dtensor``: the default SPMD backend (spmd_types) is not for CPU; the config
   functions here set ``parallelism.spmd_backend = "partial_dtensor"``.
3. ``dense_flex_attention``: FlexAttention has no CPU backward; compute the same document
   mask densely and call scaled_dot_product_attention (its block mask built eagerly).
4. ``sum_reduction_for_comms``: gloo has no PREMUL_SUM; FSDP2 reduces with SUM instead
   (torchtitan divides by the global token count itself).
5. ``pg_set_timeout``: ``torch.distributed.set_timeout`` (called after step 1) maps to
   ``_set_pg_timeout``.

Nothing here is part of the integration (src/flexckpt_torchtitan).
"""
from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

# -- the five shims ----------------------------------------------------------------------------


class _CpuDeviceModule:
    """What torchtitan asks of a device module (torch.cuda's names), for the CPU."""

    def __getattr__(self, name: str):
        import torch

        return getattr(torch.cpu, name)

    def get_device_name(self, device=None) -> str:
        return "cpu"

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def get_device_properties(self, device=None):
        import types

        return types.SimpleNamespace(name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def memory_stats(self, device=None) -> dict:
        return {}

    def set_device(self, device=None) -> None: ...
    def reset_peak_memory_stats(self, device=None) -> None: ...
    def empty_cache(self) -> None: ...
    def synchronize(self, device=None) -> None: ...


def cpu_device() -> None:
    import torch._utils as tu

    if "torchtitan.tools.utils" in sys.modules:
        return
    original = tu._get_available_device_type, tu._get_device_module
    tu._get_available_device_type = lambda: "cpu"
    tu._get_device_module = lambda device_type: _CpuDeviceModule()
    try:
        import torchtitan.tools.utils  # noqa: F401 - binds device_type "cpu" for every importer
    finally:
        tu._get_available_device_type, tu._get_device_module = original


def dense_flex_attention() -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, create_mask
    from torchtitan.models.common import attention
    from torchtitan.models.common.attention import FlexAttention

    def compiled_flex_attn(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
        if score_mod is not None or return_aux.lse:
            raise NotImplementedError("the CPU shim computes plain masked attention only")
        b, h, lq, _ = q.shape
        mask = create_mask(block_mask.mask_mod, b, 1, lq, k.shape[2], device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa), None

    FlexAttention.compiled_flex_attn = staticmethod(compiled_flex_attn)
    # the block mask only carries mask_mod here: built eagerly, not by torch.compile (a
    # dynamo trace and an inductor build per process, seconds each, for the same bits)
    attention._compiled_create_block_mask = create_block_mask


def sum_reduction_for_comms() -> None:
    from torch.distributed.fsdp import FSDPModule

    if getattr(FSDPModule, "_cpu_shim", False):
        return
    original = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self, factor: float) -> None:
        original(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor
    FSDPModule._cpu_shim = True


def pg_set_timeout() -> None:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: _set_pg_timeout(timeout, group)


def apply_cpu_shims() -> None:
    cpu_device()
    dense_flex_attention()
    sum_reduction_for_comms()
    pg_set_timeout()
    # the fifth, partial_dtensor, is a config field: see _base() below


# -- assets: a tokenizer of <= 2048 ids and a corpus ---------------------------------------------

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
         "tau upsilon phi chi psi omega river stone cloud field light night water story garden window").split()


def make_assets(folder: str | Path, documents: int = 400, seed: int = 0) -> Path:
    """``folder/tokenizer`` (tokenizer.json, a word-level vocabulary) and
    ``folder/data/train.jsonl``; the same bytes for the same arguments."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = Path(folder)
    (folder / "tokenizer").mkdir(parents=True, exist_ok=True)
    (folder / "data").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) + (str(rng.randrange(40)) if rng.random() < 0.3 else "")
                     for _ in range(rng.randrange(20, 200))) for _ in range(documents)]
    with open(folder / "data" / "train.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    vocab = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<unk>": 2}
    for w in sorted({t for d in docs for t in d.split()}):
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    tok.save(str(folder / "tokenizer" / "tokenizer.json"))
    (folder / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True}))
    return folder


# -- config functions (``--module torchtitan_cpu --config NAME``) -----------------------------------


def _base():
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import DebugConfig, ParallelismConfig, TrainingConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    assets = Path(os.environ["TT_ASSETS"])
    spec = model_registry("debugmodel")
    spec.model.layers = spec.model.layers[:2]  # tiny: 2 of the debug model's 6 layers
    return Trainer.Config(
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec)),
        hf_assets_path=str(assets / "tokenizer"),
        model_spec=spec,
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                                  min_lr_factor=0.0),
        training=TrainingConfig(local_batch_size=2, seq_len=64, steps=8, mixed_precision_param="float32"),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=str(assets / "data")),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),  # shim 2
        checkpoint=CheckpointManager.Config(interval=4, last_save_model_only=False),
        debug=DebugConfig(seed=0),
    )


def dcp_default_loader():
    """torchtitan's own manager (DCP) and loader: the baseline."""
    return _base()


def flex_default_loader():
    from flexckpt_torchtitan import FlexCheckpointManager

    c = _base()
    c.checkpoint = FlexCheckpointManager.Config(interval=4, last_save_model_only=False)
    return c


def flex_zephon():
    from flexckpt_torchtitan import FlexCheckpointManager

    c = dcp_zephon()
    c.checkpoint = FlexCheckpointManager.Config(interval=4, last_save_model_only=False)
    return c


def dcp_zephon():
    """torchtitan's own manager (DCP) with the zephon loader."""
    from flexckpt_torchtitan import ZephonDataLoader

    c = _base()
    c.dataloader = ZephonDataLoader.Config(dataset_path=str(Path(os.environ["TT_ASSETS"]) / "data" / "train.jsonl"),
                                           lanes=4, shuffle_buffer=16, global_batch_size=8)
    c.training.global_batch_size = 8
    return c


# -- one rank's run -----------------------------------------------------------------------------


def try_run(rank: int, world: int, args: list[str], stop_after: int | None = None) -> dict[str, Any]:
    """``run_trainer``, with a failure returned as ``{"error": "Type: message"}`` (for the
    runs that must be refused)."""
    try:
        return run_trainer(rank, world, args, stop_after)
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        return {"error": f"{type(e).__name__}: {e}", "losses": {}, "digests": []}


def run_trainer(rank: int, world: int, args: list[str], stop_after: int | None = None) -> dict[str, Any]:
    """Build torchtitan's trainer from ``args`` (``--config NAME ...``) on this rank of an
    initialized gloo group, train (stopping after ``stop_after`` steps, as a preempted job
    would), and return the logged losses, the loader's lane digests per step and the
    checkpoint waits."""
    import time

    import torch

    t0 = time.perf_counter()
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    apply_cpu_shims()
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(["--module", "torchtitan_cpu", *args])
    trainer = config.build()
    t_built = time.perf_counter()
    losses: dict[int, float] = {}
    step_ends: list[float] = []
    log = trainer.metrics_processor.log

    def record(step, loss, *rest, **kw):
        losses[step] = float(loss)
        step_ends.append(time.perf_counter())
        return log(step, loss, *rest, **kw)

    trainer.metrics_processor.log = record
    # the training thread's time in the checkpointer, per step: save() and the fence before
    # optimizers.step() (which belongs to the save of the step before)
    ckpt_seconds: dict[str, float] = {"save": 0.0, "staging": 0.0}
    per_save: dict[int, float] = {}

    def timed(name, fn):
        def call(*a, **kw):
            t = time.perf_counter()
            result = fn(*a, **kw)
            spent = time.perf_counter() - t
            ckpt_seconds[name] += spent
            if name == "save" and result:
                per_save[kw.get("curr_step", a[0] if a else None)] = spent
            elif name == "staging" and trainer.step - 1 in per_save:
                per_save[trainer.step - 1] += spent
            return result
        return call

    trainer.checkpointer.save = timed("save", trainer.checkpointer.save)
    trainer.checkpointer.maybe_wait_for_staging = timed("staging", trainer.checkpointer.maybe_wait_for_staging)
    if stop_after is not None:
        trainer.should_continue_training = lambda: trainer.step < min(stop_after, config.training.steps)
    try:
        trainer.train()
    finally:
        trainer.close()
    t_end = time.perf_counter()
    loader = trainer.dataloader
    digests = [{str(k): v.hex() for k, v in d.items()} for d in getattr(loader, "step_digests", [])]
    return {"losses": losses, "digests": digests, "waits": list(getattr(trainer.checkpointer, "waits", [])),
            "seconds": {"build": t_built - t0, "train": t_end - t_built, **ckpt_seconds},
            "step_s": [b - a for a, b in zip(step_ends, step_ends[1:])], "per_save": per_save}
