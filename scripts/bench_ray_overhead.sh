#!/bin/sh
# What `--ray local` adds to a run: scenarios/quick.yaml plain, then with --ray local, back to
# back, wall time of each whole command. Runs inside a network namespace with only loopback up
# (Ray advertises the machine's address otherwise); needs root, util-linux and iproute2.
#   sudo scripts/bench_ray_overhead.sh [OUT_DIR]
set -eu
if [ "${HARNESS_IN_NS:-}" != 1 ]; then
    exec env HARNESS_IN_NS=1 unshare -n --pid --fork --mount-proc "$0" "$@"
fi
ip link set lo up
out=${1:-/tmp/ray-overhead}
harness=${HARNESS:-.venv/bin/harness}
export RAY_USAGE_STATS_ENABLED=0
rm -rf "$out" && mkdir -p "$out"
for mode in plain ray; do
    extra=""; [ "$mode" = ray ] && extra="--ray local"
    start=$(date +%s.%N)
    # shellcheck disable=SC2086
    $harness run scenarios/quick.yaml $extra --out "$out/$mode" > "$out/$mode.log" 2>&1
    end=$(date +%s.%N)
    echo "$mode: $(echo "$end - $start" | bc) s"
done
echo "noise and rates: $out/plain/results.jsonl and $out/ray/*/results.jsonl (round records)"
