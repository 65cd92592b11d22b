"""The worker side: executors (executor.py in-process, parallel_executor.py spawning one process
per rank), the worker that owns a device (worker.py) and its model runner with the step inputs
and buffers, block tables, CUDA graphs and the sampler. Runs in the engine core's process with
one rank, and in one worker process per rank otherwise."""
