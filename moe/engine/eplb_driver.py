"""EPLB in the engine core: every `step_interval` steps, re-place the experts from the load of the
last `window_size` steps and move the weights (vLLM's `enable_eplb` / `eplb_config`).

The placement comes from routing/eplb.py (DeepSeek's algorithm: hierarchical when the expert
groups divide over the nodes, global otherwise; experts that stay on a rank keep their slot); the
move is the executor's `apply_expert_placement`, a collective that every rank runs at the same
step boundary, so the engine pauses only for the move itself.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from moe.config import EPLBConfig
from moe.expert_load.tracker import ExpertLoadTracker
from moe.worker.executor import Executor
from routing.eplb import ExpertPlacement, balancedness, gpu_loads, rebalance_experts

logger = logging.getLogger("moe.eplb")


class EplbDriver:
    def __init__(self, config: EPLBConfig, tracker: ExpertLoadTracker, executor: Executor, num_groups: int,
                 num_nodes: int = 1) -> None:
        meta = tracker.meta
        self.config, self.tracker, self.executor = config, tracker, executor
        self.num_groups, self.num_nodes, self.ep_size = num_groups, num_nodes, meta.ep_size
        self.placement = ExpertPlacement.initial(meta.num_layers, meta.num_experts, meta.num_physical_experts)
        self.last_rebalance_step = 0
        self.num_rebalances = 0
        self.last_seconds = 0.0

    def due(self, step: int) -> bool:
        return step - self.last_rebalance_step >= self.config.step_interval

    def rebalance(self, step: int) -> None:
        """Re-place from the recent load (the caller folded a window at `step` just before)."""
        self.last_rebalance_step = step
        load_LE = self.tracker.recent_counts(self.config.window_size)
        if not load_LE.any():
            return  # nothing routed in the window: keep the placement
        new = rebalance_experts(load_LE, self.tracker.meta.num_physical_experts, self.num_groups, self.num_nodes,
                                self.ep_size, previous=self.placement)
        before = float(balancedness(gpu_loads(load_LE, self.placement, self.ep_size)).mean())
        after = float(balancedness(gpu_loads(load_LE, new, self.ep_size)).mean())
        start = time.perf_counter()
        phys_to_log_LP = new.phys_to_log_LP.numpy()
        by_layer = {layer: phys_to_log_LP[i].tolist() for i, layer in enumerate(self.tracker.meta.layers)}
        moved = self.executor.apply_expert_placement(by_layer)
        self.last_seconds = time.perf_counter() - start
        self.placement = new
        self.num_rebalances += 1
        self.tracker.note_placement(np.asarray(phys_to_log_LP))
        logger.info("EPLB: rebalanced at step %d in %.3f s (%d expert slots moved); balancedness over the last "
                    "%d steps %.3f -> %.3f (expected)", step, self.last_seconds, moved, self.config.window_size,
                    before, after)
