"""Triton attention kernels for the GPU path, one file per kernel family; each has its
pure-torch reference in kernels/attention.py or kernels/mla_attention.py (the CPU path).
Import from the submodules: importing this package loads no Triton."""
