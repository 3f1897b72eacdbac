"""The security section of a run configuration: payload encryption, keys, audit, differential privacy.

A leaf of the package graph (no :mod:`retexo_fl.config`): :class:`~retexo_fl.config.TrainConfig`
imports it to build and validate its ``security`` section.
"""

from __future__ import annotations

import math

from retexo_fl.setting import check_choices, section, setting

#: The most clients a secure-aggregation run may have. Every client shares its self seed with
#: every other (a complete masking graph), so a round's extra bytes grow with the square of the
#: clients and the server's unmasking (a threshold-t reconstruction of each of n seeds) faster
#: still. Measured in one process, one thread, Cora, random partitions
#: (``bench/results/secagg-scale-2026-11-27.json``, ``secagg-2026-11-24.json``): server seconds
#: a round 0.038 at 50 clients, 0.36 at 100, 4.5 at 200, and the run's wall 2.6x, 2.3x and 5.7x
#: the plain run's; extra bytes 0.76, 3.1 and 12.3 MB a round. A sparse (SecAgg+-style) masking
#: graph would lift this; until there is one, larger runs are refused rather than left to stall.
MAX_SECAGG_CLIENTS = 200


def min_threshold(members: int) -> int:
    """The least secure-aggregation threshold ``t`` safe against a server that tells clients
    different survivor sets: the smallest with ``2 t > members + 1`` (see
    :mod:`retexo_fl.secure.secagg`).

    Args:
        members (int): the clients that mask together, >= 1.
    """
    return (members + 1) // 2 + 1


@section
class SecuritySettings:
    r"""What protects a run's data in flight: end-to-end encryption, audit records, DP-FedAvg.

    The ``security`` section of :class:`~retexo_fl.config.TrainConfig` (guide: ``docs/security.md``).
    """

    encrypt: bool = setting(
        True, "seal boundary payloads end to end between clients (false only for debugging)"
    )
    identity_keys: str = setting(
        "", "a folder of client-<id>.key identity keys (empty: one key pair per run; deployed: node config)"
    )
    pinned_keys: str = setting(
        "", "a JSON file {client id: public key hex} from `retexo-fl keys`, exchanged out of band"
    )
    audit: str = setting(
        "", "a folder where each client records every message it sends (checked by `retexo-fl audit`)"
    )
    dp_noise: float = setting(
        0.0, "DP-FedAvg noise multiplier of model updates (0: off; else needs retexo-fl[dp])"
    )
    dp_clip: float = setting(1.0, "L2 norm each client's round update is clipped to", needs="dp_noise")
    dp_delta: float = setting(1e-5, "the delta of the reported (epsilon, delta) guarantees")
    dp_reproducible: bool = setting(
        False,
        "draw the update noise from the run's seed, so that runs and engines agree bit for bit; "
        "anyone who knows the seed (every client, any reader of config.json) can then remove the "
        "noise from the released model (off: a secret key from the operating system, kept only in "
        "the server's checkpoint)",
        needs="dp_noise",
    )
    boundary_clip: float = setting(
        0.0, "the L2 norm every boundary row a client releases is clipped to (0: rows as they are)"
    )
    boundary_noise: float = setting(
        0.0,
        "Gaussian noise multiplier on released boundary rows, standard deviation "
        "boundary-noise * boundary-clip per entry (needs boundary-clip; 0: off)",
    )
    secure_aggregation: bool = setting(
        False,
        "clients mask their round replies so that the server learns only the survivors' sum (needs encrypt)",
    )
    secagg_threshold: int = setting(
        0,
        "the shares that rebuild a client's self seed, also the fewest survivors a round decodes "
        "with (0: the least safe one, (clients + 1) // 2 + 1)",
        needs="secure_aggregation",
    )
    secagg_clip: float = setting(
        10.0,
        "the largest magnitude of a client's weighted update coordinate in the field encoding "
        "(larger ones are clipped and counted); with dp-noise the bound follows from dp-clip",
        needs="secure_aggregation",
    )

    def validate(self) -> SecuritySettings:
        """Raise :class:`ValueError` naming the first bad setting; return ``self`` otherwise."""
        check_choices(self)
        values = (self.dp_noise, self.dp_clip, self.dp_delta, self.boundary_clip, self.boundary_noise)
        if not all(math.isfinite(v) for v in values):  # NaN passes every comparison below
            raise ValueError("dp-noise, dp-clip, dp-delta, boundary-clip and boundary-noise must be finite")
        if self.dp_noise < 0 or self.dp_clip <= 0 or not 0 < self.dp_delta < 1:
            raise ValueError("dp-noise must be >= 0, dp-clip > 0 and dp-delta in (0, 1)")
        if self.boundary_clip < 0 or self.boundary_noise < 0:
            raise ValueError("boundary-clip and boundary-noise must be >= 0")
        if self.boundary_noise > 0 and self.boundary_clip <= 0:
            raise ValueError("boundary-noise needs boundary-clip > 0 (the noise is scaled to the clip)")
        if not (math.isfinite(self.secagg_clip) and self.secagg_clip > 0) or self.secagg_threshold < 0:
            raise ValueError("secagg-clip must be a finite float > 0 and secagg-threshold >= 0")
        if self.secure_aggregation and not self.encrypt:
            raise ValueError(
                "secure-aggregation needs encrypt: the self-seed shares travel sealed to their holders"
            )
        return self
