"""Compress what crosses the cuts: calibration data, the split-point autoencoder, and the choice
of a codec for every tensor a slice hands on (the paper's COM). Runs in the compiler, with torch;
the codecs themselves (`mopar.codec`) run in the functions, without it."""
