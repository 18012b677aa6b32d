#!/usr/bin/env bash
# The C modules (balancer/_scan.c, _offload.c) built with AddressSanitizer and
# UndefinedBehaviorSanitizer into a scratch directory outside the source tree, then the fuzz tests
# (tests/test_c_fuzz.py, tests/test_fuzz.py, the C-against-Python tests of
# tests/test_frames.py and tests/test_offload.py) and the hostile-worker and smuggling-probe tests
# (whose wslb processes take the same builds) run against them: any overflow, out-of-bounds
# access or undefined arithmetic aborts the run with the sanitizer's report.
#
#   tools/sanitize.sh                  # build, then the fuzz tests
#   tools/sanitize.sh -k chunk         # extra arguments go to pytest
#   WSLB_SANITIZE_DIR=/tmp/asan tools/sanitize.sh
#
# _offload.c is built with llhttp's C sources, fetched and proven by
# tools/llhttp_src.py (cached outside the checkout), as setup.py builds them.
#
# Needs gcc with its libasan and libubsan (Debian's gcc has both) and the test extras installed.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
out=${WSLB_SANITIZE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/wslb/asan}
py=${PYTHON:-python3}
if ! command -v gcc >/dev/null || [ ! -e "$(gcc -print-file-name=libasan.so)" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then  # a fresh Debian CI machine
        apt-get install -y -q gcc >/dev/null || true
    fi
fi
asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
for lib in "$asan" "$ubsan"; do
    if [ ! -e "$lib" ]; then
        echo "sanitize: gcc has no $(basename "$lib") (apt-get install gcc)" >&2
        exit 2
    fi
done
include=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
llhttp=$(CC=gcc "$py" tools/llhttp_src.py)
rm -rf "$out/balancer"
mkdir -p "$out/balancer"
flags=(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all
       -g -O1 -fPIC -shared -pthread -Wall -Werror=implicit-function-declaration)
gcc "${flags[@]}" -I"$include" balancer/_scan.c -o "$out/balancer/_scan$suffix"
gcc "${flags[@]}" -I"$include" -I"$llhttp" balancer/_offload.c "$llhttp"/{llhttp,api,http}.c \
    -o "$out/balancer/_offload$suffix"
echo "sanitize: built $out/balancer in $(($(date +%s) - start)) s"
# The interpreter is not instrumented: the runtimes are preloaded, and its own allocations that
# live until exit are not leaks worth reporting.
export LD_PRELOAD="$asan $ubsan${LD_PRELOAD:+ $LD_PRELOAD}"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export WSLB_SANITIZED="$out"
# The processes the tests start (wslb and its serving processes) take the sanitized builds too:
# a sitecustomize on their PYTHONPATH puts the build first on balancer's package path, as the
# plugin does for the test process (tests/fuzz/sanitized.py).
mkdir -p "$out/site"
cat > "$out/site/sitecustomize.py" <<'PY'
import os

if os.environ.get("WSLB_SANITIZED"):
    import balancer

    balancer.__path__.insert(0, os.path.join(os.environ["WSLB_SANITIZED"], "balancer"))
PY
export PYTHONPATH="$out/site${PYTHONPATH:+:$PYTHONPATH}"
export WSLB_FUZZ_EXAMPLES=${WSLB_FUZZ_EXAMPLES:-500}  # tests/test_c_fuzz.py: more than its default
rc=0
tests=(
    tests/test_c_fuzz.py
    tests/test_fuzz.py
    tests/test_frames.py::test_fast_path_matches_general_path_over_any_chunking
    tests/test_frames.py::test_c_and_python_loops_agree_at_every_length_boundary
    tests/test_frames.py::test_c_loop_arguments_and_buffers
    tests/test_offload.py::test_stops_at_the_first_frame_it_must_not_take
    tests/test_offload.py::test_chunked_stops_at_the_first_chunk_it_must_not_take
    tests/test_hostile_worker.py
    tests/test_probes_every_path.py
)
timeout "${WSLB_SANITIZE_TIMEOUT:-600}" "$py" -m pytest -q -n 0 -p no:cacheprovider --capture=sys \
    -p tests.fuzz.sanitized "${tests[@]}" "$@" || rc=$?
echo "sanitize: build and fuzz took $(($(date +%s) - start)) s (exit $rc)"
exit $rc
