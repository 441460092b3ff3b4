set -e
# durastack replica llm-svc/decode/r3-s1
command -v bash >/dev/null 2>&1 || apk add --no-cache bash >/dev/null
(dockerd-entrypoint.sh dockerd >/var/log/dockerd.log 2>&1 &)
timeout 120 sh -c 'until docker info >/dev/null 2>&1; do sleep 0.5; done'
for f in /durastack/env.d/*; do if [ -f "$f" ]; then export "$(basename "$f")=$(cat "$f")"; fi; done
pip install vllm
vllm serve Qwen/Qwen2.5-0.5B --port 8000
