#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py) in one command, for the lent GPU machine.
# See docs/gpu.md.
#
#   Here, once (needs the package index): fetch the simplejpeg wheel for the GPU
#   machine's Python 3.12 into .whl/ (git-ignored through .git/info/exclude):
#       bash bench/gpu_check.sh --fetch-wheels
#   On the GPU machine, through the device tool:
#       run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=480)
#   Any other arguments go to gpu_check.py (e.g. --quick, --sections a,b).
#
# simplejpeg is not in that machine's image: when python3 cannot import it, the
# carried wheel is installed into /tmp/site (no index, no deps) first. Outputs go
# to $OUT (the device tool brings them back) or bench-results/: gpu_check.json,
# gpu_check.log and nvidia-smi.txt. The exit status is gpu_check.py's: 0 unless a
# check failed or a section crashed (a figure below its target is not a failure).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
cd "$repo" || exit 2
py="${PYTHON:-python3}"
SIMPLEJPEG_VERSION="${SIMPLEJPEG_VERSION:-1.9.0}"

if [ "${1:-}" = "--fetch-wheels" ]; then
  exclude="$(git rev-parse --git-path info/exclude)"
  mkdir -p "$(dirname "$exclude")"
  grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
  exec "$py" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "simplejpeg==$SIMPLEJPEG_VERSION"
fi

if ! "$py" -c "import simplejpeg" 2>/dev/null; then
  tag="cp$("$py" -c 'import sys; print("%d%d" % sys.version_info[:2])')"
  wheels=(.whl/simplejpeg-*-"$tag"-*.whl)
  if [ ! -e "${wheels[0]}" ]; then
    echo "gpu_check.sh: simplejpeg is missing and .whl/ has no wheel for $tag" \
         "(run 'bash bench/gpu_check.sh --fetch-wheels' where pip works, and carry .whl)" >&2
    exit 2
  fi
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "${wheels[@]}" || exit 2
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
out="${OUT:-$repo/bench-results}"
mkdir -p "$out"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
fi
"$py" bench/gpu_check.py --out "$out/gpu_check.json" "$@" 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
