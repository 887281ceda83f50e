"""Service profiler: measurements, features, predictors and aggregation."""
