"""vLLM's Triton expert kernel (`fused_moe_kernel`) timed beside ours in `moe bench kernel`.

Nothing of vLLM is vendored: benchmarks/fetch_vllm_kernel.py downloads vLLM's wheel and writes
the kernel's source (two @triton.jit functions cut out of vLLM's fused_moe.py, unchanged) and
vLLM's H200 configs into an ignored folder (benchmarks/vllm_kernel/, or MOE_VLLM_KERNEL_DIR),
which is carried to the GPU machine. When the folder is absent the bench skips vLLM.

The call below is vLLM's unquantised bf16 path (fused_experts_impl): alignment (ours: the same
sorted-ids / expert-ids / padded-count layout as vLLM's moe_align_block_size), the gate_up GEMM
into [M, K, 2F], SiLU(gate) * up, the down GEMM with the routing weight applied, then the sum
over K. vLLM does the SiLU-mul and the sum with its own CUDA ops; here they are torch ops, so
the row times the kernel and a few elementwise launches, as vLLM's own path does.

Legend: M tokens, D hidden, E experts, F expert intermediate size, K top-k.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
KERNEL_FILE = "vllm_fused_moe_kernel.py"


def kernel_dir() -> Path:
    return Path(os.environ.get("MOE_VLLM_KERNEL_DIR", REPO_ROOT / "benchmarks" / "vllm_kernel"))


class VllmExperts:
    """fused_experts with vLLM's kernel and vLLM's tuned config for the shape (nearest M bucket,
    as vLLM picks it), or vLLM's default config where it has no file for the shape."""

    def __init__(self, folder: Path) -> None:
        spec = importlib.util.spec_from_file_location("vllm_fused_moe_kernel", folder / KERNEL_FILE)
        self.module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.module)  # triton.jit reads the source from this real file
        self.folder = folder
        self.version = (folder / "VERSION").read_text().strip() if (folder / "VERSION").is_file() else "unknown"

    def configs(self, E: int, N: int) -> dict[int, dict] | None:
        """vLLM's H200 configs for E experts and N = F (vLLM names a file by the down GEMM's input)."""
        path = self.folder / "configs" / f"E={E},N={N},device_name=NVIDIA_H200.json"
        if not path.is_file():
            return None
        return {int(m): cfg for m, cfg in json.loads(path.read_text()).items()}

    def config(self, M: int, E: int, F: int, K: int) -> tuple[dict, str]:
        table = self.configs(E, F)
        if table:
            return table[min(table, key=lambda m: abs(m - M))], "vllm_h200_file"
        # vLLM's fallback for bf16 without a file (get_default_config), in its simple form
        if M <= E:
            return {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}, "vllm_default"
        return {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8}, "vllm_default"

    def _gemm(self, a_RD, w_END, c_MKN, topk_weights_TK, sorted_ids, expert_ids, npp, top_k: int,
              mul_routed_weight: bool, cfg: dict) -> None:
        import triton
        import triton.language as tl

        N, Dk = w_END.shape[1], w_END.shape[2]
        EM = sorted_ids.shape[0]
        launch = {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages")}
        grid = (triton.cdiv(EM, cfg["BLOCK_SIZE_M"]) * triton.cdiv(N, cfg["BLOCK_SIZE_N"]),)
        self.module.fused_moe_kernel[grid](
            a_RD, w_END, c_MKN, None, None, None, topk_weights_TK, sorted_ids, expert_ids, npp,
            N, Dk, EM, topk_weights_TK.numel(),
            a_RD.stride(0), a_RD.stride(1), w_END.stride(0), w_END.stride(2), w_END.stride(1),
            c_MKN.stride(1), c_MKN.stride(2), 0, 0, 0, 0, 0, 0, 0,
            group_n=0, group_k=0, naive_block_assignment=False,
            BLOCK_SIZE_M=cfg["BLOCK_SIZE_M"], BLOCK_SIZE_N=cfg["BLOCK_SIZE_N"], BLOCK_SIZE_K=cfg["BLOCK_SIZE_K"],
            GROUP_SIZE_M=cfg["GROUP_SIZE_M"], SPLIT_K=1, MUL_ROUTED_WEIGHT=mul_routed_weight, top_k=top_k,
            compute_type=tl.bfloat16 if a_RD.dtype == torch.bfloat16 else tl.float16,
            use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False,
            HAS_BIAS=False, SWAP_AB=False, **launch)

    def __call__(self, x_MD, w13_E2FD, w2_EDF, topk_weights_MK, topk_ids_MK) -> torch.Tensor:
        from kernels.triton_moe.align import align_tokens

        (M, D), (E, F2, _), K = x_MD.shape, w13_E2FD.shape, topk_ids_MK.shape[1]
        F = F2 // 2
        cfg, _ = self.config(M, E, F, K)
        sorted_ids, expert_ids, npp = align_tokens(topk_ids_MK, E, cfg["BLOCK_SIZE_M"])
        weights = topk_weights_MK.float().contiguous()
        cache1_MKN = torch.empty(M, K, F2, device=x_MD.device, dtype=x_MD.dtype)
        self._gemm(x_MD, w13_E2FD, cache1_MKN, weights, sorted_ids, expert_ids, npp, K, False, cfg)
        act_RF = (torch.nn.functional.silu(cache1_MKN[..., :F]) * cache1_MKN[..., F:]).reshape(M * K, F)
        cache3_MKD = torch.empty(M, K, D, device=x_MD.device, dtype=x_MD.dtype)
        self._gemm(act_RF, w2_EDF, cache3_MKD, weights, sorted_ids, expert_ids, npp, 1, True, cfg)
        return cache3_MKD.sum(dim=1)


def load_vllm_experts(folder: Path | None = None) -> VllmExperts | None:
    """vLLM's expert path if benchmarks/fetch_vllm_kernel.py has filled `folder`, else None."""
    folder = Path(folder) if folder is not None else kernel_dir()
    if not (folder / KERNEL_FILE).is_file():
        return None
    return VllmExperts(folder)
