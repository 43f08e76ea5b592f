#!/usr/bin/env bash
# Time to first token and time per output token against the scheduler's policy: for each
# setting, start `pagedllm serve` with it, load it with `pagedllm bench serve`, stop it, and
# print one markdown row (output tok/s, TTFT p50/p99, TPOT p50/p99, ITL p99).
#
#   scripts/serve_sweep.sh [--concurrency 16] [--num-prompts 64] [--input-len 256] [--output-len 128] \
#       -- "--max-num-batched-tokens 512" "--max-num-batched-tokens 2048" ...
#
# Each quoted argument after `--` is one server setting (any `pagedllm serve` flags). Results
# (server logs, JSON) go to $SWEEP_DIR (default: a new temporary folder).
set -euo pipefail

concurrency=16 num_prompts=64 input_len=256 output_len=128 port=${SWEEP_PORT:-8471}
while [ $# -gt 0 ]; do
  case $1 in
    --concurrency) concurrency=$2; shift 2 ;;
    --num-prompts) num_prompts=$2; shift 2 ;;
    --input-len) input_len=$2; shift 2 ;;
    --output-len) output_len=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "give at least one server setting after --" >&2; exit 2; }
dir=${SWEEP_DIR:-$(mktemp -d)}
mkdir -p "$dir"

echo "| server flags | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | ITL p99 ms |"
echo "|---|---|---|---|---|---|---|"
i=0
for setting in "$@"; do
  i=$((i + 1))
  # shellcheck disable=SC2086  # a setting is a list of flags
  pagedllm serve --port "$port" $setting > "$dir/server-$i.log" 2>&1 &
  server=$!
  ready=0
  for _ in $(seq 600); do
    if curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null; then ready=1; break; fi
    kill -0 "$server" 2> /dev/null || break
    sleep 0.5
  done
  if [ $ready = 1 ]; then
    pagedllm bench serve --base-url "http://127.0.0.1:$port" --max-concurrency "$concurrency" \
      --num-prompts "$num_prompts" --input-len-range "$input_len:$input_len" \
      --output-len-range "$output_len:$output_len" --result-json "$dir/result-$i.json" > "$dir/bench-$i.log" 2>&1 || true
  fi
  kill "$server" 2> /dev/null || true
  wait "$server" 2> /dev/null || true
  python3 - "$dir/result-$i.json" "$setting" <<'EOF'
import json, sys
path, setting = sys.argv[1:]
try:
    m = json.load(open(path))["metrics"]
except (OSError, ValueError):
    print(f"| `{setting}` | failed: see the logs beside {path} |||||")
    sys.exit()
cols = ["output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "p99_itl_ms"]
fail = f" ({m['failed']} failed)" if m.get("failed") else ""
print(f"| `{setting}`{fail} | " + " | ".join(f"{m[c]:.1f}" if c == cols[0] else f"{m[c]:.0f}" for c in cols) + " |")
EOF
done
