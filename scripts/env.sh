# shellcheck shell=bash
# Sourced by scripts/bench.sh and scripts/test.sh: creates the environment both run in on
# first use, reuses it after, and sets ASYNCFEED_PY to its interpreter.
#
#   ASYNCFEED_VENV  where the virtual environment lives (default: .venv in the checkout)
#   PYTHON          the interpreter that creates it (default: python3, >= 3.10)
#   TORCH_VERSION   the torch installed first (default: 2.13.0)
#
# torch goes in first and alone, pinned: a bare torch requirement (asyncfeed's own range,
# asked for with no torch installed) would pull a multi-GB CUDA build; with it installed,
# asyncfeed's range is satisfied and nothing more comes.  Then asyncfeed, editable, with
# every extra and the test tools: ".[all,test]", at the versions in scripts/constraints.txt.
# The environment is reused while a stamp in it matches pyproject.toml, the constraints, the
# torch version and this checkout's path.
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="${ASYNCFEED_VENV:-$_repo/.venv}"
_torch="${TORCH_VERSION:-2.13.0}"
_want="$(cat "$_repo/pyproject.toml" "$_repo/scripts/constraints.txt" | sha256sum | cut -d' ' -f1)"
_want="$_want torch==$_torch $_repo"
if [ ! -x "$_venv/bin/python" ]; then
  echo "asyncfeed: creating the environment in $_venv (first use: a few minutes)" >&2
  "${PYTHON:-python3}" -m venv "$_venv"
fi
if [ "$(cat "$_venv/.asyncfeed-env" 2>/dev/null)" != "$_want" ]; then
  echo "asyncfeed: installing torch==$_torch, then asyncfeed[all,test] (editable) into $_venv" >&2
  "$_venv/bin/python" -m pip install -q "torch==$_torch"
  if ! "$_venv/bin/python" -m pip install -q -c "$_repo/scripts/constraints.txt" \
      -e "$_repo[all,test]"; then  # e.g. another Python, for which a pinned release has no build
    echo "asyncfeed: installing at the pinned versions failed; resolving afresh" >&2
    "$_venv/bin/python" -m pip install -q -e "$_repo[all,test]"
  fi
  echo "$_want" > "$_venv/.asyncfeed-env"
fi
ASYNCFEED_PY="$_venv/bin/python"
export ASYNCFEED_PY
unset _repo _venv _torch _want
