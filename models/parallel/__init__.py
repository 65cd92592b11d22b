"""The parallel layout as model code sees it: process groups and their collectives (state.py) and
the pipeline-stage helpers (pipeline.py). The engine sets the state up once per worker process."""
