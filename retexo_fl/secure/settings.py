"""The security section of a run configuration: payload encryption, keys, audit, differential privacy.

A leaf of the package graph (no :mod:`retexo_fl.config`): :class:`~retexo_fl.config.TrainConfig`
imports it to build and validate its ``security`` section.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def min_threshold(members: int) -> int:
    """The least secure-aggregation threshold ``t`` safe against a server that tells clients
    different survivor sets: the smallest with ``2 t > members + 1`` (see
    :mod:`retexo_fl.secure.secagg`).

    Args:
        members (int): the clients that mask together, >= 1.
    """
    return (members + 1) // 2 + 1


@dataclass(frozen=True)
class SecuritySettings:
    r"""What protects a run's data in flight: end-to-end encryption, audit records, DP-FedAvg.

    The ``security`` section of :class:`~retexo_fl.config.TrainConfig` (guide: ``docs/security.md``).

    Args:
        encrypt (bool, optional): seal boundary payloads end to end between clients (:obj:`False`
            only for debugging). (default: :obj:`True`)
        identity_keys (str, optional): a folder of ``client-<id>.key`` identity keys; empty for
            one key pair per run. (default: :obj:`""`)
        pinned_keys (str, optional): a JSON file ``{client id: public key hex}`` exchanged out of
            band. (default: :obj:`""`)
        audit (str, optional): a folder where each client records every message it sends (checked
            by ``retexo-fl audit``). (default: :obj:`""`)
        dp_noise (float, optional): DP-FedAvg noise multiplier of model updates; :obj:`0` turns
            differential privacy off (else needs ``retexo-fl[dp]``). (default: :obj:`0.0`)
        dp_clip (float, optional): L2 norm each client's round update is clipped to.
            (default: :obj:`1.0`)
        dp_delta (float, optional): the :math:`\delta` of the reported
            :math:`(\varepsilon, \delta)` guarantees. (default: :obj:`1e-5`)
        dp_reproducible (bool, optional): draw the update noise from the run's seed, so that
            runs and engines agree bit for bit; anyone who knows the seed (every client, any
            reader of ``config.json``) can then remove the noise from the released model. Off,
            the server draws a secret key from the operating system, kept only in its
            checkpoint. (default: :obj:`False`)
        boundary_clip (float, optional): the L2 norm every boundary row a client releases is
            clipped to; :obj:`0` leaves rows as they are. (default: :obj:`0.0`)
        boundary_noise (float, optional): the Gaussian noise multiplier on released boundary
            rows (standard deviation ``boundary_noise * boundary_clip`` per entry); needs
            ``boundary_clip``. (default: :obj:`0.0`)
        secure_aggregation (bool, optional): clients mask their round replies so that the server
            learns only the survivors' sum (:mod:`retexo_fl.secure.secagg`); needs ``encrypt``.
            (default: :obj:`False`)
        secagg_threshold (int, optional): the shares that rebuild a client's self seed, also
            the fewest survivors a round decodes with; :obj:`0` for the least safe one,
            ``(clients + 1) // 2 + 1``. (default: :obj:`0`)
        secagg_clip (float, optional): the largest magnitude of a client's weighted update
            coordinate in the field encoding (larger ones are clipped and counted); with
            ``dp-noise`` the bound follows from ``dp-clip`` instead. (default: :obj:`10.0`)
    """

    encrypt: bool = True
    identity_keys: str = ""
    pinned_keys: str = ""
    audit: str = ""
    dp_noise: float = 0.0
    dp_clip: float = 1.0
    dp_delta: float = 1e-5
    dp_reproducible: bool = False
    boundary_clip: float = 0.0
    boundary_noise: float = 0.0
    secure_aggregation: bool = False
    secagg_threshold: int = 0
    secagg_clip: float = 10.0

    def validate(self) -> SecuritySettings:
        """Raise :class:`ValueError` naming the first bad setting; return ``self`` otherwise."""
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
