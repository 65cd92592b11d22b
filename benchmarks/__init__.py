"""Standalone benchmark and GPU-check scripts and their raw results; not installed (what
`moe bench` runs lives in moe/bench/). A package only so that tests and scripts can import
each other from the repository root."""
