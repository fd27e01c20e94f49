#!/bin/sh
# The image's HEALTHCHECK, by the role PID 1 runs: the gateway's (or serve's) /healthz, a
# worker's heartbeat in the broker (`tokenyard worker-ready`); other commands have nothing to ask.
set -eu
cmd=$(tr '\0' ' ' </proc/1/cmdline)
case "$cmd" in
  *" gateway"* | *" serve"*)
    exec python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('TOKENYARD_GATEWAY_PORT', '8000') + '/healthz', timeout=4)" ;;
  *" worker"*) exec tokenyard worker-ready ;;
  *) exit 0 ;;
esac
