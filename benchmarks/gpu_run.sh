#!/bin/bash
# The H200 runs behind benchmarks/results/gpu-h200-*: run from the repository root on the
# GPU machine, after the wheels are installed in /tmp/site (../shared/GPU.md), with the
# photographs in .photos. Usage: benchmarks/gpu_run.sh STAGE... (prepare, tests, probe, daliprobe,
# split, decoders, bench, diagnose, profile, memory, delivery, ingest, ddp, soak, rebuild); logs and JSON go to $OUT. MAX_SIZE=512
# makes "bench" compare every pipeline on images capped at 512 px (imfeed-bench --max-size);
# SHORT_SIDE=800-1000 makes camera-sized images instead of ImageNet-shaped ones
# (--short-side). PROBE_ARGS go to the probe (e.g. "--busy-thread --gather-chunk 256");
# MIN_PASS the least seconds of a timed pass (imfeed-bench's default 2; 0: one epoch, as in
# every run up to picker8); TRAIN_STEPS sets the timed steps of the bench's training
# checks (30; TRAIN=0: none),
# TRAIN_WARMUP the untimed ones before (at least the bench's own minimum);
# TESTS_K a -k expression for the GPU tests (TESTS: files or node ids, split on spaces);
# SOAK_S the seconds of the soak (benchmarks/soak.py; SOAK_ARGS to it, e.g. "--cache shm");
# MODELS, STEPS and DIAG_ARGS go to diagnose_training.py (e.g. "--only synthetic --dali base,prime1"); DALI_SETTINGS to dali_stage_probe.py.
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
    tests) timeout ${TESTS_S:-180} python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_gpu_path.py tests/test_gpu_dali.py} ${TESTS_K:+-k "$TESTS_K"} > $OUT/gpu-tests.log 2>&1; tail -3 $OUT/gpu-tests.log ;;
    probe) prepare; timeout 240 python3 benchmarks/gpu_path_probe.py "$STORE" --epochs ${EPOCHS:-5} --cpu-share ${SHARES:-0,0.15} --decoder ${DECODER:-nvjpeg} ${PROBE_ARGS:-} --out $OUT/probe.json > $OUT/probe.log 2>&1; grep -v "^  " $OUT/probe.log | cut -c1-150 ;;
    daliprobe) prepare; timeout 300 python3 benchmarks/dali_stage_probe.py "$STORE" ${DALI_SETTINGS:+--settings $DALI_SETTINGS} ${DALI_ARGS:-} --out $OUT/dali-stage-probe.json > $OUT/dali-stage-probe.log 2>&1; grep -v "^\[\|^$" $OUT/dali-stage-probe.log | tail -12 ;;
    split) prepare; timeout 300 python3 benchmarks/gpu_split.py "$STORE" --out $OUT/gpu-split.json 2>&1 | tee $OUT/gpu-split.log | tail -30 ;;
    decoders) prepare; timeout 200 python3 benchmarks/gpu_decoders.py "$STORE" --out $OUT/gpu-decoders.json 2>&1 | tee $OUT/gpu-decoders.log | tail -20 ;;
    bench) prepare; timeout ${BENCH_S:-560} python3 -m loader.bench --images "$N" --photos .photos --workdir $W ${MAX_SIZE:+--max-size $MAX_SIZE} ${SHORT_SIDE:+--short-side $SHORT_SIDE} \
        --batch-size 256 --workers 16 --dtype float16 --channels-last --passes ${PASSES:-3} ${MIN_PASS:+--min-pass-seconds $MIN_PASS} $([ "${TRAIN:-1}" = 1 ] && echo --train-check) \
        --train-steps ${TRAIN_STEPS:-30} ${TRAIN_WARMUP:+--train-warmup $TRAIN_WARMUP} --only "${ONLY:-torch-pil,loader-nvjpeg,loader-dali,loader-dali-auto,dali-crop,dali-ram}" \
        --name "${NAME:-gpu-h200-dali}" --out $OUT --logs /tmp/blogs > $OUT/bench.log 2>&1; tail -25 $OUT/bench.log ;;
    diagnose) prepare; for m in ${MODELS:-resnet50 resnet18}; do timeout 280 python3 benchmarks/diagnose_training.py "$STORE" --model $m --steps ${STEPS:-40} ${DIAG_ARGS:-} > $OUT/diagnose-$m.log 2>&1; grep -v "^ \|^{\|^}" $OUT/diagnose-$m.log | cut -c1-300; done ;;
    profile) prepare; timeout 300 python3 benchmarks/profile_example.py "$FOLDER" "$STORE" > $OUT/profile.log 2>&1; cat $OUT/profile.log | tail -20 ;;
    memory) for r in "" --release; do timeout 200 python3 benchmarks/dali_memory_probe.py --epochs ${EPOCHS:-150} $r > $OUT/memory$r.log 2>&1; cut -c1-400 $OUT/memory$r.log | tail -40; done ;;
    ingest) timeout ${INGEST_S:-300} python3 benchmarks/bench_ingest.py --images 20000 --workdir /tmp/bi --out $OUT > $OUT/ingest.log 2>&1; tail -25 $OUT/ingest.log ;;
    soak) prepare; timeout $(( ${SOAK_S:-300} + 90 )) python3 benchmarks/soak.py "$STORE" --seconds ${SOAK_S:-300} --device cuda --workers 16 ${SOAK_ARGS:-} --out $OUT/soak.json > $OUT/soak.log 2>&1; tail -c 1500 $OUT/soak.log ;;
    rebuild) prepare; timeout ${REBUILD_S:-300} python3 benchmarks/rebuild_probe.py "$STORE" ${REBUILD_ARGS:-} --out $OUT/rebuild.json > $OUT/rebuild.log 2>&1; cut -c1-600 $OUT/rebuild.log | tail -20 ;;
    delivery) timeout ${DELIVERY_S:-240} python3 benchmarks/dali_delivery_probe.py --runs ${RUNS:-12} ${VARIANTS:+--variants $VARIANTS} --out $OUT/dali-delivery.json > $OUT/dali-delivery.log 2>&1; grep "runs delivered" $OUT/dali-delivery.log ;;
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
