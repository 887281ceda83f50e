"""The service profiler as plan and compile use it: features, the shipped predictors (loaded and
applied per layer), the transports profile's reader, expert traces and shard analyses.
Collecting the samples, training the predictors and probing a target's speed is the
repository's, beside the package (``tools/profiler``)."""
