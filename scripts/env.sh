#!/usr/bin/env bash
# Create or reuse the project's virtual environment and put it first on PATH. Sourced by
# scripts/train and scripts/test (and by hand: `source scripts/env.sh`). The environment (~5.5 GB:
# torch's CUDA build) lives outside the clone, keyed by requirements.lock + the Python version, so
# every clone and CI run shares it. Override the location with HYBRIDEP_VENV=/path/to/venv and the
# interpreter with HYBRIDEP_PYTHON=/path/to/python3.12. Sourcing leaves the caller's shell options
# alone: the work runs in a subshell with errexit, and only PATH/PYTHONPATH are exported.

_hybridep_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

_hybridep_venv=$(
  set -euo pipefail
  repo=$_hybridep_repo

  find_python() {
    if [ -n "${HYBRIDEP_PYTHON:-}" ]; then echo "$HYBRIDEP_PYTHON"; return; fi
    local c
    if command -v pyenv >/dev/null 2>&1; then
      for c in "$(pyenv root)"/versions/3.12*/bin/python; do [ -x "$c" ] && { echo "$c"; return; }; done
    fi
    for c in python3.12 python3; do
      if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
        command -v "$c"; return
      fi
    done
    echo "error: Python 3.12 not found (megatron-core >= 0.17 needs Python >= 3.12; the lock is tested on 3.12)." >&2
    echo "fix: 'pyenv install 3.12' or install python3.12, or set HYBRIDEP_PYTHON=/path/to/python3.12" >&2
    return 1
  }

  py=$(find_python)
  pyver=$("$py" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
  key=$( (cat "$repo/requirements.lock"; echo "$pyver") | sha256sum | cut -c1-12)
  venv=${HYBRIDEP_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron-hybridep/venv-$key}

  if [ ! -f "$venv/.complete" ]; then
    mkdir -p "$(dirname "$venv")"
    # One creator at a time (parallel test runs, several clones): the others wait, then reuse it.
    exec 9>"$venv.lock"
    flock 9
    if [ ! -f "$venv/.complete" ]; then
      echo "[env] creating $venv (python $pyver, requirements.lock $key); first time takes a few minutes" >&2
      rm -rf "$venv"
      "$py" -m venv "$venv"
      # Only this lock is installed: the machine-wide pip constraint/find-links must not change versions.
      PIP_CONSTRAINT= PIP_FIND_LINKS= "$venv/bin/python" -m pip install --quiet --no-input \
        --disable-pip-version-check -r "$repo/requirements.lock" >&2
      touch "$venv/.complete"
    fi
  fi
  echo "$venv"
) || { echo "[env] could not set up the environment (see above)" >&2; return 1 2>/dev/null || exit 1; }

export PATH="$_hybridep_venv/bin:$PATH"
export PYTHONPATH="$_hybridep_repo${PYTHONPATH:+:$PYTHONPATH}"
export HYBRIDEP_REPO="$_hybridep_repo"
unset _hybridep_venv _hybridep_repo
