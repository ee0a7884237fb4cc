#!/usr/bin/env bash
# The GPU checks of a round, on a machine with a GPU, CuPy and NCCL (no network needed):
# build the package into a scratch folder, run every `gpu` test against real CuPy,
# then the GPU benchmarks (collectives vs bound/naive CuPy, run overhead, the
# training step eager vs md.function with SGD and Adam, md.linalg.matmul's host cost). Results land in $OUT (default out/gpu_check).
#
#   OUT=out/gpu bash bench/gpu_check.sh
#
# CUDA_ARCHITECTURES (default: native, the GPU at hand) and EXTRA_PYTHONPATH (wheels
# installed beside it, e.g. greenlet where the machine lacks it) may be set. TEST_WORKERS=N
# runs the gpu tests in N pytest-xdist processes on the one GPU (pytest-benchmark, which refuses
# xdist with a warning the suite turns into an error, is switched off then); NATIVE_GPU_TESTS=0 skips the
# native GPU tests' second build. Benchmark output goes to one file, $OUT/benchmarks.txt, so that
# a lease that returns few files still brings everything back.
set -uo pipefail
OUT=${OUT:-out/gpu_check}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
site=${SITE:-/tmp/mirrored-site}
nvidia-smi -L
t0=$(date +%s)
$PY -m pip install -q --no-build-isolation --no-deps --no-index --target "$site" \
  --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHITECTURES:-native}" . > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
export PYTHONPATH=$site${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}
$PY -c "import mirrored as md, importlib.util as u; print('GPUs', md.config.list_physical_devices('GPU'), 'NCCL', md.config.is_nccl_available(), 'greenlet', bool(u.find_spec('greenlet')))"
t0=$(date +%s)
timeout "${TEST_SECONDS:-200}" $PY -m pytest -m gpu tests -q -p no:cacheprovider -rf --junitxml="$OUT/gpu_tests.xml" \
  ${TEST_WORKERS:+-n "$TEST_WORKERS" -p no:benchmark} 2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"
echo "gpu tests: $(( $(date +%s) - t0 )) s"
B="$OUT/benchmarks.txt"
timeout 80 $PY bench/compare_gpu.py --logical --replicas 2 4 8 -b 4 -e 256M -f 64 --iters 10 --warmup 3 \
  --json "$OUT/compare_gpu.json" 2>&1 | tee -a "$B"
timeout 60 $PY bench/train_step.py --device gpu --function --replicas 1 2 --steps 10 --optimizer sgd \
  --torch-python "$PY" 2>&1 | tee -a "$B"
timeout 90 $PY bench/train_step.py --device gpu --model mlp --function --replicas 1 2 4 --steps 10 --optimizer sgd \
  2>&1 | tee -a "$B"
timeout 60 $PY bench/train_step.py --device gpu --function --replicas 1 2 --steps 10 --optimizer adam \
  2>&1 | tee -a "$B"
timeout 60 $PY bench/linalg_overhead.py --repeat 2000 --dtypes float32 2>&1 | tee -a "$B"
timeout 60 $PY bench/sparse_gradients.py --gpu --repeat 5 2>&1 | tee -a "$B"
# The native tests that only a GPU runs (the fused update and the ordered scatter against the host loops).
if [ "${NATIVE_GPU_TESTS:-1}" = 1 ]; then
  cmake -S . -B /tmp/mirrored-native-gpu -G Ninja -DMIRRORED_PYTHON=OFF -DMIRRORED_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHITECTURES:-native}" > "$OUT/native_gpu_build.log" 2>&1 \
    && timeout 240 cmake --build /tmp/mirrored-native-gpu -j"$(nproc)" --target test_cuda_fused_update test_cuda_scatter_rows \
      >> "$OUT/native_gpu_build.log" 2>&1 \
    && for t in test_cuda_fused_update test_cuda_scatter_rows; do
         timeout 120 /tmp/mirrored-native-gpu/tests/native/$t 2>&1 | tail -5 | tee -a "$B"; echo "$t: rc=${PIPESTATUS[0]}"; done \
    || tail -20 "$OUT/native_gpu_build.log"
fi
