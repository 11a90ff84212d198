#!/usr/bin/env bash
# Load times on the GPU machine, in one device call, after the Qwen GGUF is
# staged (stage.sh qwen) and the prelude has run. Writes JSON and profiles under $OUT.
#
#   bash benchmarks/load_gpu.sh /tmp/qwen25coder05b.gguf .carry/tok
#
# The machine's packages carry no bytecode and a fresh machine has no Triton cache, so the
# first process pays for compiling both ("cold", one run). PYTHONPYCACHEPREFIX keeps the
# bytecode that run writes, as a normal install's compiled packages would; every later
# figure starts from there.
set -u
gguf=$1
tokenizer=$(realpath "$2")
export PYTHONPYCACHEPREFIX=/tmp/pyc
cd "$(dirname "$0")"
python3 load_time.py "$gguf" --device cuda --repeat 1 --name load_qwen_gguf_cold
python3 load_time.py "$gguf" --device cuda --repeat 3 --name load_qwen_gguf
for run in first again; do echo "profile, $run:"; ASTREAM_CACHE_DIR=/tmp/astream-cache python3 load_profile.py "$gguf" 2>&1 | tail -3; done
python3 make_checkpoint.py qwen3-4b /tmp/qwen3-4b --tokenizer "$tokenizer"
python3 load_time.py /tmp/qwen3-4b --device cuda --repeat 3 --name load_qwen3_4b_folder
python3 load_profile.py /tmp/qwen3-4b 2>&1 | tail -3
# The folder once more with its files out of the page cache, where the machine allows it.
if sync && echo 1 > /proc/sys/vm/drop_caches 2>/dev/null; then
  python3 load_time.py /tmp/qwen3-4b --device cuda --repeat 1 --name load_qwen3_4b_folder_uncached
else
  echo "page cache not droppable here"
fi
