"""yeto-patch: DiLoCo across Megatron islands, attached through sitecustomize and YETO_* variables."""

__version__ = "0.1.0"
