# torchrun --nproc-per-node 2 fsdp2_quickstart.py   (run it again at any --nproc-per-node: it resumes)
import torch, torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from flexckpt import Checkpointer

dist.init_process_group("gloo")  # on GPUs: "nccl", with the model and batches on cuda:LOCAL_RANK
model = fully_shard(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)))
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
with Checkpointer("file:///tmp/flexckpt-quickstart", keep_last=2) as ckpt:  # or s3://bucket/run
    start = 0
    if ckpt.latest_step() is not None:  # resume, at this world size or any other
        msd, osd = get_state_dict(model, optim)  # this rank's shards, as DTensors
        start = ckpt.load(state := {"model": msd, "optim": osd})  # in place
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for step in range(start + 1, start + 11):
        model(torch.randn(8, 16)).square().mean().backward()
        optim.step()
        optim.zero_grad()
        msd, osd = get_state_dict(model, optim)
        ckpt.save(step, {"model": msd, "optim": osd}).wait_staged()  # copied: written in the background
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: resumed at {start}, saved step {step}")
dist.destroy_process_group()
