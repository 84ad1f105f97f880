"""Cascadia: plan, simulate and run huge mixture-of-experts models on fleets of ordinary PCs."""

__version__ = "0.1.0"
