"""Differential privacy of model updates: server-side clipping, Gaussian noise, Flower's RDP accountant.

This is DP-FedAvg with central noise (McMahan et al., 2018) as Flower's
``DifferentialPrivacyServerSideFixedClipping`` does it, using Flower's own clipping and noise
scale functions and its RDP accountant (``flwr[dp]``): each round, every client's update is clipped
to L2 norm ``dp-clip``, the clipped updates are averaged with equal weights, and Gaussian noise
of standard deviation ``dp-noise * dp-clip / n`` is added to the mean. Every round of every
stage is one Gaussian release over all ``n`` clients (no sampling, so no amplification); the
accountant composes them and reports the client-level (epsilon, delta) spent.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch
from torch import Tensor

from retexo_fl.coordinator.aggregate import apply_updates
from retexo_fl.seeding import derive_seed

StateDict = dict[str, Tensor]


class UpdatePrivacy:
    """Clip, average and noise one round's updates, and account for the privacy spent.

    Args:
        noise (float): the noise multiplier (noise standard deviation over the clipping norm), > 0.
        clip (float): the L2 clipping norm of one client's whole update, > 0.
        clients (int): the number of clients (every one takes part in every round).
        delta (float): the delta at which epsilon is reported.
        seed (int, optional): seeds the noise, so a run is reproducible (and anyone who knows
            the seed can remove it); :obj:`None` draws a secret 256-bit key from the operating
            system, which only this object (and so the server's checkpoint) holds.
            (default: :obj:`None`)

    Raises:
        ValueError: if ``noise`` or ``clip`` is not positive.
        RuntimeError: if Flower's privacy accountant (``retexo-fl[dp]``) is not installed.
    """

    def __init__(
        self, noise: float, clip: float, clients: int, delta: float, seed: int | None = None
    ) -> None:
        if noise <= 0 or clip <= 0:
            raise ValueError(f"dp-noise and dp-clip must be > 0, got {noise} and {clip}")
        try:  # Flower's accountant needs the optional dp-accounting package (retexo-fl[dp])
            from flwr.supercore.privacy_accounting import NeighboringRelation, PrivacyConfig, SamplingMethod
            from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

            self.accountant = RdpAccountant(
                PrivacyConfig(
                    target_delta=delta,
                    population_size=clients,
                    neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                    sampling_method=SamplingMethod.NO_AMPLIFICATION,
                )
            )
        except ImportError as exc:
            raise RuntimeError(
                "dp-noise needs Flower's privacy accountant: pip install 'retexo-fl[dp]' (flwr[dp])"
            ) from exc
        self.noise, self.clip, self.clients, self.delta = noise, clip, clients, delta
        self.reproducible = seed is not None
        # The released model is public: noise anyone could regenerate protects nothing.
        self.seed = seed if seed is not None else secrets.randbits(256)
        self.clipped = 0  # updates whose norm exceeded the clipping norm
        self.distributed = False  # secure aggregation: clients clip and add the noise

    def aggregate(
        self, state: StateDict, view: StateDict, states: list[StateDict], tag: tuple[int, ...]
    ) -> StateDict:
        """``state`` plus the noisy mean of the clipped updates ``states[i] - view``.

        The updates are averaged with equal weights, and every call is one Gaussian release composed
        into the accountant.

        Args:
            state (StateDict): the server's global state.
            view (StateDict): the state the clients trained from.
            states (list[StateDict]): the clients' trained states.
            tag (tuple[int, ...]): ``(stage, round)``, and the training's index for ``first-stage
                auto``'s second training of stage 0; seeds this release's noise.

        Shapes:
            - **input:** every tensor of ``view`` and ``states[i]`` the shape of ``state``'s
            - **output:** one tensor per key of ``view``, in ``state``'s shape and dtype
        """
        # Flower's DP functions: imported only when DP is on (they pull the optional accountant).
        from flwr.supercore.differential_privacy import (
            clip_inputs_inplace,
            compute_stdv,
            get_norm,
        )
        from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

        keys = list(view)
        deltas = []
        for s in states:
            d = [(s[k].float() - view[k].float()).numpy().astype(np.float64) for k in keys]
            if get_norm(d) > self.clip:  # (Flower's clip divides by the norm: a zero update stays as is)
                self.clipped += 1
                clip_inputs_inplace(d, self.clip)
            deltas.append(d)
        mean = [np.mean([d[i] for d in deltas], axis=0) for i in range(len(keys))]
        # Flower's add_gaussian_noise_inplace draws from NumPy's global generator, which takes a
        # 32-bit seed: a generator of this release's own, keyed by the whole seed, instead.
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(self.seed, spawn_key=(*tag, 0xD9))))
        stdv = compute_stdv(self.noise, self.clip, len(states))
        mean = [m + rng.normal(0.0, stdv, m.shape) for m in mean]
        self.accountant.compose(GaussianPrivacyEvent(self.noise, len(states), self.clients))
        return {
            k: (state[k].float() + torch.from_numpy(m).float()).to(state[k].dtype)
            for k, m in zip(keys, mean, strict=True)
        }

    def account_distributed(self, survivors: int, members: int, clipped: int) -> None:
        """Compose one round of distributed noise (secure aggregation): each of ``members``
        clients added noise of standard deviation ``noise * clip / sqrt(members)`` to its clipped
        update, and the server decoded the sum of ``survivors`` of them, whose noise is
        ``noise * clip * sqrt(survivors / members)``: a Gaussian release over ``survivors`` equal-weight
        updates with that smaller multiplier.

        Args:
            survivors (int): the updates summed.
            members (int): the clients that masked the round.
            clipped (int): how many of the summed updates were clipped (a sum the clients reported).
        """
        from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

        self.distributed = True
        self.clipped += clipped
        multiplier = self.noise * (survivors / members) ** 0.5
        self.accountant.compose(GaussianPrivacyEvent(multiplier, survivors, self.clients))

    def __getstate__(self) -> dict:
        # The accountant holds modules; its own state_dict is what a checkpoint can keep.
        state = dict(self.__dict__)
        state["accountant"] = self.accountant.state_dict()
        return state

    def __setstate__(self, state: dict) -> None:
        saved = state.pop("accountant")
        fresh = UpdatePrivacy(state["noise"], state["clip"], state["clients"], state["delta"], 0)
        self.__dict__.update({**fresh.__dict__, **state})
        self.accountant.load_state_dict(saved)

    def spent(self) -> dict:
        """The (epsilon, delta) spent so far, with the releases composed and the clipping rate.

        Returns:
            ``epsilon``, ``delta``, ``releases``, ``noise_multiplier``, ``clip``,
            ``updates_clipped`` (updates whose norm exceeded ``clip``), ``noise_seed``
            (``"secret"``, or ``"run seed"`` when anyone with the run config can remove it) and
            ``noise`` (``"central"``: the server adds it; ``"distributed"``: each client adds its
            share under secure aggregation, and the server holds no noiseless sum unless
            ``dp-reproducible`` seeds the shares from the run's seed).
        """
        s = self.accountant.get_privacy_spent(self.delta)
        return {
            "epsilon": s.epsilon,
            "delta": s.delta,
            "releases": s.num_releases,
            "noise_multiplier": self.noise,
            "clip": self.clip,
            "updates_clipped": self.clipped,
            "noise_seed": "run seed" if self.reproducible else "secret",
            "noise": "distributed" if self.distributed else "central",
        }


def make_privacy(cfg, clients: int) -> UpdatePrivacy | None:
    """The run's :class:`UpdatePrivacy`, or ``None`` when ``dp-noise`` is 0.

    Args:
        cfg (TrainConfig): the run configuration (``dp_noise``, ``dp_clip``, ``dp_delta``, and
            ``seed`` with ``dp_reproducible``).
        clients (int): the number of clients.
    """
    if cfg.dp_noise <= 0:
        return None
    seed = derive_seed(cfg.seed, 0xD9) if cfg.dp_reproducible else None
    return UpdatePrivacy(cfg.dp_noise, cfg.dp_clip, clients, cfg.dp_delta, seed)


def aggregate_round(
    state: StateDict,
    view: StateDict,
    states: list[StateDict],
    weights: list[float],
    privacy: UpdatePrivacy | None,
    tag: tuple[int, ...],
) -> StateDict:
    """One round's aggregate before the server optimizer: FedAvg, or DP-FedAvg with ``privacy``.

    Args:
        state (StateDict): the server's global state.
        view (StateDict): the state the clients trained from.
        states (list[StateDict]): the clients' trained states.
        weights (list[float]): the FedAvg weights (DP-FedAvg weighs every client equally).
        privacy (UpdatePrivacy | None): the run's DP, or ``None`` for plain FedAvg.
        tag (tuple[int, ...]): ``(stage, round)`` (and a second training's index); seeds DP's noise.

    Shapes:
        - **input:** every tensor of ``view`` and ``states[i]`` the shape of ``state``'s
        - **output:** one tensor per key of ``state``, in its shape and dtype
    """
    if privacy is None:
        return apply_updates(state, view, states, weights)
    return privacy.aggregate(state, view, states, tag)
