# Profile `mlxc serve` at $LEVEL streams with py-spy (bench/results/serve-profile-gpu-h200-s20/README.md says how it ran)
LEVEL=${LEVEL:-64}; SIZE=${SIZE:-medium}; PORT=8321
PYSPY=${PYSPY:-py-spy}
echo "py-spy: $PYSPY"
python3 -c "
from bench import models; from pathlib import Path
p = Path('/tmp/m'); models.write_checkpoint(p, 'llama', '$SIZE'); models.write_tokenizer(p, models.config('llama', '$SIZE')['vocab_size'])"
python3 -m mlxc.cli serve --model /tmp/m --port $PORT --max-concurrency $LEVEL > $OUT/prof-server.log 2>&1 &
SPID=$!
for i in $(seq 120); do curl -sf http://127.0.0.1:$PORT/v1/models >/dev/null && break; sleep 1; done
python3 -m bench.serve_load --url http://127.0.0.1:$PORT --concurrency $LEVEL --requests ${REQ:-$((LEVEL*6))} --max-tokens 256 --duration ${DUR:-60} --out $OUT/prof-load > $OUT/prof-load.log 2>&1 &
LPID=$!
sleep ${WARM:-8}
$PYSPY record --pid $SPID --duration ${REC:-12} --rate 200 --threads --nonblocking --format raw -o $OUT/prof-py.txt > $OUT/prof-spy1.log 2>&1; tail -3 $OUT/prof-spy1.log
$PYSPY record --pid $SPID --duration ${REC:-12} --rate 200 --threads --idle --nonblocking --format raw -o $OUT/prof-idle.txt > $OUT/prof-spy2.log 2>&1; tail -1 $OUT/prof-spy2.log
$PYSPY record --pid $SPID --duration ${REC:-12} --rate 200 --threads --gil --nonblocking --format raw -o $OUT/prof-gil.txt > $OUT/prof-spy3.log 2>&1; tail -1 $OUT/prof-spy3.log
wait $LPID; tail -5 $OUT/prof-load.log
curl -s http://127.0.0.1:$PORT/metrics | grep -E "^mlxc_(scheduler_seconds|forwards)_total" > $OUT/prof-metrics.txt
kill $SPID; wait $SPID 2>/dev/null
ls -la $OUT
