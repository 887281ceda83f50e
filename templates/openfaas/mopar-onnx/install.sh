#!/bin/sh
# mopar: install a function's run-time requirements into /opt/venv, then remove what the
# function never imports, so its image stays small. Both of a bundle's Dockerfiles run it, with
# the wheels mounted at /tmp/wheels for that step only.
#   sh install.sh PIP_INSTALL_ARGS...    PIP_OFFLINE=true: from /tmp/wheels alone, no index.
set -eu
python3 -m venv /opt/venv
offline=""
if [ "${PIP_OFFLINE:-false}" = true ]; then offline="--no-index"; fi
/opt/venv/bin/pip install $offline --find-links /tmp/wheels "$@"
# pip and setuptools install nothing at run time; zstandard's cffi backend is never loaded
# (CPython loads its C one); onnxruntime's model tools and the packages' test suites never run.
/opt/venv/bin/pip uninstall --quiet --yes pip setuptools
cd /opt/venv/lib/python3*/site-packages
rm -rf zstandard/_cffi.* onnxruntime/transformers onnxruntime/tools onnxruntime/quantization \
    onnxruntime/datasets
find . -depth -type d -name tests -prune -exec rm -rf {} +
# A Lambda image's boto3 only ever makes a "lambda" client: botocore's other 400-odd service
# models (28 MB) are never read.
if [ -d botocore/data ]; then
    find botocore/data -mindepth 1 -maxdepth 1 -type d ! -name lambda -exec rm -rf {} +
fi
