"""Llama-4 vision tower: image tiles -> image features in the text model's hidden size.

Per tile: unfold into patches -> linear patch embedding -> CLS token appended (last) -> learned
positional embedding -> LayerNorm -> encoder layers (bidirectional attention with 2-D RoPE over the
patch grid, GELU MLP) -> LayerNorm -> CLS dropped -> pixel shuffle (ratio r merges r^-1 x r^-1
neighbouring patches into one token) -> adapter MLP (GELU after both layers) -> projector linear.
The features of all tiles are flattened tile-major and replace, in order, the text embeddings at
the image-token positions of the prompt (`merge_image_features`).

Matches transformers' Llama4VisionModel + Llama4MultiModalProjector, including what they hard-code
regardless of config.json: exact (erf) GELU, LayerNorm eps 1e-5, bias-free adapter and projector,
the last encoder layer's output (`vision_feature_layer` -1, `vision_feature_select_strategy`
"default": the CLS token is dropped).

Parameter names are the checkpoint's: the module's children are `vision_model` and
`multi_modal_projector`, as at the top level of a `Llama4ForConditionalGeneration` checkpoint.

Tensor parallelism (vLLM's `mm_encoder_tp_mode`, a field of the config; both modes are the plain
single-rank code when tensor_parallel_size is 1):
* "weights": the linears are split over the TP ranks like the text model's. Per encoder layer
  q/k/v column-parallel (heads split; num_attention_heads must divide by TP), o_proj row-parallel,
  MLP fc1 column / fc2 row; the adapter MLP (fc1 column / fc2 row) when projector_input_dim
  divides by TP and the projector (column, outputs gathered) when the text hidden size does,
  else those stay replicated. Patch embedding, class/positional embeddings, LayerNorms replicated.
* "data": every rank holds all the weights and runs only its share of the tiles (the batch padded
  with zero tiles to a multiple of TP); the features are all-gathered over the TP group, so
  every rank returns the features of all tiles.

Legend: N tiles (all images' tiles together), C image channels, P patches per tile (grid G x G),
S = P + 1 positions (patches + CLS), D vision hidden, H heads, d head dim (D / H), Q tokens per
tile after pixel shuffle (P * r^2), A adapter output dim, E text hidden, T prompt tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.triton_fused import fused_kernels_serve
from models.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from models.layers.weights import ReplicatedLoader, attach_loader, new_param
from models.parallel.state import get_parallel_state, tp_all_gather_rows, tp_row_chunk

# Top-level checkpoint prefixes of the vision tower of a Llama4ForConditionalGeneration checkpoint.
VISION_CHECKPOINT_PREFIXES = ("vision_model.", "multi_modal_projector.")
_LAYER_NORM_EPS = 1e-5           # transformers builds nn.LayerNorm(hidden) and ignores `norm_eps`
_DEFAULT_IMAGE_TOKEN_INDEX = 200092  # transformers' Llama4Config.image_token_index
MM_ENCODER_TP_MODES = ("weights", "data")


def _check_tp_mode(mode) -> None:
    if mode not in MM_ENCODER_TP_MODES:
        raise ValueError(f"mm_encoder_tp_mode={mode!r} is not supported: use 'weights' (the encoder's linears split "
                         "over the tensor-parallel ranks) or 'data' (weights replicated, tiles split over the ranks)")


def _square_size(value, name: str) -> int:
    """image_size / patch_size: an int, or an [h, w] pair with h == w."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"vision_config.{name}={value!r}: only square images and patches are supported")
        value = value[0]
    return int(value)


