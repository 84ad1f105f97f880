"""What the coordinator and every node must agree on, as a digest a node says in its HELLO."""

from __future__ import annotations

import hashlib
import json

import attrs

from cascadia.graph.plan import Plan
from cascadia.spec.types import Spec


def settings_digest(spec: Spec, plan: Plan, with_logits: bool) -> str:
    """A hash of the model, its formats, the runtime, the plan's stages and whether the last node sends logits back.
    A node started by hand with another spec or plan says another digest and is refused, rather than computing
    something else. The cluster's node names count (in order: they number the control channel's senders); paths,
    addresses and thread counts may differ from machine to machine and are left out; how
    tokens are drawn travels with each frame's rows."""
    settings = {"model": spec.model.config.to_hf_dict(), "formats": attrs.asdict(spec.model.formats),
                "runtime": attrs.asdict(spec.runtime),
                "stages": [(s.node, s.first_layer, s.last_layer, list(s.roles)) for s in plan.stages],
                "members": [node.name for node in spec.cluster.members],  # their order gives the control sender ids
                "logits": with_logits}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
