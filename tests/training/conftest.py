"""Builders the training tests share: a lazy client at stage 1 over fixed rows, and what a
stage computes from them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from retexo_fl.config import TrainConfig
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.records import StateDict


@pytest.fixture()
def stage_one_client(sbm) -> Callable[..., LazyClient]:
    """``build(cfg, row_scale=1.0)``: client 0 of 3 random partitions of ``sbm`` at stage 1, its
    owned and halo rows (8 wide) random but fixed, ``row_scale`` times a standard normal's size,
    its edges (and GCN weights) its own."""

    def build(cfg: TrainConfig, row_scale: float = 1.0) -> LazyClient:
        client = LazyClient(partition_graph(sbm, 3, "random", seed=0)[0], cfg)
        client.stage = 1
        gen = torch.Generator().manual_seed(0)
        client.owned = torch.randn(client.graph.num_owned, 8, generator=gen) * row_scale
        client.halo = torch.randn(client.graph.num_halo, 8, generator=gen) * row_scale
        client.halo_degree = torch.randint(1, 9, (client.graph.num_halo,), generator=gen).float()
        return client

    return build


@pytest.fixture()
def stage_outputs() -> Callable[[LazyClient, StateDict], tuple[Tensor, Tensor, dict[str, Tensor]]]:
    """``run(client, state)``: the client's hidden rows and logits under ``state`` (eval mode),
    and the gradients of the logits' sum of squares with respect to each parameter."""

    def run(client: LazyClient, state: StateDict) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        model = client.loaded_model(state)
        model.eval()
        model.zero_grad()
        hidden, logits = client.outputs(model)
        logits.square().sum().backward()
        return hidden, logits, {k: p.grad.clone() for k, p in model.named_parameters()}

    return run
