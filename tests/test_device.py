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
