#!/bin/sh
# The image's install steps, kept in one script so a test can run them in a fresh venv
# (`make test-deploy`): a venv at $VENV, torch first from $TORCH_INDEX (empty: pip's default
# index, whose Linux wheel is the CUDA build; https://download.pytorch.org/whl/cpu for the
# CPU-only one), then tokenyard from $SRC with $EXTRAS, not editable, as users get it.
set -eu
VENV=${VENV:-/opt/tokenyard}
PYTHON=${PYTHON:-python3}
TORCH=${TORCH:-torch==2.13.0}
TORCH_INDEX=${TORCH_INDEX:-}
EXTRAS=${EXTRAS:-hf}
SRC=${SRC:-.}

"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --no-cache-dir --upgrade pip
# shellcheck disable=SC2086  # TORCH may name several requirements
"$VENV/bin/python" -m pip install --no-cache-dir ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} $TORCH
"$VENV/bin/python" -m pip install --no-cache-dir "${SRC}[${EXTRAS}]"
# fail the build, not the first pod, on an install that cannot start
"$VENV/bin/tokenyard" --help >/dev/null
