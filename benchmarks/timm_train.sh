#!/bin/bash
# timm's train.py fed by timm's own loader, by ours (benchmarks/timm_swap.diff: two lines,
# and --no-prefetcher, since our loader does what timm's PrefetchLoader does), and by one
# batch kept on the GPU (the ceiling), for ResNet-50 and ResNet-18 with a modern recipe:
#   TIMM_TRAIN=path/to/train.py benchmarks/timm_train.sh IMAGE_FOLDER STORE
# (train.py of huggingface/pytorch-image-models at aa4b5850, with timm 1.0.31; the GPU
# machine cannot download it: carry it in.)
# Prints "timm MODEL LOADER IMG/S" lines: each run's mean of its epochs after the first.
# Knobs: MODELS, FEEDS, EPOCHS, EPOCHS_FAST, RUN_S; OURS_ARGS adds arguments to ours (e.g.
# OURS_ARGS="persistent_workers=False, decoder='cpu'": a name the swap passes takes the new value);
# TRAIN_ARGS adds train.py options to every run (e.g. TRAIN_ARGS="--torchcompile inductor");
# SWITCH_S runs it with that GIL switch interval (sys.setswitchinterval; Python's is 0.005).
set -u
folder=$1 store=$2 train=/tmp/timm_train.py
cp "${TIMM_TRAIN:?set TIMM_TRAIN to timm\'s train.py (pytorch-image-models at aa4b5850)}" $train && patch -s $train benchmarks/timm_swap.diff || exit 1
if [ -n "${OURS_ARGS:-}" ]; then
  # each name=value replaces the swap's own value for that name, or is added to its call
  python3 - "$train" "$OURS_ARGS" <<'PY' || exit 1
import re, sys
path, args = sys.argv[1], sys.argv[2]
if not re.fullmatch(r"[a-z_]+=[A-Za-z0-9.']+(, ?[a-z_]+=[A-Za-z0-9.']+)*", args):
    sys.exit(f"OURS_ARGS={args}: give name=value, ... (e.g. worker_nice=19)")
text = open(path).read()
line = next((x for x in text.splitlines() if "imfeed.DataLoader(" in x), None)
if line is None:
    sys.exit("OURS_ARGS: the swap's line not found")
new = line
for name, value in (a.strip().split("=", 1) for a in args.split(",")):
    if re.search(rf"\b{name}=", new):
        new = re.sub(rf"\b{name}=[^,)]+", f"{name}={value}", new)
    else:
        new = new.replace("verbose=True)", f"verbose=True, {name}={value})")
open(path, "w").write(text.replace(line, new))
PY
fi
mkdir -p /tmp/timm_data && ln -sfn "$folder" /tmp/timm_data/train
recipe="--aa rand-m9-mstd0.5-inc1 --reprob 0.25 --mixup 0.2 --cutmix 1.0 --amp --channels-last"
for model in ${MODELS:-resnet50 resnet18}; do
  for feed in ${FEEDS:-timm ours synthetic}; do
    epochs=${EPOCHS:-4}; [ $model = resnet18 ] && [ $feed != timm ] && epochs=${EPOCHS_FAST:-8}
    case $feed in
      timm) env=() prefetch=() ;;
      ours) env=(IMFEED_STORE=$store) prefetch=(--no-prefetcher) ;;
      synthetic) env=(IMFEED_SYNTHETIC=1) prefetch=(--no-prefetcher) ;;
    esac
    echo "== $model $feed $(date -u +%T)"
    run=($train)  # or through a wrapper that sets the switch interval first
    [ -n "${SWITCH_S:-}" ] && run=(-c "import runpy, sys; sys.setswitchinterval($SWITCH_S); sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')" $train)
    env "${env[@]}" timeout ${RUN_S:-200} python3 "${run[@]}" --data-dir /tmp/timm_data --val-split '' \
      --model $model -b 256 --epochs $epochs --warmup-epochs 0 --workers 16 --pin-mem $recipe \
      "${prefetch[@]}" ${TRAIN_ARGS:-} --log-interval 10 --eval-metric loss --checkpoint-hist 1 \
      --output /tmp/timm_out --experiment $model-$feed 2>&1 | tee /tmp/timm_run.log
    label="${TRAIN_ARGS:+ $TRAIN_ARGS}${SWITCH_S:+ switch $SWITCH_S}"; [ $feed = ours ] && label="$label${OURS_ARGS:+ $OURS_ARGS}"
    python3 - $model $feed "$label" <<'PY'
import re, sys
last = {}
for line in open("/tmp/timm_run.log"):
    m = re.search(r"Train: (\d+) \[.*\(\s*[\d.]+s,\s*([\d.]+)/s\)", line)
    if m:
        last[int(m.group(1))] = float(m.group(2))
rates = [r for e, r in sorted(last.items()) if e > 0]
mean = sum(rates) / len(rates) if rates else float("nan")
print(f"timm {sys.argv[1]} {sys.argv[2]}{sys.argv[3]} {mean:.0f} img/s (epochs 1..{len(rates)}: {rates})")
PY
  done
done
