#!/usr/bin/env bash
# Stop the server start.sh launched: SIGTERM, STOP_TIMEOUT seconds to drain (default 30), then remove it.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")"
source ./scripts/config.sh
docker stop --time "${STOP_TIMEOUT:-30}" "$CONTAINER_NAME" >/dev/null 2>&1 || true
docker rm -f "$CONTAINER_NAME" >/dev/null 2>&1 || true
log "stopped $CONTAINER_NAME"
