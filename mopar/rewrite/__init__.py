"""Rewrite: apply a Plan to the exported graph (split into slice modules)."""

from mopar.rewrite.split import SliceModule, output_values, split_by_plan

__all__ = ["SliceModule", "output_values", "split_by_plan"]
