#!/usr/bin/env bash
# FP8 benchmarks on the lent H200 (device tool), with the small wheels from .whl carried along
# (pydantic, torchtitan, safetensors' friends: the engine and trainer imports need them), as
# bench/gpu_debug/run.sh does. Each script stays under 6 minutes; run them as two device calls:
#   bash bench/fp8/run.sh gemm        -> $OUT/fp8_gemm.json (+ .txt)
#   bash bench/fp8/run.sh mismatch    -> $OUT/fp8_mismatch.json (+ .txt)
#   bash bench/fp8/run.sh wgmma       -> $OUT/fp8_wgmma.json (+ .txt): the CUDA kernel probe
#   NCU_VARIANTS=0,2,4 bash bench/fp8/run.sh ncu    (NCU_VARIANT=0 ... ncu-source): Nsight Compute
#      (every ncu mode profiles M, N, K = NCU_SHAPE, default 4096,4096,7168)
#   bash bench/fp8/run.sh clocks      -> $OUT/fp8_clocks.json: SM clock and power under bf16 vs FP8 GEMMs
#   bash bench/fp8/run.sh deepgemm    -> $OUT/fp8_deepgemm.json: DeepGEMM as a baseline (deepgemm.py),
#                                        its chosen configuration per shape printed in the .txt
#   bash bench/fp8/run.sh deepgemm-ncu ncu   -> Nsight Compute over DeepGEMM's kernel at
#      NCU_SHAPE ($OUT/deepgemm_ncu*), then over ours at the same shape (NCU_VARIANTS)
#   bash bench/fp8/run.sh product     -> the CUDA kernel as the dispatch's large-M backend: its self-check,
#      tune.py --skip-triton at M = 512-8192 ($OUT/fp8_tune.json, the new table $OUT/fp8_configs.json),
#      then gemm.py reading that table (~4 minutes). (train_linear.py imports torchtitan, whose import-time
#      dependencies, tyro, torchdata and datasets with pyarrow, the GPU image lacks and .whl does not carry.)
#   bash bench/fp8/run.sh trainer     -> train_linear.py with the committed table, and with cuBLAS in place of
#      its "cuda" entries ($OUT/fp8_train_linear{,_cublas}.json); needs `bash bench/wheels.sh --trainer` first,
#      and pyarrow and pandas on the GPU image (checked first)
#   bash bench/fp8/run.sh train-linear  -> $OUT/fp8_train_linear.json: train_linear.py with the committed table
#   bash bench/fp8/run.sh train-profile -> $OUT/fp8_train_profile.json: where the trainer's FP8 linear
#      spends a step (host time, GPU kernel times, host functions); needs the same wheels as trainer
#   bash bench/fp8/run.sh deepgemm-ncu-source   -> $OUT/wgmma_source_deepgemm.csv: its stall samples per
#      SASS instruction, as ncu-source gives ours
set -uo pipefail
IFS=, read -r NCU_M NCU_N NCU_K <<< "${NCU_SHAPE:-4096,4096,7168}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# A fresh tree from the tarball, once per invocation (deepgemm and deepgemm-ncu share it).
unpack_deepgemm() {
  [[ -n "${DG_UNPACKED:-}" ]] && return 0
  rm -rf /tmp/deepgemm && mkdir -p /tmp/deepgemm && tar -xzf "${DEEPGEMM_TAR:-.deepgemm/src.tar.gz}" -C /tmp/deepgemm &&
    DG_UNPACKED=1
}
for what in "${@:-gemm}"; do
  case "$what" in
    gemm) python3 bench/fp8/gemm.py --out "$OUT/fp8_gemm.json" 2>&1 | tee "$OUT/fp8_gemm.txt" ;;
    wgmma) python3 bench/fp8/wgmma.py --out "$OUT/fp8_wgmma.json" 2>&1 | tee "$OUT/fp8_wgmma.txt" ;;
    ncu) NCU_PROGRAM="${NCU_PROGRAM_OURS:-python3 bench/fp8/wgmma_profile.py --variants ${NCU_VARIANTS:-0} --m $NCU_M --n $NCU_N --k $NCU_K}" \
      bash bench/fp8/wgmma_ncu.sh ;;
    ncu-source) NCU_PROGRAM="${NCU_PROGRAM_OURS:-python3 bench/fp8/wgmma_profile.py --variants ${NCU_VARIANT:-0} --m $NCU_M --n $NCU_N --k $NCU_K}" \
      bash bench/fp8/wgmma_ncu_source.sh "${NCU_VARIANT:-0}" ;;
    mismatch) python3 bench/fp8/mismatch.py --out "$OUT/fp8_mismatch.json" 2>&1 | tee "$OUT/fp8_mismatch.txt" ;;
    clocks) python3 bench/fp8/clocks.py --out "$OUT/fp8_clocks.json" 2>&1 | tee "$OUT/fp8_clocks.txt" ;;
    deepgemm)  # needs the tarball of bench/fp8/deepgemm_bundle.sh carried (.deepgemm, ignored by git)
      unpack_deepgemm || exit 1
      DG_PRINT_CONFIGS=1 python3 bench/fp8/deepgemm.py --src /tmp/deepgemm --out "$OUT/fp8_deepgemm.json" 2>&1 | tee "$OUT/fp8_deepgemm.txt" ;;
    deepgemm-ncu)  # the --quick shape only, no timing: one launch of DeepGEMM's GEMM to profile
      unpack_deepgemm || exit 1
      DG_PRINT_CONFIGS=1 NCU_TAG=deepgemm_ncu NCU_KERNELS=regex:sm90_fp8_gemm \
        NCU_PROGRAM="python3 bench/fp8/deepgemm.py --src /tmp/deepgemm --quick --ms $NCU_M --nk ${NCU_N}x$NCU_K --skip-timing --out /tmp/deepgemm_ncu.json" \
        bash bench/fp8/wgmma_ncu.sh ;;
    product)
      python3 bench/fp8/wgmma.py --variants "${WGMMA_VARIANTS:-0}" --skip-timing --out "$OUT/fp8_wgmma_check.json" 2>&1 | tail -2
      python3 -c "import json, sys; sys.exit(not json.load(open('$OUT/fp8_wgmma_check.json'))['check_ok'])" ||
        { echo "the CUDA kernel failed its self-check: not tuned"; exit 1; }
      cp ops/fp8/fp8_configs.json "$OUT/fp8_configs.json"
      python3 bench/fp8/tune.py --m 512,1024,2048,4096,8192 --skip-triton --skip-grouped --budget-s 200 \
        --nk 7168x2048,4096x7168,2048x7168,18432x7168,4096x1024,1024x2048,6144x1024,1024x3072,3072x1024,9728x2560,2560x9728 \
        --table "$OUT/fp8_configs.json" --out "$OUT/fp8_tune.json" 2>&1 | grep -v '^{'
      export RELAY_FP8_CONFIGS="$OUT/fp8_configs.json"
      python3 bench/fp8/gemm.py --skip-grouped --sweep-budget-s 0 --out "$OUT/fp8_gemm.json" > "$OUT/fp8_gemm.txt" 2>&1
      tail -5 "$OUT/fp8_gemm.txt" ;;
    trainer)
      python3 -c "import trainer.fp8" 2>&1 | tail -1
      python3 -c "import trainer.fp8" 2>/dev/null || { echo "trainer.fp8 does not import here"; exit 1; }
      python3 -c "
