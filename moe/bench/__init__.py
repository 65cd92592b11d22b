"""What `moe bench NAME` runs: one module per benchmark, each with `main(argv)`.

throughput, latency (engine, vLLM's flags), scheduler (CPU), kernel (GPU), all2all (torchrun);
engine_cpu is the engine-overhead split on the CPU. Nothing is imported here, so that
`moe bench --help` stays fast.
"""
