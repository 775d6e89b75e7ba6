#!/usr/bin/env bash
# One call of the device tool (see benchmarks/README.md): install the carried wheels
# (.whl/, e.g. lark, which the GPU machine lacks), run the GPU tests, then the benchmark.
#   TESTS="tests/test_attention.py ..."  CASES=all|gpt2_block,mlp  PROBES=none|default|a,b
#   MODELS=gpt2,llama [MODES=train] [BACKENDS=inductor-ro,rewritec-ro] [STEPS=8]: the
#   models suite (benchmarks/models.py), written to $OUT/models.md and .json
#   NOWORKER=1: the probe cases again with REWRITEC_COMPILE_WORKER=0 (runtime/ahead.py),
#   written to $OUT/cuda_noworker.md, for the compile workers' effect on the same machine
# Before the call, on a machine that reaches PyPI (.whl/ is git-ignored, so a fresh
# checkout has none; pass carry: [".whl"] to the device tool):
#   pip download lark==1.3.1 --no-deps -d .whl
set -u
OUT=${OUT:-/tmp/rewritec-gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
# the checkout is the package `rewritec`; an editable install also registers the
# backend's entry point (torch.compile(..., backend="rewritec") by name)
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/rewritec
export PYTHONPATH=/tmp/pkg:${PYTHONPATH:-}
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
  || echo "(no editable install: backend='rewritec' by name is unavailable)"
export PYTHONUNBUFFERED=1
# Without lark every graph falls back to ATen, and the run measures eager three times.
if ! python3 -c "import lark" 2>/dev/null; then
  echo "gpu_check: lark is not importable: put its wheel in .whl/ and carry .whl (see the top of this file)" >&2
  exit 2
fi
# Byte-compile everything as an installation would, so that a cold compile does not
# also measure Python compiling rewritec's and lark's sources (the checkout arrives bare),
# nor torch's and Triton's: the GPU machine's image ships them without bytecode and sets
# PYTHONDONTWRITEBYTECODE=1, so every process compiled each torch module it imported
# (Inductor's many more than rewritec's); pip writes bytecode when it installs them.
SITE_PKGS=$(python3 -c "import os, torch, triton; print(os.path.dirname(torch.__file__), os.path.dirname(triton.__file__))" 2>/dev/null)
python3 -m compileall -q -j 0 . /tmp/site $SITE_PKGS >/dev/null 2>&1
# Likewise the built-in rules' parsed table, kept beside them (rulesets.builtin_rules).
REWRITEC_CACHE_DIR=$(mktemp -d) python3 -c "from rewritec.rulesets import builtin_rules as b; b()"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ -n "${TESTS:-}" ]; then
  python3 -m pytest -q -p no:logging $TESTS 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
fi
if [ -n "${CASES:-}" ]; then
  # CASES=all runs every case; PROBES=default probes --quick's default cases
  SEL=(--cases "$CASES"); [ "$CASES" = all ] && SEL=()
  PRB=(--probe-cases "${PROBES:-none}"); [ "${PROBES:-}" = default ] && PRB=()
  python3 -m benchmarks.run --device cuda --quick "${SEL[@]}" "${PRB[@]}" \
    --out "$OUT/cuda.md" 2>&1 | tail -45
fi
if [ -n "${NOWORKER:-}" ]; then
  NW=pointwise_chain,layer_norm_4k  # --quick's probe cases, unless PROBES lists others
  case "${PROBES:-default}" in default|none) ;; *) NW=$PROBES ;; esac
  REWRITEC_COMPILE_WORKER=0 python3 -m benchmarks.run --device cuda --quick \
    --cases "$NW" --out "$OUT/cuda_noworker.md" 2>&1 | tail -12
fi
if [ -n "${MODELS:-}" ]; then
  python3 -m benchmarks.models --models "$MODELS" --modes "${MODES:-train}" \
    --backends "${BACKENDS:-inductor-ro,rewritec-ro}" --steps "${STEPS:-8}" --warmup 3 \
    --out "$OUT/models.md" 2>&1 | grep " | " | cut -c1-220
fi
