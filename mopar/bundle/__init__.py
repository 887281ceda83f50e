"""The bundle format: what `mopar compile` writes and everything that runs a bundle reads. torch-free.

Read in this order: `layout` (the files and folders of a bundle, by name), `document` (``plan.json``:
the versioned manifest, `BundleDocument`, and `read_document`), `function` (``function.json``: what
one deployed function receives, sends and returns, `FunctionSpec`), and `dispatch` (the dispatch
spec a mixture-of-experts layer's function carries, `DispatchSpec`).

This package is the one reader and writer of ``plan.json`` and ``function.json``: the compiler
builds a `BundleDocument` in memory, writes it once and derives each `FunctionSpec` from it; the
runner, the containers, the benchmark, the CLI and the profiler read it back through
`read_document`, and each deployed function reads its spec through `FunctionSpec.load`. It ships
inside every function (the runtime imports it), so it imports numpy and the codecs, never torch.
An older or newer format is refused with one line that names both versions and the fix.
"""
