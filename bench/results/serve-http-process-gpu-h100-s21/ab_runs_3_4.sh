source scratch/stage.sh || exit 1
PORT=8341
phases() { curl -s http://127.0.0.1:$PORT/metrics | grep -E "^mlxc_(scheduler_seconds|forwards)_total" | tr '\n' ';'; }
for mode in http-process no-http-process; do
  python3 -m mlxc.cli serve --model /tmp/m --port $PORT --max-concurrency 64 --$mode > /tmp/ab-$mode-3.log 2>&1 &
  SPID=$!
  for i in $(seq 200); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 0.5; done
  timeout 60 python3 -m bench.serve_load --url http://127.0.0.1:$PORT --concurrency 16 --requests 16 --max-tokens 64 > /dev/null 2>&1
  for level in 64 16; do
    B=$(phases)
    timeout 60 python3 -m bench.serve_load --url http://127.0.0.1:$PORT --concurrency $level --requests $((level*3)) --max-tokens 256 --max-tokens-spread 64 --out /tmp/ab-$mode-3-$level > /dev/null 2>&1
    A=$(phases)
    python3 - "$B" "$A" <<P
import json, re, sys
def parse(t): return {k: float(v) for k, v in re.findall(r'(\S+\}) (\S+);', t)}
b, a = parse(sys.argv[1]), parse(sys.argv[2])
d = {k: a[k] - b.get(k, 0) for k in a}
dec = d['mlxc_forwards_total{kind="decode"}']
ph = {re.search(r'phase="(\w+)"', k).group(1): round(1e3 * v / dec, 2) for k, v in d.items() if 'phase' in k}
L = json.load(open('/tmp/ab-$mode-3-$level.json'))['levels'][0]
print('$mode run 3 streams $level: %.0f tok/s, seconds median %.0f min %.0f; ms per decode forward %s' % (L['aggregate_tps'], L['second_tps_median'] or 0, L['second_tps_min'] or 0, ph))
P
  done
  kill $SPID; wait $SPID 2>/dev/null
done
