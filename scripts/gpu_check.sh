#!/usr/bin/env bash
# Everything a GPU machine should run, in about 10 minutes (the time bounds below add up to 11.2:
# lower TESTS_LIMIT_S or name fewer parts where a command may run 10 minutes at most),
# with the machine's own torch and no network access:
#
#   OUT=/some/folder scripts/gpu_check.sh [PART ...]   # from anywhere; JSON rows and logs to $OUT
#
# PART: tests, kernels, hf, host (the default: all four), tiles (the Triton kernels' tile sweep, about
# 6 minutes: a session of its own). The install runs first whatever the parts. TILES_BUDGET_S
# (default 300) bounds the sweep.
#
# 1. install the checkout without touching torch: no dependencies, no build isolation (the core is
#    compiled with the machine's pybind11 and setuptools); wheels found in .gpu_wheels/ first, also
#    without dependencies (a transformers >= 5.6 where the machine's is older, pybind11 where it has
#    none, or peft for the integration's LoRA tests: fetch them here with
#    `pip download --no-deps -d .gpu_wheels "transformers==5.19.0" pybind11 setuptools wheel peft`
#    and carry the folder);
# 2. `pytest -m gpu tests` (kernels, ops, collectives and the Hugging Face integration);
# 3. `mmbalance bench attention varlen --quick` on CUDA (TFLOP/s against SDPA and flash-attn,
#    bandwidth against a copy), and `mmbalance bench gdn --quick` (the Gated DeltaNet maps' fused
#    backward against autograd through the reference: time and peak memory);
# 4. `mmbalance bench hf --device cuda`: one training step of Qwen2-VL-2B's language model on 8k
#    tokens, mmbalance_varlen against sdpa (and flash_attention_2 where installed);
# 5. (host) scripts/host_profile.py: host time of one eager call of the varlen ops and an attention
#    block against a torch op and a raw Triton launch, and where it goes (cProfile);
# 6. (tiles) `python -m mmbalance.bench.attention.tiles`: every candidate tiling of the forward, dq
#    and dk/dv kernels per shape, audited for the GPU's architecture, checked against the torch
#    reference and timed against the table's choice and SDPA; the winners printed as table entries.
#
# Every part runs under its own time limit and the script goes on after a failure, so one run
# gives every figure it can; it exits 1 when any part failed. TESTS_LIMIT_S and KERNELS_LIMIT_S
# (default 200 and 130) bound the tests and the kernel benchmarks.
set -uo pipefail
export PYTHONUNBUFFERED=1  # a part cut off by its time limit keeps what it printed
cd "$(dirname "$0")/.."
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
py="${PYTHON:-python3}"
start=$(date +%s)
failed=()
part() { echo; echo "== $1 ($(($(date +%s) - start)) s)"; }
parts=" ${*:-tests kernels hf host} "
for p in $parts; do
  case "$p" in tests|kernels|hf|host|tiles) ;; *) echo "unknown part '$p': choose from tests kernels hf host tiles"; exit 2 ;; esac
done
wants() { [[ "$parts" == *" $1 "* ]]; }

part "install the checkout (torch untouched)"
if compgen -G ".gpu_wheels/*.whl" > /dev/null; then
  "$py" -m pip install -q --no-deps --no-index .gpu_wheels/*.whl || failed+=("carried wheels")
fi
"$py" -c "import pybind11, setuptools, wheel" 2> /dev/null \
  || echo "pybind11, setuptools or wheel missing here (the core builds with them): carry their wheels in .gpu_wheels/"
torch_before=$("$py" -c "import torch; print(torch.__version__)")
if ! timeout 150 "$py" -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1; then
  tail -20 "$out/install.log"
  failed+=("install")
fi
torch_after=$("$py" -c "import torch; print(torch.__version__)")
[ "$torch_before" = "$torch_after" ] || { echo "torch changed: $torch_before -> $torch_after"; failed+=("torch kept"); }
"$py" - << 'EOF' | tee "$out/environment.txt"
import torch, triton
import mmbalance._core  # noqa: F401 - the compiled core built
from mmbalance.pyops.attention_backends import torch_flash_impl
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")
print(f"device {torch.cuda.get_device_name(0)}, sm_{''.join(map(str, torch.cuda.get_device_capability(0)))}")
print(f"torch's FlashAttention: {torch_flash_impl()}")
try:
    import transformers
    print(f"transformers {transformers.__version__}")
except ImportError:
    print("transformers: not installed")
try:
    import flash_attn
    print(f"flash-attn {flash_attn.__version__}")
except ImportError:
    print("flash-attn: not installed")
EOF

if wants tests; then
  part "pytest -m gpu tests"
  timeout -s INT -k 20 "${TESTS_LIMIT_S:-200}" "$py" -m pytest -q -m gpu tests -p no:cacheprovider --timeout 90 \
    --durations 12 --junitxml "$out/gpu-tests.xml" \
    > "$out/gpu-tests.log" 2>&1 || failed+=("pytest -m gpu")
  grep -E "^(FAILED|ERROR)" "$out/gpu-tests.log" | head -40; tail -32 "$out/gpu-tests.log"
fi

if wants kernels; then
  part "mmbalance bench attention varlen --quick --device cuda"
  timeout "${KERNELS_LIMIT_S:-130}" "$py" -m mmbalance.cli bench attention varlen --quick --device cuda --json "$out/bench.jsonl" \
    > "$out/bench-kernels.log" 2>&1 || failed+=("bench attention varlen")
  grep -E "^(attention|varlen|pack|unpack|segment)" "$out/bench-kernels.log" | head -60
  part "mmbalance bench gdn --quick (the delta rule's maps: fused backward against autograd, on CUDA)"
  timeout 40 "$py" -m mmbalance.cli bench gdn --quick --json "$out/bench.jsonl" \
    > "$out/bench-gdn.log" 2>&1 || failed+=("bench gdn")
  grep -E "^gdn_" "$out/bench-gdn.log"
fi

if wants hf; then
  part "mmbalance bench hf --device cuda"
  timeout 90 "$py" -m mmbalance.cli bench hf --device cuda --json "$out/bench.jsonl" \
    > "$out/bench-hf.log" 2>&1 || failed+=("bench hf")
  grep -E "hf_train_step" "$out/bench-hf.log"
fi

if wants host; then
  part "scripts/host_profile.py"
  timeout 60 "$py" scripts/host_profile.py > "$out/host.log" 2>&1 || failed+=("host profile")
  grep -E " us a call" "$out/host.log"
fi

if wants tiles; then
  # no candidate starts after the budget; the rows so far are in tiles.jsonl shape by shape
  budget="${TILES_BUDGET_S:-300}"
  part "python -m mmbalance.bench.attention.tiles --device cuda --budget-s $budget"
  timeout $((budget + 90)) "$py" -m mmbalance.bench.attention.tiles --device cuda --budget-s "$budget" \
    ${TILES_SHAPES:+--shapes $TILES_SHAPES} --json "$out/tiles.jsonl" \
    > "$out/tiles.log" 2>&1 || failed+=("tiles")
  grep -E "^(d128|d64)|tiles_fwd_bwd|winners" -A0 "$out/tiles.log" | head -40
  sed -n '/== winners/,$p' "$out/tiles.log"
fi

part "done"
echo "rows: $out/bench.jsonl; logs: $out"
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}"
  exit 1
fi