@dataclass
class Llama4VisionConfig:
    """`vision_config` of a Llama4ForConditionalGeneration config.json (plus the top-level image
    token id). Missing fields take transformers' defaults; `check()` validates consistency."""
    hidden_size: int = 768
    intermediate_size: int = 5632
    num_hidden_layers: int = 34
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 448
    patch_size: int = 14
    pixel_shuffle_ratio: float = 0.5
    projector_input_dim: int = 4096
    projector_output_dim: int = 4096
    vision_output_dim: int = 7680
    rope_theta: float = 10000.0
    hidden_act: str = "gelu"
    multi_modal_projector_bias: bool = False
    vision_feature_layer: int = -1
    vision_feature_select_strategy: str = "default"
    text_hidden_size: int = 5120     # the projector's output (text_config.hidden_size)
    image_token_index: int = _DEFAULT_IMAGE_TOKEN_INDEX
    # Not in config.json: set from the engine argument of the same name (see the module docstring).
    mm_encoder_tp_mode: str = "weights"

    def __post_init__(self) -> None:
        _check_tp_mode(self.mm_encoder_tp_mode)

    @classmethod
    def from_hf(cls, cfg: dict) -> "Llama4VisionConfig":
        """From the whole multimodal config.json dict (vision_config, text_config, image token)."""
        v = cfg.get("vision_config")
        if not isinstance(v, dict):
            raise ValueError("config.json has no vision_config: not a multimodal Llama-4 checkpoint")
        text = cfg.get("text_config") or {}
        d = cls()
        rope = v.get("rope_parameters") or {}
        image_token = cfg.get("image_token_index", cfg.get("image_token_id"))
        return cls(
            hidden_size=int(v.get("hidden_size", d.hidden_size)),
            intermediate_size=int(v.get("intermediate_size", d.intermediate_size)),
            num_hidden_layers=int(v.get("num_hidden_layers", d.num_hidden_layers)),
            num_attention_heads=int(v.get("num_attention_heads", d.num_attention_heads)),
            num_channels=int(v.get("num_channels", d.num_channels)),
            image_size=_square_size(v.get("image_size", d.image_size), "image_size"),
            patch_size=_square_size(v.get("patch_size", d.patch_size), "patch_size"),
            pixel_shuffle_ratio=float(v.get("pixel_shuffle_ratio", d.pixel_shuffle_ratio)),
            projector_input_dim=int(v.get("projector_input_dim", d.projector_input_dim)),
            projector_output_dim=int(v.get("projector_output_dim", d.projector_output_dim)),
            vision_output_dim=int(v.get("vision_output_dim", d.vision_output_dim)),
            rope_theta=float(rope.get("rope_theta", v.get("rope_theta", d.rope_theta))),
            hidden_act=str(v.get("hidden_act", d.hidden_act)),
            multi_modal_projector_bias=bool(v.get("multi_modal_projector_bias", False)),
            vision_feature_layer=int(v.get("vision_feature_layer", d.vision_feature_layer)),
            vision_feature_select_strategy=str(v.get("vision_feature_select_strategy",
                                                     d.vision_feature_select_strategy)),
            text_hidden_size=int(text.get("hidden_size", d.text_hidden_size)),
            image_token_index=int(image_token if image_token is not None else d.image_token_index),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def grid_size(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        """Q: image features (and image tokens in the prompt) per tile."""
        return round(self.grid_size * self.pixel_shuffle_ratio) ** 2

    def check(self) -> None:
        """The shapes the tower needs agree; raises naming the field (vision_config.*)."""
        def bad(msg: str) -> ValueError:
            return ValueError(f"vision_config: {msg}")
        _check_tp_mode(self.mm_encoder_tp_mode)  # a field that may have been set after construction
        if self.hidden_size % self.num_attention_heads:
            raise bad(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                      f"{self.num_attention_heads}")
        if self.head_dim % 4:
            raise bad(f"head dim {self.head_dim} (hidden_size / num_attention_heads) must be a multiple of 4 "
                      "(2-D RoPE rotates pairs, half of them per axis)")
        if self.image_size % self.patch_size:
            raise bad(f"image_size={self.image_size} is not divisible by patch_size={self.patch_size}")
        r, g = self.pixel_shuffle_ratio, self.grid_size
        if not 0 < r <= 1 or not (g * r).is_integer() or not (1 / r).is_integer():
            raise bad(f"pixel_shuffle_ratio={r} must be 1/k for an integer k dividing the patch grid size {g}")
        if self.intermediate_size != round(self.hidden_size / r ** 2):
            raise bad(f"intermediate_size={self.intermediate_size} must equal hidden_size / pixel_shuffle_ratio^2 = "
                      f"{round(self.hidden_size / r ** 2)} (the adapter's input width)")
        if self.projector_input_dim != self.projector_output_dim:
            raise bad(f"projector_input_dim={self.projector_input_dim} must equal projector_output_dim="
                      f"{self.projector_output_dim}")
        if self.vision_output_dim != self.projector_output_dim:
            raise bad(f"vision_output_dim={self.vision_output_dim} must equal projector_output_dim="
                      f"{self.projector_output_dim}")
        if self.hidden_act != "gelu":
            raise bad(f"hidden_act={self.hidden_act!r} is not supported (Llama-4's tower uses exact GELU)")
        if self.multi_modal_projector_bias:
            raise bad("multi_modal_projector_bias=true is not supported (Llama-4's projector has no bias)")
        if self.vision_feature_layer != -1 or self.vision_feature_select_strategy != "default":
            raise bad(f"vision_feature_layer={self.vision_feature_layer}, vision_feature_select_strategy="
                      f"{self.vision_feature_select_strategy!r}: only -1 / 'default' (the last layer, CLS dropped) "
                      "are supported, as in transformers")


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias loaded from the checkpoint."""

    def __init__(self, dim: int, eps: float = _LAYER_NORM_EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = attach_loader(new_param(dim), ReplicatedLoader((dim,)))
        self.bias = attach_loader(new_param(dim), ReplicatedLoader((dim,)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def vision_rope_angles(grid: int, head_dim: int, theta: float, device=None) -> torch.Tensor:
    """Rotation angles [S, d/2] (fp32): per head, the first d/4 pairs turn with the patch's column
    (x + 1), the last d/4 with its row (y + 1); the CLS position (last) is not rotated."""
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, 2, device=device, dtype=torch.float32) / half)  # [d/4]
    idx = torch.arange(grid * grid, device=device)
    x, y = (idx % grid + 1).float(), (idx // grid + 1).float()
    angles_PH = torch.cat([x[:, None] * inv_freq, y[:, None] * inv_freq], dim=-1)
    return torch.cat([angles_PH, angles_PH.new_zeros(1, half)])  # CLS row: angle 0


def apply_pair_rotation(x_NHSd: torch.Tensor, cos_Sh: torch.Tensor, sin_Sh: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) as complex numbers, in fp32."""
    h = x_NHSd.float().unflatten(-1, (-1, 2))
    re, im = h[..., 0], h[..., 1]
    out = torch.stack([re * cos_Sh - im * sin_Sh, re * sin_Sh + im * cos_Sh], dim=-1)
    return out.flatten(-2).to(x_NHSd.dtype)


def _column(in_features: int, out_features: int, bias: bool, split: bool,
            gather_output: bool = False) -> nn.Module:
    """Column-parallel (outputs split over the TP ranks) when `split`, else replicated."""
    if split:
        return ColumnParallelLinear(in_features, [out_features], bias=bias, gather_output=gather_output)
    return ReplicatedLinear(in_features, out_features, bias=bias)


def _row(in_features: int, out_features: int, bias: bool, split: bool) -> nn.Module:
    """Row-parallel (inputs split, partial outputs all-reduced) when `split`, else replicated."""
    return RowParallelLinear(in_features, out_features, bias=bias) if split else ReplicatedLinear(
        in_features, out_features, bias=bias)


class VisionAttention(nn.Module):
    """With `split`, this rank holds H / TP heads: q/k/v column-parallel, o_proj row-parallel."""

    def __init__(self, cfg: Llama4VisionConfig, split: bool) -> None:
        super().__init__()
        D, tp = cfg.hidden_size, get_parallel_state().tp_size if split else 1
        self.num_heads, self.head_dim = cfg.num_attention_heads // tp, cfg.head_dim  # local heads
        self.q_proj, self.k_proj = _column(D, D, True, split), _column(D, D, True, split)
        self.v_proj, self.o_proj = _column(D, D, True, split), _row(D, D, True, split)

    def forward(self, x_NSD: torch.Tensor, cos_Sh: torch.Tensor, sin_Sh: torch.Tensor) -> torch.Tensor:
        def heads(t: torch.Tensor) -> torch.Tensor:  # [N, S, H*d (local)] -> [N, H, S, d]
            return t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        q_NSD, k_NSD, v = self.q_proj(x_NSD), self.k_proj(x_NSD), heads(self.v_proj(x_NSD))
        if fused_kernels_serve(x_NSD):
            q, k = self._rotate_triton(q_NSD, k_NSD, cos_Sh, sin_Sh)
        else:
            q, k = apply_pair_rotation(heads(q_NSD), cos_Sh, sin_Sh), apply_pair_rotation(heads(k_NSD), cos_Sh, sin_Sh)
        out_NHSd = F.scaled_dot_product_attention(q, k, v, is_causal=False)  # every patch sees its whole tile
        return self.o_proj(out_NHSd.transpose(1, 2).flatten(2))


    def _rotate_triton(self, q_NSD: torch.Tensor, k_NSD: torch.Tensor, cos_Sh: torch.Tensor,
                       sin_Sh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """apply_pair_rotation of q and k in one Triton launch (the interleaved rotary kernel of the
        text models, each tile's position s indexing the 2-D angle table; the same fp32 arithmetic
        without contraction, so the same bits): [N, S, H*d] -> [N, H, S, d] views."""
        from kernels.triton_fused.rope import rope_triton

        (N, S, _), H, d = q_NSD.shape, self.num_heads, self.head_dim
        positions = torch.arange(S, device=q_NSD.device, dtype=torch.int32).repeat(N)
        q, k = rope_triton(positions, q_NSD.reshape(N * S, H, d), k_NSD.reshape(N * S, H, d), cos_Sh, sin_Sh,
                           d, is_neox_style=False)
        return q.view(N, S, H, d).transpose(1, 2), k.view(N, S, H, d).transpose(1, 2)


class VisionMLP(nn.Module):
    """fc1 -> GELU -> fc2 (-> GELU). With `split`: fc1 column-, fc2 row-parallel (one all-reduce,
    before the second GELU, which therefore sees the full sum)."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int, bias: bool, gelu_after_fc2: bool,
                 split: bool = False) -> None:
        super().__init__()
        self.fc1 = _column(in_dim, hidden_dim, bias, split)
        self.fc2 = _row(hidden_dim, out_dim, bias, split)
        self.gelu_after_fc2 = gelu_after_fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc2(F.gelu(self.fc1(x)))
        return F.gelu(x) if self.gelu_after_fc2 else x


class VisionEncoderLayer(nn.Module):
    def __init__(self, cfg: Llama4VisionConfig, split: bool) -> None:
        super().__init__()
        self.input_layernorm = LayerNorm(cfg.hidden_size)
        self.self_attn = VisionAttention(cfg, split)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size)
        # intermediate = hidden * k^2 (check()): divisible by TP whenever the heads are.
        self.mlp = VisionMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size, bias=True,
                             gelu_after_fc2=False, split=split)

    def forward(self, x_NSD: torch.Tensor, cos_Sh: torch.Tensor, sin_Sh: torch.Tensor) -> torch.Tensor:
        x_NSD = x_NSD + self.self_attn(self.input_layernorm(x_NSD), cos_Sh, sin_Sh)
        return x_NSD + self.mlp(self.post_attention_layernorm(x_NSD))


class _Stack(nn.Module):
    """`vision_model.model`: holds `layers` (the checkpoint's nesting)."""

    def __init__(self, cfg: Llama4VisionConfig, split: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg, split) for _ in range(cfg.num_hidden_layers))


class _PatchEmbedding(nn.Module):
    """Non-overlapping patches, flattened channel-major (C, row, col) as torch's unfold does, then a
    bias-free linear: the same as a stride-`patch` convolution."""

    def __init__(self, cfg: Llama4VisionConfig) -> None:
        super().__init__()
        self.patch = cfg.patch_size
        self.linear = ReplicatedLinear(cfg.num_channels * cfg.patch_size ** 2, cfg.hidden_size)

    def forward(self, pixels_NCHW: torch.Tensor) -> torch.Tensor:
        patches = F.unfold(pixels_NCHW, kernel_size=self.patch, stride=self.patch)  # [N, C*p*p, P], row-major
        return self.linear(patches.transpose(1, 2))


def pixel_shuffle(x_NPD: torch.Tensor, ratio: float) -> torch.Tensor:
    """[N, G*G, D] -> [N, (G*r)^2, D / r^2]: each output token concatenates the channels of a
    (1/r x 1/r) block of patches, in transformers' order (columns folded first, then rows)."""
    N, P, D = x_NPD.shape
    g, k = math.isqrt(P), round(1 / ratio)
    # Fold k neighbouring columns into the channels, transpose so rows become the inner axis, fold
    # k neighbouring rows the same way, transpose back.
    x = x_NPD.reshape(N, g, g // k, D * k).transpose(1, 2)         # [N, G/k, G, kD]
    x = x.reshape(N, g // k, g // k, D * k * k).transpose(1, 2)    # [N, G/k (rows), G/k (cols), k^2 D]
    return x.reshape(N, -1, D * k * k)


class _VisionModel(nn.Module):
    """`vision_model.`: encoder + pixel-shuffle adapter (transformers' Llama4VisionModel)."""

    def __init__(self, cfg: Llama4VisionConfig, split: bool) -> None:
        super().__init__()
        self.config = cfg
        D, S = cfg.hidden_size, cfg.grid_size ** 2 + 1
        self.patch_embedding = _PatchEmbedding(cfg)
        self.class_embedding = attach_loader(new_param(D), ReplicatedLoader((D,)))
        self.positional_embedding_vlm = attach_loader(new_param(S, D), ReplicatedLoader((S, D)))
        self.layernorm_pre = LayerNorm(D)
        self.layernorm_post = LayerNorm(D)
        self.model = _Stack(cfg, split)
        # The adapter is split (fc1 column / fc2 row) only when its hidden width divides by TP,
        # else replicated on every rank.
        split_adapter = split and cfg.projector_input_dim % get_parallel_state().tp_size == 0
        self.vision_adapter = nn.Module()  # `vision_adapter.mlp.fc{1,2}` in the checkpoint
        self.vision_adapter.mlp = VisionMLP(cfg.intermediate_size, cfg.projector_input_dim, cfg.projector_output_dim,
                                            bias=False, gelu_after_fc2=True, split=split_adapter)

    def forward(self, pixels_NCHW: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        x_NPD = self.patch_embedding(pixels_NCHW)
        cls_N1D = self.class_embedding.expand(x_NPD.shape[0], 1, -1)
        x_NSD = self.layernorm_pre(torch.cat([x_NPD, cls_N1D], dim=1) + self.positional_embedding_vlm)
        angles_Sh = vision_rope_angles(cfg.grid_size, cfg.head_dim, cfg.rope_theta, device=x_NSD.device)
        cos_Sh, sin_Sh = angles_Sh.cos(), angles_Sh.sin()
        for layer in self.model.layers:
            x_NSD = layer(x_NSD, cos_Sh, sin_Sh)
        x_NPD = self.layernorm_post(x_NSD)[:, :-1]  # drop CLS
        return self.vision_adapter.mlp(pixel_shuffle(x_NPD, cfg.pixel_shuffle_ratio))  # [N, Q, A]


class _Projector(nn.Module):
    """`multi_modal_projector.`: adapter output -> text hidden size."""

    def __init__(self, cfg: Llama4VisionConfig, split: bool) -> None:
        super().__init__()
        # Column-parallel with the outputs gathered when the text hidden size divides by TP, else
        # replicated on every rank.
        split = split and cfg.text_hidden_size % get_parallel_state().tp_size == 0
        self.linear_1 = _column(cfg.vision_output_dim, cfg.text_hidden_size, False, split, gather_output=True)


class Llama4VisionEncoder(nn.Module):
    """Image tiles -> image features [N * Q, E] ready to replace the image tokens' embeddings.

    Loadable on its own (`models.loader.load_weights(encoder, checkpoint_dir)` reads only the
    vision tensors) or as a child of the text model (models/llama4.py maps the prefix)."""

    def __init__(self, cfg: Llama4VisionConfig) -> None:
        super().__init__()
        cfg.check()
        self.config = cfg
        tp = get_parallel_state().tp_size
        # "weights": linears split over the TP ranks; "data": replicated, tiles split in forward.
        self.split_weights = cfg.mm_encoder_tp_mode == "weights" and tp > 1
        self.split_tiles = cfg.mm_encoder_tp_mode == "data" and tp > 1
        if self.split_weights and cfg.num_attention_heads % tp:
            raise ValueError(f"vision_config.num_attention_heads={cfg.num_attention_heads} is not divisible by "
                             f"tensor_parallel_size={tp}: mm_encoder_tp_mode='weights' splits the vision encoder's "
                             "heads over the TP ranks; use mm_encoder_tp_mode='data' (replicated encoder, tiles "
                             "split over the ranks) or a TP size that divides the heads")
        self.vision_model = _VisionModel(cfg, self.split_weights)
        self.multi_modal_projector = _Projector(cfg, self.split_weights)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, image_size, image_size] (the processor's normalised tiles, any float
        dtype) -> image features [N * tokens_per_tile, text hidden], tile-major."""
        cfg = self.config
        want = (cfg.num_channels, cfg.image_size, cfg.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != want:
            raise ValueError(f"pixel_values has shape {list(pixel_values.shape)}, expected [num_tiles, "
                             f"{', '.join(map(str, want))}] (tiles of the checkpoint's image_size)")
        if not pixel_values.is_floating_point():
            raise ValueError(f"pixel_values must be floating point (normalised pixels), got {pixel_values.dtype}")
        pixels_NCHW = pixel_values.to(self.vision_model.class_embedding.dtype)
        if not self.split_tiles:
            return self._features(pixels_NCHW).flatten(0, 1)
        # Data mode: zero tiles pad the batch to a multiple of TP so every rank runs the same number
        # of tiles (rank r: tiles [r * chunk, (r + 1) * chunk)); the gather drops the padding.
        ps, N = get_parallel_state(), pixels_NCHW.shape[0]
        _, _, chunk = tp_row_chunk(N)
        start = ps.tp_rank * chunk
        padded_NCHW = F.pad(pixels_NCHW, (0, 0, 0, 0, 0, 0, 0, chunk * ps.tp_size - N))
        mine_NQE = self._features(padded_NCHW[start:start + chunk])
        return tp_all_gather_rows(mine_NQE, N).flatten(0, 1)

    def _features(self, pixels_NCHW: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, Q, E]: the tower and projector on these tiles."""
        return self.multi_modal_projector.linear_1(self.vision_model(pixels_NCHW))

    # Standalone loading (models.loader.load_weights): checkpoint names are parameter names.
    def weight_name_rules(self) -> list:
        return []

    def ignore_checkpoint_name(self, name: str) -> bool:
        return not name.startswith(VISION_CHECKPOINT_PREFIXES)


def merge_image_features(inputs_embeds_TD: torch.Tensor, input_ids_T: torch.Tensor, image_features_ND: torch.Tensor,
                         image_token_id: int) -> torch.Tensor:
    """A copy of inputs_embeds [T, E] whose rows at image tokens (input_ids == image_token_id)
    are the image features [N, E], in order (transformers' masked_scatter). The number of image
    tokens must equal the number of feature rows."""
    if input_ids_T.shape != inputs_embeds_TD.shape[:1]:
        raise ValueError(f"input_ids has shape {list(input_ids_T.shape)} but inputs_embeds has "
                         f"{list(inputs_embeds_TD.shape)}: expected [T] and [T, hidden]")
    if image_features_ND.dim() != 2 or image_features_ND.shape[1] != inputs_embeds_TD.shape[1]:
        raise ValueError(f"image features have shape {list(image_features_ND.shape)}, expected [rows, "
                         f"{inputs_embeds_TD.shape[1]}] (the text hidden size)")
    is_image_T = input_ids_T == image_token_id
    num_image_tokens = int(is_image_T.sum())
    if num_image_tokens != image_features_ND.shape[0]:
        raise ValueError(f"the prompt has {num_image_tokens} image tokens (id {image_token_id}) but "
                         f"{image_features_ND.shape[0]} image feature rows were given (tiles x tokens per tile): "
                         "they must be equal")
    merged_TD = inputs_embeds_TD.clone()
    merged_TD[is_image_T] = image_features_ND.to(merged_TD.dtype)
    return merged_TD
