"""Compress what crosses the cuts and what the functions hold, within a budget
(`mopar.compress.budget`): calibration data, the split-point autoencoder, the choice of a codec
for every tensor a slice hands on (the paper's COM), and the form of every function's weights
(`mopar.compress.quantize`). Runs in the compiler; the codecs themselves (`mopar.codec`) run in
the functions, without torch."""