import json
t = json.load(open('ops/fp8/fp8_configs.json'))
for e in t['dense']:
    e['choice'] = 'torch' if e['choice'] == 'cuda' else e['choice']
json.dump(t, open('$OUT/fp8_configs_cublas.json', 'w'))"
      RELAY_FP8_CONFIGS="$OUT/fp8_configs_cublas.json" python3 bench/fp8/train_linear.py --out "$OUT/fp8_train_linear_cublas.json" 2>&1 | tail -9
      python3 bench/fp8/train_linear.py --out "$OUT/fp8_train_linear.json" 2>&1 | tail -9 ;;
    train-linear) python3 bench/fp8/train_linear.py --out "$OUT/fp8_train_linear.json" 2>&1 | tail -10 ;;
    train-profile) python3 bench/fp8/train_profile.py --out "$OUT/fp8_train_profile.json" 2>&1 | tee "$OUT/fp8_train_profile.txt" ;;
    deepgemm-ncu-source)  # warp-stall samples per SASS instruction of DeepGEMM's kernel (--quick shape)
      unpack_deepgemm || exit 1
      NCU_PROGRAM="python3 bench/fp8/deepgemm.py --src /tmp/deepgemm --quick --ms $NCU_M --nk ${NCU_N}x$NCU_K --skip-timing --out /tmp/deepgemm_src.json" \
        bash bench/fp8/wgmma_ncu_source.sh deepgemm regex:sm90_fp8_gemm ;;
    *) echo "unknown benchmark $what (gemm | wgmma | ncu | ncu-source | mismatch | clocks | deepgemm | deepgemm-ncu | deepgemm-ncu-source | product | trainer)"; exit 2 ;;
  esac
done
# The device tool brings back only the first few files under $OUT (Nsight Compute's
# CSVs can be lost that way): everything but the .json and .txt results goes into one tarball per
# invocation (raw_<first mode>_<time>.tgz, so a second run.sh in the same call keeps the first's).
(cd "$OUT" && raw=$(ls | grep -v -E '\.(json|txt)$|^raw_.*\.tgz$') && [ -n "$raw" ] &&
  tar czf "raw_${1:-gemm}_$(date +%s).tgz" --remove-files $raw && echo "raw outputs packed in $OUT: $(echo $raw | wc -w) files") || true
