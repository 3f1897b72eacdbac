"""Run configuration shared by the CLI, the in-process engines and the Flower apps."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

MODES = ("lazy", "eager", "local", "centralized", "datacenter")
ALGORITHMS = ("1d", "1.5d", "2d", "3d")
BIT_POLICIES = ("fixed", "adaptive-budget", "adaptive-bandwidth")
PER_STAGE = ("rounds", "local_epochs", "lr", "server_lr", "dropout", "input_dropout")


@dataclass
class TrainConfig:
    """Every setting of a training run; kebab-case names are the run-config / CLI keys.

    Per-stage settings (``rounds``, ``local_epochs``, ``lr``) take one value for every stage or
    a list with one value per stage.
    """

    mode: str = "lazy"
    dataset: str = "Cora"
    data_root: str = "data"
    split: str = "public"
    split_index: int = 0
    clients: int = 4
    method: str = "metis"
    partitions: str = ""
    seed: int = 0
    model: str = "gcn"
    stages: int = 5
    central_layers: int = 2
    hidden: int = 256
    pass_embedding: str = "hidden"
    # Self-training (lazy and centralized): after the last stage, every client labels its own
    # unlabeled nodes predicted with at least this confidence (never validation nodes), and the
    # whole stack is trained again on them, once per pass. The labels never leave the client.
    self_training: int = 0  # extra passes
    pseudo_threshold: float = 0.9
    pseudo_per_class: int = 0  # at most this many new labels per predicted class and client; 0: no cap
    rounds: int | list[int] = 200
    local_epochs: int | list[int] = 1
    # One local SGD step (lr 1) per round makes the averaged update the exact full-graph
    # gradient; the server's Adam then follows centralized Adam (see ServerOptimizer).
    optimizer: str = "sgd"
    momentum: float = 0.0
    lr: float | list[float] = 1.0
    server_optimizer: str = "adam"
    server_lr: float | list[float] = 0.01
    weight_decay: float = 5e-4
    dropout: float | list[float] = 0.5
    input_dropout: float | list[float] = 0.5
    norm: str = "layer"
    heads: int = 4
    patience: int = 0
    device: str = "auto"
    # Local mode's time-based aggregation: seconds of local training per round (0: local-epochs).
    round_seconds: float = 0.0
    step_delay: str = ""  # "P:seconds,...": slow client P down by that much per step (emulation)
    # Small clients: profile "edge" means CPU, bounded threads, embeddings in row chunks and
    # 8-bit boundary rows, updates and broadcasts wherever those were left at their defaults.
    profile: str = "default"
    threads: int = 0  # torch threads per client (0: torch's default)
    chunk_rows: int = 0  # embeddings for this many target rows at a time (0: all at once)
    # Compression (DESIGN section 5): boundary rows and model updates.
    bits: int = 32
    bit_policy: str = "fixed"
    byte_budget: str = ""
    link_bandwidths: str = ""
    time_budget: float = 0.0
    rate_schedule: str = "fixed"
    update_bits: int = 32
    broadcast_bits: int = 32  # the server's model broadcast as b-bit deltas (32: whole state)
    range_dtype: str = "fp16"
    # End-to-end encryption of boundary payloads between clients (DESIGN section 6).
    encrypt: bool = True
    identity_keys: str = ""  # folder of client-<id>.key identity keys (else one key pair per run)
    pinned_keys: str = ""  # JSON {client id: public key hex} exchanged out of band
    # Differential privacy of model updates (DP-FedAvg, central noise; needs retexo-fl[dp]).
    dp_noise: float = 0.0  # noise multiplier; 0 turns DP off
    dp_clip: float = 1.0  # L2 norm each client's round update is clipped to
    dp_delta: float = 1e-5
    # Client failures (Flower engines): how many clients a run needs, what replaces a lost
    # client's boundary rows (fail | zero | reuse-last), and how long the server waits per message.
    min_clients: int = 0  # 0: every client; a lost client ends the run
    on_missing_halo: str = "fail"
    client_timeout: float = 300.0
    resume: str = ""  # a lazy run's folder (--out) to continue from its last checkpoint (Flower engines)
    audit: str = ""  # folder where each client records every message it sends (retexo-fl audit)
    # Data-center mode (CAGNET full-graph training on torch.distributed, trusted clusters only).
    algorithm: str = "1d"
    procs: int = 4
    replication: int = 2  # 1.5d's replication factor c
    trusted_cluster: bool = False
    out_dir: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.profile == "edge":
            self.device = "cpu" if self.device == "auto" else self.device
            self.threads = self.threads or 1
            self.chunk_rows = self.chunk_rows or 4096
            self.bits = 8 if self.bits == 32 else self.bits
            self.update_bits = 8 if self.update_bits == 32 else self.update_bits
            self.broadcast_bits = 8 if self.broadcast_bits == 32 else self.broadcast_bits

    @property
    def total_stages(self) -> int:
        """Stages of a lazy run over all self-training passes."""
        return self.stages * (1 + self.self_training)

    def layer(self, stage: int) -> int:
        """Which layer of the stack a lazy run's ``stage`` trains (passes repeat the stack)."""
        return stage % self.stages

    def ends_pass(self, stage: int) -> bool:
        """Whether ``stage`` is the last of a self-training pass that another pass follows."""
        return stage < self.total_stages - 1 and self.layer(stage) == self.stages - 1

    def per_stage(self, name: str, stage: int) -> Any:
        """The value of a per-stage setting for ``stage`` (the last list entry repeats)."""
        value = getattr(self, name)
        if isinstance(value, list | tuple):
            if not value:
                raise ValueError(f"{name}: empty list")
            return value[min(stage, len(value) - 1)]
        return value

    def validate(self) -> TrainConfig:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.stages < 1:
            raise ValueError(f"stages must be >= 1, got {self.stages}")
        if self.self_training < 0 or not 0 <= self.pseudo_threshold <= 1 or self.pseudo_per_class < 0:
            raise ValueError(
                "self-training and pseudo-per-class must be >= 0 and pseudo-threshold in [0, 1], got "
                f"{self.self_training}, {self.pseudo_per_class} and {self.pseudo_threshold}"
            )
        if self.self_training and self.mode not in ("lazy", "centralized"):
            raise ValueError(f"self-training applies to lazy and centralized mode, not {self.mode}")
        if self.pass_embedding not in ("hidden", "logits"):
            raise ValueError(f"pass-embedding must be hidden or logits, got {self.pass_embedding!r}")
        if self.server_optimizer not in ("avg", "adam"):
            raise ValueError(f"server-optimizer must be avg or adam, got {self.server_optimizer!r}")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be adam or sgd, got {self.optimizer!r}")
        if self.clients < 1:
            raise ValueError(f"clients must be >= 1, got {self.clients}")
        from retexo_fl.compress.quantize import ALL_BITS, RANGE_DTYPES
        from retexo_fl.compress.schedule import RateSchedule

        if self.broadcast_bits not in ALL_BITS:
            raise ValueError(f"broadcast-bits must be one of {ALL_BITS}, got {self.broadcast_bits}")
        if self.bits not in ALL_BITS or self.update_bits not in ALL_BITS:
            raise ValueError(
                f"bits and update-bits must be one of {ALL_BITS}, got {self.bits}, {self.update_bits}"
            )
        if self.bit_policy not in BIT_POLICIES:
            raise ValueError(f"bit-policy must be one of {BIT_POLICIES}, got {self.bit_policy!r}")
        if self.range_dtype not in RANGE_DTYPES:
            raise ValueError(f"range-dtype must be fp16 or bf16, got {self.range_dtype!r}")
        if self.bit_policy == "adaptive-budget" and not self.byte_budget and self.rate_schedule == "fixed":
            raise ValueError(
                "bit-policy adaptive-budget needs byte-budget (bytes, or e.g. 4b) or a rate-schedule"
            )
        if self.bit_policy == "adaptive-bandwidth" and not self.link_bandwidths:
            raise ValueError("bit-policy adaptive-bandwidth needs link-bandwidths")
        RateSchedule.parse(self.rate_schedule)
        if self.dp_noise < 0 or self.dp_clip <= 0 or not 0 < self.dp_delta < 1:
            raise ValueError("dp-noise must be >= 0, dp-clip > 0 and dp-delta in (0, 1)")
        if self.on_missing_halo not in ("fail", "zero", "reuse-last"):
            raise ValueError(
                f"on-missing-halo must be fail, zero or reuse-last, got {self.on_missing_halo!r}"
            )
        if not 0 <= self.min_clients <= self.clients:
            raise ValueError(f"min-clients must be in [0, clients={self.clients}], got {self.min_clients}")
        if self.client_timeout <= 0:
            raise ValueError(f"client-timeout must be > 0 seconds, got {self.client_timeout}")
        if self.profile not in ("default", "edge"):
            raise ValueError(f"profile must be default or edge, got {self.profile!r}")
        if self.threads < 0 or self.chunk_rows < 0:
            raise ValueError("threads and chunk-rows must be >= 0")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if self.procs < 1:
            raise ValueError(f"procs must be >= 1, got {self.procs}")
        if self.mode == "datacenter":
            from retexo_fl.datacenter.volumes import check_procs

            check_procs(self.algorithm, self.procs, self.replication)
        for name in ("rounds", "local_epochs"):
            for s in range(self.stages):
                if int(self.per_stage(name, s)) < 0:
                    raise ValueError(f"{name} must be >= 0")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> TrainConfig:
        """Build from kebab- or snake-case keys (run config, CLI); unknown keys are refused."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in names:
                raise ValueError(f"unknown setting {key!r}")
            kwargs[name] = parse_list(value) if name in PER_STAGE else value
        return cls(**kwargs).validate()


def parse_list(value: Any) -> Any:
    """``"200,100"`` -> ``[200, 100]``; numbers and lists pass through."""
    if isinstance(value, str):
        items = [v for v in value.replace(" ", "").split(",") if v]
        nums = [float(v) if any(c in v for c in ".e") else int(v) for v in items]
        return nums[0] if len(nums) == 1 else nums
    return value
