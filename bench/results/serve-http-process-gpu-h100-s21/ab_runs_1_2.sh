# A/B on one machine: mlxc serve with HTTP in its own process (default) against one process,
# alternated, medium llama, 16 and 64 streams, 256-token answers (+-64). Writes $OUT/ab-*.json
source scratch/stage.sh || exit 1
python3 -c "
from bench import models; from pathlib import Path
p = Path('/tmp/m'); models.write_checkpoint(p, 'llama', 'medium'); models.write_tokenizer(p, models.config('llama', 'medium')['vocab_size'])"
PORT=8340
for run in 1 2; do for mode in http-process no-http-process; do
  python3 -m mlxc.cli serve --model /tmp/m --port $PORT --max-concurrency 64 --$mode > $OUT/ab-$mode-$run.log 2>&1 &
  SPID=$!
  for i in $(seq 200); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 0.5; done
  python3 -m bench.serve_load --url http://127.0.0.1:$PORT --concurrency 16 --requests 16 --max-tokens 64 > /dev/null 2>&1
  for level in 16 64; do
    python3 -m bench.serve_load --url http://127.0.0.1:$PORT --concurrency $level --requests $((level*3)) --max-tokens 256 --max-tokens-spread 64 --out $OUT/ab-$mode-$run-$level > /dev/null 2>&1
    python3 -c "
import json; d=json.load(open('$OUT/ab-$mode-$run-$level.json'))['levels'][0]
print('$mode run $run streams $level: %.0f tok/s, seconds median %.0f min %.0f, errors %d' % (d['aggregate_tps'], d['second_tps_median'] or 0, d['second_tps_min'] or 0, d['errors']))"
  done
  kill $SPID; wait $SPID 2>/dev/null
done; done
