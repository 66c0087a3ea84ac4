#!/bin/sh
# Stand-in for the recipe's download: progress lines, resumable, into $HF_CACHE.
set -e
steps=${PREPARE_SECONDS:-1}
mkdir -p "$HF_CACHE"
i=0
while [ "$i" -lt "$steps" ]; do
    i=$((i+1))
    printf 'Downloading %s: %d%%\r' "$MODEL_ID" $((i * 100 / steps))
    sleep 1
done
echo
[ -z "$PREPARE_FAILS" ] || { echo "download failed: 401 Unauthorized" >&2; exit 4; }
echo "$MODEL_ID" > "$HF_CACHE/complete"
echo "Download complete"
