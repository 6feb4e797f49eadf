#!/usr/bin/env bash
# `posttrain report --rows in-process` three times in a row, each from a fresh clone of HEAD, with
# every core busy with a CPU hog: the verdicts must be identical and every run must exit 0.
# Usage: benchmarks/report_under_load.sh [WORKDIR]   (uses this checkout's .venv)
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
D=${1:-$(mktemp -d)}
PY=$REPO/.venv/bin/python
REV=$(git -C "$REPO" rev-parse HEAD)
HOGS=()
for _ in $(seq "$(nproc)"); do ( while :; do :; done ) & HOGS+=($!); done
trap 'kill "${HOGS[@]}" 2>/dev/null' EXIT
for i in 1 2 3; do
  rm -rf "$D/clone$i"
  git clone -q "$REPO" "$D/clone$i" && git -C "$D/clone$i" checkout -q "$REV"
  cd "$D/clone$i" || exit 2
  start=$(date +%s); before=$(cut -d' ' -f1 /proc/loadavg)
  PYTHONPATH=$D/clone$i "$PY" -m posttrain.cli report --rows in-process --out reports > "$D/out$i.txt" 2>&1
  rc=$?
  end=$(date +%s); after=$(cut -d' ' -f1 /proc/loadavg)
  echo "run $i at $REV: exit $rc, $((end - start)) s wall, load average $before before, $after after"
  "$PY" -c "
import json
d = json.load(open('reports/conformance.json'))
rows = sorted((r['run']['target'], sorted(x['id'] + ':' + x['status'] for x in r['results'] if x['status'] != 'PASS')) for r in d['reports'])
json.dump(rows, open('$D/verdicts$i.json', 'w'))
print(f'  {len(rows)} rows, {sum(len(v) for _, v in rows)} non-PASS rows')
"
done
if cmp -s "$D/verdicts1.json" "$D/verdicts2.json" && cmp -s "$D/verdicts2.json" "$D/verdicts3.json"; then
  echo "verdicts identical across the three runs"
else
  echo "verdicts DIFFER: diff $D/verdicts1.json $D/verdicts2.json $D/verdicts3.json"; exit 1
fi
