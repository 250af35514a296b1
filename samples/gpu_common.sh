# Shared by samples/gpu_bench.sh and samples/gpu_check.sh (sourced, not run).

# environment_report DEVICE: the date, Python, torch, Triton and (DEVICE cuda) the GPU, on stdout
environment_report() {
  date -u
  python3 -c "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
  python3 -c "import triton; print('triton', triton.__version__)" 2>/dev/null || echo "triton: not installed"
  if [ "$1" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv 2>/dev/null || true
  fi
}

# tables_from_json JSON: `vispec bench decoders`' printed tables of a (partial) result JSON, on stdout
tables_from_json() {
  python3 -c "import json, sys; from vispec.eval.bench.decoders import format_table; print(format_table(json.load(open(sys.argv[1]))))" "$1"
}
