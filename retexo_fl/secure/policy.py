"""A party's own security policy: what it requires of any run, whatever the server's run config says.

The server writes the run config, so nothing in it can protect a party from the server. A party's
policy comes from its node config (deployment: ``retexo-fl supernode --node-config``) or from the
command line that started it (simulation and the in-process engine, where the user runs every
party). A client checks every run config it is sent against its policy and refuses a weaker one,
naming the setting; its pins, identity key and audit folder are the policy's, never the server's.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from retexo_fl.protocol import (
    NODE_AUDIT_DIR,
    NODE_ENCRYPT,
    NODE_IDENTITY_KEY,
    NODE_MAX_BOUNDARY_EPSILON,
    NODE_MAX_DP_CLIP,
    NODE_MIN_BOUNDARY_NOISE,
    NODE_MIN_DP_NOISE,
    NODE_PINNED_KEYS,
    NODE_SECURE_AGGREGATION,
)
from retexo_fl.secure.boundary_noise import ReleaseLedger, gaussian_epsilon, load_epsilon, release_load
from retexo_fl.secure.keys import load_pins, pin_digest

#: Environment variable a simulation sets for its virtual nodes (they share one machine and
#: one command line, and Flower's simulation gives virtual nodes no node config of ours).
POLICY_ENV = "RETEXO_FL_POLICY"

#: The delta at which a party's own boundary-release budget is counted: its own, not the run
#: config's ``dp-delta`` (a server could announce a large delta to make epsilon look small).
BUDGET_DELTA = 1e-5


class PolicyError(ValueError):
    """A run config weaker than the party's policy, or a policy setting that is malformed.

    Args:
        where (str): the party (``"client 3"``).
        setting (str): the setting at fault (a run config or node config key).
        reason (str): what is wrong.
    """

    def __init__(self, where: str, setting: str, reason: str) -> None:
        super().__init__(f"{where}: refusing the run, {setting}: {reason}")
        self.where, self.setting, self.reason = where, setting, reason


def _flag(value: Any, key: str, where: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise PolicyError(where, key, f"node config value {value!r} is not true or false")


def _number(value: Any, key: str, where: str) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise PolicyError(where, key, f"node config value {value!r} is not a number") from None
    if math.isnan(out) or out < 0:
        raise PolicyError(where, key, f"node config value {value!r} must be >= 0")
    return out


#: Policy settings whose default is unbounded (``inf``, ``null`` in JSON).
_UNBOUNDED = ("max_dp_clip", "max_boundary_epsilon")


@dataclass(frozen=True)
class PartyPolicy:
    """What a party requires of every run it joins.

    Args:
        encrypt (bool, optional): require end-to-end sealed boundary payloads; a run config with
            ``encrypt = false`` is refused. (default: :obj:`True`)
        pinned_keys (str, optional): a JSON file ``{client id: public key hex}`` this party got
            out of band; with it, a run config must announce the same pin set and the server's
            key directory must match it. (default: ``""``)
        identity_key (str, optional): this party's long-term X25519 private key file (``{id}``
            in it is replaced by the party's client id); empty for a key pair made for the run.
            (default: ``""``)
        audit_dir (str, optional): record every reply this party sends in this folder.
            (default: ``""``)
        min_dp_noise (float, optional): the least DP noise multiplier of model updates this
            party accepts. (default: :obj:`0.0`)
        max_dp_clip (float, optional): with ``min_dp_noise`` > 0, the largest clipping norm it
            accepts (noise scales with the clip, the update with it). (default: ``inf``)
        min_boundary_noise (float, optional): the least noise multiplier on the boundary rows
            it releases (``boundary-noise``). (default: :obj:`0.0`)
        max_boundary_epsilon (float, optional): this party's own budget over the boundary rows
            it releases: the :math:`\varepsilon` (at :data:`BUDGET_DELTA`) each row's value may
            spend over the whole run, counted by the party itself, release by release. A
            release that would exceed it is refused. (default: ``inf``)
        secure_aggregation (bool, optional): require masked round replies
            (``secure-aggregation``), so that the server only ever learns sums of updates.
            (default: :obj:`False`)
        release_ledger (str, optional): a node's file of what its releases spent, across runs
            (:class:`ReleaseLedger`): with it, ``max_boundary_epsilon`` is a budget over every
            run on the node, not one run's, since the run key that names a run is the server's
            choice. Set by the node, never by a message. (default: ``""``: this run's count)
        release_key (str, optional): whose rows the ledger counts (the partition's folder).
            (default: ``""``)
    """

    encrypt: bool = True
    pinned_keys: str = ""
    identity_key: str = ""
    audit_dir: str = ""
    min_dp_noise: float = 0.0
    max_dp_clip: float = math.inf
    min_boundary_noise: float = 0.0
    max_boundary_epsilon: float = math.inf
    secure_aggregation: bool = False
    release_ledger: str = ""
    release_key: str = ""

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any], where: str) -> PartyPolicy:
        """The policy in a node config (keys :data:`ENCRYPT`, :data:`PINNED_KEYS`, ...), falling
        back to :data:`POLICY_ENV` (simulation) and then to the defaults (encryption required).

        Args:
            node_config (Mapping[str, Any]): the node's config.
            where (str): the party, for errors.

        Raises:
            PolicyError: a malformed value, naming its key.
        """
        base = cls.from_json(os.environ[POLICY_ENV], where) if POLICY_ENV in os.environ else cls()
        values = asdict(base)
        if NODE_ENCRYPT in node_config:
            values["encrypt"] = _flag(node_config[NODE_ENCRYPT], NODE_ENCRYPT, where)
        if NODE_SECURE_AGGREGATION in node_config:
            values["secure_aggregation"] = _flag(
                node_config[NODE_SECURE_AGGREGATION], NODE_SECURE_AGGREGATION, where
            )
        for key, field in (
            (NODE_PINNED_KEYS, "pinned_keys"),
            (NODE_IDENTITY_KEY, "identity_key"),
            (NODE_AUDIT_DIR, "audit_dir"),
        ):
            if key in node_config:
                values[field] = str(node_config[key])
        if NODE_MIN_DP_NOISE in node_config:
            values["min_dp_noise"] = _number(node_config[NODE_MIN_DP_NOISE], NODE_MIN_DP_NOISE, where)
        if NODE_MIN_BOUNDARY_NOISE in node_config:
            values["min_boundary_noise"] = _number(
                node_config[NODE_MIN_BOUNDARY_NOISE], NODE_MIN_BOUNDARY_NOISE, where
            )
        if NODE_MAX_DP_CLIP in node_config:
            values["max_dp_clip"] = _number(node_config[NODE_MAX_DP_CLIP], NODE_MAX_DP_CLIP, where)
        if NODE_MAX_BOUNDARY_EPSILON in node_config:
            values["max_boundary_epsilon"] = _number(
                node_config[NODE_MAX_BOUNDARY_EPSILON], NODE_MAX_BOUNDARY_EPSILON, where
            )
        return cls(**values)

    @classmethod
    def from_settings(cls, security: Any) -> PartyPolicy:
        """The policy of a party started from the user's own command line (in-process engine,
        simulation): exactly the security settings it was given.

        Args:
            security (SecuritySettings): the ``security`` section of the user's config.
        """
        key = str(Path(security.identity_keys) / "client-{id}.key") if security.identity_keys else ""
        # Noise from the run seed (the user's own choice here) is noise every party can strip:
        # a party started with it requires no update noise of the run.
        required = 0.0 if security.dp_reproducible else security.dp_noise
        return cls(
            encrypt=security.encrypt,
            pinned_keys=security.pinned_keys,
            identity_key=key,
            audit_dir=security.audit,
            min_dp_noise=required,
            max_dp_clip=security.dp_clip if required > 0 else math.inf,
            min_boundary_noise=security.boundary_noise,
            secure_aggregation=security.secure_aggregation,
        )

    def identity_file(self, party: int) -> str:
        """Party ``party``'s identity key file (``identity_key`` with ``{id}`` filled in), or ``""``."""
        return self.identity_key.replace("{id}", str(party))

    def to_json(self) -> str:
        """The policy as JSON."""
        values = asdict(self)
        for name in _UNBOUNDED:  # JSON has no infinity
            values[name] = None if math.isinf(values[name]) else values[name]
        return json.dumps(values, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> PartyPolicy:
        """Read :meth:`to_json`.

        Raises:
            PolicyError: text that is not a policy, naming :data:`POLICY_ENV`.
        """
        try:
            values = json.loads(text)
            for name in _UNBOUNDED:
                values[name] = math.inf if values.get(name) is None else values[name]
            return cls(**values)
        except (TypeError, ValueError, AttributeError) as exc:
            raise PolicyError(where, POLICY_ENV, f"not a policy ({exc})") from None

    def pins_digest(self) -> str | None:
        """The digest of this party's pin set (:func:`~retexo_fl.secure.keys.pin_digest`), or None."""
        return pin_digest(load_pins(self.pinned_keys)) if self.pinned_keys else None

    def check(self, cfg: Any, where: str) -> None:
        """Refuse a run config weaker than this policy.

        Args:
            cfg (TrainConfig): the run config the server sent.
            where (str): the party, for errors.

        Raises:
            PolicyError: naming the first setting that is weaker than the policy.
        """
        for name in ("dp_noise", "dp_clip", "boundary_noise", "boundary_clip"):
            value = getattr(cfg, name)
            if not math.isfinite(value):  # NaN would pass every comparison below
                raise PolicyError(where, name.replace("_", "-"), f"{value!r} is not a finite number")
        if self.encrypt and not cfg.encrypt:
            raise PolicyError(
                where, "encrypt", "the run config turns payload encryption off; this party requires it"
            )
        if self.secure_aggregation and not cfg.secure_aggregation:
            raise PolicyError(
                where,
                "secure-aggregation",
                "the run config sends round updates in clear; this party requires secure aggregation",
            )
        if cfg.dp_noise < self.min_dp_noise:
            raise PolicyError(
                where, "dp-noise", f"{cfg.dp_noise} is below this party's minimum {self.min_dp_noise}"
            )
        if cfg.boundary_noise < self.min_boundary_noise:
            raise PolicyError(
                where,
                "boundary-noise",
                f"{cfg.boundary_noise} is below this party's minimum {self.min_boundary_noise}",
            )
        if self.min_dp_noise > 0 and cfg.dp_clip > self.max_dp_clip:
            raise PolicyError(
                where, "dp-clip", f"{cfg.dp_clip} is above this party's maximum {self.max_dp_clip}"
            )
        if math.isfinite(self.max_boundary_epsilon) and (cfg.boundary_clip <= 0 or cfg.boundary_noise <= 0):
            raise PolicyError(
                where,
                "boundary-noise",
                f"the run releases boundary rows without noise; this party's budget is epsilon "
                f"{self.max_boundary_epsilon:g} over its releases",
            )
        if self.min_dp_noise > 0 and getattr(cfg, "dp_reproducible", False):
            raise PolicyError(
                where,
                "dp-reproducible",
                "the run's update noise would come from its seed, which every party knows; "
                "this party requires dp-noise it cannot be stripped of",
            )

    def spend_boundary_release(self, noise: float, released: int, where: str) -> None:
        """Refuse one more release of boundary rows noised with ``noise`` when it would take
        this party past :attr:`max_boundary_epsilon`.

        Args:
            noise (float): the run's ``boundary-noise``.
            released (int): releases this party made before, in this run.
            where (str): the party, for errors.

        Raises:
            PolicyError: naming ``max-boundary-epsilon``, the epsilon it would reach and the
                releases so far.
        """
        if math.isinf(self.max_boundary_epsilon):
            return
        if not self.release_ledger:
            after = gaussian_epsilon(noise, released + 1, BUDGET_DELTA)
            if after > self.max_boundary_epsilon:
                raise PolicyError(
                    where,
                    NODE_MAX_BOUNDARY_EPSILON,
                    f"release {released + 1} of its boundary rows would spend epsilon {after:.3g} "
                    f"(delta {BUDGET_DELTA:g}) on each row's value, above this party's budget "
                    f"{self.max_boundary_epsilon:g}",
                )
            return
        ledger = ReleaseLedger(Path(self.release_ledger), self.release_key)
        with ledger.spending() as spent:
            after = load_epsilon(spent + release_load(noise), BUDGET_DELTA)
            if after > self.max_boundary_epsilon:
                before = load_epsilon(spent, BUDGET_DELTA)
                raise PolicyError(
                    where,
                    NODE_MAX_BOUNDARY_EPSILON,
                    f"release {released + 1} of its boundary rows in this run would spend epsilon "
                    f"{after:.3g} (delta {BUDGET_DELTA:g}) on each row's value, counting the "
                    f"{before:.3g} its earlier releases on this node spent in every run "
                    f"({ledger.path}), above this party's budget {self.max_boundary_epsilon:g}",
                )
            ledger.add(release_load(noise))

    def check_pins(self, announced: str | None, where: str) -> None:
        """Refuse a setup that pins no keys, or other keys, when this party pins keys.

        Args:
            announced (str | None): the pin set digest the setup message announced.
            where (str): the party, for errors.

        Raises:
            PolicyError: naming ``pinned-keys``.
        """
        own = self.pins_digest()
        if own is None:
            return
        if not announced:
            raise PolicyError(
                where, "pinned-keys", "the run config pins no keys; this party's policy pins them"
            )
        if announced != own:
            raise PolicyError(
                where,
                "pinned-keys",
                f"the run config pins another key set ({announced}, this party's is {own})",
            )
