#!/usr/bin/env bash
# The wheel as a user gets it. Builds the sdist and, from it, the wheel (python -m build),
# repairs its platform tag (auditwheel), checks that the sdist carries the kernels' sources and the wheel every kernel variant of
# this architecture, installs the wheel into a fresh virtual environment where no C++
# compiler can be reached (CXX=/bin/false, PATH holding only that venv), and checks there
# that the best variant this CPU runs is loaded from the wheel with nothing compiled, and
# that a greedy generation equals the editable install's (the active environment).
# To spare CI a second download of PyTorch, the fresh venv reads the dependencies from the
# active environment's site-packages (a .pth line); pagedllm itself comes from the wheel.
# Kernel builds go through $PAGEDLLM_CACHE, so the suite that follows reuses them.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf dist
python -m build --sdist --wheel --outdir dist . >dist.log 2>&1 || { cat dist.log >&2; exit 1; }
rm dist.log
# The platform tag repaired for the oldest glibc the libraries allow (manylinux), libgomp
# vendored into pagedllm.libs/, as auditwheel does for any wheel with native code.
auditwheel repair -w dist "$(ls dist/pagedllm-*-linux_*.whl)" >dist.log 2>&1 || { cat dist.log >&2; exit 1; }
rm dist.log dist/pagedllm-*-linux_*.whl
wheel=$(ls dist/pagedllm-*.whl)
sdist=$(ls dist/pagedllm-*.tar.gz)
echo "== built $wheel and $sdist"
grep -q 'pagedllm/csrc/pagedllm_abi.h' <<<"$(tar tzf "$sdist")" || { echo "the sdist lacks csrc" >&2; exit 1; }
expected=$(python -c 'import platform; from pagedllm.kernels.isa import architecture_isas as a; print(*sorted(f"kernels-{i}.so" for i in a(platform.machine())))')
shipped=$(python -m zipfile -l "$wheel" | grep -o 'kernels-[a-z0-9_]*\.so' | sort | xargs)
[ "$shipped" = "$expected" ] || { echo "the wheel holds '$shipped', not '$expected'" >&2; exit 1; }
echo "== the wheel holds $shipped"

smoke=$(mktemp -d)
trap 'rm -rf "$smoke"' EXIT
python -m venv "$smoke/venv"
python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
  > "$("$smoke/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/dependencies.pth"
"$smoke/venv/bin/python" -m pip install -q --no-deps --no-index "$wheel"
prompt=(generate --prompt "The capital of France is" --max-tokens 24 --json)
env PATH="$smoke/venv/bin" CXX=/bin/false "$smoke/venv/bin/pagedllm" "${prompt[@]}" >"$smoke/wheel.out" 2>"$smoke/wheel.log"
env PATH="$smoke/venv/bin" CXX=/bin/false "$smoke/venv/bin/python" -I - <<'PY'  # -I: not the checkout's pagedllm
from pagedllm.kernels import build, library
best = library.available_isas()[0]
assert library.active_isa() == best, (library.active_isa(), best)
assert build.library_path(best) == build.prebuilt_path(best), build.library_path(best)
print(f"== the wheel's venv runs {best} from {build.library_path(best)}")
PY
grep -q "native kernels: .*, shipped in the wheel" "$smoke/wheel.log" || { cat "$smoke/wheel.log" >&2; exit 1; }
if grep -q "building the" "$smoke/wheel.log"; then echo "the wheel's venv compiled kernels" >&2; exit 1; fi
python -m pagedllm.entrypoints.cli "${prompt[@]}" >"$smoke/editable.out" 2>/dev/null
diff "$smoke/editable.out" "$smoke/wheel.out"
echo "== greedy generation from the wheel equals the editable install's: $(cat "$smoke/wheel.out")"
