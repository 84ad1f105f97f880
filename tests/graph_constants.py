"""The constants of an OpenVINO graph, for tests that compare how two builds store the same weights."""

from __future__ import annotations

import numpy as np


def constants(model) -> list[tuple[str, list, bytes]]:
    """(element type, shape, bytes) of every constant, in graph order."""
    return [(str(op.get_element_type()), list(op.get_output_shape(0)), np.array(op.get_data()).tobytes())
            for op in model.get_ordered_ops() if op.get_type_name() == "Constant"]
