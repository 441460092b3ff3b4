set -e
# durastack replica llm-svc/decode/r3-s1
command -v curl >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq curl >/dev/null)
curl -LsSf https://astral.sh/uv/install.sh | env UV_INSTALL_DIR=/usr/local/bin sh >/dev/null
uv venv --seed --python 3.12 /opt/durastack-python >/dev/null
export PATH=/opt/durastack-python/bin:$PATH
for f in /durastack/env.d/*; do if [ -f "$f" ]; then export "$(basename "$f")=$(cat "$f")"; fi; done
pip install vllm
vllm serve Qwen/Qwen2.5-0.5B --port 8000
