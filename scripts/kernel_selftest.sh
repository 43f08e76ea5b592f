#!/usr/bin/env bash
# Build the native kernels with the C++ self-test (pagedllm/csrc/selftest) and run it.
#   scripts/kernel_selftest.sh aarch64   cross-compile for ARM NEON (with and without dotprod)
#                                        and run under qemu-aarch64; installs Debian's
#                                        g++-aarch64-linux-gnu and qemu-user when missing
#   scripts/kernel_selftest.sh native [ISA]
#                                        this machine's compiler, flags from $ISA_FLAGS, else
#                                        those of variant ISA (pagedllm/kernels/isa.py's names),
#                                        else of the best variant this CPU runs
set -euo pipefail
cd "$(dirname "$0")/.."
csrc=pagedllm/csrc
target=${1:-aarch64}
common=(-O3 -ffast-math -fopenmp -std=c++20)

compile() {  # dir, cxx, flags...: every kernel translation unit and the self-test, in parallel
  local dir=$1 cxx=$2
  shift 2
  local pids=() src name
  for src in "$csrc"/*.cpp "$csrc/selftest/selftest.cpp"; do
    name=$(basename "$src" .cpp)
    if [ "$name" = paged_attention ]; then
      for kind in 0 1 2 3; do  # pagedllm_abi.h's PAGEDLLM_CACHE_*
        "$cxx" "${common[@]}" "$@" -DPAGED_ATTENTION_CACHE=$kind -c "$src" -o "$dir/${name}_$kind.o" & pids+=($!)
      done
    else
      "$cxx" "${common[@]}" "$@" -c "$src" -o "$dir/$name.o" & pids+=($!)
    fi
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
}

run() {  # dir, cxx, runner (may be empty), flags...: link and run
  local dir=$1 cxx=$2 runner=$3
  shift 3
  "$cxx" "${common[@]}" "$@" -o "$dir/selftest" "$dir"/*.o
  echo "== kernel self-test: $cxx $*"
  $runner "$dir/selftest"
}

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
case "$target" in
  aarch64)
    if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
      echo "installing g++-aarch64-linux-gnu and qemu-user (Debian packages)"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++-aarch64-linux-gnu qemu-user >/dev/null
    fi
    export QEMU_LD_PREFIX=/usr/aarch64-linux-gnu
    compile "$out" aarch64-linux-gnu-g++ -march=armv8.2-a+dotprod
    run "$out" aarch64-linux-gnu-g++ qemu-aarch64 -march=armv8.2-a+dotprod
    # Without dotprod only the int8 dot product differs: rebuild the GEMMs alone (moe.cpp's too).
    aarch64-linux-gnu-g++ "${common[@]}" -march=armv8-a -c "$csrc/linear.cpp" -o "$out/linear.o"
    aarch64-linux-gnu-g++ "${common[@]}" -march=armv8-a -c "$csrc/kquant.cpp" -o "$out/kquant.o"
    aarch64-linux-gnu-g++ "${common[@]}" -march=armv8-a -c "$csrc/moe.cpp" -o "$out/moe.o"
    run "$out" aarch64-linux-gnu-g++ qemu-aarch64 -march=armv8-a
    ;;
  native)
    if [ -z "${ISA_FLAGS+set}" ]; then
      ISA_FLAGS=$(python3 - "${2:-}" <<'EOF'
import importlib.util, platform, sys
spec = importlib.util.spec_from_file_location("isa", "pagedllm/kernels/isa.py")
isa = importlib.util.module_from_spec(spec)
spec.loader.exec_module(isa)
name = sys.argv[1] or isa.runnable_isas(isa.cpu_flags(), platform.machine())[0]
print(" ".join(f for f in isa.isa_flags(name) if f not in isa.COMMON_FLAGS))
EOF
)
    fi
    # shellcheck disable=SC2086
    compile "$out" "${CXX:-g++}" ${ISA_FLAGS:-}
    # shellcheck disable=SC2086
    run "$out" "${CXX:-g++}" "" ${ISA_FLAGS:-}
    ;;
  *)
    echo "usage: $0 aarch64|native" >&2
    exit 2
    ;;
esac
