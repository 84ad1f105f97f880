"""The YAML spec language: frozen attrs classes (`types`); YAML read into a tree of values with their lines, includes
merged (`yaml_tree`); that tree validated into the classes (`load`), whose faults are `problems`; specs written back
out as plain data (`dump`)."""

from cascadia.spec.types import (ClusterSpec, LengthSpec, LinkSpec, ModelSpec, NodeSpec, RuntimeSpec, Spec,
                                 WeightFormat, WeightFormats, WorkloadSpec)

__all__ = [
    "ClusterSpec", "LengthSpec", "LinkSpec", "ModelSpec", "NodeSpec", "RuntimeSpec", "Spec", "WeightFormat",
    "WeightFormats", "WorkloadSpec",
]
