"""The YAML spec language: frozen attrs classes (`types`) and the loader that validates YAML into them (`load`)."""

from cascadia.spec.types import (
    ClusterSpec,
    LengthSpec,
    LinkSpec,
    ModelSpec,
    NodeSpec,
    RuntimeSpec,
    Spec,
    WeightFormat,
    WeightFormats,
    WorkloadSpec,
)

__all__ = [
    "ClusterSpec", "LengthSpec", "LinkSpec", "ModelSpec", "NodeSpec", "RuntimeSpec", "Spec", "WeightFormat",
    "WeightFormats", "WorkloadSpec",
]
