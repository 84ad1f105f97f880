"""The host side of the expert-grouped MoE (`graphs.moe_grouped`): a call's expert choices sorted by expert, so that
each touched expert runs once over every row that chose it.

Shapes: T rows, H hidden, k routed experts per row, E routed experts, S shared experts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import openvino as ov

from cascadia.engine.device import Compiled


class GroupedBlock(Compiled):
    """The compiled expert-grouped graph. Takes what the fused MoE block takes (x [T, H], index [T, k] int32,
    weights [T, k], and shared_weights [T, S] where the family has shared experts) and returns its output [T, H];
    only the real rows are computed (a padding row would cost as much as a real one and touch no other expert)."""

    def __init__(self, model: ov.Model, device: str, options: dict[str, object], buckets: Sequence[int]):
        super().__init__(model, device, options)
        self.buckets = tuple(sorted(buckets))
        width = {p.get_any_name(): p.get_partial_shape()[-1].get_length() for p in self.compiled.inputs}
        self.hidden, self.top_k, self.n_shared = width["x"], width["unsort"], width.get("shared_weights", 0)
        self.n_experts = self.compiled.input("lengths").get_partial_shape()[0].get_length()

    def __call__(self, x: np.ndarray, index: np.ndarray, weights: np.ndarray, *shared_weights: np.ndarray
                 ) -> np.ndarray:
        choices = index.reshape(-1)
        order = np.argsort(choices, kind="stable")  # choices in expert order
        unsort = np.empty(len(order), np.int32)
        unsort[order] = np.arange(len(order), dtype=np.int32)
        lengths = np.bincount(choices, minlength=self.n_experts).astype(np.int64)
        sorted_weights = weights.reshape(-1)[order][:, None]
        inputs = (x, *shared_weights, x[order // self.top_k], lengths, sorted_weights, unsort.reshape(index.shape))
        for i, array in enumerate(inputs):  # in the graph's order: shared_weights second where it has them
            self.request.set_input_tensor(i, ov.Tensor(np.ascontiguousarray(array), shared_memory=True))
        self.request.infer()
        return self.request.get_output_tensor(0).data.copy()

    def warm_up(self) -> None:
        """Run once at every bucket's rows, row i choosing experts i k ... i k + k - 1 modulo E (as many experts
        as the rows can touch), so that first calls are not slow; then drop the weights file's pages that the
        plugin read again while preparing its kernels."""
        for rows in self.buckets:
            index = (np.arange(rows)[:, None] * self.top_k + np.arange(self.top_k)) % self.n_experts
            shared = (np.zeros((rows, self.n_shared), np.float32),) if self.n_shared else ()
            self(np.zeros((rows, self.hidden), np.float32), index.astype(np.int32),
                 np.zeros((rows, self.top_k), np.float32), *shared)
        self.drop_mapped_pages()
