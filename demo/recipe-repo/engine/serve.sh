#!/bin/sh
# A tiny engine: logs like one, answers /v1/models and /metrics with busybox httpd once "loaded".
# `docker exec <c> sh -c 'echo 3 > /tmp/die'` makes it exit with code 3;
# `echo 64 > /tmp/hog` makes it hold 64 MB (beyond a memory limit: the kernel kills it).
echo "engine: loading $MODEL_ID (parallel=$PARALLEL context=$CONTEXT)"
on_term() {
    echo "engine: SIGTERM received, draining for ${STOP_DELAY:-0}s"
    sleep "${STOP_DELAY:-0}"
    echo "engine: bye"
    exit 0
}
trap on_term TERM
i=0
while [ "$i" -lt "${READY_DELAY:-0}" ]; do
    i=$((i+1))
    echo "engine: loading weights $i/${READY_DELAY:-0}"
    sleep 1 & wait $!
done
mkdir -p /www/v1
echo '{"object":"list","data":[{"id":"'"$SERVED_NAME"'"}]}' > /www/v1/models
printf '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n' > /www/metrics
httpd -f -p "${PORT}" -h /www &
echo "engine: ready on port ${PORT}"
while :; do
    if [ -f /tmp/hog ]; then
        mb=$(cat /tmp/hog); rm -f /tmp/hog
        echo "engine: allocating ${mb} MB for the KV cache"
        hog=$(head -c $((mb * 1048576)) /dev/zero | tr '\0' a)
    fi
    if [ -f /tmp/die ]; then
        code=$(cat /tmp/die)
        echo "engine: fatal error, exiting with $code"
        exit "$code"
    fi
    sleep 0.2 & wait $!
done
