"""Benchmark clients (no torch). `pdserve.bench.serve` is the online serving benchmark:
`await run(BenchConfig(...))` as a library, `build_bench_parser()` / `run_bench(args)` for the CLI."""
