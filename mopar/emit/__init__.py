"""Emit: ONNX slices, handlers, the manifest and deployment files of a bundle."""
