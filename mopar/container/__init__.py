"""A bundle's functions as real containers: `mopar build` and `mopar run --containers`.

`engine` finds podman or docker and works around what the host refuses, `wheels` gathers the
wheelhouse for the image's own Python, `build` decides and builds each function's image from the
bundle's Dockerfiles, and `session` serves a bundle from containers of those images. Torch-free.
"""
