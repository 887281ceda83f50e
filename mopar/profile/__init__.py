"""The service profiler as plan and compile use it: features, the shipped predictors (loaded and
applied per layer), the machine factor's probe, the transports profile's reader, expert traces
and shard analyses. Collecting the samples and training the predictors is the repository's,
beside the package (``tools/profiler``)."""
