"""Device-agnostic code paths, checked without a GPU: the ``meta`` device stands for any
device that is not the CPU (a buffer allocated on the CPU by mistake fails the copy into
or out of it), and the stream/event interface of staging has a CPU implementation that
records what a GPU one would do."""
import pytest
import torch

from flexshard.optimizer import ShardedOptimizer, ShardingConfig, check_backend_device


def _meta_params():
    return {
        "w": torch.nn.Parameter(torch.empty(64, 40, device="meta")),
        "v": torch.nn.Parameter(torch.empty(96, 32, device="meta")),
        "b": torch.nn.Parameter(torch.empty(70, device="meta")),
    }


@pytest.mark.parametrize("placement", ["owned", "fsdp"])
@pytest.mark.parametrize("compute_copy", ["full", "mxfp8"])
def test_sharded_optimizer_keeps_masters_state_and_buffers_on_the_parameters_device(placement, compute_copy):
    params = _meta_params()
    opt = ShardedOptimizer(params, sharding=ShardingConfig(placement=placement, compute_copy=compute_copy))
    for p in params.values():
        p.grad = torch.empty_like(p)
    opt.reduce_gradients()
    opt.step()  # any CPU buffer on the way would fail to mix with meta tensors
    devices = {st.local.device.type for e in opt.entries for st in (e.master, *e.state.values())}
    assert devices == {"meta"} and opt._grad_bucket.device.type == "meta"
    if compute_copy == "mxfp8":
        assert {mx.data.device.type for mx in opt.mx_params.values()} == {"meta"}


def test_sharded_optimizer_refuses_parameters_on_two_devices():
    params = {"a": torch.zeros(4, 4), "b": torch.empty(4, device="meta")}
    with pytest.raises(ValueError, match=r"one device .*\['cpu', 'meta'\]"):
        ShardedOptimizer(params)


def test_backend_must_move_the_parameters_device():
    check_backend_device("nccl", torch.device("cuda", 0))
    check_backend_device("gloo", torch.device("cpu"))
    with pytest.raises(ValueError, match="backend is nccl, which moves cuda tensors: init the group with backend='gloo'"):
        check_backend_device("nccl", torch.device("cpu"))
    with pytest.raises(ValueError, match="backend is gloo, which moves cpu tensors: init the group with backend='nccl'"):
        check_backend_device("gloo", torch.device("cuda", 0))


# --- flexckpt staging: the stream/event logic, on a fake of the few torch.cuda calls ---------

import threading  # noqa: E402

from flexckpt import Checkpointer  # noqa: E402
import flexckpt.save_pipeline as save_pipeline  # noqa: E402
from flexckpt.staging import HostCopies, StreamCopies, copies_for, staging_device  # noqa: E402


class FakeStreams:
    """Streams and events that log what happens, on which stream and which thread."""

    def __init__(self):
        self.log = []
        self.current = "train"

    def current_stream(self, device):
        return self.current

    def new_stream(self, device):
        self.log.append(("new_stream", threading.current_thread().name))
        return _FakeStream(self, "side")

    def new_event(self):
        return _FakeEvent(self)

    def use(self, stream):
        fake = self

        class _Use:
            def __enter__(self):
                fake.current = stream.name

            def __exit__(self, *exc):
                fake.current = "train"

        return _Use()


class _FakeStream:
    def __init__(self, fake, name):
        self.fake, self.name = fake, name

    def wait_event(self, event):
        self.fake.log.append(("wait", self.name, event.recorded_on))


class _FakeEvent:
    def __init__(self, fake):
        self.fake, self.recorded_on = fake, None

    def record(self, stream):
        self.recorded_on = getattr(stream, "name", stream)
        self.fake.log.append(("record", self.recorded_on, threading.current_thread().name))

    def synchronize(self):
        self.fake.log.append(("synchronize", self.recorded_on))


def _logging_foreach_copy(fake, monkeypatch):
    plain = torch._foreach_copy_

    def logged(dsts, srcs, non_blocking=False):
        fake.log.append(("copy", fake.current, len(srcs), non_blocking))
        return plain(dsts, srcs, non_blocking=non_blocking)

    monkeypatch.setattr(torch, "_foreach_copy_", logged)


def test_stream_copies_wait_for_the_training_stream_then_copy_on_the_side_stream_only(monkeypatch):
    fake = FakeStreams()
    _logging_foreach_copy(fake, monkeypatch)
    copies = StreamCopies(torch.device("cpu"), fake)
    srcs, dsts = [torch.arange(6.0), torch.ones(2, 3)], [torch.zeros(6), torch.zeros(2, 3)]
    mark = copies.ready()
    assert fake.log == [("record", "train", threading.current_thread().name)]  # nothing copied at save()
    copies.copy(dsts, srcs, mark)
    copies.copy(dsts, srcs, copies.ready())  # the side stream is made once and reused
    ops = [entry[0] for entry in fake.log]
    assert ops == ["record", "new_stream", "wait", "copy", "record", "synchronize",
                   "record", "wait", "copy", "record", "synchronize"]
    assert [e for e in fake.log if e[0] == "copy"] == [("copy", "side", 2, True)] * 2
    assert [e for e in fake.log if e[0] == "wait"] == [("wait", "side", "train")] * 2
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))


