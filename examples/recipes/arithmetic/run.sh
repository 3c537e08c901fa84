#!/usr/bin/env bash
# The arithmetic recipe end to end on this machine:
#   bash examples/recipes/arithmetic/run.sh [KEY=VALUE ...]     e.g. pipelines[0].steps=10
# Needs `bash scripts/setup.sh cpu models recipes`. Writes rlix-out/ beside this file:
# arithmetic/metrics.jsonl (eval/reward every 5 steps), samples.jsonl, logs/.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
py="$root/.venv/bin/python"
[ -x "$py" ] || py=python3
cd "$here"
# one-digit sums: 60 for training (repeated to 3,000 rows), 40 held out for evaluation
"$py" make_data.py --digits 1 1 --eval 40
model="$("$py" -m rlix_async.cli models smollm2-135m-instruct | tail -n 1)"
exec "$py" -m rlix_async.cli launch recipe.yaml "pipelines[0].model.path=$model" "$@"
