"""Inkling's router, in FP32 on the host (as the reference keeps it, so close scores do not tie before top-k)."""

from __future__ import annotations

import attrs
import numpy as np

from cascadia.engine.host_ops import log_sigmoid, softmax


@attrs.frozen
class Routing:
    index: np.ndarray  # [T, k] int32 routed experts of each row
    weights: np.ndarray  # [T, k] their weights
    shared_weights: np.ndarray  # [T, S] weights of the shared experts


@attrs.frozen(eq=False)
class Router:
    weight: np.ndarray  # [E + S, H] logits over routed then shared experts
    correction: np.ndarray  # [E] e_score_correction_bias: shifts selection, not weights
    route_scale: float
    global_scale: np.ndarray  # [1]
    top_k: int

    def __call__(self, h: np.ndarray) -> Routing:
        """Selection by top-k of sigmoid(logit) + correction; weights are a softmax over the log-sigmoid of the
        selected and shared logits (the shared experts are the sink), times route_scale * global_scale."""
        n_routed = self.correction.shape[0]
        logits = h @ self.weight.T
        routed = logits[:, :n_routed]
        choice = 1 / (1 + np.exp(-routed)) + self.correction
        index = np.argpartition(-choice, self.top_k - 1, axis=1)[:, : self.top_k]
        chosen = np.concatenate([routed[np.arange(len(h))[:, None], index], logits[:, n_routed:]], axis=1)
        weights = softmax(log_sigmoid(chosen), axis=1) * (np.float32(self.route_scale) * self.global_scale)
        return Routing(index.astype(np.int32), weights[:, : self.top_k], weights[:, self.top_k:])