def test_staging_copies_are_chosen_by_the_one_device_of_the_pieces():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 1)
    assert staging_device({cpu}) == cpu and staging_device({cpu, gpu}) == gpu
    assert isinstance(copies_for(cpu), HostCopies)
    assert isinstance(copies_for(gpu), StreamCopies) and copies_for(gpu).device == gpu
    with pytest.raises(ValueError, match=r"spans devices \['cuda:0', 'cuda:1'\].*one device"):
        staging_device({torch.device("cuda", 0), gpu})


def test_a_save_marks_the_training_stream_and_the_staging_thread_copies(tmp_path, monkeypatch):
    fake = FakeStreams()
    _logging_foreach_copy(fake, monkeypatch)
    monkeypatch.setattr(save_pipeline, "copies_for", lambda device: StreamCopies(device, fake))
    w = torch.arange(1000, dtype=torch.float32)
    with Checkpointer(str(tmp_path)) as ckpt:
        h = ckpt.save(1, {"w": w, "step": 1})
        h.wait_staged()
        w.add_(1)  # after the fence the state is the trainer's again
        h.result()
        target = {"w": torch.zeros_like(w), "step": 0}
        ckpt.load(target)
    assert torch.equal(target["w"], torch.arange(1000, dtype=torch.float32)) and target["step"] == 1
    me = threading.current_thread().name
    assert fake.log[0] == ("record", "train", me)  # save(): the mark, on the training thread
    staged = [e for e in fake.log if e[0] in ("new_stream", "copy")]
    assert staged[0][0] == "new_stream" and staged[0][1] != me  # the staging thread's side stream
    assert [e for e in fake.log if e[0] == "copy"][0][1:] == ("side", 1, True)


# --- flextrain: the device chosen in one place ------------------------------------------------

from flextrain.config import ConfigError, differences, fingerprint, load_config  # noqa: E402
from flextrain.device import autocast, backend_for, choose_device, resolve_autocast, to_device  # noqa: E402


def test_the_device_defaults_to_cuda_when_present_on_the_local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert choose_device("auto", cuda_available=lambda: True) == torch.device("cuda", 3)
    assert choose_device("cuda", cuda_available=lambda: True) == torch.device("cuda", 3)
    assert choose_device("cpu", cuda_available=lambda: True) == torch.device("cpu")
    assert choose_device("auto", cuda_available=lambda: False) == torch.device("cpu")
    with pytest.raises(ValueError, match="device='cuda' but torch sees no CUDA device; use --set device=cpu"):
        choose_device("cuda", cuda_available=lambda: False)
    assert backend_for(torch.device("cuda", 0)) == "nccl" and backend_for(torch.device("cpu")) == "gloo"


def test_autocast_is_bf16_on_cuda_by_default_and_changes_the_fingerprint_device_does_not():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert (resolve_autocast("auto", cuda), resolve_autocast("auto", cpu), resolve_autocast("bf16", cpu)) == ("bf16", "none", "bf16")
    gpu_run = load_config(sets=["device=cuda", "autocast=bf16"]).to_dict()
    cpu_run = load_config(sets=["device=cpu", "autocast=none"]).to_dict()
    same_numbers = load_config(sets=["device=cpu", "autocast=bf16"]).to_dict()
    assert differences(gpu_run, cpu_run) == ["autocast: saved 'bf16', now 'none'"]
    assert differences(gpu_run, same_numbers) == [] and fingerprint(gpu_run) == fingerprint(same_numbers)
    older = {k: v for k, v in cpu_run.items() if k != "autocast"}  # a run from before autocast: fp32
    assert differences(older, cpu_run) == []
    with pytest.raises(ConfigError, match="device='gpu' is not allowed: it must be one of 'auto', 'cuda', 'cpu'"):
        load_config(sets=["device=gpu"])


def test_batches_stay_put_on_the_cpu_and_autocast_runs_the_forward_in_bf16():
    batch = {"input_ids": torch.arange(4)}
    assert to_device(batch, torch.device("cpu")) is batch
    a = torch.randn(4, 4)
    with autocast("bf16", torch.device("cpu")):
        assert (a @ a).dtype == torch.bfloat16
    with autocast("none", torch.device("cpu")):
        assert (a @ a).dtype == torch.float32
