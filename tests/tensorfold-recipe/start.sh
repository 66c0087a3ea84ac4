#!/usr/bin/env bash
# Serve the stand-in as the Spark recipe's start.sh serves TensorFold: prepare when needed, check the arguments
# with the engine's own parser in a throwaway container, stop a running server only then (restart), and launch
# `tensorfold serve` with scripts/config.sh's settings. The worker does not run this file; it keeps the layout
# and the command line (read it to see what a recipe must pass).
# Usage: ./start.sh [restart] [extra tensorfold serve args]   (extra arguments come last, so they win)
# Test knob: TEST_NO_GPU=1 leaves out --gpus all (for a machine without the NVIDIA runtime).
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")"
source ./scripts/config.sh
check_draft_language

MODE=start
case "${1:-}" in
  restart) MODE=restart; shift ;;
  help|-h|--help) sed -n '2,7s/^# \{0,1\}//p' "$0"; exit 0 ;;
esac
WAIT_TIMEOUT="${WAIT_TIMEOUT:-1800}"

SERVE_ARGS=(--name "$SERVED_NAME" --parallel "$PARALLEL" --context "$CONTEXT" --kv-dtype "$KV_DTYPE"
            --mtp-drafts "$MTP_DRAFTS" --mtp-confidence "$MTP_CONFIDENCE"
            --temperature "$TEMPERATURE" --top-p "$TOP_P" --top-k "$TOP_K" --max-tokens "$MAX_TOKENS")
if [[ "$PLE_ON_SSD" == 1 ]]; then SERVE_ARGS+=(--ple-on-ssd); fi
if [[ "$VISION" == 1 ]]; then
  SERVE_ARGS+=(--vision)
  if [[ "$VISION_URLS" == 1 ]]; then SERVE_ARGS+=(--vision-urls); fi
  if [[ -n "$VISION_MAX_IMAGES" ]]; then SERVE_ARGS+=(--vision-max-images "$VISION_MAX_IMAGES"); fi
  if [[ -n "${TENSORFOLD_IMAGE_TOKENS:-}" ]]; then SERVE_ARGS+=(--vision-image-tokens "$TENSORFOLD_IMAGE_TOKENS"); fi
fi
if [[ "$THINKING" == 1 ]]; then SERVE_ARGS+=(--thinking); else SERVE_ARGS+=(--no-thinking); fi
SERVE_ARGS+=("$@")

API_HOST=$HOST; [[ "$HOST" != 0.0.0.0 && "$HOST" != "::" ]] || API_HOST=127.0.0.1
URL="http://$API_HOST:$PORT"
running() { [[ "$(docker inspect --format '{{.State.Running}}' "$CONTAINER_NAME" 2>/dev/null)" == true ]]; }

command -v docker >/dev/null || die "docker is not installed"
mkdir -p "$KERNEL_CACHE"
exec 8>"$KERNEL_CACHE/.start.lock"
flock -n 8 || die "another ./start.sh is already running; wait for it to finish"

if [[ "$MODE" == start ]] && running; then
  log "$CONTAINER_NAME is already running (port $PORT): nothing to do; ./start.sh restart restarts it."
  exit 0
fi

# 1. setup: prepare.sh whenever what it last left ready differs from now (PREPARE=1 always, PREPARE=0 never)
if [[ "${PREPARE:-auto}" == 1 ]] || [[ "${PREPARE:-auto}" != 0 && "$(prepared_state)" != "$(cat "$PREPARED_MARKER" 2>/dev/null)" ]]; then
  ./scripts/prepare.sh
fi
docker image inspect "$IMAGE" >/dev/null 2>&1 || die "image $IMAGE missing: scripts/prepare.sh did not build it"
have_snapshot || die "$MODEL_ID not in $HF_CACHE: scripts/prepare.sh did not download it"

# 2. checks, before anything is stopped: the engine's own parser in a throwaway container (no GPU, no mounts)
docker run --rm --entrypoint python "$IMAGE" -c \
  'import sys; from tensorfold.cli import build_parser; build_parser().parse_args(sys.argv[1:])' \
  serve "$MODEL_ID" --host "$HOST" --port "$PORT" "${SERVE_ARGS[@]}" >/dev/null ||
  die "tensorfold serve rejects these arguments (see above); nothing was changed"
if [[ "$MODE" == restart ]] && running; then ./stop.sh; fi
if docker ps -a --format '{{.Names}}' | grep -qx "$CONTAINER_NAME"; then docker rm -f "$CONTAINER_NAME" >/dev/null; fi
if ss -ltn "sport = :$PORT" 2>/dev/null | grep -q LISTEN; then die "port $PORT is already in use"; fi
avail=$(awk '/^MemAvailable:/ { print int($2 / 1048576) }' /proc/meminfo)
if (( avail >= 103 )); then
  log "Arguments OK, port $PORT free, ${avail} GiB memory available"
else
  warn "only ${avail} GiB memory available (the default needs ~103): stop other GPU workloads (docker ps), or lower PARALLEL / CONTEXT"
fi

# 3. launch: every TENSORFOLD_* variable by name, the HF cache and the kernel cache, no token
pass=()
while IFS='=' read -r name _; do pass+=(-e "$name"); done < <(env | grep -E '^TENSORFOLD_[A-Z0-9_]+=' || true)
gpus=(--gpus all); [[ "${TEST_NO_GPU:-0}" != 1 ]] || gpus=()
log "tensorfold serve $MODEL_ID --host $HOST --port $PORT ${SERVE_ARGS[*]}"
docker run -d --name "$CONTAINER_NAME" \
  "${gpus[@]}" --ipc=host --network host \
  --ulimit memlock=-1 --ulimit stack=67108864 \
  -e HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" "${pass[@]}" \
  -v "$HF_CACHE":/root/.cache/huggingface \
  -v "$KERNEL_CACHE":/cache \
  "$IMAGE" \
  tensorfold serve "$MODEL_ID" --host "$HOST" --port "$PORT" "${SERVE_ARGS[@]}" >/dev/null

# 4. wait until the API answers
start=$SECONDS
until curl -sf --max-time 5 "$URL/v1/models" >/dev/null 2>&1; do
  running || die "the server exited (code $(docker inspect --format '{{.State.ExitCode}}' "$CONTAINER_NAME")) before it was ready"
  (( SECONDS - start < WAIT_TIMEOUT )) || die "not ready after ${WAIT_TIMEOUT}s (WAIT_TIMEOUT)"
  sleep 1
done
log "$SERVED_NAME is now LIVE on $URL/v1 after $((SECONDS - start))s"
