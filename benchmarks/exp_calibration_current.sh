#!/bin/bash
# Experiment (reverted after measuring; the H200 host, 16 cores): calibration on the live placement (EPLB_EXP_CAL=current) against the older plan; EPLB_EXP_CAL=current_nogate also drops the noise price from the gate
# when the prediction is calibrated on the live placement. Variants: the arguments (default: older
# current); the paired timing only with the default.
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
mkdir -p /tmp/r
variants=${*:-older current}
for v in $variants; do
  for c in deepseek-v3/EP32 qwen3-235b-a22b/EP32 drifting/EP32 deepseek-v3/EP64 qwen3-235b-a22b/EP64 drifting/EP64 deepseek-v3/EP32/1; do
    n=$(echo $c | tr '/' '_')
    EPLB_EXP_CAL=$v timeout 400 python -m benchmarks.bench_continuous --cases $c --budgets 160 --json /tmp/r/${v}_$n.json > /tmp/r/${v}_$n.log 2>&1 &
  done
done
[ $# -gt 0 ] || timeout 400 python -m benchmarks.exp_calibration_paired 32 20 > /tmp/r/paired32.txt 2>&1 &
[ $# -gt 0 ] || timeout 400 python -m benchmarks.exp_calibration_paired 64 20 > /tmp/r/paired64.txt 2>&1 &
wait
python - <<'PY' > $OUT/cal.txt
import json, glob, os
for f in sorted(glob.glob("/tmp/r/*.json")):
    d = json.load(open(f))
    for case in d.get("cases", [d]):
        v = case.get("verdict", {})
        rows = [r for r in case.get("rows", []) if r["mode"] == "continuous"]
        for r in rows:
            print(os.path.basename(f), r["label"], "bal %.4f speedup %.4f GB/1000 %.1f err %s bias %s solve %.4f" % (
                r["balancedness_prefill_mean"], r["speedup_vs_none"], r["bytes_moved_per_1000_passes"]/1e9,
                r["prediction_error_mean"], r["prediction_bias_mean"], r["solve_seconds_mean"]))
        if v:
            print("   verdict margin %.4f bytes %.3f checks %s" % (v["min_speedup_margin"], v["bytes_fraction_of_periodic_1000"], v["checks"]))
PY
cat /tmp/r/paired*.txt >> $OUT/cal.txt 2>/dev/null
for f in /tmp/r/*.log; do echo "== $f"; tail -3 $f; done >> $OUT/cal.txt
tar czf $OUT/cal_json.tgz -C /tmp/r .
cat $OUT/cal.txt
