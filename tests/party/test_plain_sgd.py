"""PlainSGD steps as torch.optim.SGD (momentum 0) does, bit for bit, without importing torch._dynamo."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from retexo_fl.party.plain_sgd import PlainSGD


def _steps(make_optimizer, device: str, steps: int = 6) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(37, 19), torch.nn.ReLU(), torch.nn.Linear(19, 5)).to(device)
    model[2].bias.requires_grad_(False)  # a frozen parameter is left alone
    opt = make_optimizer(model.parameters())
    x = torch.randn(64, 37, device=device)
    y = torch.randint(0, 5, (64,), device=device)
    for step in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if step != 3:  # a step without a backward: no gradient, no change
            loss.backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("decay", [0.0, 5e-3])
def test_plain_sgd_steps_as_torch_optim_sgd_does(device, decay):
    ours = _steps(lambda ps: PlainSGD(ps, lr=0.7, weight_decay=decay), device)
    torchs = _steps(lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.0, weight_decay=decay), device)
    for a, b in zip(ours, torchs, strict=True):
        assert torch.equal(a, b)  # bit for bit, not within a tolerance


def test_a_stage_0_round_in_a_fresh_process_does_not_import_dynamo(tmp_path):
    # torch.optim's first optimizer imported torch._dynamo: 2.9 s of every ClientApp process a
    # message that trains stage 0 (which reads no PyG layer, whose import brings it too). The
    # partition is written here and loaded there, as a node loads its own.
    from retexo_fl.data.datasets import apply_split, synthetic_sbm
    from retexo_fl.data.partition import save_partition
    from retexo_fl.data.partitioners import partition_graph

    data = synthetic_sbm(60, 3, avg_degree=4, num_features=8, seed=0)
    apply_split(data, "random:0.5,0.25,0.25", seed=0)
    folder = save_partition(partition_graph(data, 2, "random", seed=0)[0], tmp_path / "part-0")
    code = f"""
import sys
from retexo_fl.config import TrainConfig
from retexo_fl.data.partition import load_partition
from retexo_fl.party.lazy_client import LazyClient
cfg = TrainConfig.resolve(clients=2, first_stage="mlp", device="cpu")
client = LazyClient(load_partition({str(folder)!r}), cfg)
state = {{k: v.clone() for k, v in client.make_model().state_dict().items()}}
new, loss = client.train(state, 1)
assert any(not new[k].equal(state[k]) for k in state), "the round changed nothing"
print("dynamo imported" if "torch._dynamo" in sys.modules else "no dynamo")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("no dynamo"), out.stdout
