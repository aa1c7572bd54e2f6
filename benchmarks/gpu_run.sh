#!/bin/bash
# The benchmarks on the GPU machine. Run from the repository root after the wheels are
# installed in /tmp/site (../shared/GPU.md), with the photographs in .photos:
#   benchmarks/gpu_run.sh STAGE...   (prepare, tests, bench, timm, profile, ingest, ddp, soak)
# Logs and JSON go to $OUT. Knobs (environment):
#   IMAGES (20000) and SHORT_SIDE (e.g. 800-1000: camera-sized images) for the store;
#   bench: PASSES (3), MIN_PASS (least seconds of a timed pass; imfeed-bench's default 2),
#     TRAIN=0 (no training checks), TRAIN_STEPS (30), TRAIN_WARMUP, ONLY (pipelines),
#     MAX_SIZE=512 (every pipeline on images capped at 512 px), ENCODING (raw, mixed:SHARE:
#     ours read a store of that encoding; name@jpeg in ONLY: ours on the JPEG store), NAME,
#     RECIPE (randaugment), BENCH_S (time limit);
#   tests: TESTS (files or node ids), TESTS_K (a -k expression), TESTS_S (time limit);
#   soak: SOAK_S (seconds), SOAK_ARGS (e.g. "--cache shm --resume-every 20");
#   ddp: DDP_RUNS (1 2 2numa), DDP_ARGS, DDP_TAG (added to the file names).
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
W=/tmp/bw N=${IMAGES:-20000}
prepare() {  # the images and store imfeed-bench makes for IMAGES and SHORT_SIDE (10 classes)
  local name="10x$(( (N + 9) / 10 ))${SHORT_SIDE:+-short$SHORT_SIDE}"
  [ -d "$W/store-$name" ] ||
    python3 -m loader.bench --prepare-only --images "$N" --photos .photos --workdir $W ${SHORT_SIDE:+--short-side $SHORT_SIDE} > $OUT/prepare.log 2>&1
  STORE=$W/store-$name FOLDER=$W/images-$name
}
for stage in "$@"; do
  echo "== $stage $(date -u +%T)"
  case $stage in
    prepare) prepare; tail -1 $OUT/prepare.log 2>/dev/null || echo "reusing $STORE" ;;
    tests) timeout ${TESTS_S:-180} python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/loader/gpu/test_gpu_path.py tests/loader/gpu/test_gpu_dali.py} ${TESTS_K:+-k "$TESTS_K"} > $OUT/gpu-tests.log 2>&1; tail -3 $OUT/gpu-tests.log ;;
    bench) prepare; timeout ${BENCH_S:-560} python3 -m loader.bench --images "$N" --photos .photos --workdir $W ${MAX_SIZE:+--max-size $MAX_SIZE} ${SHORT_SIDE:+--short-side $SHORT_SIDE} ${ENCODING:+--encoding $ENCODING} ${RECIPE:+--recipe $RECIPE} \
        --batch-size 256 --workers 16 --dtype float16 --channels-last --passes ${PASSES:-3} ${MIN_PASS:+--min-pass-seconds $MIN_PASS} $([ "${TRAIN:-1}" = 1 ] && echo --train-check) \
        --train-steps ${TRAIN_STEPS:-30} ${TRAIN_WARMUP:+--train-warmup $TRAIN_WARMUP} --only "${ONLY:-torch-pil,loader-nvjpeg,loader-dali,loader-dali-auto,dali-crop,dali-ram}" \
        --name "${NAME:-gpu-h200-dali}" --out $OUT --logs /tmp/blogs > $OUT/bench.log 2>&1; tail -25 $OUT/bench.log ;;
    timm) prepare; benchmarks/timm_train.sh "$FOLDER" "$STORE" > $OUT/timm-train.log 2>&1; grep "^timm " $OUT/timm-train.log ;;
    profile) prepare; timeout 300 python3 benchmarks/profile_example.py "$FOLDER" "$STORE" > $OUT/profile.log 2>&1; cat $OUT/profile.log | tail -20 ;;
    ingest) timeout ${INGEST_S:-300} python3 benchmarks/bench_ingest.py --images 20000 --workdir /tmp/bi --out $OUT > $OUT/ingest.log 2>&1; tail -25 $OUT/ingest.log ;;
    soak) prepare; timeout $(( ${SOAK_S:-300} + 90 )) python3 benchmarks/soak.py "$STORE" --seconds ${SOAK_S:-300} --device cuda --workers 16 ${SOAK_ARGS:-} --out $OUT/soak.json > $OUT/soak.log 2>&1; tail -c 1500 $OUT/soak.log ;;
    ddp) prepare; (echo "== topology"; nproc; lscpu | grep -i "numa\|thread\|socket"; nvidia-smi topo -m) >> $OUT/ddp.log 2>&1; echo "$(nproc) cores, $(nvidia-smi -L | wc -l) GPU(s)"
      # 1: one rank on the first half of the cores (the single-GPU figure); 1all: one rank on
      # all of them; 2: two ranks, each on half the cores; 2numa: two ranks, torchrun binding
      # each to cores near its GPU. DDP_TAG is added to the file names (runs with other DDP_ARGS).
      for run in ${DDP_RUNS:-1 2 2numa}; do
        case $run in
          1) pre="taskset -c 0-$(( $(nproc) / 2 - 1 ))" args=--nproc_per_node=1 ;;
          1all) pre="" args=--nproc_per_node=1 ;;
          2) pre="" args=--nproc_per_node=2 ;;
          2numa) pre="" args="--nproc_per_node=2 --numa-binding exclusive" ;;
        esac
        # One log for every run (at most 8 files come back from the machine), a JSON each.
        echo "== $run${DDP_TAG:-} $(date -u +%T)" >> $OUT/ddp.log
        timeout 200 $pre python3 -m torch.distributed.run $args benchmarks/ddp_two_gpus.py "$STORE" ${DDP_ARGS:-} > $OUT/ddp-$run${DDP_TAG:-}.json 2>> $OUT/ddp.log
        python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(sys.argv[2], {k: v for k, v in r.items() if k not in ('stats', 'cores', 'alone', 'beside', 'trials')}, 'starved', r.get('beside', {}).get('starved_handoffs'), 'pending', r.get('beside', {}).get('pending_handoffs'), len(r['cores']), 'cores', r['stats'].get('way'), r['stats'].get('cpu_share'), [(t['cause'], t['kept']) for t in r.get('trials', [])], r['stats'].get('way_paces_ms')) for r in d['ranks']]" $OUT/ddp-$run${DDP_TAG:-}.json "$run${DDP_TAG:-}" 2>/dev/null || tail -5 $OUT/ddp.log
      done ;;
  esac
done
